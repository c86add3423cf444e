#include "smp/main.h"

#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>

#include "smp/comm/communicator.h"

namespace smp {

int guarded_main(int argc, char** argv, const std::function<int(int, char**)>& body) {
  std::string reason;
  try {
    const int status = body(argc, argv);
    std::fflush(stdout);
    return status;
  } catch (const std::exception& error) {
    reason = comm::brief_message(error);
  } catch (...) {
    reason = "unknown exception";
  }
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s\n", reason.c_str());
  std::fflush(stderr);
  _exit(1);
}

}  // namespace smp
