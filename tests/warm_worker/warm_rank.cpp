// warm_rank PROGRAM ARGS: runs PROGRAM ARGS as a fork of the warm worker named by SMP_WARM_WORKER (server.h), or
// execs it where there is none or the server says to. To its launcher it is the rank: signals sent to it go on to
// the fork, and it ends as the fork ended (its exit status, or killed by its signal); if it is killed itself, the
// server kills the fork.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "protocol.h"

extern char** environ;

namespace {

int server_connection = -1;
constexpr int kForwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

void forward(int signal_number) {
  const std::int32_t value = signal_number;
  const int saved = errno;
  // Not write: after the fork's end the server closes the connection, and a signal then (the launcher stopping the
  // other ranks) must not kill this process with SIGPIPE before it reads how the fork ended.
  [[maybe_unused]] const ssize_t sent = ::send(server_connection, &value, sizeof value, MSG_NOSIGNAL);
  errno = saved;
}

// Sends the request with this process's standard streams; false if no server takes it.
bool send_request(const char* name, int argc, char** argv) {
  server_connection = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address;
  const socklen_t length = smp_test::warm::address_of(name, address);
  if (server_connection < 0 || ::connect(server_connection, reinterpret_cast<sockaddr*>(&address), length) != 0) return false;
  char cwd[PATH_MAX];
  if (::getcwd(cwd, sizeof cwd) == nullptr) return false;
  std::string payload = std::string(cwd) + '\0' + std::to_string(argc) + '\0';
  for (int i = 0; i < argc; ++i) payload += std::string(argv[i]) + '\0';
  for (char** entry = environ; *entry != nullptr; ++entry) payload += std::string(*entry) + '\0';
  const auto size = static_cast<std::uint32_t>(payload.size());
  const int fds[3] = {0, 1, 2};
  char control[CMSG_SPACE(sizeof fds)] = {};
  iovec part{const_cast<std::uint32_t*>(&size), sizeof size};
  msghdr message{};
  message.msg_iov = &part;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(sizeof fds);
  std::memcpy(CMSG_DATA(header), fds, sizeof fds);
  if (::sendmsg(server_connection, &message, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof size)) return false;
  for (std::size_t sent = 0; sent < payload.size();) {
    const ssize_t wrote = ::send(server_connection, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return false;
    sent += static_cast<std::size_t>(wrote);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: warm_rank PROGRAM [ARGS...] (SMP_WARM_WORKER names the server)\n");
    return 2;
  }
  const char* name = std::getenv("SMP_WARM_WORKER");
  if (name != nullptr && *name != '\0' && send_request(name, argc - 1, argv + 1)) {
    // Installed once the request is whole: a signal number written into it would garble it. One that comes before
    // kills this process, and the server the fork with it.
    struct sigaction passing_on {};
    passing_on.sa_handler = forward;
    sigemptyset(&passing_on.sa_mask);
    for (int number : kForwarded) ::sigaction(number, &passing_on, nullptr);
    char kind = 0;
    std::int32_t value = 0;
    using smp_test::warm::read_fully;
    if (!read_fully(server_connection, &kind, 1) || (kind != 'F' && !read_fully(server_connection, &value, sizeof value))) {
      std::fprintf(stderr, "warm_rank: the warm worker %s ended before %s did\n", name, argv[1]);
      return 1;
    }
    if (kind == 'K') {
      ::signal(value, SIG_DFL);
      sigset_t only;
      sigemptyset(&only);
      sigaddset(&only, value);
      ::sigprocmask(SIG_UNBLOCK, &only, nullptr);
      ::raise(value);
      return 128 + value;  // a signal whose default is to go on
    }
    if (kind == 'E') return value;
    for (int number : kForwarded) ::signal(number, SIG_DFL);  // 'F': the server leaves it to this process
  }
  ::execv(argv[1], argv + 1);
  std::fprintf(stderr, "warm_rank: cannot run %s: %s\n", argv[1], std::strerror(errno));
  return 127;
}
