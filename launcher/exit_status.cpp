#include "exit_status.h"

#include <sys/wait.h>

#include <csignal>

namespace smp::launch {
namespace {

// Written out rather than taken from sigabbrev_np(), which only recent glibc has.
const char* signal_abbreviation(int signal_number) {
  switch (signal_number) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGCHLD: return "SIGCHLD";
    case SIGCONT: return "SIGCONT";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGTTIN: return "SIGTTIN";
    case SIGTTOU: return "SIGTTOU";
    case SIGURG: return "SIGURG";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGVTALRM: return "SIGVTALRM";
    case SIGPROF: return "SIGPROF";
    case SIGSYS: return "SIGSYS";
    default: return nullptr;
  }
}

}  // namespace

std::string describe_signal(int signal_number) {
  const char* abbreviation = signal_abbreviation(signal_number);
  if (abbreviation == nullptr) return std::to_string(signal_number);
  return std::string(abbreviation) + " (" + std::to_string(signal_number) + ")";
}

std::string describe_wait_status(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    const std::string core = WCOREDUMP(wait_status) ? ", core dumped" : "";
    return "was killed by signal " + describe_signal(WTERMSIG(wait_status)) + core;
  }
  return "exited with status " + std::to_string(WEXITSTATUS(wait_status));
}

bool is_failure(int wait_status) { return !(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0); }

}  // namespace smp::launch
