#include "socket_channels.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>

#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "smp/comm/sockets.h"

namespace smp::comm {
namespace {

constexpr std::uint32_t kHandshakeMagic = 0x736d7043;  // "smpC"
constexpr std::size_t kHeaderBytes = 12;               // int32 tag, int64 payload bytes
// The last message of a rank that leaves the job, its reason the payload; no transfer uses this tag.
constexpr std::int32_t kFarewellTag = std::numeric_limits<std::int32_t>::min();
constexpr std::size_t kFarewellBytes = 4000;

using Clock = std::chrono::steady_clock;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

std::string seconds(std::chrono::milliseconds timeout) { return std::to_string(timeout.count() / 1000.0).substr(0, 5) + " s"; }

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_nodelay(int fd) {
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// Reads or writes exactly `size` bytes of a handshake on a blocking socket, within the deadline.
void exchange_exactly(int fd, void* data, std::size_t size, bool writing, Clock::time_point deadline,
                      const std::string& what) {
  auto* bytes = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < size) {
    pollfd waiting{fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0};
    if (::poll(&waiting, 1, remaining_ms(deadline)) == 0) throw CommError(what + ": timed out");
    const ssize_t n = writing ? ::send(fd, bytes + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                              : ::recv(fd, bytes + done, size - done, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) throw CommError(what + ": " + (n == 0 ? std::string("connection closed") : std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
}

int connect_to(const std::string& host, const std::string& port, Clock::time_point deadline, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int status = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); status != 0) {
    throw CommError(what + ": cannot resolve " + host + ": " + ::gai_strerror(status));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> candidates(found, &::freeaddrinfo);
  std::string failure = "no address";
  for (const addrinfo* candidate = found; candidate; candidate = candidate->ai_next) {
    const int fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (::connect(fd, candidate->ai_addr, candidate->ai_addrlen) == 0 || errno == EINPROGRESS) {
      pollfd waiting{fd, POLLOUT, 0};
      int error = 0;
      socklen_t length = sizeof error;
      if (::poll(&waiting, 1, remaining_ms(deadline)) == 1 &&
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0) {
        return fd;
      }
      failure = error ? std::strerror(error) : "timed out";
    } else {
      failure = std::strerror(errno);
    }
    ::close(fd);
  }
  throw CommError(what + ": cannot connect to " + host + ":" + port + ": " + failure);
}

}  // namespace

struct SocketChannels::Outgoing {
  unsigned char header[kHeaderBytes];
  at::Tensor keep;
  std::size_t payload_bytes = 0;
  std::size_t written = 0;  // of header and payload
  bool done = false;
};

struct SocketChannels::Incoming {
  at::Tensor into;
  bool done = false;
};

struct SocketChannels::Connection {
  int fd = -1;
  std::string peer_name;
  ~Connection() {
    if (fd >= 0) ::close(fd);
  }

  // Sending: the queue is written in order, by the thread that sends while nothing is queued, else by the
  // progress thread. Under send_mutex.
  std::mutex send_mutex;
  std::condition_variable written;
  std::deque<std::shared_ptr<Outgoing>> queue;
  std::string send_error;

  // Receiving: whoever waits for a receive reads, under recv_mutex.
  std::mutex recv_mutex;
  std::map<int, std::deque<std::shared_ptr<Incoming>>> posted;    // by tag, in posting order
  std::map<int, std::deque<std::vector<unsigned char>>> arrived;  // by tag: messages no receive was posted for
  std::string recv_error;
  bool read_to_end = false;  // after this rank left: the peer closed (progress thread only)
  // The message being read.
  unsigned char header[kHeaderBytes];
  std::size_t header_read = 0;
  int tag = 0;
  std::size_t payload_bytes = 0, payload_read = 0;
  std::shared_ptr<Incoming> target;      // its receive, or null: kept in `spill`
  std::vector<unsigned char> spill;

  // Writes what the socket takes. Returns false when it would block with bytes left.
  bool write_queue() {
    while (!queue.empty()) {
      Outgoing& out = *queue.front();
      iovec parts[2];
      int count = 0;
      if (out.written < kHeaderBytes) {
        parts[count++] = {out.header + out.written, kHeaderBytes - out.written};
      }
      const std::size_t payload_done = out.written > kHeaderBytes ? out.written - kHeaderBytes : 0;
      if (payload_done < out.payload_bytes) {
        parts[count++] = {static_cast<char*>(out.keep.data_ptr()) + payload_done, out.payload_bytes - payload_done};
      }
      ssize_t n = 0;
      if (count > 0) {
        msghdr message{};
        message.msg_iov = parts;
        message.msg_iovlen = static_cast<std::size_t>(count);
        n = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return false;
        if (n < 0) {
          fail_sends(std::strerror(errno) + std::string(" (") + peer_name + " exited or failed?)");
          return true;
        }
      }
      out.written += static_cast<std::size_t>(n);
      if (out.written == kHeaderBytes + out.payload_bytes) {
        out.done = true;
        out.keep = at::Tensor();
        queue.pop_front();
        written.notify_all();
      }
    }
    return true;
  }

  void fail_sends(const std::string& error) {
    send_error = error;
    queue.clear();
    written.notify_all();
  }

  // Reads what has arrived, without waiting: completes receives, keeps messages nobody posted for. A closed
  // connection sets recv_error (what was read before it still counts: a peer may send its last message and exit);
  // a message larger than its receive throws CommError.
  void read_available() {
    while (recv_error.empty()) {
      if (header_read < kHeaderBytes) {
        const ssize_t n = ::recv(fd, header + header_read, kHeaderBytes - header_read, MSG_DONTWAIT);
        if (!check(n)) return;
        header_read += static_cast<std::size_t>(n);
        if (header_read < kHeaderBytes) continue;
        std::int32_t message_tag;
        std::int64_t bytes;
        std::memcpy(&message_tag, header, 4);
        std::memcpy(&bytes, header + 4, 8);
        tag = message_tag;
        payload_bytes = static_cast<std::size_t>(bytes);
        payload_read = 0;
        auto& waiting = posted[tag];
        if (!waiting.empty() && arrived[tag].empty()) {
          target = waiting.front();
          waiting.pop_front();
          if (target->into.nbytes() < payload_bytes) {
            recv_error = "a message of " + std::to_string(payload_bytes) + " bytes (tag " + std::to_string(tag) +
                         ") for a receive of " + std::to_string(target->into.nbytes()) +
                         "; are both sides running the same program?";
            throw CommError(recv_error);
          }
        } else {
          spill.assign(payload_bytes, 0);
        }
      }
      if (payload_read < payload_bytes) {
        unsigned char* into = target ? static_cast<unsigned char*>(target->into.data_ptr()) : spill.data();
        const ssize_t n = ::recv(fd, into + payload_read, payload_bytes - payload_read, MSG_DONTWAIT);
        if (!check(n)) return;
        payload_read += static_cast<std::size_t>(n);
        if (payload_read < payload_bytes) continue;
      }
      if (target) {
        target->done = true;
        target.reset();
      } else if (tag == kFarewellTag) {
        recv_error = peer_name + " left the job: " + std::string(spill.begin(), spill.end());
        spill.clear();
        header_read = 0;
        return;
      } else {
        arrived[tag].push_back(std::move(spill));
        spill.clear();
      }
      header_read = 0;
    }
  }

  // False when nothing more can be read now.
  bool check(ssize_t n) {
    if (n > 0) return true;
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    // A reset is a close with data unread on the peer's side: as much a peer that exited as a plain close.
    if (n == 0 || errno == ECONNRESET) {
      recv_error = peer_name + " closed the connection (it exited or failed)";
    } else {
      recv_error = std::strerror(errno);
    }
    return false;
  }
};

namespace {

class SendPending final : public Pending {
 public:
  SendPending(std::shared_ptr<SocketChannels::Connection> connection, std::shared_ptr<SocketChannels::Outgoing> out,
              std::chrono::milliseconds timeout, std::string what)
      : connection_(std::move(connection)), out_(std::move(out)), timeout_(timeout), what_(std::move(what)) {}
  void wait() override {
    if (!out_) return;
    std::unique_lock<std::mutex> lock(connection_->send_mutex);
    const bool finished = connection_->written.wait_for(
        lock, timeout_, [&] { return out_->done || !connection_->send_error.empty(); });
    if (!out_->done) {
      throw CommError(what_ + " failed: " +
                      (finished ? connection_->send_error
                                : "timed out after " + seconds(timeout_) + " (" + connection_->peer_name +
                                      " stopped reading: is it alive?)"));
    }
    out_.reset();
  }

 private:
  std::shared_ptr<SocketChannels::Connection> connection_;
  std::shared_ptr<SocketChannels::Outgoing> out_;
  std::chrono::milliseconds timeout_;
  std::string what_;
};

class RecvPending final : public Pending {
 public:
  RecvPending(std::shared_ptr<SocketChannels::Connection> connection, std::shared_ptr<SocketChannels::Incoming> in,
              std::chrono::milliseconds timeout, std::string what)
      : connection_(std::move(connection)), in_(std::move(in)), timeout_(timeout), what_(std::move(what)) {}
  void wait() override {
    if (!in_) return;
    const auto deadline = Clock::now() + timeout_;
    std::lock_guard<std::mutex> lock(connection_->recv_mutex);
    try {
      while (!in_->done) {
        connection_->read_available();
        if (in_->done) break;
        if (!connection_->recv_error.empty()) throw CommError(connection_->recv_error);
        pollfd readable{connection_->fd, POLLIN, 0};
        const int ready = ::poll(&readable, 1, remaining_ms(deadline));
        if (ready == 0) {
          throw CommError("timed out after " + seconds(timeout_) + " (" + connection_->peer_name +
                          " sent nothing: is it alive?)");
        }
      }
    } catch (const CommError& error) {
      throw CommError(what_ + " failed: " + error.what());
    }
    in_.reset();
  }

 private:
  std::shared_ptr<SocketChannels::Connection> connection_;
  std::shared_ptr<SocketChannels::Incoming> in_;
  std::chrono::milliseconds timeout_;
  std::string what_;
};

}  // namespace

SocketChannels::SocketChannels(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank,
                               std::string bind_host, std::chrono::milliseconds timeout,
                               std::function<std::string(int)> describe)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      bind_host_(std::move(bind_host)),
      timeout_(timeout),
      describe_(std::move(describe)) {}

SocketChannels::~SocketChannels() {
  bool left;
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    left = left_;
  }
  if (left && progress_.joinable()) {
    // The farewell may wait behind other messages: a little time for it to go, or peers learn nothing of why.
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    bool queued = true;
    while (queued && Clock::now() < deadline) {
      queued = false;
      {
        std::lock_guard<std::mutex> lock(progress_mutex_);
        for (auto& [peer, connection] : connections_) {
          std::lock_guard<std::mutex> send_lock(connection->send_mutex);
          queued = queued || !connection->queue.empty();
        }
      }
      if (queued) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (progress_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(progress_mutex_);
      stopping_ = true;
    }
    wake_progress();
    progress_.join();
  }
  for (int fd : {listener_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void SocketChannels::connect(const std::vector<int>& peers) {
  std::set<int> to_accept;
  std::vector<int> to_connect;
  for (int peer : peers) {
    if (peer == rank_ || connected(peer)) continue;
    if (peer > rank_) {
      to_connect.push_back(peer);
    } else {
      to_accept.insert(peer);
    }
  }
  if (to_accept.empty() && to_connect.empty()) return;
  const auto deadline = Clock::now() + timeout_;
  if (listener_ < 0) {
    // Where the higher rank of each pair waits for the lower one.
    listener_ = listen_on(bind_host_, 0);
    sockaddr_storage address{};
    socklen_t length = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    const int port = ntohs(address.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&address)->sin_port
                                                        : reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
    const std::string where = bind_host_ + " " + std::to_string(port);
    store_->set(prefix_ + std::to_string(rank_), std::vector<uint8_t>(where.begin(), where.end()));
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) throw CommError("cannot create a pipe: " + std::string(std::strerror(errno)));
    progress_ = std::thread([this] { progress_sends(); });
  }
  auto add = [&](int peer, int fd) {
    set_nodelay(fd);
    set_nonblocking(fd);
    auto connection = std::make_shared<Connection>();
    connection->fd = fd;
    connection->peer_name = describe_(peer);
    std::lock_guard<std::mutex> lock(progress_mutex_);  // the progress thread walks the connections
    connections_[peer] = std::move(connection);
  };
  for (int peer : to_connect) {
    const std::string what = "connecting to " + describe_(peer);
    std::vector<uint8_t> value;
    try {
      value = store_->get(prefix_ + std::to_string(peer));
    } catch (const std::exception& error) {
      throw CommError(what + ": its address never came: " + brief_message(error));
    }
    std::istringstream where(std::string(value.begin(), value.end()));
    std::string host, port;
    where >> host >> port;
    const int fd = connect_to(host, port, deadline, what);
    std::uint32_t hello[2] = {kHandshakeMagic, static_cast<std::uint32_t>(rank_)};
    try {
      exchange_exactly(fd, hello, sizeof hello, true, deadline, what);
    } catch (...) {
      ::close(fd);
      throw;
    }
    add(peer, fd);
  }
  while (!to_accept.empty()) {
    pollfd waiting{listener_, POLLIN, 0};
    if (::poll(&waiting, 1, remaining_ms(deadline)) == 0) {
      throw CommError("waiting for " + describe_(*to_accept.begin()) + " to connect: timed out after " +
                      seconds(timeout_));
    }
    const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::uint32_t hello[2] = {0, 0};
    try {
      exchange_exactly(fd, hello, sizeof hello, false, deadline, "accepting a connection");
    } catch (const CommError&) {
      ::close(fd);
      continue;  // not one of ours
    }
    const int peer = static_cast<int>(hello[1]);
    if (hello[0] != kHandshakeMagic || !to_accept.count(peer)) {
      ::close(fd);
      continue;
    }
    to_accept.erase(peer);
    add(peer, fd);
  }
}

void SocketChannels::leave(const std::string& reason) {
  const std::string said = reason.substr(0, kFarewellBytes);
  std::vector<std::shared_ptr<Connection>> peers;
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    for (const auto& [peer, connection] : connections_) peers.push_back(connection);
  }
  for (const auto& connection : peers) {
    auto out = std::make_shared<Outgoing>();
    const std::int64_t bytes = static_cast<std::int64_t>(said.size());
    std::memcpy(out->header, &kFarewellTag, 4);
    std::memcpy(out->header + 4, &bytes, 8);
    out->keep = at::empty({bytes}, at::kByte);
    std::memcpy(out->keep.data_ptr(), said.data(), said.size());
    out->payload_bytes = said.size();
    std::lock_guard<std::mutex> lock(connection->send_mutex);
    if (!connection->send_error.empty()) continue;  // already broken: nobody reads there
    connection->queue.push_back(out);
    // Written now if nothing waits before it, else by the progress thread after what does.
    if (connection->queue.size() == 1) connection->write_queue();
    connection->send_error = "this rank left the job (" + said + ")";
    connection->written.notify_all();  // a send waiting here ends now
  }
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    left_ = true;
  }
  if (!peers.empty()) wake_progress();  // for what is still queued, and to start dropping what peers send
}

std::unique_ptr<Pending> SocketChannels::isend(const at::Tensor& tensor, int peer, int tag, std::string what) {
  if (tag == kFarewellTag) throw CommError(what + ": tag " + std::to_string(tag) + " is reserved");
  auto connection = connections_.at(peer);
  auto out = std::make_shared<Outgoing>();
  const std::int32_t tag32 = tag;
  const std::int64_t bytes = static_cast<std::int64_t>(tensor.nbytes());
  std::memcpy(out->header, &tag32, 4);
  std::memcpy(out->header + 4, &bytes, 8);
  out->keep = tensor;
  out->payload_bytes = tensor.nbytes();
  bool blocked;
  {
    std::lock_guard<std::mutex> lock(connection->send_mutex);
    if (!connection->send_error.empty()) throw CommError(what + " failed: " + connection->send_error);
    connection->queue.push_back(out);
    blocked = connection->queue.size() == 1 && !connection->write_queue();
    blocked = blocked || connection->queue.size() > 1;
  }
  if (blocked) wake_progress();
  return std::make_unique<SendPending>(std::move(connection), std::move(out), timeout_, std::move(what));
}

std::unique_ptr<Pending> SocketChannels::irecv(const at::Tensor& into, int peer, int tag, std::string what) {
  auto connection = connections_.at(peer);
  auto in = std::make_shared<Incoming>();
  in->into = into;
  {
    std::lock_guard<std::mutex> lock(connection->recv_mutex);
    auto& arrived = connection->arrived[tag];
    if (!arrived.empty()) {  // it came first: copied from where it waited
      const auto& message = arrived.front();
      if (message.size() > into.nbytes()) {
        throw CommError(what + " failed: a message of " + std::to_string(message.size()) + " bytes for a receive of " +
                        std::to_string(into.nbytes()));
      }
      std::memcpy(into.data_ptr(), message.data(), message.size());
      arrived.pop_front();
      in->done = true;
    } else if (connection->header_read == kHeaderBytes && !connection->target && connection->tag == tag) {
      // It is arriving now, into memory of its own: the rest goes where it belongs.
      if (connection->payload_bytes > into.nbytes()) {
        throw CommError(what + " failed: a message of " + std::to_string(connection->payload_bytes) +
                        " bytes for a receive of " + std::to_string(into.nbytes()));
      }
      std::memcpy(into.data_ptr(), connection->spill.data(), connection->payload_read);
      connection->spill.clear();
      connection->target = in;
    } else {
      connection->posted[tag].push_back(in);
    }
  }
  return std::make_unique<RecvPending>(std::move(connection), std::move(in), timeout_, std::move(what));
}

void SocketChannels::wake_progress() {
  const char byte = 1;
  [[maybe_unused]] const ssize_t ignored = ::write(wake_[1], &byte, 1);
}

void SocketChannels::progress_sends() {
  std::vector<char> discarded(1 << 16);
  while (true) {
    std::vector<pollfd> waiting{{wake_[0], POLLIN, 0}};
    std::vector<Connection*> polled;
    {
      std::lock_guard<std::mutex> connections_lock(progress_mutex_);
      for (auto& [peer, connection] : connections_) {
        std::lock_guard<std::mutex> lock(connection->send_mutex);
        short events = connection->queue.empty() ? 0 : POLLOUT;
        // Once this rank has left, what peers still send here is read and dropped: a peer blocked sending to it
        // gets on to its next receive, which meets the farewell.
        if (left_ && !connection->read_to_end) events |= POLLIN;
        if (events == 0) continue;
        waiting.push_back({connection->fd, events, 0});
        polled.push_back(connection.get());
      }
    }
    ::poll(waiting.data(), waiting.size(), -1);
    {
      std::lock_guard<std::mutex> lock(progress_mutex_);
      if (stopping_) return;
    }
    char drain[64];
    while (::read(wake_[0], drain, sizeof drain) > 0) {
    }
    for (std::size_t i = 0; i < polled.size(); ++i) {
      const short revents = waiting[i + 1].revents;
      if (!revents) continue;
      Connection& connection = *polled[i];
      if (waiting[i + 1].events & POLLOUT) {
        std::lock_guard<std::mutex> lock(connection.send_mutex);
        connection.write_queue();
      }
      if (waiting[i + 1].events & POLLIN) {
        std::unique_lock<std::mutex> lock(connection.recv_mutex, std::try_to_lock);
        if (!lock.owns_lock()) continue;
        while (true) {
          const ssize_t n = ::recv(connection.fd, discarded.data(), discarded.size(), MSG_DONTWAIT);
          if (n > 0) continue;
          if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
          connection.read_to_end = true;  // closed or failed: nothing more to drop
          break;
        }
      }
    }
  }
}

}  // namespace smp::comm
