#pragma once
// What a warm worker's server and its clients (warm_rank) say to each other over a Unix socket. A request: the
// client's working directory, argv and environment as NUL-terminated strings, with its standard streams' descriptors
// attached; then, while the fork runs, each signal the client got (one int each); the server's reply, at the fork's
// end: 'E' and its exit status, or 'K' and the signal that killed it. 'F' instead: the client runs the program itself.

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>

namespace smp_test::warm {

// An abstract socket: no file to leave behind.
inline socklen_t address_of(const std::string& name, sockaddr_un& address) {
  std::memset(&address, 0, sizeof address);
  address.sun_family = AF_UNIX;
  const std::string path = std::string(1, '\0') + "smp-warm-worker:" + name;
  const std::size_t length = std::min(path.size(), sizeof address.sun_path);
  std::memcpy(address.sun_path, path.data(), length);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + length);
}

// `size` bytes from `fd`, through interruptions and short reads; false at its end or on an error.
inline bool read_fully(int fd, void* data, std::size_t size) {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::read(fd, bytes, size);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    bytes += got;
    size -= static_cast<std::size_t>(got);
  }
  return true;
}

constexpr char kStop[] = "stop";  // a request of this single string stops the server

}  // namespace smp_test::warm
