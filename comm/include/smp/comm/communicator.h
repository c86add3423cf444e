#pragma once
// The communication seam: point-to-point tensor transfers and the few collectives the engine needs, over a
// group of ranks. Every blocking call is bounded by the group's timeout and fails with a CommError that names
// the peer, never a hang.

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}

namespace smp::comm {

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A posted transfer. wait() returns when it is complete, or throws CommError.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const std::string& name() const = 0;
  virtual int rank() const = 0;  // this process's rank within the group
  virtual int size() const = 0;
  virtual int global_rank(int group_rank) const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;

  // The tensor must stay alive and unchanged until the transfer completes; the Pending keeps a reference.
  virtual std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag) = 0;
  // `into` must already have the sender's shape and dtype.
  virtual std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag) = 0;

  virtual void all_reduce_sum(const at::Tensor& tensor) = 0;  // in place
  virtual void broadcast(const at::Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;
};

// Creates the Gloo communicator of a group. Only the members call it, each with the same `members` (global
// ranks, in group order) and `name`; the group's rendezvous goes through `store` under that name.
std::shared_ptr<Communicator> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              const std::vector<int>& members, int global_rank,
                                              const std::string& name, const std::string& bind_host,
                                              std::chrono::milliseconds timeout);

// The first line of an exception's message, without LibTorch's C++ backtrace.
std::string brief_message(const std::exception& error);

}  // namespace smp::comm
