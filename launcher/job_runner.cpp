#include "job_runner.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "exit_status.h"
#include "line_assembler.h"
#include "rank_setup.h"
#include "traceback_folder.h"

extern char** environ;

namespace smp::launch {
namespace {

using Clock = std::chrono::steady_clock;

// Once every rank has exited, output can only still come from processes they left behind; give those this
// long to finish writing rather than waiting on them forever.
constexpr auto kDrainAfterLastExit = std::chrono::seconds(1);
// A signal repeated within this long of the first is taken as the same one (handle_signals).
constexpr auto kSameSignalWindow = std::chrono::milliseconds(500);
// Bounds the reads done at once from a rank that has just exited (a descendant could keep writing).
constexpr int kMaxReadsWhenDraining = 64;
constexpr std::size_t kReadChunkBytes = 64 * 1024;

// The signals whose disposition smprun changes; every rank gets back the dispositions smprun inherited.
constexpr std::array<int, 5> kManagedSignals{SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE};

int g_signal_pipe_write_end = -1;

// Only wakes the event loop; everything else happens there, outside signal context.
void record_signal(int signal_number) {
  const int saved_errno = errno;
  const auto byte = static_cast<unsigned char>(signal_number);
  // A full pipe already guarantees a wake-up, so a failed write loses nothing.
  [[maybe_unused]] const ssize_t written = ::write(g_signal_pipe_write_end, &byte, 1);
  errno = saved_errno;
}

sigset_t managed_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (const int signal_number : kManagedSignals) sigaddset(&set, signal_number);
  return set;
}

// False when the data cannot be delivered because the reader is gone (EPIPE) or the descriptor is unusable.
bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t written = ::write(fd, data.data(), data.size());
    if (written >= 0) {
      data.remove_prefix(static_cast<std::size_t>(written));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd writable{fd, POLLOUT, 0};
      ::poll(&writable, 1, -1);
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

// Whether the message arrived changes nothing: the ranks must be supervised either way.
void report(const std::string& message) { write_all(STDERR_FILENO, "smprun: " + message + "\n"); }

std::string format_seconds(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

int poll_timeout_ms(std::optional<Clock::time_point> deadline, Clock::time_point now) {
  if (!deadline) return -1;
  if (*deadline <= now) return 0;
  // Rounded up so that the loop never wakes just before a deadline and spins on a zero timeout.
  const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(*deadline - now).count();
  return static_cast<int>(std::min<long long>(remaining, 24LL * 3600 * 1000));
}

std::optional<Clock::time_point> earliest(std::optional<Clock::time_point> a,
                                          std::optional<Clock::time_point> b) {
  if (!a) return b;
  if (!b) return a;
  return std::min(*a, *b);
}

struct OutputStream {
  int read_fd = -1;
  int destination_fd = -1;
  LineAssembler assembler;
  TracebackFolder::Held traceback;
};

struct Rank {
  int index = 0;        // on this node: LOCAL_RANK
  int global_index = 0;  // in the job: RANK, what every message names
  std::string line_prefix;
  pid_t pid = -1;  // -1: never started
  bool running = false;
  int wait_status = 0;
  std::array<OutputStream, 2> streams;  // the rank's stdout, then its stderr

  bool output_open() const { return streams[0].read_fd >= 0 || streams[1].read_fd >= 0; }
};

// Collects a rank's lines, prefixed, into one batch to write.
auto appender(const Rank& rank, std::string& lines) {
  return [&rank, &lines](std::string_view line) { lines.append(rank.line_prefix).append(line).push_back('\n'); };
}

enum class StopReason { None, RankFailed, LaunchFailed, Timeout, Signal };
enum class ReadResult { Data, Empty, Closed };

class Job {
 public:
  explicit Job(const LaunchOptions& options) : options_(options) {
    ranks_.resize(static_cast<std::size_t>(options.world_size));
    for (int index = 0; index < options.world_size; ++index) {
      Rank& rank = ranks_[static_cast<std::size_t>(index)];
      rank.index = index;
      rank.global_index = options.node_rank * options.world_size + index;
      rank.line_prefix = options.prefix_output ? "[rank " + std::to_string(rank.global_index) + "] " : "";
      rank.streams[0].destination_fd = STDOUT_FILENO;
      rank.streams[1].destination_fd = STDERR_FILENO;
    }
  }

  ~Job() {
    for (Rank& rank : ranks_) {
      for (OutputStream& stream : rank.streams) close_fd(stream.read_fd);
    }
    close_fd(null_input_fd_);
    close_fd(signal_pipe_[0]);
    close_fd(signal_pipe_[1]);
  }

  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  int run() {
    if (!install_signal_handling()) return kExitRankFailed;
    started_at_ = Clock::now();
    start_ranks();
    supervise();
    release_held_output();
    if (stop_reason_ != StopReason::None) report_final_statuses();
    return exit_code();
  }

 private:
  static void close_fd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  bool install_signal_handling() {
    if (::pipe2(signal_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
      report(std::string("cannot create the signal pipe: ") + std::strerror(errno));
      return false;
    }
    g_signal_pipe_write_end = signal_pipe_[1];
    struct sigaction recording {};
    recording.sa_handler = record_signal;
    sigemptyset(&recording.sa_mask);
    // SA_NOCLDSTOP: a rank stopped by job control has not ended, so it needs no attention.
    recording.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    struct sigaction ignoring {};
    ignoring.sa_handler = SIG_IGN;
    sigemptyset(&ignoring.sa_mask);

    for (std::size_t index = 0; index < kManagedSignals.size(); ++index) {
      const int signal_number = kManagedSignals[index];
      ::sigaction(signal_number, nullptr, &inherited_actions_[index]);
      if (signal_number == SIGPIPE) {
        // A closed stdout must not kill smprun while it is still responsible for stopping the ranks.
        ::sigaction(signal_number, &ignoring, nullptr);
      } else if (signal_number == SIGCHLD || inherited_actions_[index].sa_handler != SIG_IGN) {
        // A stop signal that whoever started smprun chose to ignore (nohup) stays ignored.
        ::sigaction(signal_number, &recording, nullptr);
      }
    }
    return true;
  }

  void start_ranks() {
    null_input_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_input_fd_ < 0) {
      fail_launch(0, errno);
      return;
    }
    for (const std::string& arg : options_.program_and_args) argv_.push_back(const_cast<char*>(arg.c_str()));
    argv_.push_back(nullptr);
    exec_failure_prefix_ = "smprun: cannot execute '" + options_.program_and_args.front() + "': ";

    std::vector<std::string> base_environment;
    for (char** entry = environ; *entry != nullptr; ++entry) base_environment.emplace_back(*entry);

    for (Rank& rank : ranks_) {
      const int error = start_rank(rank, rank_environment(base_environment, rank.index, options_.world_size,
                                                          options_.master_addr, options_.master_port,
                                                          options_.torch_port, options_.node_rank, options_.nodes,
                                                          options_.job_id));
      if (error != 0) {
        fail_launch(rank.global_index, error);
        return;
      }
    }
  }

  void fail_launch(int rank_index, int error) {
    report("cannot start rank " + std::to_string(rank_index) + ": " + std::strerror(error));
    begin_stop(StopReason::LaunchFailed, SIGTERM);
  }

  // Returns 0 or an errno.
  int start_rank(Rank& rank, const std::vector<std::string>& environment) {
    std::vector<char*> environment_pointers;
    for (const std::string& entry : environment)
      environment_pointers.push_back(const_cast<char*>(entry.c_str()));
    environment_pointers.push_back(nullptr);

    int stdout_pipe[2];
    int stderr_pipe[2];
    if (::pipe2(stdout_pipe, O_CLOEXEC) != 0) return errno;
    if (::pipe2(stderr_pipe, O_CLOEXEC) != 0) {
      const int error = errno;
      ::close(stdout_pipe[0]);
      ::close(stdout_pipe[1]);
      return error;
    }

    // Blocked across fork so that the child cannot run smprun's handlers and feed them into smprun's own
    // signal pipe before it has reset them.
    const sigset_t managed = managed_signal_set();
    sigset_t previous_mask;
    ::sigprocmask(SIG_BLOCK, &managed, &previous_mask);
    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      exec_rank(stdout_pipe[1], stderr_pipe[1], environment_pointers.data(), previous_mask, launcher);
    }
    const int fork_error = errno;
    ::sigprocmask(SIG_SETMASK, &previous_mask, nullptr);
    ::close(stdout_pipe[1]);
    ::close(stderr_pipe[1]);
    if (pid < 0) {
      ::close(stdout_pipe[0]);
      ::close(stderr_pipe[0]);
      return fork_error;
    }
    // The child does the same; doing it here too means the group exists before smprun may signal it.
    ::setpgid(pid, pid);
    rank.pid = pid;
    rank.running = true;
    rank.streams[0].read_fd = stdout_pipe[0];
    rank.streams[1].read_fd = stderr_pipe[0];
    for (const OutputStream& stream : rank.streams) ::fcntl(stream.read_fd, F_SETFL, O_NONBLOCK);
    return 0;
  }

  // In the forked child. smprun is single-threaded, so the child may use any libc function until exec.
  [[noreturn]] void exec_rank(int stdout_write_fd, int stderr_write_fd, char** environment,
                              const sigset_t& original_mask, pid_t launcher) const {
    // A rank dies with smprun (an OOM kill, a scheduler's kill -9): left alone, it trained on and kept saving into
    // and pruning the checkpoint directory that a restarted job was resuming from.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher) ::_exit(1);  // smprun died before the line above
    // Left as smprun set them, an ignored SIGPIPE would survive exec and change how the program reacts to a
    // closed pipe.
    for (std::size_t index = 0; index < kManagedSignals.size(); ++index) {
      ::sigaction(kManagedSignals[index], &inherited_actions_[index], nullptr);
    }
    ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);
    // Its own group, so that stopping a rank also reaches the processes it started.
    ::setpgid(0, 0);
    ::dup2(null_input_fd_, STDIN_FILENO);
    ::dup2(stdout_write_fd, STDOUT_FILENO);
    ::dup2(stderr_write_fd, STDERR_FILENO);
    environ = environment;
    ::execvp(argv_[0], argv_.data());
    const std::string message = exec_failure_prefix_ + std::strerror(errno) + "\n";
    write_all(STDERR_FILENO, message);
    ::_exit(127);
  }

  void supervise() {
    std::optional<Clock::time_point> job_deadline;
    if (options_.timeout_seconds > 0) {
      job_deadline = started_at_ + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options_.timeout_seconds));
    }

