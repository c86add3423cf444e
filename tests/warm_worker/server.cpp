#include "server.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "protocol.h"

extern char** environ;

namespace smp_test::warm {
namespace {

constexpr double kIdleExitSeconds = 900;  // a server whose stop never came goes by itself

struct Request {
  std::string cwd;
  std::vector<std::string> argv;
  std::vector<std::string> environment;
  std::vector<int> fds;  // the client's standard streams
};

// What the process read at start-up and a fork cannot change: a request that differs here is run by the client.
bool read_at_start(const std::string& entry) {
  const std::string key = entry.substr(0, entry.find('='));
  if (key == "CUDA_VISIBLE_DEVICES" || key == "GLIBC_TUNABLES") return true;
  // The OpenMP and BLAS runtimes, the loader and malloc read theirs as the libraries load, before main.
  for (const char* prefix : {"OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "TORCH_", "PYTORCH_"}) {
    if (key.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

std::vector<std::string> start_up_environment(const std::vector<std::string>& environment) {
  std::vector<std::string> kept;
  for (const auto& entry : environment) {
    if (read_at_start(entry)) kept.push_back(entry);
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

std::vector<std::string> own_environment() {
  std::vector<std::string> entries;
  for (char** entry = environ; *entry != nullptr; ++entry) entries.emplace_back(*entry);
  return entries;
}

void write_fully(int fd, const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t sent = ::write(fd, bytes, size);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return;  // the client is gone: nothing to tell
    bytes += sent;
    size -= static_cast<std::size_t>(sent);
  }
}

// The request on a new connection: false if the client went away first.
bool receive_request(int connection, Request& request) {
  std::uint32_t length = 0;
  char control[CMSG_SPACE(3 * sizeof(int))] = {};
  iovec part{&length, sizeof length};
  msghdr message{};
  message.msg_iov = &part;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  ssize_t got;
  do {
    got = ::recvmsg(connection, &message, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (got < 0 && errno == EINTR);
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS) {
      const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof fd);
        request.fds.push_back(fd);
      }
    }
  }
  if (got != static_cast<ssize_t>(sizeof length) || length > (64u << 20)) return false;
  std::string payload(length, '\0');
  if (!read_fully(connection, payload.data(), length)) return false;
  std::vector<std::string> strings;
  for (std::size_t start = 0; start < payload.size();) {
    const std::size_t end = payload.find('\0', start);
    if (end == std::string::npos) return false;
    strings.push_back(payload.substr(start, end - start));
    start = end + 1;
  }
  if (strings.size() == 1 && strings[0] == kStop) {
    request.cwd = kStop;
    return true;
  }
  // cwd, argc, argv..., the environment
  if (strings.size() < 3) return false;
  request.cwd = strings[0];
  if (strings[1].empty() || strings[1].find_first_not_of("0123456789") != std::string::npos ||
      strings[1].size() > 9) {
    return false;
  }
  const std::size_t argc = std::stoul(strings[1]);
  if (argc > strings.size() - 2) return false;
  request.argv.assign(strings.begin() + 2, strings.begin() + 2 + static_cast<std::ptrdiff_t>(argc));
  request.environment.assign(strings.begin() + 2 + static_cast<std::ptrdiff_t>(argc), strings.end());
  return true;
}

void kill_group(pid_t pid, int signal_number) {
  ::kill(-pid, signal_number);
  ::kill(pid, signal_number);
}

[[noreturn]] void run_request(Request& request, pid_t server, const std::vector<int>& to_close,
                              const std::function<int(int, char**)>& main) {
  ::setsid();  // its own process group, killed whole if the client dies
  // And with the server: nothing else would stop it, and it holds the launcher's output pipes open.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != server) ::_exit(1);
  ::signal(SIGPIPE, SIG_DFL);
  sigset_t child_ended;
  sigemptyset(&child_ended);
  sigaddset(&child_ended, SIGCHLD);
  ::sigprocmask(SIG_UNBLOCK, &child_ended, nullptr);
  for (int fd : to_close) ::close(fd);
  for (int target = 0; target < 3 && target < static_cast<int>(request.fds.size()); ++target) {
    ::dup2(request.fds[target], target);  // dup2 clears close-on-exec on the copy
  }
  for (int fd : request.fds) {
    if (fd > 2) ::close(fd);
  }
  ::clearenv();
  for (const auto& entry : request.environment) {
    const std::size_t equals = entry.find('=');
    if (equals != std::string::npos) ::setenv(entry.substr(0, equals).c_str(), entry.c_str() + equals + 1, 1);
  }
  if (::chdir(request.cwd.c_str()) != 0) {
    std::fprintf(stderr, "warm worker: cannot enter %s: %s\n", request.cwd.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  std::vector<char*> argv;
  for (auto& argument : request.argv) argv.push_back(argument.data());
  argv.push_back(nullptr);
  std::exit(main(static_cast<int>(request.argv.size()), argv.data()));  // static destructors and atexit, as main's return
}

// A request for this very file: not another program, nor this one rebuilt since the server started.
bool same_program(const std::vector<std::string>& argv) {
  struct stat requested {}, running {};
  return !argv.empty() && ::stat(argv[0].c_str(), &requested) == 0 && ::stat("/proc/self/exe", &running) == 0 &&
         requested.st_dev == running.st_dev && requested.st_ino == running.st_ino;
}

// Abstract sockets have no permissions: only this user's processes may have a rank run as this user.
bool same_user(int connection) {
  ucred peer{};
  socklen_t size = sizeof peer;
  return ::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &size) == 0 && peer.uid == ::getuid();
}

int thread_count() {
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = ::readdir(tasks)) count += entry->d_name[0] != '.';
  ::closedir(tasks);
  return count;
}

int serve(const std::string& name, const std::function<int(int, char**)>& main) {
  if (thread_count() != 1) {
    std::fprintf(stderr, "warm worker: the program started threads; forking would copy them half-way: not serving\n");
    return 0;  // the clients run the program themselves
  }
  ::signal(SIGPIPE, SIG_IGN);
  ::signal(SIGCHLD, SIG_DFL);  // an ignored SIGCHLD (inherited) would reap the forks before waitpid sees them
  // A fork's end wakes the loop at once: its client must end as soon as a process of its own would, or the
  // launcher sees the rank's peers fail first.
  sigset_t child_ended;
  sigemptyset(&child_ended);
  sigaddset(&child_ended, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &child_ended, nullptr);
  const int ended_forks = ::signalfd(-1, &child_ended, SFD_CLOEXEC | SFD_NONBLOCK);
  int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address;
  const socklen_t length = address_of(name, address);
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 || ::listen(listener, 128) != 0) {
    std::fprintf(stderr, "warm worker: cannot listen as %s: %s\n", name.c_str(), std::strerror(errno));
    return 1;
  }
  const std::vector<std::string> environment = start_up_environment(own_environment());
  std::map<int, pid_t> fork_of;       // client connection -> its fork
  std::map<pid_t, int> connection_of;  // fork -> its client connection, -1 once the client is gone
  auto idle_since = std::chrono::steady_clock::now();
  while (true) {
    std::vector<pollfd> watched{{listener, POLLIN, 0}, {ended_forks, POLLIN, 0}};
    for (const auto& [connection, pid] : fork_of) watched.push_back({connection, POLLIN, 0});
    ::poll(watched.data(), watched.size(), 50);
    for (const auto& ready : watched) {
      if (!(ready.revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (ready.fd == ended_forks) {
        signalfd_siginfo drained;
        while (::read(ended_forks, &drained, sizeof drained) > 0) {
        }
      } else if (ready.fd == listener) {
        const int connection = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (connection < 0) continue;
        if (!same_user(connection)) {
          ::close(connection);
          continue;
        }
        // A client that connects and then stalls must not stop the server serving the others.
        const timeval patience{5, 0};
        ::setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
        Request request;
        if (!receive_request(connection, request)) {
          for (int fd : request.fds) ::close(fd);
          ::close(connection);
          continue;
        }
        if (request.cwd == kStop) {
          // The name free at once for a new server; ranks still running finish and are answered first.
          ::close(listener);
          listener = -1;
          ::close(connection);
          continue;
        }
        if (start_up_environment(request.environment) != environment || !same_program(request.argv)) {
          write_fully(connection, "F", 1);
          for (int fd : request.fds) ::close(fd);
          ::close(connection);
          continue;
        }
        std::fflush(nullptr);
        const pid_t server = ::getpid();
        const pid_t pid = ::fork();
        if (pid == 0) {
          std::vector<int> to_close{listener, ended_forks};
          for (const auto& [client, other] : fork_of) to_close.push_back(client);
          to_close.push_back(connection);
          run_request(request, server, to_close, main);
        }
        for (int fd : request.fds) ::close(fd);
        if (pid < 0) {
          write_fully(connection, "F", 1);  // no fork to be had: the client runs it
          ::close(connection);
          continue;
        }
        fork_of[connection] = pid;
        connection_of[pid] = connection;
      } else {
        const int connection = ready.fd;
        const pid_t pid = fork_of.at(connection);
        std::int32_t signal_number = 0;
        if (read_fully(connection, &signal_number, sizeof signal_number)) {
          kill_group(pid, signal_number);
        } else {  // the client died (SIGKILL): its rank goes with it
          kill_group(pid, SIGKILL);
          fork_of.erase(connection);
          connection_of[pid] = -1;
          ::close(connection);
        }
      }
    }
    int status = 0;
    pid_t ended;
    while ((ended = ::waitpid(-1, &status, WNOHANG)) > 0) {
      const auto found = connection_of.find(ended);
      if (found == connection_of.end()) continue;
      const int connection = found->second;
      connection_of.erase(found);
      if (connection < 0) continue;
      char reply[1 + sizeof(std::int32_t)];
      const std::int32_t value = WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status);
      reply[0] = WIFSIGNALED(status) ? 'K' : 'E';
      std::memcpy(reply + 1, &value, sizeof value);
      write_fully(connection, reply, sizeof reply);
      fork_of.erase(connection);
      ::close(connection);
    }
    if (listener < 0 && connection_of.empty()) return 0;  // stopped, and every rank answered
    if (!connection_of.empty()) {
      idle_since = std::chrono::steady_clock::now();
    } else if (std::chrono::duration<double>(std::chrono::steady_clock::now() - idle_since).count() > kIdleExitSeconds) {
      return 0;
    }
  }
}

// True if a server answers as `name`: the connection is closed at once (the server reads it as a client gone).
bool answering(const std::string& name) {
  const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address;
  const socklen_t length = address_of(name, address);
  const bool connected = ::connect(probe, reinterpret_cast<sockaddr*>(&address), length) == 0;
  ::close(probe);
  return connected;
}

int stop(const std::string& name) {
  const int connection = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address;
  const socklen_t length = address_of(name, address);
  if (::connect(connection, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    ::close(connection);
    return 0;  // none running
  }
  const std::uint32_t size = sizeof kStop;
  write_fully(connection, &size, sizeof size);
  write_fully(connection, kStop, sizeof kStop);
  char ignored;
  while (::read(connection, &ignored, 1) > 0) {
  }  // closed as the server exits
  ::close(connection);
  return 0;
}

// Returns 0 whether or not a server came up: without one the clients run the program themselves.
int start(const std::string& name, const std::function<int(int, char**)>& main) {
  stop(name);
  if (thread_count() != 1) {  // checked here: the daemon, a fork, would always count one
    std::fprintf(stderr, "warm worker: the program started threads; forking would copy them half-way: not serving\n");
    return 0;
  }
  const char* temporary = std::getenv("TMPDIR");
  const std::string log = std::string(temporary && *temporary ? temporary : "/tmp") + "/smp-warm-worker-" + name + ".log";
  std::fflush(nullptr);
  const pid_t daemon = ::fork();
  if (daemon < 0) {
    std::perror("warm worker: fork");
    return 1;
  }
  if (daemon == 0) {
    ::setsid();
    // Nothing of the starter's stays open: its caller (ctest) reads the starter's output until every copy closes.
    const int null = ::open("/dev/null", O_RDWR);
    int output = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (output < 0) output = null;
    ::dup2(null, 0);
    ::dup2(output, 1);
    ::dup2(output, 2);
    const long most = ::sysconf(_SC_OPEN_MAX);
    for (int fd = 3; fd < (most > 0 ? most : 1024); ++fd) {
      const int flags = ::fcntl(fd, F_GETFD);
      if (flags >= 0 && !(flags & FD_CLOEXEC)) ::close(fd);  // inherited from the caller, not the program's own
    }
    ::_exit(serve(name, main));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(daemon, &status, WNOHANG) == daemon) {
      std::fprintf(stderr, "warm worker: the server ended at once; see %s\n", log.c_str());
      return 0;  // the clients run the program themselves
    }
    if (answering(name)) {
      std::printf("warm worker %s up (pid %d)\n", name.c_str(), static_cast<int>(daemon));
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(daemon, SIGKILL);
  std::fprintf(stderr, "warm worker: the server did not come up within 30 s: the ranks start as processes\n");
  return 0;
}

}  // namespace

int main_or_serve(int argc, char** argv, const std::function<int(int, char**)>& main) {
  if (argc == 3) {
    const std::string command = argv[1], name = argv[2];
    if (command == "--warm-start") return start(name, main);
    if (command == "--warm-stop") return stop(name);
    if (command == "--warm-serve") return serve(name, main);
  }
  return main(argc, argv);
}

}  // namespace smp_test::warm
