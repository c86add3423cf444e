#pragma once
// Human-readable process statuses for smprun's reports.

#include <string>

namespace smp::launch {

// "SIGKILL (9)"; just "42" for numbers without a portable name, to follow the word "signal".
std::string describe_signal(int signal_number);

// For a waitpid() status: "exited with status 3" or "was killed by signal SIGKILL (9)".
std::string describe_wait_status(int wait_status);

// True unless the process exited with status 0.
bool is_failure(int wait_status);

}  // namespace smp::launch
