// NCCL for the CUDA tensors of a group; its CPU tensors, and barriers, go over the Gloo group it wraps.
//
// Point-to-point: one two-rank NCCL communicator and one CUDA stream per direction of a pair of ranks (a channel),
// so that a send blocked until its receiver arrives never holds up traffic the other way or with another peer,
// and the host never waits for either. The engine posts a peer's messages in the peer's send order
// (sched::receives_in_send_order), which is all NCCL's order-based matching needs.
// Every operation waits for the work already queued on the caller's current stream, runs on its own stream and
// records an event. A point-to-point wait() makes the caller's current stream wait for that event and returns: the
// host goes on queueing the compute that uses a received tensor while it is still in flight, and the watchdog
// (nccl_watchdog.h) bounds the transfer by the group's timeout, aborting the communicators (ncclCommAbort) with a
// CommError naming the peer should it fail or never complete: never a hang. Collectives, whose results the
// engine reads on the host, are waited for on the host, polling the event and the communicator's error.

#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>

#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "nccl_primitives.h"
#include "nccl_watchdog.h"
#include "smp/comm/communicator.h"

namespace smp::comm {
namespace {

using nccl::Clock;
using nccl::Completion;
using nccl::Handle;

// A posted operation. A point-to-point one is waited for on the caller's stream (the watchdog bounds it); a
// collective on the host.
class NcclPending final : public Pending {
 public:
  enum class WaitOn { stream, host };
  // The timeout counts from wait(), as Gloo's does: a send posted early and waited for at the step's end must not
  // be called stuck because the step itself took longer than the timeout.
  NcclPending(std::shared_ptr<Completion> completion, at::Tensor keep_alive, WaitOn wait_on,
              std::shared_ptr<nccl::Watchdog> watchdog, c10::Device device, std::chrono::milliseconds timeout,
              std::string what)
      : completion_(std::move(completion)),
        keep_alive_(std::move(keep_alive)),
        wait_on_(wait_on),
        watchdog_(std::move(watchdog)),
        device_(device),
        timeout_(timeout),
        what_(std::move(what)) {}

  void wait() override {
    if (!completion_) return;
    watchdog_->throw_if_failed();
    if (!completion_->done) {
      throw CommError(what_ + ": no matching operation was posted (a send to oneself needs its receive)");
    }
    const auto deadline = Clock::now() + timeout_;
    if (wait_on_ == WaitOn::stream) {
      // The tensor's memory stays reserved for the transfer's stream (recordStream when it was posted), and work
      // the caller queues from now on runs after the transfer: neither needs the host to wait.
      nccl::order_after(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), completion_->done.get());
      if (!nccl::has_completed(completion_->done.get())) watchdog_->watch(completion_, deadline, what_);
    } else {
      host_wait(deadline);
    }
    completion_.reset();
    keep_alive_.reset();
  }

 private:
  void host_wait(Clock::time_point deadline) {
    while (!nccl::has_completed(completion_->done.get())) {
      if (auto failure = nccl::stalled(*completion_, deadline, what_)) {
        completion_->handle->abort_group();
        throw CommError(*failure);
      }
      std::this_thread::yield();
    }
  }

  std::shared_ptr<Completion> completion_;
  at::Tensor keep_alive_;
  WaitOn wait_on_;
  std::shared_ptr<nccl::Watchdog> watchdog_;
  c10::Device device_;
  std::chrono::milliseconds timeout_;
  std::string what_;
};

ncclDataType_t nccl_type(at::ScalarType type, bool for_reduction, const std::string& what) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    default:
      // Moving bytes needs no arithmetic: any other type travels as raw bytes (see element_count).
      if (!for_reduction) return ncclUint8;
      throw CommError(what + ": NCCL cannot reduce tensors of type " + std::string(c10::toString(type)));
  }
}

