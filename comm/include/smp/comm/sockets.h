#pragma once
// The few socket operations the rendezvous needs beyond what c10d offers.

#include <string>

namespace smp::comm {

// A TCP socket listening on host:port, bound to that address only (loopback stays loopback). Throws CommError
// naming the address when it cannot be had, e.g. another job already listens there.
int listen_on(const std::string& host, int port);

// The IPv4 address of network interface `name` (what GLOO_SOCKET_IFNAME names). Throws CommError naming it when it
// has none.
std::string address_of_interface(const std::string& name);

// The local IP address this host uses to reach `host` (no packet is sent): where peers can reach us.
// Throws CommError when `host` does not resolve or is unreachable.
std::string local_address_towards(const std::string& host);

}  // namespace smp::comm
