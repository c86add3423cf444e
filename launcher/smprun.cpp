// smprun: the local process launcher of smp. See `smprun --help` (command_line.cpp) for the interface.

#include <cstdio>
#include <random>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "command_line.h"
#include "job_runner.h"
#include "rank_setup.h"

namespace {

int usage_error(const std::string& problem) {
  std::fprintf(stderr, "smprun: %s\n%s\n", problem.c_str(), smp::launch::usage_line().c_str());
  return smp::launch::kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace smp::launch;

  CommandLine command_line;
  try {
    command_line = parse_command_line({argv + 1, argv + argc});
  } catch (const UsageError& error) {
    return usage_error(error.what());
  }
  if (command_line.help_requested) {
    std::fputs(help_text().c_str(), stdout);
    return kExitSuccess;
  }

  LaunchOptions& options = command_line.options;
  // Checked once here so that a typo is one clear error instead of N failing ranks.
  const std::string& program = options.program_and_args.front();
  if (const int error = check_executable(program, std::getenv("PATH")); error != 0) {
    const bool script = program.size() > 3 && program.compare(program.size() - 3, 3, ".py") == 0;
    return usage_error("cannot execute '" + program + "': " + std::strerror(error) +
                       (script ? " (a Python script runs under its interpreter: smprun -n N -- python " + program + ")"
                               : std::string()));
  }
  if (options.master_port == 0) {
    try {
      options.master_port = pick_free_port(options.master_addr);
    } catch (const std::runtime_error& error) {
      return usage_error(std::string(error.what()) + "; pass --master-port");
    }
  }
  try {
    options.torch_port = torch_port_beside(options.master_port, options.nodes,
                                           [&] { return pick_free_port(options.master_addr); });
  } catch (const std::runtime_error&) {
    options.torch_port = options.master_port < 65535 ? options.master_port + 1 : options.master_port - 1;
  }
  if (options.job_id.empty() && options.nodes == 1) {
    std::random_device entropy;
    char id[32];
    std::snprintf(id, sizeof id, "%08x%08x", entropy(), entropy());
    options.job_id = id;
  }
  return run_job(options);
}
