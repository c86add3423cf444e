#include "smp/comm/sockets.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "smp/comm/communicator.h"

namespace smp::comm {
namespace {

using AddressList = std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)>;

AddressList resolve(const std::string& host, int port, int socket_type, int flags) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socket_type;
  hints.ai_flags = flags;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (status != 0) throw CommError("cannot resolve \"" + host + "\": " + ::gai_strerror(status));
  return AddressList(found, &::freeaddrinfo);
}

}  // namespace

int listen_on(const std::string& host, int port) {
  const auto candidates = resolve(host, port, SOCK_STREAM, AI_NUMERICSERV);
  std::string failure = "no address";
  for (const addrinfo* candidate = candidates.get(); candidate; candidate = candidate->ai_next) {
    const int fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (fd < 0) {
      failure = std::strerror(errno);
      continue;
    }
    // Lets a restarted job reuse the port at once; Linux still refuses while another socket listens on it.
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (::bind(fd, candidate->ai_addr, candidate->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) return fd;
    const int error = errno;
    ::close(fd);
    if (error == EADDRINUSE) {
      throw CommError("cannot host the rendezvous on " + host + ":" + std::to_string(port) +
                      ": the port is in use (another job, or a process still holding it); pick another port (smprun's "
                      "--master-port, or MASTER_PORT)");
    }
    if (error == EADDRNOTAVAIL) {
      throw CommError("cannot host the rendezvous on " + host + ":" + std::to_string(port) + ": " + host +
                      " is not an address of this host, which runs rank 0; set MASTER_ADDR to rank 0's host");
    }
    failure = std::strerror(error);
  }
  throw CommError("cannot host the rendezvous on " + host + ":" + std::to_string(port) + ": " + failure);
}

std::string address_of_interface(const std::string& name) {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) throw CommError("cannot list network interfaces: " + std::string(std::strerror(errno)));
  std::string found;
  for (const ifaddrs* entry = all; entry; entry = entry->ifa_next) {
    if (!entry->ifa_addr || entry->ifa_addr->sa_family != AF_INET || name != entry->ifa_name) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(entry->ifa_addr)->sin_addr, text, sizeof text)) {
      found = text;
      break;
    }
  }
  ::freeifaddrs(all);
  if (found.empty()) throw CommError("network interface \"" + name + "\" (GLOO_SOCKET_IFNAME) has no IPv4 address");
  return found;
}

std::string local_address_towards(const std::string& host) {
  const auto candidates = resolve(host, 9, SOCK_DGRAM, AI_NUMERICSERV);
  for (const addrinfo* candidate = candidates.get(); candidate; candidate = candidate->ai_next) {
    const int fd = ::socket(candidate->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    // Connecting a datagram socket only picks the route; nothing goes on the wire.
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    const bool routed = ::connect(fd, candidate->ai_addr, candidate->ai_addrlen) == 0 &&
                        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
    ::close(fd);
    if (!routed) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* address = local.ss_family == AF_INET
                              ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr)
                              : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, address, text, sizeof text)) return text;
  }
  throw CommError("no route from this host to " + host);
}

}  // namespace smp::comm
