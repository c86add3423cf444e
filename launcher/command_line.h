#pragma once
// smprun's command line: `smprun -n N [options] -- program args...`. Parsing is separate from launching so
// that every usage error can be tested without starting a process.

#include <stdexcept>
#include <string>
#include <vector>

namespace smp::launch {

// Exit codes of smprun itself; a rank's own exit code is never passed through, so that these stay
// unambiguous.
inline constexpr int kExitSuccess = 0;
inline constexpr int kExitRankFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitTimeout = 124;     // as timeout(1) does
inline constexpr int kExitSignalBase = 128;  // + the signal smprun received, as shells report it

// Far above what one machine runs; it keeps a typo such as -n 40000 from forking the machine to death.
inline constexpr int kMaxWorldSize = 4096;

struct LaunchOptions {
  int world_size = 0;             // ranks started by this smprun (per node)
  int nodes = 1;                  // smprun instances of the job, one per host
  int node_rank = 0;              // this instance's index: its ranks are node_rank * world_size + i
  std::string job_id;             // exported as SMP_JOB_ID; empty: a random one when nodes == 1
  std::string master_addr = "127.0.0.1";
  int master_port = 0;           // smp's store (SMP_MASTER_PORT); 0: pick a free port at launch
  int torch_port = 0;            // MASTER_PORT, for the program's torch.distributed (torch_port_beside)
  double timeout_seconds = 0.0;  // 0: no limit
  double grace_seconds = 5.0;    // between SIGTERM and SIGKILL when stopping
  bool prefix_output = true;
  std::vector<std::string> program_and_args;
};

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CommandLine {
  bool help_requested = false;
  LaunchOptions options;  // meaningful only when help was not requested
};

// `args` are argv[1..]. Throws UsageError naming the first problem found.
CommandLine parse_command_line(const std::vector<std::string>& args);

// One line, for error messages.
std::string usage_line();
// The full --help text.
std::string help_text();

}  // namespace smp::launch
