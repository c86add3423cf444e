#include "rank_setup.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>

namespace smp::launch {
namespace {

int port_of(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
}

// 0, or the errno execve would give for this exact path.
int check_executable_path(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return errno;
  if (!S_ISREG(info.st_mode)) return EACCES;
  if (::access(path.c_str(), X_OK) != 0) return errno;
  return 0;
}

// The kernel hands out source ports of outgoing connections from this range; a rendezvous port picked inside it can
// be taken by any connection opened between the pick and rank 0's bind (parallel jobs open hundreds).
int lowest_ephemeral_port() {
  std::ifstream file("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  if (file >> low && 0 < low && low <= 65535) return low;
  return 32768;  // Linux's default
}

// The port bound (the kernel's choice for port 0), or 0 with the errno in `failure` (0: no usable address).
int bind_probe(const std::string& address, int port, int& failure) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* candidates = nullptr;
  const int lookup = ::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &candidates);
  if (lookup != 0) {
    throw std::runtime_error("cannot resolve '" + address + "': " + ::gai_strerror(lookup));
  }
  failure = 0;
  int bound_port = 0;
  for (const addrinfo* candidate = candidates; candidate != nullptr && bound_port == 0;
       candidate = candidate->ai_next) {
    const int fd =
        ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (fd < 0) {
      failure = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t bound_length = sizeof bound;
    if (::bind(fd, candidate->ai_addr, candidate->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_length) == 0) {
      bound_port = port_of(bound);
    } else {
      failure = errno;
    }
    ::close(fd);
  }
  ::freeaddrinfo(candidates);
  return bound_port;
}

}  // namespace

int pick_free_port(const std::string& address) {
  constexpr int lowest_unreserved = 10000;  // below it sit well-known services' ports
  const int ephemeral_low = lowest_ephemeral_port();
  int failure = 0;
  if (ephemeral_low - lowest_unreserved >= 1000) {
    std::random_device seed;
    std::mt19937 generator(seed());
    std::uniform_int_distribution<int> below_ephemeral(lowest_unreserved, ephemeral_low - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int port = bind_probe(address, below_ephemeral(generator), failure);
      if (port != 0) return port;
      if (failure != EADDRINUSE) break;  // the address itself is unusable: port 0 will say so
    }
  }
  const int port = bind_probe(address, 0, failure);
  if (port == 0) {
    throw std::runtime_error("cannot pick a free port on '" + address +
                             "': " + (failure == 0 ? "no usable address" : std::strerror(failure)));
  }
  return port;
}

int torch_port_beside(int master_port, int nodes, const std::function<int()>& picked) {
  if (nodes > 1) return master_port < 65535 ? master_port + 1 : master_port - 1;
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int port = picked();
    if (port != master_port) return port;
  }
  return master_port < 65535 ? master_port + 1 : master_port - 1;
}

std::vector<std::string> rank_environment(const std::vector<std::string>& base, int local_rank, int local_world_size,
                                          const std::string& master_addr, int master_port, int torch_port,
                                          int node_rank, int nodes, const std::string& job_id) {
  const std::array<std::pair<const char*, std::string>, 9> rendezvous{{
      {"RANK", std::to_string(node_rank * local_world_size + local_rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(nodes * local_world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(local_world_size)},
      {"GROUP_RANK", std::to_string(node_rank)},
      {"MASTER_ADDR", master_addr},
      {"SMP_MASTER_PORT", std::to_string(master_port)},
      {"MASTER_PORT", std::to_string(torch_port)},
      {"SMP_JOB_ID", job_id},
  }};
  const auto is_rendezvous_variable = [&](const std::string& entry) {
    const std::string name = entry.substr(0, entry.find('='));
    return std::any_of(rendezvous.begin(), rendezvous.end(),
                       [&](const auto& variable) { return name == variable.first; });
  };

  std::vector<std::string> environment;
  environment.reserve(base.size() + rendezvous.size());
  std::copy_if(base.begin(), base.end(), std::back_inserter(environment),
               [&](const std::string& entry) { return !is_rendezvous_variable(entry); });
  for (const auto& [name, value] : rendezvous) {
    if (!value.empty()) environment.push_back(std::string(name) + "=" + value);
  }
  return environment;
}

int check_executable(const std::string& program, const char* path_variable) {
  if (program.empty()) return ENOENT;
  if (program.find('/') != std::string::npos) return check_executable_path(program);

  // glibc's execvp searches this when PATH is unset.
  const std::string search_path = path_variable != nullptr ? path_variable : "/bin:/usr/bin";
  int failure = ENOENT;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = search_path.find(':', start);
    const std::string directory = search_path.substr(start, end == std::string::npos ? end : end - start);
    // An empty PATH entry means the current directory, as for execvp.
    const int result = check_executable_path((directory.empty() ? "." : directory) + "/" + program);
    if (result == 0) return 0;
    // Like execvp: a file that exists but cannot be run is reported over one that is missing elsewhere.
    if (result == EACCES) failure = EACCES;
    if (end == std::string::npos) return failure;
    start = end + 1;
  }
}

}  // namespace smp::launch
