#pragma once
// The communication seam: point-to-point tensor transfers and the few collectives the engine needs, over a
// group of ranks. Every blocking call is bounded by the group's timeout and fails with a CommError that names
// the peer, never a hang.

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}

namespace smp::comm {

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A posted transfer. wait() returns when its result can be used, or throws CommError: on the host, except for a
// point-to-point transfer of device tensors on a transport that can order it on the GPU (NCCL), where only work
// queued afterwards on the caller's current stream is sure to see it; Communicator::synchronize waits for those on
// the host.
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
  // Where the tensors this group moves live (CPU, or this process's GPU): receive buffers are made there.
  virtual c10::Device device() const = 0;
  // True when tensors on device() are matched between two ranks in the order they are posted, not by tag
  // (NCCL): a receiver must then post a peer's messages in the order the peer sends them. CPU tensors are always
  // matched by tag.
  virtual bool in_order() const { return false; }
  // Sets up the point-to-point channels (sender, receiver), as group ranks, before their first use. Every member
  // calls it with the same list. Transports with per-pair state (NCCL) create it here, in an order that cannot
  // deadlock; sending on a channel that was not connected is an error there.
  virtual void connect(const std::vector<std::pair<int, int>>& channels) { (void)channels; }
  // Waits on the host, within the timeout, for every transfer whose wait() returned before it completed, and throws
  // CommError naming the first that failed. Call before the host reads what such transfers delivered or produced
  // from it, or treats them as done.
  virtual void synchronize() {}
  // This rank leaves the group after a failure that put it out of step with its peers (a step that threw midway):
  // a peer waiting on it for a point-to-point transfer or a small collective over smp's own connections fails at
  // once, naming `reason`; other transfers (Gloo's large collectives, NCCL) end at the peer's timeout or when this
  // process exits. Nothing may be sent here afterwards.
  virtual void leave(const std::string& reason) { (void)reason; }

  // The tensor must stay alive and unchanged until the transfer completes; the Pending keeps a reference.
  virtual std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag) = 0;
  // `into` must already have the sender's shape and dtype, and be contiguous.
  virtual std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag) = 0;

  // In place; the result is there when the Pending's wait() returns.
  virtual std::unique_ptr<Pending> iall_reduce_sum(const at::Tensor& tensor) = 0;
  // Blocking; a transport may take another path for it than for the asynchronous form (small tensors).
  virtual void all_reduce_sum(const at::Tensor& tensor) { iall_reduce_sum(tensor)->wait(); }
  virtual void broadcast(const at::Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;
  // Blocking collectives over shards along dimension 0 (tensor-parallel layers). all_gather: every member's `shard`
  // (all of one shape) concatenated in group rank order into `whole`. reduce_scatter_sum: the sum over members of
  // `whole`, this member's rank-th slice of it into `shard`. `whole` has size() times `shard`'s first dimension.
  virtual void all_gather(const at::Tensor& whole, const at::Tensor& shard) = 0;
  virtual void reduce_scatter_sum(const at::Tensor& shard, const at::Tensor& whole) = 0;
  // Blocking: rows (dimension 0) of `input` to every member, the first `input_rows[0]` to group rank 0, the next
  // `input_rows[1]` to rank 1, ...; `output` takes `output_rows[r]` rows from each rank r, in rank order. Every
  // member's row shape and dtype are the same, and what one sends another expects (the counts exchanged first):
  // the token dispatch and combine of expert parallelism.
  virtual void all_to_all(const at::Tensor& output, const at::Tensor& input, const std::vector<std::int64_t>& output_rows,
                          const std::vector<std::int64_t>& input_rows) = 0;
};

// CommError naming `what` unless `whole` is `members` shards of `shard`'s shape along dimension 0, of one dtype.
void check_shards(const at::Tensor& whole, const at::Tensor& shard, int members, const std::string& what);
// CommError naming `what` unless the row counts have one entry per member and add up to the tensors' first
// dimensions, and the two tensors have one row shape and dtype.
void check_rows(const at::Tensor& output, const at::Tensor& input, const std::vector<std::int64_t>& output_rows,
                const std::vector<std::int64_t>& input_rows, int members, const std::string& what);

// Creates the Gloo communicator of a group. Only the members call it, each with the same `members` (global
// ranks, in group order) and `name`; the group's rendezvous goes through `store` under that name. Tensors on
// `device` other than the CPU are staged through host memory.
std::shared_ptr<Communicator> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              const std::vector<int>& members, int global_rank,
                                              const std::string& name, const std::string& bind_host,
                                              std::chrono::milliseconds timeout,
                                              c10::Device device = c10::Device(c10::kCPU));

// Creates the NCCL communicator of a group on this process's GPU `device`: CUDA tensors go over NCCL, CPU tensors
// (and barriers) over `host_group`, a Gloo group of the same members. Called by the same ranks with the same
// arguments as make_gloo_group. Throws CommError when this build has no NCCL or the GPU cannot be used.
std::shared_ptr<Communicator> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              std::shared_ptr<Communicator> host_group, c10::Device device);
// Whether this build can make NCCL groups.
bool nccl_available();
// The loaded NCCL library's version (ncclGetVersion: 23007 for 2.30.7), which may be newer than the one built
// against; 0 in a build without NCCL.
int nccl_version();
// From this version on, NCCL lets ranks of several processes share one GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1).
constexpr int kNcclSharesGpusFrom = 23000;

// The first line of an exception's message, without LibTorch's C++ backtrace.
std::string brief_message(const std::exception& error);

}  // namespace smp::comm