    while (true) {
      reap_exited_ranks();
      const Clock::time_point now = Clock::now();
      const bool ranks_running = any_rank_running();
      if (stop_reason_ == StopReason::None && ranks_running && job_deadline && now >= *job_deadline) {
        report("job exceeded --timeout " + format_seconds(options_.timeout_seconds) +
               " s; stopping all ranks");
        begin_stop(StopReason::Timeout, SIGTERM);
      }
      if (stopping_ && !kill_sent_ && now >= grace_deadline_) kill_remaining("the --grace period ended");

      std::optional<Clock::time_point> wake_at;
      if (stop_reason_ == StopReason::None && ranks_running) wake_at = job_deadline;
      if (stopping_ && !kill_sent_) wake_at = earliest(wake_at, grace_deadline_);
      if (!ranks_running && !any_output_open()) return;
      // While stopping, processes left behind that hold a pipe open are still due a SIGKILL, so the drain
      // deadline only starts after it.
      if (!ranks_running && (!stopping_ || kill_sent_)) {
        if (!drain_deadline_) drain_deadline_ = now + kDrainAfterLastExit;
        if (now >= *drain_deadline_) return;
        wake_at = earliest(wake_at, drain_deadline_);
      }
      wait_for_events(poll_timeout_ms(wake_at, now));
    }
  }

  void wait_for_events(int timeout_ms) {
    std::vector<pollfd> watched{{signal_pipe_[0], POLLIN, 0}};
    std::vector<std::pair<Rank*, OutputStream*>> watched_streams;
    for (Rank& rank : ranks_) {
      for (OutputStream& stream : rank.streams) {
        if (stream.read_fd < 0) continue;
        watched.push_back({stream.read_fd, POLLIN, 0});
        watched_streams.emplace_back(&rank, &stream);
      }
    }
    if (::poll(watched.data(), watched.size(), timeout_ms) <= 0) return;

    if (watched[0].revents != 0) handle_signals();
    for (std::size_t index = 0; index < watched_streams.size(); ++index) {
      auto [rank, stream] = watched_streams[index];
      // The stream may have been closed meanwhile, because its destination went away.
      if (watched[index + 1].revents == 0 || stream->read_fd < 0) continue;
      read_stream(*rank, *stream);
    }
  }

  void handle_signals() {
    unsigned char received[64];
    ssize_t count;
    while ((count = ::read(signal_pipe_[0], received, sizeof received)) > 0) {
      for (ssize_t index = 0; index < count; ++index) {
        const int signal_number = received[index];
        // SIGCHLD needs nothing here: the loop reaps on every pass.
        if (signal_number == SIGCHLD) continue;
        if (!stopping_) {
          report("received " + describe_signal(signal_number) + "; forwarding it to all ranks");
          received_signal_ = signal_number;
          received_at_ = Clock::now();
          begin_stop(StopReason::Signal, signal_number);
        } else if (signal_number == received_signal_ && Clock::now() - received_at_ < kSameSignalWindow) {
          // The same signal again at once is one Ctrl-C delivered twice (a terminal's to the process group and a
          // wrapper's such as timeout's, which forwards it to its group too), not a second press.
          continue;
        } else if (!kill_sent_) {
          kill_remaining("received " + describe_signal(signal_number) + " while stopping");
        }
      }
    }
  }

  void reap_exited_ranks() {
    int wait_status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &wait_status, WNOHANG)) > 0) {
      for (Rank& rank : ranks_) {
        if (rank.pid != pid) continue;
        rank.running = false;
        rank.wait_status = wait_status;
        // What a failing rank printed last usually explains the failure, so it goes out before the verdict.
        drain_output(rank);
        if (is_failure(wait_status) && !stopping_) {
          report("rank " + std::to_string(rank.global_index) + " " + describe_wait_status(wait_status));
          begin_stop(StopReason::RankFailed, SIGTERM);
        }
      }
    }
  }

  void drain_output(Rank& rank) {
    for (OutputStream& stream : rank.streams) {
      for (int reads = 0; reads < kMaxReadsWhenDraining && stream.read_fd >= 0; ++reads) {
        if (read_stream(rank, stream) != ReadResult::Data) break;
      }
    }
  }

  ReadResult read_stream(const Rank& rank, OutputStream& stream) {
    char buffer[kReadChunkBytes];
    const ssize_t count = ::read(stream.read_fd, buffer, sizeof buffer);
    if (count < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ReadResult::Empty;

    std::string lines;
    if (count > 0) {
      stream.assembler.feed(std::string_view(buffer, static_cast<std::size_t>(count)), [&](std::string_view line) {
        traceback_folder_.line(stream.traceback, rank.global_index, line, appender(rank, lines));
      });
    } else {
      end_stream(rank, stream, lines);
    }
    // One write per batch of whole lines, so nothing from another rank can land inside a line.
    if (!write_all(stream.destination_fd, lines)) close_streams_to(stream.destination_fd);
    return count > 0 && stream.read_fd >= 0 ? ReadResult::Data : ReadResult::Closed;
  }

  // What the stream still holds (a line without its end, a traceback waiting for its exception line) goes out as
  // it stands: it is often what says why the rank failed.
  void end_stream(const Rank& rank, OutputStream& stream, std::string& lines) {
    stream.assembler.flush([&](std::string_view line) {
      traceback_folder_.line(stream.traceback, rank.global_index, line, appender(rank, lines));
    });
    traceback_folder_.flush(stream.traceback, appender(rank, lines));
    close_fd(stream.read_fd);
  }

  // Supervision can end with a stream still open: a process the rank left behind holds its pipe past the drain
  // deadline.
  void release_held_output() {
    for (Rank& rank : ranks_) {
      drain_output(rank);  // what reached the pipe by the deadline
      for (OutputStream& stream : rank.streams) {
        if (stream.read_fd < 0) continue;
        std::string lines;
        end_stream(rank, stream, lines);
        write_all(stream.destination_fd, lines);
      }
    }
  }

  // smprun's stdout or stderr is gone (`smprun ... | head`): closing the ranks' pipes to it lets them meet
  // the closed pipe (SIGPIPE, EPIPE) as they would have without smprun in between.
  void close_streams_to(int destination_fd) {
    for (Rank& rank : ranks_) {
      for (OutputStream& stream : rank.streams) {
        if (stream.destination_fd == destination_fd) close_fd(stream.read_fd);
      }
    }
  }

  void begin_stop(StopReason reason, int signal_number) {
    stop_reason_ = reason;
    stopping_ = true;
    grace_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(options_.grace_seconds));
    signal_ranks(signal_number);
  }

  void kill_remaining(const std::string& why) {
    kill_sent_ = true;
    if (any_rank_running() || any_output_open()) {
      report(why + "; sending SIGKILL to the ranks still running");
      signal_ranks(SIGKILL);
    }
  }

  // A rank that has exited but whose pipes are still open has left processes behind in its group, so the
  // group is signalled too; once both are gone the group id may belong to someone else and is left alone.
  void signal_ranks(int signal_number) const {
    for (const Rank& rank : ranks_) {
      if (rank.pid <= 0 || !(rank.running || rank.output_open())) continue;
      if (::kill(-rank.pid, signal_number) != 0 && rank.running) ::kill(rank.pid, signal_number);
    }
  }

  bool any_rank_running() const {
    for (const Rank& rank : ranks_) {
      if (rank.running) return true;
    }
    return false;
  }

  bool any_output_open() const {
    for (const Rank& rank : ranks_) {
      if (rank.output_open()) return true;
    }
    return false;
  }

  void report_final_statuses() const {
    std::string summary = "final status:";
    for (const Rank& rank : ranks_) {
      summary += (rank.index == 0 ? " rank " : "; rank ") + std::to_string(rank.global_index) + " ";
      summary += rank.pid > 0 ? describe_wait_status(rank.wait_status) : "was not started";
    }
    report(summary);
  }

  int exit_code() const {
    switch (stop_reason_) {
      case StopReason::None:
        return kExitSuccess;
      case StopReason::RankFailed:
      case StopReason::LaunchFailed:
        return kExitRankFailed;
      case StopReason::Timeout:
        return kExitTimeout;
      case StopReason::Signal:
        return kExitSignalBase + received_signal_;
    }
    return kExitRankFailed;
  }

  const LaunchOptions& options_;
  std::vector<Rank> ranks_;
  std::vector<char*> argv_;
  std::string exec_failure_prefix_;
  TracebackFolder traceback_folder_;
  int null_input_fd_ = -1;
  int signal_pipe_[2] = {-1, -1};
  std::array<struct sigaction, kManagedSignals.size()> inherited_actions_{};

  Clock::time_point started_at_;
  StopReason stop_reason_ = StopReason::None;
  int received_signal_ = 0;
  Clock::time_point received_at_;
  bool stopping_ = false;
  bool kill_sent_ = false;
  Clock::time_point grace_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
};

}  // namespace

int run_job(const LaunchOptions& options) { return Job(options).run(); }

}  // namespace smp::launch
