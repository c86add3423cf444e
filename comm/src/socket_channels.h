#pragma once
// Point-to-point tensor transfers between the ranks of a group over TCP connections of their own, one per pair of
// ranks that exchange tensors (a pipeline's neighbours), for CPU tensors.
//
// Why not Gloo's send and receive: Gloo transmits a message only once the receiver has announced its receive, and
// every message passes through Gloo's I/O thread on both sides, which then wakes the waiting thread. On a host whose
// cores all compute (a CPU pipeline), each of those hops waits for a core, and a 16 KiB transfer inside a pipeline
// step took 1 ms where the wire needs 50 us. Here a send is written by the calling thread at once (eagerly, into the
// kernel's socket buffer), and a receive is read by the thread that waits for it, straight into the posted tensor:
// no other thread runs unless a send does not fit the socket buffer, which a progress thread then finishes.
//
// Messages are matched by (peer, tag), first posted first matched, like Gloo's. A message that arrives before its
// receive is posted is kept in memory until it is. Every wait is bounded by the group's timeout, and a peer that
// dies closes its connections, and one that leaves the job (leave) says why: either fails the wait naming the peer.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "smp/comm/communicator.h"

namespace smp::comm {

class SocketChannels {
 public:
  // `describe(peer)` names a group rank in messages ("rank 3"); `prefix` keeps this group's store keys apart.
  SocketChannels(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, std::string bind_host,
                 std::chrono::milliseconds timeout, std::function<std::string(int peer)> describe);
  ~SocketChannels();
  SocketChannels(const SocketChannels&) = delete;
  SocketChannels& operator=(const SocketChannels&) = delete;

  // Connects to each of `peers` (group ranks) not connected yet. Every peer calls it in the same order of calls,
  // with this rank among its peers: the lower rank of a pair connects, the higher one accepts.
  void connect(const std::vector<int>& peers);
  bool connected(int peer) const { return connections_.count(peer) > 0; }

  // Sends `reason` to every peer after what is queued for it: their waits on this rank fail with it (the peer "left
  // the job: <reason>"); sends here fail afterwards.
  void leave(const std::string& reason);

  // A contiguous CPU tensor, kept alive until written.
  std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag, std::string what);
  // Into a contiguous CPU tensor at least as large as the message.
  std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag, std::string what);

  struct Outgoing;
  struct Incoming;
  struct Connection;

 private:
  void progress_sends();  // the progress thread
  void wake_progress();

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_;
  std::string bind_host_;
  std::chrono::milliseconds timeout_;
  std::function<std::string(int)> describe_;
  int listener_ = -1;
  std::map<int, std::shared_ptr<Connection>> connections_;
  // The progress thread: started with the first send that does not fit the socket buffer.
  std::thread progress_;
  int wake_[2] = {-1, -1};  // a pipe that wakes it
  std::mutex progress_mutex_;
  bool stopping_ = false;
  bool left_ = false;  // leave() was called: the progress thread drops what peers send
};

}  // namespace smp::comm
