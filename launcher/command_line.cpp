#include "command_line.h"

#include <cerrno>
#include <cstdlib>
#include <optional>

namespace smp::launch {
namespace {

constexpr double kMaxSeconds = 1e8;

int parse_int_in_range(const std::string& flag, const std::string& text, int min, int max) {
  const std::string range = std::to_string(min) + ".." + std::to_string(max);
  const bool all_digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  if (!all_digits) {
    throw UsageError(flag + " needs an integer in " + range + ", got '" + text + "'");
  }
  errno = 0;
  const long long value = std::strtoll(text.c_str(), nullptr, 10);
  if (errno == ERANGE || value < min || value > max) {
    throw UsageError(flag + " must be in " + range + ", got " + text);
  }
  return static_cast<int>(value);
}

// Plain decimals only: strtod alone would also take "inf", "nan", hex and exponents.
double parse_seconds(const std::string& flag, const std::string& text) {
  const bool plain_decimal = text.find_first_not_of("0123456789.") == std::string::npos &&
                             text.find_first_of("0123456789") != std::string::npos &&
                             text.find('.') == text.rfind('.');
  if (!plain_decimal) {
    throw UsageError(flag + " needs a non-negative number of seconds, got '" + text + "'");
  }
  const double seconds = std::strtod(text.c_str(), nullptr);
  // Larger values would overflow the clock arithmetic; no job needs more than a few years.
  if (seconds > kMaxSeconds) {
    throw UsageError(flag + " must be at most " + std::to_string(static_cast<long long>(kMaxSeconds)) +
                     " seconds, got " + text);
  }
  return seconds;
}

struct FlagWithValue {
  std::string name;
  std::optional<std::string> inline_value;  // from --name=value
};

FlagWithValue split_flag(const std::string& arg) {
  const auto equals = arg.find('=');
  if (arg.rfind("--", 0) == 0 && equals != std::string::npos) {
    return {arg.substr(0, equals), arg.substr(equals + 1)};
  }
  if (arg.size() > 2 && arg.rfind("-n", 0) == 0) return {"-n", arg.substr(2)};  // -n4, as mpirun takes it
  return {arg, std::nullopt};
}

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CommandLine result;
  LaunchOptions& options = result.options;
  bool world_size_given = false;
  std::size_t index = 0;
  bool separator_found = false;

  while (index < args.size()) {
    const std::string& arg = args[index++];
    if (arg == "--") {
      separator_found = true;
      break;
    }
    const FlagWithValue flag = split_flag(arg);
    const auto take_value = [&]() -> std::string {
      if (flag.inline_value) return *flag.inline_value;
      if (index >= args.size() || args[index] == "--") {
        throw UsageError(flag.name + " needs a value");
      }
      return args[index++];
    };

    if (flag.name == "-h" || flag.name == "--help") {
      result.help_requested = true;
      return result;
    } else if (flag.name == "-n") {
      options.world_size = parse_int_in_range("-n", take_value(), 1, kMaxWorldSize);
      world_size_given = true;
    } else if (flag.name == "--master-addr") {
      options.master_addr = take_value();
      if (options.master_addr.empty()) throw UsageError("--master-addr must not be empty");
    } else if (flag.name == "--master-port") {
      options.master_port = parse_int_in_range("--master-port", take_value(), 1, 65535);
    } else if (flag.name == "--timeout") {
      options.timeout_seconds = parse_seconds("--timeout", take_value());
    } else if (flag.name == "--grace") {
      options.grace_seconds = parse_seconds("--grace", take_value());
    } else if (flag.name == "--nodes") {
      options.nodes = parse_int_in_range("--nodes", take_value(), 1, kMaxWorldSize);
    } else if (flag.name == "--node-rank") {
      options.node_rank = parse_int_in_range("--node-rank", take_value(), 0, kMaxWorldSize - 1);
    } else if (flag.name == "--job-id") {
      options.job_id = take_value();
      if (options.job_id.empty()) throw UsageError("--job-id must not be empty");
    } else if (flag.name == "--no-prefix") {
      if (flag.inline_value) throw UsageError("--no-prefix takes no value");
      options.prefix_output = false;
    } else if (!arg.empty() && arg[0] == '-') {
      const bool torchrun = arg.rfind("--nproc", 0) == 0;  // torchrun's --nproc-per-node / --nproc_per_node
      throw UsageError("unknown option '" + arg + "'" + (torchrun ? " (smprun's is -n, the number of processes)" : ""));
    } else {
      throw UsageError("unexpected argument '" + arg + "' (put the program after '--')");
    }
  }

