#include "smp/main.h"

#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>

#include "smp/comm/communicator.h"

namespace smp {

namespace {

[[noreturn]] void report_uncaught_exception_and_exit() {
  std::string reason = "terminated without an exception (std::terminate)";
  if (const std::exception_ptr current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& error) {
      reason = comm::brief_message(error);
    } catch (...) {
      reason = "unknown exception";
    }
  }
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s\n", reason.c_str());
  std::fflush(stderr);
  _exit(1);
}

}  // namespace

int guarded_main(int argc, char** argv, const std::function<int(int, char**)>& body) {
  // Deliberately no catch here. Catching would first unwind body's frames, and their destructors (a process
  // group with receives posted) can wait for peers; a peer that meets the closed connection fails at once, the
  // launcher stops this rank, and the reason for the whole failure is never printed. An exception with no handler
  // on its way calls std::terminate before any frame unwinds (libstdc++'s two-phase throw), so the reason goes
  // out first and nothing else runs.
  std::set_terminate(report_uncaught_exception_and_exit);
  const int status = body(argc, argv);
  std::fflush(stdout);
  return status;
}

}  // namespace smp
