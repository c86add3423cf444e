#pragma once
// The outer frame of an smp program: turns every failure into one clear line and a non-zero exit.

#include <functional>

namespace smp {

// Runs `body`; on an exception prints "error: <reason>" (no C++ backtrace) to stderr and exits with status 1
// at once, without running destructors that could wait on peers which are gone.
int guarded_main(int argc, char** argv, const std::function<int(int, char**)>& body);

}  // namespace smp