  if (!world_size_given) throw UsageError("missing -n N (the number of ranks)");
  if (options.node_rank >= options.nodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) + " must be below --nodes " +
                     std::to_string(options.nodes));
  }
  if (static_cast<long long>(options.nodes) * options.world_size > kMaxWorldSize) {
    throw UsageError("--nodes x -n exceeds " + std::to_string(kMaxWorldSize) + " ranks");
  }
  // Every node must agree on the rendezvous: a port picked on one host means nothing to the others.
  if (options.nodes > 1 && options.master_port == 0) throw UsageError("--nodes > 1 needs --master-port");
  if (!separator_found) throw UsageError("missing '--' before the program");
  if (index >= args.size()) throw UsageError("missing program after '--'");
  options.program_and_args.assign(args.begin() + static_cast<std::ptrdiff_t>(index), args.end());
  return result;
}

std::string usage_line() {
  return "usage: smprun -n N [--nodes M --node-rank K] [--master-addr A] [--master-port P] [--job-id ID] [--timeout S] [--grace S] [--no-prefix] "
         "-- program [args...]  (smprun --help for details)";
}

std::string help_text() {
  return R"(usage: smprun -n N [options] -- program [args...]

Starts N local ranks of `program args...` (looked up on PATH) and waits for them.

Each rank gets the caller's environment plus
  RANK=K*N+i  LOCAL_RANK=i  WORLD_SIZE=M*N  LOCAL_WORLD_SIZE=N  GROUP_RANK=K  MASTER_ADDR
  SMP_MASTER_PORT (smp's rendezvous, --master-port)  MASTER_PORT (another port, for the program's own
  torch.distributed.init_process_group)
  SMP_JOB_ID (the same for every rank of the job, so that a rank never joins another job's rendezvous)
(OMP_NUM_THREADS is passed through if set and never invented), its own process group,
stdin from /dev/null, and its stdout/stderr forwarded line by line to smprun's
stdout/stderr as "[rank i] line"; a Python traceback the same as one another rank printed
before is shortened to a line naming that rank and the exception's own line. If smprun's
stdout or stderr is closed (smprun ... | head),
the ranks' pipes to it are closed too, so they see the closed pipe as they would without smprun.

options:
  -n N                 number of ranks on this node, 1..4096 (required)
  --nodes M            number of nodes (smprun instances) in the job (default 1)
  --node-rank K        this node's index, 0..M-1 (default 0); needs --master-port when M > 1
  --job-id ID          job identity shared by all nodes (default: random for one node, none for several)
  --master-addr A      rendezvous address (default 127.0.0.1)
  --master-port P      rendezvous port, 1..65535 (default: a free port on A, picked at launch)
  --timeout S          stop the job after S seconds (default 0: no limit)
  --grace S            seconds between SIGTERM and SIGKILL when stopping (default 5)
  --no-prefix          forward output lines without the "[rank i] " prefix
  -h, --help           show this text
Seconds are plain decimals (2, 0.5), at most 100000000. Values may also be given as --option=value.

Stopping: when a rank exits non-zero or is killed by a signal, smprun reports it, sends
SIGTERM to the process groups of all other ranks, SIGKILL to whatever is left after the
grace period, forwards the remaining output and prints every rank's final status.
SIGINT, SIGTERM and SIGHUP sent to smprun are forwarded to all ranks the same way
(those ignored when smprun started, as under nohup, stay ignored); one more while
stopping kills all ranks at once.

exit status:
  0    every rank exited 0
  1    a rank failed (its own status is printed, not passed through) or could not be started
  2    bad usage, a program that cannot be executed, or no free port on the master address
  124  the job ran longer than --timeout
  128+s  smprun received signal s (130 for SIGINT, 143 for SIGTERM)
)";
}

}  // namespace smp::launch
