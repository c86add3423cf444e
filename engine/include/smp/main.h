#pragma once
// The outer frame of an smp program: turns every failure into one clear line and a non-zero exit.

#include <functional>

namespace smp {

// Runs `body`; on an exception that nothing in `body` catches prints "error: <reason>" (no C++ backtrace) to
// stderr and exits with status 1 at once, before any destructor runs: destructors of communicators can wait on
// peers, which meanwhile fail on the closed connection and get this rank stopped before it says why.
int guarded_main(int argc, char** argv, const std::function<int(int, char**)>& body);

}  // namespace smp
