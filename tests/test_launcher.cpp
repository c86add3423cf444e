// smprun: parsing and setup tested directly, process handling tested by running the real binary.
// Every run of smprun goes through run_smprun(), which kills it at a deadline, so no test can hang.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "command_line.h"
#include "exit_status.h"
#include "line_assembler.h"
#include "rank_setup.h"
#include "test_paths.h"
#include "traceback_folder.h"

using namespace smp::launch;

namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------------------
// Running smprun

struct SmprunResult;

// Sends `signal_number` to smprun once `when` first holds for the output read so far.
struct SignalTrigger {
  std::function<bool(const SmprunResult&)> when;
  int signal_number = SIGTERM;
};

struct SmprunRun {
  std::vector<std::string> args;
  // Applied to smprun's environment: a value sets the variable, nullopt removes it.
  std::vector<std::pair<std::string, std::optional<std::string>>> environment_changes;
  // Fired in order, each only after the previous one.
  std::vector<SignalTrigger> signal_triggers;
  // Ignored in smprun from its start, as nohup does with SIGHUP.
  std::vector<int> ignored_signals;
  std::chrono::seconds deadline{60};
};

struct SmprunResult {
  int exit_code = -1;  // -1 when smprun itself died from a signal
  std::string out;
  std::string err;
  double seconds = 0;
  bool hit_deadline = false;
};

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