size_t element_count(const at::Tensor& tensor, ncclDataType_t type) {
  return type == ncclUint8 ? tensor.nbytes() : static_cast<size_t>(tensor.numel());
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, std::shared_ptr<Communicator> host,
                   c10::Device device)
      : store_(store),
        host_(std::move(host)),
        device_(device),
        events_(std::make_shared<nccl::EventPool>()),
        handles_(std::make_shared<nccl::Handles>()),
        watchdog_(std::make_shared<nccl::Watchdog>(device_.index(), [handles = handles_] { handles->abort_all(); })) {
    if (!device_.is_cuda() || !device_.has_index()) {
      throw CommError("NCCL group " + host_->name() + ": needs a CUDA device with an index, got " + device_.str());
    }
    if (device_.index() >= c10::cuda::device_count()) {
      throw CommError("NCCL group " + host_->name() + ": " + device_.str() + " does not exist (" +
                      std::to_string(c10::cuda::device_count()) + " visible)");
    }
    c10::cuda::CUDAGuard guard(device_);
    collective_stream_ = std::make_unique<nccl::Stream>();
    const std::string what = "creating NCCL group " + host_->name();
    ncclUniqueId id;
    if (rank() == 0) {
      check_plain(ncclGetUniqueId(&id), what);
      publish_id("smp_nccl/" + host_->name() + "/id", id);
    } else {
      id = fetch_id("smp_nccl/" + host_->name() + "/id", what);
    }
    collective_ = create({id}, {size()}, {rank()}, what).front();
    handles_->add(collective_);
  }

  // Every communicator aborted at once (see nccl::Handles), not one by one as each Handle goes.
  ~NcclCommunicator() override { handles_->abort_all(); }

  const std::string& name() const override { return host_->name(); }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  int global_rank(int group_rank) const override { return host_->global_rank(group_rank); }
  std::chrono::milliseconds timeout() const override { return host_->timeout(); }
  c10::Device device() const override { return device_; }
  bool in_order() const override { return true; }

  void synchronize() override {
    host_->synchronize();
    watchdog_->wait_all();
  }
  // NCCL has no way to tell a peer why: a peer waiting on this rank's NCCL transfers ends at its watchdog's timeout.
  void leave(const std::string& reason) override { host_->leave(reason); }

  void connect(const std::vector<std::pair<int, int>>& wanted) override {
    // Every member sees the same sorted list. Senders publish the ids of their channels before anyone waits for
    // one, then each rank creates all of its channels in one NCCL group: no order of arrival can deadlock.
    c10::cuda::CUDAGuard guard(device_);
    const std::set<std::pair<int, int>> channels(wanted.begin(), wanted.end());
    std::vector<std::pair<int, int>> mine;
    std::vector<ncclUniqueId> ids;
    std::vector<int> sizes, ranks;
    for (const auto& channel : channels) {
      const auto [from, to] = channel;
      // Only the sender makes the id: each one leaves a bootstrap thread and socket behind.
      if (from != rank() || channels_.count(channel)) continue;
      ncclUniqueId id;
      check_plain(ncclGetUniqueId(&id), "creating NCCL channel " + channel_name(channel));
      if (from == to) {  // a one-rank communicator: sends to oneself
        mine.push_back(channel);
        ids.push_back(id);
        sizes.push_back(1);
        ranks.push_back(0);
      } else {
        publish_id(key_of(channel), id);
      }
    }
    for (const auto& channel : channels) {
      const auto [from, to] = channel;
      if (from == to || (from != rank() && to != rank()) || channels_.count(channel)) continue;
      mine.push_back(channel);
      // The sender publishes; both ends read it back so that they agree whatever was published first.
      ids.push_back(fetch_id(key_of(channel), "creating NCCL channel " + channel_name(channel)));
      sizes.push_back(2);
      ranks.push_back(from == rank() ? 0 : 1);
    }
    if (mine.empty()) return;
    const std::string what = "creating NCCL channels of group " + name();
    const auto handles = split_blocking(create(ids, sizes, ranks, what), ranks, what);
    std::vector<Channel*> created;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      Channel channel;
      channel.handle = handles[i];
      channel.stream = std::make_unique<nccl::Stream>();
      created.push_back(&channels_.emplace(mine[i], std::move(channel)).first->second);
    }
    // NCCL connects a channel at its first transfer, and until the peer is there the host waits (the channels are
    // blocking communicators): one byte each way now, while every member is here, so that no transfer in training
    // waits on the host for its peer. One NCCL group over all channels connects them together, so no order of
    // arrival can deadlock. The split just proved every peer here, so this wait is not bounded by the timeout.
    const at::Tensor byte = at::zeros({2}, at::TensorOptions(at::kByte).device(device_));
    const auto ready = events_->record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    uint8_t* const first = static_cast<uint8_t*>(byte.data_ptr());
    for (Channel* channel : created) {
      const cudaStream_t stream = channel->stream->get();
      nccl::order_after(stream, ready.get());
      // Should one warm-up fail, `byte` goes while others may still write into it: not reused until they end.
      c10::cuda::CUDACachingAllocator::recordStream(byte.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
    }
    // Inside the NCCL group nothing may throw, and nothing is aborted: NCCL would reclaim an aborted communicator
    // only at the group's end, beside the transfers queued on it. A failure is acted on after the group has ended
    // (it then launches nothing).
    ncclResult_t failed = ncclSuccess;
    std::size_t failed_on = 0;
    check_plain(ncclGroupStart(), what);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto [from, to] = mine[i];
      const cudaStream_t stream = created[i]->stream->get();
      const bool sending = from == rank();
      const ncclResult_t result = created[i]->handle->try_enqueue([&](ncclComm_t comm) {
        if (from == to) return nccl::self_pair(comm, first, first + 1, 1, ncclUint8, stream);
        return sending ? ncclSend(first, 1, ncclUint8, 1, comm, stream)
                       : ncclRecv(first + 1, 1, ncclUint8, 0, comm, stream);
      });
      if (result != ncclSuccess && result != ncclInProgress && failed == ncclSuccess) {
        failed = result;
        failed_on = i;
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (failed != ncclSuccess) {
      created[failed_on]->handle->fail(what + ": first transfer on " + channel_name(mine[failed_on]) + " failed: ",
                                       failed);
    }
    if (ended != ncclSuccess && ended != ncclInProgress) {
      created.front()->handle->fail(what + ": first transfers failed: ", ended);
    }
    for (std::size_t i = 0; i < mine.size(); ++i) {
      auto warm_up = std::make_shared<Completion>();
      warm_up->handle = created[i]->handle;
      warm_up->done = events_->record(created[i]->stream->get());
      const std::string where = what + ": first transfer on " + channel_name(mine[i]) + " (is the peer running?)";
      NcclPending(warm_up, byte, NcclPending::WaitOn::host, watchdog_, device_, timeout(), where).wait();
    }
  }

  std::unique_ptr<Pending> isend(const at::Tensor& tensor, int peer, int tag) override {
    if (!tensor.is_cuda()) return host_->isend(tensor, peer, tag);
    return point_to_point(tensor, peer, /*sending=*/true);
  }

  std::unique_ptr<Pending> irecv(const at::Tensor& into, int peer, int tag) override {
    if (!into.is_cuda()) return host_->irecv(into, peer, tag);
    return point_to_point(into, peer, /*sending=*/false);
  }

  std::unique_ptr<Pending> iall_reduce_sum(const at::Tensor& tensor) override {
    if (!tensor.is_cuda()) return host_->iall_reduce_sum(tensor);
    return collective(tensor, "all-reduce in group " + name(), /*reduces=*/true,
                      [&](ncclComm_t comm, void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
                        return ncclAllReduce(data, data, count, type, ncclSum, comm, stream);
                      });
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    if (!tensor.is_cuda()) return host_->broadcast(tensor, root);
    collective(tensor, "broadcast from rank " + std::to_string(global_rank(root)), /*reduces=*/false,
               [&](ncclComm_t comm, void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
                 return ncclBroadcast(data, data, count, type, root, comm, stream);
               })
        ->wait();
  }

  void barrier() override { host_->barrier(); }

  void all_gather(const at::Tensor& whole, const at::Tensor& shard) override {
    if (!whole.is_cuda()) return host_->all_gather(whole, shard);
    const std::string what = "all-gather in group " + name();
    check_shards(whole, shard, size(), what);
    check_contiguous(shard, what);
    collective(whole, what, /*reduces=*/false, [&](ncclComm_t comm, void* data, size_t count, ncclDataType_t type,
                                                   cudaStream_t stream) {
      c10::cuda::CUDACachingAllocator::recordStream(shard.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
      return ncclAllGather(shard.data_ptr(), data, count / static_cast<size_t>(size()), type, comm, stream);
    })->wait();
  }

  void all_to_all(const at::Tensor& output, const at::Tensor& input, const std::vector<std::int64_t>& output_rows,
                  const std::vector<std::int64_t>& input_rows) override {
    if (!output.is_cuda()) return host_->all_to_all(output, input, output_rows, input_rows);
    const std::string what = "all-to-all in group " + name();
    check_rows(output, input, output_rows, input_rows, size(), what);
    check_contiguous(input, what);
    const std::int64_t row = output.size(0) > 0 ? output.numel() / output.size(0)
                                                : (input.size(0) > 0 ? input.numel() / input.size(0) : 0);
    const std::size_t element = output.element_size();
    collective(output, what, /*reduces=*/false, [&](ncclComm_t comm, void* data, size_t, ncclDataType_t type,
                                                    cudaStream_t stream) {
      c10::cuda::CUDACachingAllocator::recordStream(input.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
      // Each peer's rows as one send and one receive, all in one NCCL group: NCCL pairs them by peer.
      ncclResult_t result = ncclGroupStart();
      std::int64_t sent = 0, received = 0;
      for (int peer = 0; peer < size() && result == ncclSuccess; ++peer) {
        const auto* from = static_cast<const char*>(input.data_ptr()) + sent * row * static_cast<std::int64_t>(element);
        auto* into = static_cast<char*>(data) + received * row * static_cast<std::int64_t>(element);
        if (input_rows[peer] > 0) {
          result = ncclSend(from, static_cast<size_t>(input_rows[peer] * row), type, peer, comm, stream);
        }
        if (result == ncclSuccess && output_rows[peer] > 0) {
          result = ncclRecv(into, static_cast<size_t>(output_rows[peer] * row), type, peer, comm, stream);
        }
        sent += input_rows[peer];
        received += output_rows[peer];
      }
      const ncclResult_t ended = ncclGroupEnd();
      return result != ncclSuccess ? result : ended;
    })->wait();
  }

  void reduce_scatter_sum(const at::Tensor& shard, const at::Tensor& whole) override {
    if (!shard.is_cuda()) return host_->reduce_scatter_sum(shard, whole);
    const std::string what = "reduce-scatter in group " + name();
    check_shards(whole, shard, size(), what);
    check_contiguous(whole, what);
    collective(shard, what, /*reduces=*/true, [&](ncclComm_t comm, void* data, size_t count, ncclDataType_t type,
                                                  cudaStream_t stream) {
      c10::cuda::CUDACachingAllocator::recordStream(whole.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
      return ncclReduceScatter(whole.data_ptr(), data, count, type, ncclSum, comm, stream);
    })->wait();
  }

 private:
  struct Channel {
    std::shared_ptr<Handle> handle;
    std::unique_ptr<nccl::Stream> stream;
    // Sends to oneself pair with receives from oneself inside one NCCL group; whichever comes first waits here.
    std::deque<std::pair<at::Tensor, std::shared_ptr<Completion>>> unpaired_sends, unpaired_receives;
  };

  std::string channel_name(const std::pair<int, int>& channel) const {
    return "rank " + std::to_string(global_rank(channel.first)) + " -> rank " + std::to_string(global_rank(channel.second));
  }
  std::string key_of(const std::pair<int, int>& channel) const {
    return "smp_nccl/" + name() + "/channel/" + std::to_string(channel.first) + ">" + std::to_string(channel.second);
  }

  void check_plain(ncclResult_t result, const std::string& what) {
    if (result != ncclSuccess) throw CommError(what + " failed: NCCL: " + nccl::error_text(result, nullptr));
  }
  static void check_contiguous(const at::Tensor& tensor, const std::string& what) {
    if (!tensor.is_contiguous()) throw CommError(what + ": the tensor must be contiguous");
  }

  void publish_id(const std::string& key, const ncclUniqueId& id) {
    std::vector<uint8_t> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    store_->set(key, bytes);
  }
  ncclUniqueId fetch_id(const std::string& key, const std::string& what) {
    std::vector<uint8_t> bytes;
    try {
      store_->wait({key}, timeout());
      bytes = store_->get(key);
    } catch (const std::exception& error) {
      throw CommError(what + ": no NCCL id from the other side within " + std::to_string(timeout().count() / 1000) +
                      " s: " + brief_message(error));
    }
    ncclUniqueId id;
    if (bytes.size() != sizeof(id)) throw CommError(what + ": malformed NCCL id in the store");
    std::memcpy(&id, bytes.data(), sizeof(id));
    return id;
  }

  std::vector<std::shared_ptr<Handle>> create(const std::vector<ncclUniqueId>& ids, const std::vector<int>& sizes,
                                              const std::vector<int>& ranks, const std::string& what) {
    c10::cuda::CUDAGuard guard(device_);
    std::vector<std::shared_ptr<Handle>> handles;
    const auto deadline = Clock::now() + timeout();
    check_plain(ncclGroupStart(), what);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      handles.push_back(std::make_shared<Handle>());
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t result = ncclCommInitRankConfig(&handles.back()->comm, sizes[i], ids[i], ranks[i], &config);
      if (result != ncclSuccess && result != ncclInProgress) {
        ncclGroupEnd();
        throw CommError(what + " failed: NCCL: " + nccl::error_text(result, nullptr));
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (ended != ncclSuccess && ended != ncclInProgress) {
      throw CommError(what + " failed: NCCL: " + nccl::error_text(ended, nullptr));
    }
    for (auto& handle : handles) handle->wait_ready(deadline, what + " (is every member of the group running?)");
    return handles;
  }

  // Communicators are created non-blocking, so that a member that never comes is timed out. But NCCL then starts a
  // thread for every operation it launches: a small send to oneself took 36 to 84 us that way against 13 to 19 us
  // blocking (bench_gpu nccl on an H200, 2026-11-26). So a channel goes on as a blocking communicator split from
  // its non-blocking one (the split itself runs non-blocking, bounded like the creation); once its first transfer
  // has connected it, an operation only enqueues work, and the host never waits in NCCL. The non-blocking parents
  // are aborted when the caller drops them: their children do not depend on them, unless
  // NCCL_COMM_SPLIT_SHARE_RESOURCES=1 (which overrides the configuration) makes them share the parent's abort flag,
  // and then the parents stay.
  std::vector<std::shared_ptr<Handle>> split_blocking(const std::vector<std::shared_ptr<Handle>>& parents,
                                                      const std::vector<int>& ranks, const std::string& what) {
    const char* shared = std::getenv("NCCL_COMM_SPLIT_SHARE_RESOURCES");
    if (shared != nullptr && std::atoi(shared) == 1) {
      for (const auto& parent : parents) handles_->add(parent);
    }
    c10::cuda::CUDAGuard guard(device_);
    const auto deadline = Clock::now() + timeout();
    std::vector<std::shared_ptr<Handle>> children;
    for (std::size_t i = 0; i < parents.size(); ++i) {
      children.push_back(std::make_shared<Handle>());
      // Registered before NCCL writes the communicator into it, so that it outlives a split abandoned half-way.
      handles_->add(children.back());
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 1;
      ncclComm_t* child = &children.back()->comm;
      parents[i]->enqueue([&](ncclComm_t parent) { return ncclCommSplit(parent, 0, ranks[i], child, &config); }, what);
    }
    for (std::size_t i = 0; i < parents.size(); ++i) {
      parents[i]->wait_ready(deadline, what + " (is every member of the group running?)");
      if (children[i]->comm == nullptr) throw CommError(what + ": NCCL's split made no communicator");
    }
    return children;
  }

  // An in-place collective on the group's communicator and stream, waited for on the host.
  template <typename Launch>
  std::unique_ptr<Pending> collective(const at::Tensor& tensor, const std::string& what, bool reduces, Launch launch) {
    check_contiguous(tensor, what);
    const auto type = nccl_type(tensor.scalar_type(), reduces, what);
    const auto deadline = Clock::now() + timeout();
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = collective_stream_->get();
    auto completion = start(collective_, stream, tensor);
    collective_->issue(
        [&](ncclComm_t comm) { return launch(comm, tensor.data_ptr(), element_count(tensor, type), type, stream); },
        deadline, what);
    completion->done = events_->record(stream);
    return pending(completion, tensor, NcclPending::WaitOn::host, what);
  }

  std::unique_ptr<Pending> pending(std::shared_ptr<Completion> completion, const at::Tensor& tensor,
                                   NcclPending::WaitOn wait_on, const std::string& what) {
    return std::make_unique<NcclPending>(std::move(completion), tensor, wait_on, watchdog_, device_, timeout(), what);
  }

  // The operation's stream waits for what the caller queued on its current stream (the tensor's producer), and
  // the caching allocator learns that the tensor is in use on that stream: should the caller drop it before the
  // operation completes (an exception unwinding, or a wait() that returned before the transfer ended), its memory
  // is not handed out again until then.
  std::shared_ptr<Completion> start(const std::shared_ptr<Handle>& handle, cudaStream_t stream,
                                    const at::Tensor& tensor) {
    watchdog_->throw_if_failed();
    c10::cuda::CUDAGuard guard(device_);
    nccl::order_after(stream, events_->record(c10::cuda::getCurrentCUDAStream(device_.index()).stream()).get());
    c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(stream, device_.index()));
    auto completion = std::make_shared<Completion>();
    completion->handle = handle;
    return completion;
  }

  std::unique_ptr<Pending> point_to_point(const at::Tensor& tensor, int peer, bool sending) {
    const std::pair<int, int> key = sending ? std::make_pair(rank(), peer) : std::make_pair(peer, rank());
    const std::string what = (sending ? "sending to rank " : "receiving from rank ") + std::to_string(global_rank(peer));
    const auto found = channels_.find(key);
    if (found == channels_.end()) {
      throw CommError(what + ": the NCCL channel " + channel_name(key) + " was not connected (Communicator::connect)");
    }
    check_contiguous(tensor, what);
    Channel& channel = found->second;
    const auto type = nccl_type(tensor.scalar_type(), false, what);
    const auto deadline = Clock::now() + timeout();
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = channel.stream->get();
    auto completion = start(channel.handle, stream, tensor);
    if (peer == rank()) {
      pair_self(channel, tensor, completion, sending, type, deadline, what);
    } else {
      const int other = sending ? 1 : 0;  // the channel's sender is its rank 0
      void* const data = tensor.data_ptr();
      const size_t count = element_count(tensor, type);
      channel.handle->issue(
          [&](ncclComm_t comm) {
            return sending ? ncclSend(data, count, type, other, comm, stream)
                           : ncclRecv(data, count, type, other, comm, stream);
          },
          deadline, what);
      completion->done = events_->record(stream);
    }
    return pending(completion, tensor, NcclPending::WaitOn::stream, what);
  }

  // NCCL can only send to itself with the receive in the same group call: issue the pair once both are posted.
  void pair_self(Channel& channel, const at::Tensor& tensor, const std::shared_ptr<Completion>& completion,
                 bool sending, ncclDataType_t type, Clock::time_point deadline, const std::string& what) {
    auto& waiting = sending ? channel.unpaired_receives : channel.unpaired_sends;
    if (waiting.empty()) {
      (sending ? channel.unpaired_sends : channel.unpaired_receives).emplace_back(tensor, completion);
      return;
    }
    auto [other_tensor, other_completion] = std::move(waiting.front());
    waiting.pop_front();
    const at::Tensor& source = sending ? tensor : other_tensor;
    const at::Tensor& target = sending ? other_tensor : tensor;
    if (source.nbytes() != target.nbytes()) {
      throw CommError(what + ": sending " + std::to_string(source.nbytes()) + " bytes to oneself into a " +
                      std::to_string(target.nbytes()) + "-byte receive");
    }
    const cudaStream_t stream = channel.stream->get();
    channel.handle->issue(
        [&](ncclComm_t comm) {
          return nccl::self_pair(comm, source.data_ptr(), target.data_ptr(), element_count(source, type), type, stream);
        },
        deadline, what);
    completion->done = events_->record(stream);
    other_completion->done = completion->done;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<Communicator> host_;
  c10::Device device_;
  std::shared_ptr<nccl::EventPool> events_;
  std::shared_ptr<nccl::Handles> handles_;
  std::shared_ptr<nccl::Watchdog> watchdog_;
  std::shared_ptr<Handle> collective_;
  std::unique_ptr<nccl::Stream> collective_stream_;
  std::map<std::pair<int, int>, Channel> channels_;
};

}  // namespace

bool nccl_available() { return true; }

int nccl_version() {
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess ? version : 0;
}

std::shared_ptr<Communicator> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              std::shared_ptr<Communicator> host_group, c10::Device device) {
  return std::make_shared<NcclCommunicator>(store, std::move(host_group), device);
}

}  // namespace smp::comm