SmprunResult run_smprun(const SmprunRun& run) {
  int out_pipe[2];
  int err_pipe[2];
  REQUIRE(::pipe2(out_pipe, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(err_pipe, O_CLOEXEC) == 0);
  std::vector<std::string> argv_strings{smp_test::paths::smprun};
  argv_strings.insert(argv_strings.end(), run.args.begin(), run.args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_strings) argv.push_back(arg.data());
  argv.push_back(nullptr);

  const Clock::time_point started = Clock::now();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    for (const auto& [name, value] : run.environment_changes) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
    for (const int signal_number : run.ignored_signals) ::signal(signal_number, SIG_IGN);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);

  SmprunResult result;
  const Clock::time_point deadline = started + run.deadline;
  std::vector<std::pair<int, std::string*>> open_streams{{out_pipe[0], &result.out},
                                                         {err_pipe[0], &result.err}};
  std::size_t triggers_fired = 0;
  while (!open_streams.empty() && !result.hit_deadline) {
    std::vector<pollfd> watched;
    for (const auto& stream : open_streams) watched.push_back({stream.first, POLLIN, 0});
    const auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (remaining.count() <= 0) {
      result.hit_deadline = true;
      break;
    }
    if (::poll(watched.data(), watched.size(), static_cast<int>(remaining.count())) <= 0) continue;
    for (std::size_t index = watched.size(); index-- > 0;) {
      if (watched[index].revents == 0) continue;
      char buffer[4096];
      const ssize_t count = ::read(watched[index].fd, buffer, sizeof buffer);
      if (count > 0) {
        open_streams[index].second->append(buffer, static_cast<std::size_t>(count));
      } else if (count == 0 || errno != EINTR) {
        ::close(watched[index].fd);
        open_streams.erase(open_streams.begin() + static_cast<std::ptrdiff_t>(index));
      }
    }
    while (triggers_fired < run.signal_triggers.size() && run.signal_triggers[triggers_fired].when(result)) {
      ::kill(pid, run.signal_triggers[triggers_fired++].signal_number);
    }
  }
  for (const auto& stream : open_streams) ::close(stream.first);

  int wait_status = 0;
  while (::waitpid(pid, &wait_status, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      result.hit_deadline = true;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &wait_status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (WIFEXITED(wait_status)) result.exit_code = WEXITSTATUS(wait_status);
  INFO("smprun stdout:\n" << result.out << "smprun stderr:\n" << result.err);
  CHECK_FALSE(result.hit_deadline);
  return result;
}

SmprunResult run_smprun(std::vector<std::string> args) {
  SmprunRun run;
  run.args = std::move(args);
  return run_smprun(run);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Dead, or a zombie waiting for whoever adopted it: either way no longer running.
bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto after_name = content.rfind(')');
  return after_name != std::string::npos && content.size() > after_name + 2 && content[after_name + 2] == 'Z';
}

bool eventually_gone(pid_t pid) {
  const Clock::time_point give_up = Clock::now() + std::chrono::seconds(10);
  while (!process_gone(pid)) {
    if (Clock::now() >= give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

std::vector<pid_t> pids_after(const std::string& marker, const std::string& text) {
  std::vector<pid_t> pids;
  const std::regex pattern(marker + "([0-9]+)");
  for (std::sregex_iterator match(text.begin(), text.end(), pattern), end; match != end; ++match) {
    pids.push_back(static_cast<pid_t>(std::stoi((*match)[1])));
  }
  return pids;
}

// A fresh directory under /tmp, removed with its files at the end of the test.
class TempDirectory {
 public:
  TempDirectory() {
    char path_template[] = "/tmp/smprun_test_XXXXXX";
    REQUIRE(::mkdtemp(path_template) != nullptr);
    path_ = path_template;
  }
  ~TempDirectory() { std::filesystem::remove_all(path_); }
  TempDirectory(const TempDirectory&) = delete;
  TempDirectory& operator=(const TempDirectory&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

int wait_status_of_child(const std::function<void()>& child_body) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    child_body();
    ::_exit(0);
  }
  int wait_status = 0;
  REQUIRE(::waitpid(pid, &wait_status, 0) == pid);
  return wait_status;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Command line

TEST_CASE("parse_command_line reads every option", "[launcher]") {
  const CommandLine parsed =
      parse_command_line({"-n", "4", "--master-addr", "10.0.0.1", "--master-port=29500", "--timeout", "2.5",
                          "--grace=0", "--no-prefix", "--", "prog", "-n", "--x"});
  REQUIRE_FALSE(parsed.help_requested);
  CHECK(parsed.options.world_size == 4);
  CHECK(parsed.options.master_addr == "10.0.0.1");
  CHECK(parsed.options.master_port == 29500);
  CHECK(parsed.options.timeout_seconds == 2.5);
  CHECK(parsed.options.grace_seconds == 0.0);
  CHECK_FALSE(parsed.options.prefix_output);
  CHECK(parsed.options.program_and_args == std::vector<std::string>{"prog", "-n", "--x"});
}

TEST_CASE("parse_command_line takes -n with its value attached, as mpirun does", "[launcher]") {
  CHECK(parse_command_line({"-n4", "--", "prog"}).options.world_size == 4);
  CHECK_THROWS_WITH(parse_command_line({"-nx", "--", "prog"}), Catch::Contains("-n"));
}

TEST_CASE("parse_command_line defaults", "[launcher]") {
  const LaunchOptions options = parse_command_line({"-n", "1", "--", "prog"}).options;
  CHECK(options.world_size == 1);
  CHECK(options.master_addr == "127.0.0.1");
  CHECK(options.master_port == 0);
  CHECK(options.timeout_seconds == 0.0);
  CHECK(options.grace_seconds == 5.0);
  CHECK(options.prefix_output);
}

TEST_CASE("parse_command_line stops at --help", "[launcher]") {
  CHECK(parse_command_line({"--help"}).help_requested);
  CHECK(parse_command_line({"-n", "2", "-h", "--bogus"}).help_requested);
  // After '--' it belongs to the program.
  CHECK_FALSE(parse_command_line({"-n", "2", "--", "prog", "--help"}).help_requested);
}

TEST_CASE("parse_command_line names each usage problem", "[launcher]") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--", "prog"}, "missing -n"},
      {{"-n", "0", "--", "prog"}, "-n must be in 1..4096"},
      {{"-n", "5000", "--", "prog"}, "-n must be in 1..4096"},
      {{"-n", "99999999999999999999", "--", "prog"}, "-n must be in"},
      {{"-n", "-3", "--", "prog"}, "-n needs an integer"},
      {{"-n", "two", "--", "prog"}, "-n needs an integer"},
      {{"-n", "2x", "--", "prog"}, "-n needs an integer"},
      {{"-n"}, "-n needs a value"},
      {{"-n", "--", "prog"}, "-n needs a value"},
      {{"-n", "2"}, "missing '--'"},
      {{"-n", "2", "prog"}, "unexpected argument 'prog'"},
      {{"-n", "2", "--"}, "missing program"},
      {{"-n", "2", "--frobnicate", "--", "prog"}, "unknown option '--frobnicate'"},
      {{"-n", "2", "--master-port", "0", "--", "prog"}, "--master-port must be in 1..65535"},
      {{"-n", "2", "--master-port", "70000", "--", "prog"}, "--master-port must be in 1..65535"},
      {{"-n", "2", "--master-port", "http", "--", "prog"}, "--master-port needs an integer"},
      {{"-n", "2", "--master-addr=", "--", "prog"}, "--master-addr must not be empty"},
      {{"-n", "2", "--timeout", "soon", "--", "prog"}, "--timeout needs a non-negative number"},
      {{"-n", "2", "--timeout", "-1", "--", "prog"}, "--timeout needs a non-negative number"},
      {{"-n", "2", "--timeout", "1e3", "--", "prog"}, "--timeout needs a non-negative number"},
      {{"-n", "2", "--timeout", "inf", "--", "prog"}, "--timeout needs a non-negative number"},
      {{"-n", "2", "--grace", "1.2.3", "--", "prog"}, "--grace needs a non-negative number"},
      {{"-n", "2", "--timeout", "99999999999999999999", "--", "prog"},
       "--timeout must be at most 100000000 seconds"},
      {{"-n", "2", "--grace", ".", "--", "prog"}, "--grace needs a non-negative number"},
      {{"-n", "2", "--no-prefix=yes", "--", "prog"}, "--no-prefix takes no value"},
  };
  for (const auto& [args, expected] : cases) {
    std::string joined;
    for (const std::string& arg : args) joined += " " + arg;
    INFO("args:" << joined);
    CHECK_THROWS_WITH(parse_command_line(args), Catch::Contains(expected));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Rank setup

TEST_CASE("rank_environment sets the rendezvous variables and keeps the rest", "[launcher]") {
  const std::vector<std::string> base{"PATH=/usr/bin", "RANK=7", "OMP_NUM_THREADS=3", "MASTER_PORT=1",
                                      "RANKING=kept", "EMPTY="};
  const std::vector<std::string> environment = rank_environment(base, 2, 4, "10.1.2.3", 29500, 29777);
  const std::multiset<std::string> entries(environment.begin(), environment.end());
  // smp's store on SMP_MASTER_PORT; MASTER_PORT left to the program's torch.distributed.
  const std::multiset<std::string> expected{"PATH=/usr/bin",    "OMP_NUM_THREADS=3",  "RANKING=kept",
                                            "EMPTY=",           "RANK=2",             "LOCAL_RANK=2",
                                            "WORLD_SIZE=4",     "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=10.1.2.3",
                                            "SMP_MASTER_PORT=29500", "MASTER_PORT=29777", "GROUP_RANK=0"};
  CHECK(entries == expected);
}

TEST_CASE("rank_environment numbers the ranks of several nodes globally", "[launcher]") {
  const auto environment = rank_environment({"SMP_JOB_ID=stale"}, 1, 4, "10.1.2.3", 29500, 29501, 1, 2, "job42");
  const std::multiset<std::string> entries(environment.begin(), environment.end());
  const std::multiset<std::string> expected{"RANK=5",        "LOCAL_RANK=1",         "WORLD_SIZE=8",
                                            "LOCAL_WORLD_SIZE=4", "GROUP_RANK=1",     "MASTER_ADDR=10.1.2.3",
                                            "SMP_MASTER_PORT=29500", "MASTER_PORT=29501", "SMP_JOB_ID=job42"};
  CHECK(entries == expected);
  // Every node derives torch's port alike; one node picks a free one, never smp's.
  CHECK(torch_port_beside(29500, 2, [] { return 1; }) == 29501);
  CHECK(torch_port_beside(65535, 2, [] { return 1; }) == 65534);
  int picks = 0;
  CHECK(torch_port_beside(29500, 1, [&] { return ++picks == 1 ? 29500 : 31000; }) == 31000);
}

TEST_CASE("several nodes need a shared port and a node rank below the node count", "[launcher]") {
  const auto options = parse_command_line({"-n", "4", "--nodes", "2", "--node-rank", "1", "--master-port", "29500",
                                           "--job-id", "abc", "--", "prog"}).options;
  CHECK(options.nodes == 2);
  CHECK(options.node_rank == 1);
  CHECK(options.job_id == "abc");
  CHECK_THROWS_WITH(parse_command_line({"-n", "4", "--nodes", "2", "--", "prog"}), Catch::Contains("needs --master-port"));
  CHECK_THROWS_WITH(parse_command_line({"-n", "4", "--nodes", "2", "--node-rank", "2", "--master-port", "1", "--", "p"}),
                    Catch::Contains("--node-rank 2 must be below --nodes 2"));
}

TEST_CASE("rank_environment does not invent OMP_NUM_THREADS", "[launcher]") {
  for (const std::string& entry : rank_environment({"HOME=/root"}, 0, 1, "127.0.0.1", 1, 2)) {
    CHECK(entry.rfind("OMP_NUM_THREADS=", 0) != 0);
  }
}

TEST_CASE("check_executable follows execvp's rules", "[launcher]") {
  CHECK(check_executable("sh", "/nonexistent-dir:/bin:/usr/bin") == 0);
  CHECK(check_executable("sh", nullptr) == 0);
  CHECK(check_executable("/bin/sh", "") == 0);
  CHECK(check_executable("definitely-not-a-program-xyz", "/bin:/usr/bin") == ENOENT);
  CHECK(check_executable("sh", "/nonexistent-dir") == ENOENT);
  CHECK(check_executable("/nonexistent/prog", nullptr) == ENOENT);
  CHECK(check_executable("", nullptr) == ENOENT);
  CHECK(check_executable("/tmp", nullptr) == EACCES);

  const TempDirectory temp;
  const std::string& directory = temp.path();
  const std::string not_executable = directory + "/data.txt";
  std::ofstream(not_executable) << "data\n";
  REQUIRE(::chmod(not_executable.c_str(), 0644) == 0);
  // root may execute any file with an execute bit, but none without one.
  CHECK(check_executable(not_executable, nullptr) == EACCES);
  CHECK(check_executable("data.txt", directory.c_str()) == EACCES);
  // A runnable file later on PATH wins over a non-runnable one earlier, as with execvp.
  const std::string shadowing = directory + "/sh";
  std::ofstream(shadowing) << "not a program\n";
  REQUIRE(::chmod(shadowing.c_str(), 0644) == 0);
  CHECK(check_executable("sh", (directory + ":/bin:/usr/bin").c_str()) == 0);
}

TEST_CASE("pick_free_port returns a port that can be bound", "[launcher]") {
  const int port = pick_free_port("127.0.0.1");
  REQUIRE(port >= 1);
  REQUIRE(port <= 65535);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Another process could take it in between, but on a test machine that is vanishingly unlikely.
  CHECK(::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0);
  ::close(fd);
}

TEST_CASE("pick_free_port stays below the kernel's range for outgoing connections' ports", "[launcher]") {
  // Parallel jobs' connections take source ports from that range: one of them could take the port before rank 0
  // binds it.
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int lowest_ephemeral = 0;
  REQUIRE(range >> lowest_ephemeral);
  if (lowest_ephemeral < 11000) return;  // no room below it: the kernel's pick is the only one
  for (int pick = 0; pick < 20; ++pick) {
    const int port = pick_free_port("127.0.0.1");
    CHECK(port >= 10000);
    CHECK(port < lowest_ephemeral);
  }
}

TEST_CASE("pick_free_port fails on an address that is not local", "[launcher]") {
  // 192.0.2.0/24 is reserved for documentation, so no interface here has it.
  CHECK_THROWS_WITH(pick_free_port("192.0.2.1"), Catch::Contains("cannot pick a free port on '192.0.2.1'"));
}

// ---------------------------------------------------------------------------------------------------------
// Output lines and statuses

TEST_CASE("LineAssembler rebuilds lines from arbitrary chunks", "[launcher]") {
  LineAssembler assembler;
  std::vector<std::string> lines;
  const auto collect = [&](std::string_view line) { lines.emplace_back(line); };
  assembler.feed("he", collect);
  CHECK(lines.empty());
  assembler.feed("llo\nwor", collect);
  assembler.feed("ld\n\nlast", collect);
  CHECK(lines == std::vector<std::string>{"hello", "world", ""});
  assembler.flush(collect);
  CHECK(lines == std::vector<std::string>{"hello", "world", "", "last"});
  assembler.flush(collect);
  CHECK(lines.size() == 4);
}

TEST_CASE("LineAssembler emits an overlong line in pieces", "[launcher]") {
  LineAssembler assembler(4);
  std::vector<std::string> lines;
  const auto collect = [&](std::string_view line) { lines.emplace_back(line); };
  assembler.feed("abcdefghij", collect);
  CHECK(lines == std::vector<std::string>{"abcd", "efgh"});
  assembler.feed("\n", collect);
  CHECK(lines == std::vector<std::string>{"abcd", "efgh", "ij"});
}

TEST_CASE("TracebackFolder prints a traceback once and another rank's copy as a line naming the first", "[launcher]") {
  TracebackFolder folder;
  TracebackFolder::Held rank0, rank1, rank2;
  std::vector<std::string> lines;
  const auto collect = [&](std::string_view line) { lines.emplace_back(line); };
  const std::vector<std::string> traceback = {"Traceback (most recent call last):", "  File \"a.py\", line 2, in <module>",
                                              "    smp.init(config)", "smp.ConfigError: key \"microbatches\": 3"};
  folder.line(rank1, 1, "before", collect);
  for (const std::string& line : traceback) folder.line(rank1, 1, line, collect);
  folder.line(rank1, 1, "after", collect);
  std::vector<std::string> expected = {"before"};
  expected.insert(expected.end(), traceback.begin(), traceback.end());
  expected.push_back("after");
  CHECK(lines == expected);

  lines.clear();
  for (const std::string& line : traceback) folder.line(rank0, 0, line, collect);
  CHECK(lines == std::vector<std::string>{"Traceback (most recent call last): the same as rank 1's above",
                                          traceback.back()});

  // Another ending is another traceback: whole.
  lines.clear();
  for (std::size_t index = 0; index + 1 < traceback.size(); ++index) folder.line(rank2, 2, traceback[index], collect);
  CHECK(lines.empty());  // held until its last line says how it ends
  folder.line(rank2, 2, "smp.ConfigError: key \"microbatches\": 5", collect);
  CHECK(lines.size() == traceback.size());

  // A stream that ends inside a traceback gives what it held as it was.
  lines.clear();
  for (std::size_t index = 0; index + 1 < traceback.size(); ++index) folder.line(rank0, 0, traceback[index], collect);
  folder.flush(rank0, collect);
  CHECK(lines == std::vector<std::string>(traceback.begin(), traceback.end() - 1));
}

TEST_CASE("smprun prints a traceback every rank printed once", "[launcher][smprun]") {
  // Each rank exits once all have printed, so that the first to exit stops no other before it printed.
  const TempDirectory temp;
  const SmprunResult result = run_smprun(
      {"-n", "3", "--", "sh", "-c",
       "printf 'Traceback (most recent call last):\\n  File \"x.py\", line 1\\nValueError: bad\\n' >&2; touch " +
           temp.path() + "/$RANK; while [ $(ls " + temp.path() + " | wc -l) -lt 3 ]; do sleep 0.05; done; exit 1"});
  CHECK(result.exit_code == 1);
  const std::vector<std::string> lines = split_lines(result.err);
  CHECK(std::count_if(lines.begin(), lines.end(), [](const std::string& line) {
          return contains(line, "] Traceback (most recent call last):") && !contains(line, "the same as");
        }) == 1);
  CHECK(std::count_if(lines.begin(), lines.end(), [](const std::string& line) {
          return contains(line, "] ValueError: bad");
        }) == 3);
}

TEST_CASE("smprun prints what a rank held back when a process it left behind keeps its pipe open", "[launcher][smprun]") {
  // The drain deadline ends supervision with the pipes still open: the traceback waiting for its exception line
  // and the line without its end are what the rank said last.
  const SmprunResult result = run_smprun(
      {"-n", "1", "--", "sh", "-c",
       "printf 'Traceback (most recent call last):\\n  File \"x.py\", line 1\\n' >&2; printf 'last words'; "
       "sleep 4 & exit 0"});
  CHECK(result.exit_code == 0);
  CHECK(contains(result.err, "[rank 0] Traceback (most recent call last):\n[rank 0]   File \"x.py\", line 1\n"));
  CHECK(contains(result.out, "[rank 0] last words\n"));
}

TEST_CASE("describe_wait_status reports exit codes and signals", "[launcher]") {
  const int exited_3 = wait_status_of_child([] { ::_exit(3); });
  CHECK(describe_wait_status(exited_3) == "exited with status 3");
  CHECK(is_failure(exited_3));

  const int exited_0 = wait_status_of_child([] { ::_exit(0); });
  CHECK(describe_wait_status(exited_0) == "exited with status 0");
  CHECK_FALSE(is_failure(exited_0));

  const int killed = wait_status_of_child([] { ::raise(SIGKILL); });
  CHECK(describe_wait_status(killed) == "was killed by signal SIGKILL (9)");
  CHECK(is_failure(killed));

  CHECK(describe_signal(SIGTERM) == "SIGTERM (15)");
  CHECK(describe_signal(SIGRTMIN + 1) == std::to_string(SIGRTMIN + 1));
}

// ---------------------------------------------------------------------------------------------------------
// smprun end to end

TEST_CASE("smprun runs every rank with its environment and prefixes its output", "[launcher][smprun]") {
  const SmprunResult result = run_smprun(
      {"-n", "4", "--", "/bin/sh", "-c",
       "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK localworld=$LOCAL_WORLD_SIZE addr=$MASTER_ADDR "
       "port=$MASTER_PORT"});
  CHECK(result.exit_code == 0);
  CHECK(result.err.empty());

  const std::vector<std::string> lines = split_lines(result.out);
  REQUIRE(lines.size() == 4);
  const std::regex line_pattern(
      R"(\[rank ([0-9])\] rank=([0-9]) world=4 local=([0-9]) localworld=4 addr=127\.0\.0\.1 port=([0-9]+))");
  std::set<int> ranks_seen;
  std::set<int> ports_seen;
  for (const std::string& line : lines) {
    std::smatch match;
    INFO(line);
    REQUIRE(std::regex_match(line, match, line_pattern));
    CHECK(match[1] == match[2]);
    CHECK(match[1] == match[3]);
    ranks_seen.insert(std::stoi(match[1]));
    ports_seen.insert(std::stoi(match[4]));
  }
  CHECK(ranks_seen == std::set<int>{0, 1, 2, 3});
  REQUIRE(ports_seen.size() == 1);
  CHECK(*ports_seen.begin() >= 1);
  CHECK(*ports_seen.begin() <= 65535);
}

TEST_CASE("smprun passes --master-addr and --master-port through", "[launcher][smprun]") {
  // smp's store on SMP_MASTER_PORT; MASTER_PORT another, for the program's torch.distributed.
  const SmprunResult result = run_smprun({"-n", "2", "--master-addr", "localhost", "--master-port", "29123",
                                          "--", "sh", "-c", "echo $MASTER_ADDR:$SMP_MASTER_PORT:$MASTER_PORT"});
  CHECK(result.exit_code == 0);
  const std::regex line(R"(\[rank ([01])\] localhost:29123:([0-9]+))");
  std::set<std::string> torch_ports;
  for (const std::string& each : split_lines(result.out)) {
    std::smatch match;
    INFO(each);
    REQUIRE(std::regex_match(each, match, line));
    torch_ports.insert(match[2]);
  }
  REQUIRE(torch_ports.size() == 1);
  CHECK(*torch_ports.begin() != "29123");
}

TEST_CASE("smprun keeps OMP_NUM_THREADS when set and does not invent it", "[launcher][smprun]") {
  SmprunRun run;
  run.args = {"-n", "1", "--", "sh", "-c", "echo omp=${OMP_NUM_THREADS-unset} home=$SMPRUN_TEST_MARKER"};
  run.environment_changes = {{"OMP_NUM_THREADS", "3"}, {"SMPRUN_TEST_MARKER", "kept"}};
  SmprunResult result = run_smprun(run);
  CHECK(result.exit_code == 0);
  CHECK(result.out == "[rank 0] omp=3 home=kept\n");

  run.environment_changes = {{"OMP_NUM_THREADS", std::nullopt}, {"SMPRUN_TEST_MARKER", "kept"}};
  result = run_smprun(run);
  CHECK(result.exit_code == 0);
  CHECK(result.out == "[rank 0] omp=unset home=kept\n");
}

TEST_CASE("smprun sends stdout lines to stdout and stderr lines to stderr", "[launcher][smprun]") {
  const SmprunResult result = run_smprun(
      {"-n", "2", "--", "sh", "-c", "echo out$RANK; echo err$RANK >&2; printf \"partial$RANK\""});
  CHECK(result.exit_code == 0);
  const std::multiset<std::string> out_lines = [&] {
    const auto lines = split_lines(result.out);
    return std::multiset<std::string>(lines.begin(), lines.end());
  }();
  CHECK(out_lines == std::multiset<std::string>{"[rank 0] out0", "[rank 0] partial0", "[rank 1] out1",
                                                "[rank 1] partial1"});
  CHECK(contains(result.err, "[rank 0] err0\n"));
  CHECK(contains(result.err, "[rank 1] err1\n"));
  CHECK_FALSE(contains(result.err, "out"));
  // A last line without '\n' still ends with one, so it cannot run into the next rank's line.
  CHECK(result.out.back() == '\n');
}

TEST_CASE("smprun --no-prefix passes lines through unchanged", "[launcher][smprun]") {
  const SmprunResult result =
      run_smprun({"--no-prefix", "-n", "1", "--", "sh", "-c", "echo plain; echo e >&2"});
  CHECK(result.exit_code == 0);
  CHECK(result.out == "plain\n");
  CHECK(result.err == "e\n");
}

TEST_CASE("smprun never cuts one rank's line with another's", "[launcher][smprun]") {
  // Long lines, so that each one spans several pipe reads and the ranks' writes overlap in time.
  const std::string padding(3000, 'x');
  const SmprunResult result = run_smprun(
      {"-n", "4", "--", "sh", "-c",
       "i=0; while [ $i -lt 300 ]; do echo \"r$RANK-$i-" + padding + "\"; i=$((i+1)); done"});
  CHECK(result.exit_code == 0);
  const std::vector<std::string> lines = split_lines(result.out);
  CHECK(lines.size() == 4 * 300);
  const std::regex line_pattern(R"(\[rank ([0-9])\] r([0-9])-[0-9]+-x{3000})");
  int malformed = 0;
  for (const std::string& line : lines) {
    std::smatch match;
    if (!std::regex_match(line, match, line_pattern) || match[1] != match[2]) ++malformed;
  }
  CHECK(malformed == 0);
}

TEST_CASE("smprun stops the job when one rank fails", "[launcher][smprun]") {
  const SmprunResult result =
      run_smprun({"-n", "4", "--", "sh", "-c", "if [ $RANK = 2 ]; then exit 3; fi; sleep 100"});
  CHECK(result.exit_code == 1);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: rank 2 exited with status 3\n"));
  const std::vector<std::string> err_lines = split_lines(result.err);
  REQUIRE_FALSE(err_lines.empty());
  const std::string& summary = err_lines.back();
  CHECK(contains(summary, "smprun: final status:"));
  CHECK(contains(summary, "rank 2 exited with status 3"));
  for (const char* other : {"rank 0 ", "rank 1 ", "rank 3 "}) {
    CHECK(contains(summary, std::string(other) + "was killed by signal SIGTERM (15)"));
  }
}

TEST_CASE("smprun reports the first failure as the cause", "[launcher][smprun]") {
  // Rank 1 fails first; rank 0 fails later, only because it gets SIGTERM and exits 5 on it. Rank 1 waits
  // until rank 0 has set its trap.
  const TempDirectory temp;
  const std::string ready = temp.path() + "/ready";
  const SmprunResult result = run_smprun(
      {"-n", "2", "--", "sh", "-c",
       "if [ $RANK = 1 ]; then while [ ! -e " + ready + " ]; do sleep 0.05; done; exit 4; fi; "
       "trap 'exit 5' TERM; touch " + ready + "; while :; do sleep 0.1; done"});
  CHECK(result.exit_code == 1);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: rank 1 exited with status 4\n"));
  CHECK_FALSE(contains(result.err, "smprun: rank 0 exited"));
  CHECK(contains(result.err, "final status: rank 0 exited with status 5; rank 1 exited with status 4\n"));
}

TEST_CASE("smprun reports a rank killed by a signal", "[launcher][smprun]") {
  const SmprunResult result =
      run_smprun({"-n", "3", "--", "sh", "-c", "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 100"});
  CHECK(result.exit_code == 1);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: rank 1 was killed by signal SIGKILL (9)\n"));
}

TEST_CASE("smprun stops the processes that the ranks started", "[launcher][smprun]") {
  const SmprunResult result = run_smprun(
      {"-n", "2", "--", "sh", "-c",
       "sleep 100 & echo background=$!; if [ $RANK = 1 ]; then sleep 0.5; exit 2; fi; wait"});
  CHECK(result.exit_code == 1);
  CHECK(result.seconds < 20);
  const std::vector<pid_t> background = pids_after("background=", result.out);
  REQUIRE(background.size() == 2);
  for (const pid_t pid : background) CHECK(eventually_gone(pid));
}

TEST_CASE("smprun SIGKILLs ranks that ignore SIGTERM after --grace", "[launcher][smprun]") {
  // Rank 0 fails once rank 1 has started to ignore SIGTERM (and so has the sleep it runs).
  const TempDirectory temp;
  const std::string ready = temp.path() + "/ready";
  const SmprunResult result = run_smprun(
      {"-n", "2", "--grace", "1", "--", "sh", "-c",
       "if [ $RANK = 0 ]; then while [ ! -e " + ready + " ]; do sleep 0.05; done; exit 1; fi; "
       "trap '' TERM; touch " + ready + "; sleep 100"});
  CHECK(result.exit_code == 1);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: rank 0 exited with status 1\n"));
  CHECK(contains(result.err, "sending SIGKILL"));
  CHECK(contains(result.err, "rank 1 was killed by signal SIGKILL (9)"));
}

TEST_CASE("smprun --timeout stops a hanging job with exit 124", "[launcher][smprun]") {
  const SmprunResult result = run_smprun({"-n", "2", "--timeout", "1", "--", "sleep", "100"});
  CHECK(result.exit_code == 124);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: job exceeded --timeout 1 s; stopping all ranks\n"));
  CHECK(contains(result.err, "rank 0 was killed by signal SIGTERM (15)"));
  CHECK(contains(result.err, "rank 1 was killed by signal SIGTERM (15)"));
}

TEST_CASE("smprun --timeout does not affect a job that finishes in time", "[launcher][smprun]") {
  const SmprunResult result = run_smprun({"-n", "2", "--timeout", "30", "--", "sh", "-c", "exit 0"});
  CHECK(result.exit_code == 0);
  CHECK(result.err.empty());
}

TEST_CASE("smprun forwards SIGTERM and SIGINT to the ranks", "[launcher][smprun]") {
  const int signal_number = GENERATE(SIGTERM, SIGINT);
  SmprunRun run;
  // exec, so that the pid printed is the process that must be stopped.
  run.args = {"-n", "3", "--", "sh", "-c", "echo pid=$$; exec sleep 100"};
  run.signal_triggers = {
      {[](const SmprunResult& sofar) { return pids_after("pid=", sofar.out).size() == 3; }, signal_number}};
  const SmprunResult result = run_smprun(run);
  CHECK(result.exit_code == 128 + signal_number);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: received " + describe_signal(signal_number)));
  for (const pid_t pid : pids_after("pid=", result.out)) CHECK(eventually_gone(pid));
}

TEST_CASE("ranks die with smprun when it is killed", "[launcher][smprun]") {
  SmprunRun run;
  run.args = {"-n", "2", "--", "sh", "-c", "echo pid=$$; exec sleep 100"};
  run.signal_triggers = {
      {[](const SmprunResult& sofar) { return pids_after("pid=", sofar.out).size() == 2; }, SIGKILL}};
  const SmprunResult result = run_smprun(run);
  CHECK(result.seconds < 20);
  const std::vector<pid_t> ranks = pids_after("pid=", result.out);
  REQUIRE(ranks.size() == 2);
  for (const pid_t pid : ranks) CHECK(eventually_gone(pid));
}

TEST_CASE("smprun kills at once on a second signal", "[launcher][smprun]") {
  SmprunRun run;
  // The ranks ignore SIGTERM and the grace period is long, so only the second signal can end them in time.
  run.args = {"-n", "2", "--grace", "60", "--", "sh", "-c", "trap '' TERM; echo ready; sleep 100"};
  run.signal_triggers = {
      {[](const SmprunResult& sofar) { return split_lines(sofar.out).size() == 2; }, SIGTERM},
      // Only once the first has been handled: two pending signals would merge into one. Another signal (the same
      // one within half a second is the first delivered twice, next test).
      {[](const SmprunResult& sofar) { return contains(sofar.err, "forwarding it to all ranks"); }, SIGINT}};
  const SmprunResult result = run_smprun(run);
  CHECK(result.exit_code == 128 + SIGTERM);
  CHECK(result.seconds < 20);
  CHECK(contains(result.err, "smprun: received SIGTERM (15); forwarding it to all ranks\n"));
  CHECK(contains(result.err, "smprun: received SIGINT (2) while stopping; sending SIGKILL"));
  CHECK(contains(result.err, "final status: rank 0 was killed by signal SIGKILL (9); "
                             "rank 1 was killed by signal SIGKILL (9)"));
}

TEST_CASE("smprun takes a signal delivered twice at once as one", "[launcher][smprun]") {
  // As `timeout smprun ...` under Ctrl-C delivers it: the terminal's to the group, then timeout's forwarded. The ranks
  // get the grace period, not SIGKILL at once.
  SmprunRun run;
  run.args = {"-n", "2", "--grace", "2", "--", "sh", "-c", "trap '' TERM; echo ready; sleep 100"};
  run.signal_triggers = {
      {[](const SmprunResult& sofar) { return split_lines(sofar.out).size() == 2; }, SIGTERM},
      {[](const SmprunResult& sofar) { return contains(sofar.err, "forwarding it to all ranks"); }, SIGTERM}};
  const SmprunResult result = run_smprun(run);
  CHECK(result.exit_code == 128 + SIGTERM);
  CHECK(result.seconds >= 2);
  CHECK_FALSE(contains(result.err, "while stopping"));
  CHECK(contains(result.err, "grace"));
}

TEST_CASE("smprun leaves alone a signal ignored by whoever started it", "[launcher][smprun]") {
  SmprunRun run;
  run.args = {"-n", "2", "--", "sh", "-c", "echo ready; sleep 1; echo done"};
  run.ignored_signals = {SIGHUP};
  run.signal_triggers = {
      {[](const SmprunResult& sofar) { return split_lines(sofar.out).size() == 2; }, SIGHUP}};
  const SmprunResult result = run_smprun(run);
  CHECK(result.exit_code == 0);
  CHECK(split_lines(result.out).size() == 4);
  CHECK(contains(result.out, "[rank 0] done\n"));
  CHECK(contains(result.out, "[rank 1] done\n"));
  CHECK(result.err.empty());
}

TEST_CASE("smprun rejects bad usage with exit 2 and a message", "[launcher][smprun]") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--", "true"}, "smprun: missing -n"},
      {{"-n", "0", "--", "true"}, "smprun: -n must be in 1..4096"},
      {{"-n", "abc", "--", "true"}, "smprun: -n needs an integer"},
      {{"-n", "2", "true"}, "smprun: unexpected argument 'true'"},
      {{"-n", "2"}, "smprun: missing '--'"},
      {{"-n", "2", "--"}, "smprun: missing program"},
      {{"-n", "2", "--bogus", "--", "true"}, "smprun: unknown option '--bogus'"},
      {{"-n", "2", "--timeout", "x", "--", "true"}, "smprun: --timeout needs"},
      {{"-n", "2", "--master-addr", "192.0.2.1", "--", "true"},
       "smprun: cannot pick a free port on '192.0.2.1'"},
  };
  for (const auto& [args, expected] : cases) {
    const SmprunResult result = run_smprun(args);
    INFO(result.err);
    CHECK(result.exit_code == 2);
    CHECK(result.err.rfind(expected, 0) == 0);
    CHECK(contains(result.err, "usage: smprun -n N"));
    CHECK(result.out.empty());
  }
}

TEST_CASE("smprun --help prints the usage and exits 0", "[launcher][smprun]") {
  const SmprunResult result = run_smprun({"--help"});
  CHECK(result.exit_code == 0);
  CHECK(contains(result.out, "usage: smprun -n N"));
  CHECK(contains(result.out, "--timeout"));
  CHECK(contains(result.out, "exit status"));
  CHECK(result.err.empty());
}

TEST_CASE("smprun refuses a program that cannot be executed", "[launcher][smprun]") {
  const SmprunResult missing = run_smprun({"-n", "2", "--", "/nonexistent/prog"});
  CHECK(missing.exit_code == 2);
  CHECK(missing.err.rfind("smprun: cannot execute '/nonexistent/prog': No such file or directory\n", 0) == 0);

  const SmprunResult not_on_path = run_smprun({"-n", "2", "--", "definitely-not-a-program-xyz"});
  CHECK(not_on_path.exit_code == 2);
  CHECK(contains(not_on_path.err,
                 "cannot execute 'definitely-not-a-program-xyz': No such file or directory"));

  const SmprunResult directory = run_smprun({"-n", "1", "--", "/tmp"});
  CHECK(directory.exit_code == 2);
  CHECK(contains(directory.err, "cannot execute '/tmp': Permission denied"));
}

TEST_CASE("smprun reports a rank whose exec fails as a failing rank", "[launcher][smprun]") {
  // Executable, so it passes smprun's check, but its interpreter is missing, so execvp itself fails.
  const TempDirectory temp;
  const std::string script = temp.path() + "/broken";
  std::ofstream(script) << "#!/nonexistent/interpreter\n";
  REQUIRE(::chmod(script.c_str(), 0755) == 0);

  const SmprunResult result = run_smprun({"-n", "2", "--", script});
  CHECK(result.exit_code == 1);
  CHECK(contains(result.err, "smprun: cannot execute '" + script + "': No such file or directory\n"));
  CHECK(contains(result.err, "exited with status 127"));
}
