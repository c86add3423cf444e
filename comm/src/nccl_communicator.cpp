// NCCL for the CUDA tensors of a group; its CPU tensors, and barriers, go over the Gloo group it wraps.
//
// Point-to-point: one two-rank NCCL communicator and one CUDA stream per direction of a pair of ranks (a channel),
// so that a send blocked until its receiver arrives never holds up traffic the other way or with another peer,
// and the host never waits for either. The engine posts a peer's messages in the peer's send order
// (sched::receives_in_send_order), which is all NCCL's order-based matching needs.
// Every operation waits for the work already queued on the caller's current stream, runs on its own stream and
// records an event; Pending::wait() polls that event and the communicator's asynchronous error until the group's
// timeout, then aborts the communicator (ncclCommAbort) and throws a CommError naming the peer: never a hang.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "smp/comm/communicator.h"

namespace smp::comm {
namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_error_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  }
  return text;
}

void check_cuda(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) throw CommError(what + ": CUDA error: " + cudaGetErrorString(status));
}

// A two-rank (or one-rank) NCCL communicator that remembers whether it was aborted.
struct NcclHandle {
  ncclComm_t comm = nullptr;
  bool aborted = false;

  NcclHandle() = default;
  NcclHandle(const NcclHandle&) = delete;
  NcclHandle& operator=(const NcclHandle&) = delete;
  // Abort, never ncclCommDestroy: that waits for every operation issued, and after a failure (a model error, a
  // dead peer) a send whose receiver never came would make the exit hang.
  ~NcclHandle() { abort(); }
  void abort() {
    if (comm != nullptr && !aborted) {
      ncclCommAbort(comm);
      aborted = true;
    }
  }
  // ncclCommAbort frees the communicator: nothing may touch it after.
  void throw_if_aborted(const std::string& what) const {
    if (aborted) throw CommError(what + ": the NCCL communicator was aborted after an earlier failure");
  }
  // Communicators are non-blocking (so that a dead peer can be timed out): a call may return ncclInProgress, and
  // the communicator must be polled until it is ready for the next one.
  void wait_ready(Clock::time_point deadline, const std::string& what) {
    throw_if_aborted(what);
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      if (query != ncclSuccess) state = query;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const std::string reason = nccl_error_text(state, comm);
        abort();
        throw CommError(what + " failed: NCCL: " + reason);
      }
      if (Clock::now() > deadline) {
        abort();
        throw CommError(what + " timed out (NCCL); the communicator was aborted");
      }
      std::this_thread::yield();
    }
  }
  void check(ncclResult_t result, Clock::time_point deadline, const std::string& what) {
    throw_if_aborted(what);
    if (result != ncclSuccess && result != ncclInProgress) {
      const std::string reason = nccl_error_text(result, comm);
      abort();
      throw CommError(what + " failed: NCCL: " + reason);
    }
    wait_ready(deadline, what);
  }
};

class Event {
 public:
  Event() { check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "creating a CUDA event"); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream) { check_cuda(cudaEventRecord(event_, stream), "recording a CUDA event"); }
  // `stream` waits (on the GPU) for what was recorded.
  void block(cudaStream_t stream) { check_cuda(cudaStreamWaitEvent(stream, event_, 0), "ordering CUDA streams"); }
  bool query() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    check_cuda(status, "waiting for a CUDA event");
    return true;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// A stream of our own, not one of LibTorch's pooled streams: a channel's stream can stay blocked in a send until
// the receiver arrives, so it must never be shared with anything else.
class Stream {
 public:
  Stream() { check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a CUDA stream"); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Completion of one NCCL operation; for a self transfer, possibly not issued yet (see NcclCommunicator::pair_self).
struct Completion {
  std::shared_ptr<NcclHandle> handle;
  std::unique_ptr<Event> done;  // null until the operation is issued
};

class NcclPending final : public Pending {
 public:
  // The timeout counts from wait(), as Gloo's does: a send posted early and waited for at the step's end must not
  // be called stuck because the step itself took longer than the timeout.
  NcclPending(std::shared_ptr<Completion> completion, at::Tensor keep_alive, std::chrono::milliseconds timeout,
              std::string what)
      : completion_(std::move(completion)),
        keep_alive_(std::move(keep_alive)),
        timeout_(timeout),
        what_(std::move(what)) {}

  void wait() override {
    if (!completion_) return;
    const auto deadline = Clock::now() + timeout_;
    if (!completion_->done) {
      throw CommError(what_ + ": no matching operation was posted (a send to oneself needs its receive)");
    }
    while (!completion_->done->query()) {
      completion_->handle->throw_if_aborted(what_);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(completion_->handle->comm, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        const std::string reason = nccl_error_text(state, completion_->handle->comm);
        completion_->handle->abort();
        throw CommError(what_ + " failed: NCCL: " + reason);
      }
      if (Clock::now() > deadline) {
        completion_->handle->abort();
        throw CommError(what_ + " timed out (NCCL); the communicator was aborted");
      }
      std::this_thread::yield();
    }
    completion_.reset();
    keep_alive_.reset();
  }

 private:
  std::shared_ptr<Completion> completion_;
  at::Tensor keep_alive_;
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
      : store_(store), host_(std::move(host)), device_(device) {
    if (!device_.is_cuda() || !device_.has_index()) {
      throw CommError("NCCL group " + host_->name() + ": needs a CUDA device with an index, got " + device_.str());
    }
    if (device_.index() >= c10::cuda::device_count()) {
      throw CommError("NCCL group " + host_->name() + ": " + device_.str() + " does not exist (" +
                      std::to_string(c10::cuda::device_count()) + " visible)");
    }
    c10::cuda::CUDAGuard guard(device_);
    collective_stream_ = std::make_unique<Stream>();
    const std::string what = "creating NCCL group " + host_->name();
    ncclUniqueId id;
    if (rank() == 0) {
      check_plain(ncclGetUniqueId(&id), what);
      publish_id("smp_nccl/" + host_->name() + "/id", id);
    } else {
      id = fetch_id("smp_nccl/" + host_->name() + "/id", what);
    }
    collective_ = create({id}, {size()}, {rank()}, what).front();
  }

  const std::string& name() const override { return host_->name(); }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  int global_rank(int group_rank) const override { return host_->global_rank(group_rank); }
  std::chrono::milliseconds timeout() const override { return host_->timeout(); }
  c10::Device device() const override { return device_; }
  bool in_order() const override { return true; }

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
    const auto handles = create(ids, sizes, ranks, what);
    std::vector<Channel*> created;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      Channel channel;
      channel.handle = handles[i];
      channel.stream = std::make_unique<Stream>();
      created.push_back(&channels_.emplace(mine[i], std::move(channel)).first->second);
    }
    // NCCL connects a channel at its first transfer, and until the peer is there the host waits: one byte each
    // way now, while every member is here, so that no send in training waits on the host for its receiver. All
    // are issued before any is waited for (each on its own communicator), so no order of arrival can deadlock.
    const auto deadline = Clock::now() + timeout();
    const at::Tensor byte = at::zeros({2}, at::TensorOptions(at::kByte).device(device_));
    Event ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    std::vector<std::shared_ptr<Completion>> warm_ups;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto [from, to] = mine[i];
      Channel& channel = *created[i];
      const cudaStream_t stream = channel.stream->get();
      ready.block(stream);
      // Should one warm-up fail, `byte` goes while the others may still write into it: not reused until they end.
      c10::cuda::CUDACachingAllocator::recordStream(byte.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
      ncclComm_t comm = channel.handle->comm;
      ncclResult_t result = ncclSuccess;
      if (from == to) {
        check_plain(ncclGroupStart(), what);
        const ncclResult_t sent = ncclSend(byte.data_ptr(), 1, ncclUint8, 0, comm, stream);
        const ncclResult_t received = ncclRecv(static_cast<uint8_t*>(byte.data_ptr()) + 1, 1, ncclUint8, 0, comm, stream);
        const ncclResult_t ended = ncclGroupEnd();
        result = sent != ncclSuccess ? sent : received != ncclSuccess ? received : ended;
      } else if (from == rank()) {
        result = ncclSend(byte.data_ptr(), 1, ncclUint8, 1, comm, stream);
      } else {
        result = ncclRecv(static_cast<uint8_t*>(byte.data_ptr()) + 1, 1, ncclUint8, 0, comm, stream);
      }
      if (result != ncclSuccess && result != ncclInProgress) {
        throw CommError(what + ": first transfer on " + channel_name(mine[i]) + " failed: NCCL: " +
                        nccl_error_text(result, comm));
      }
      auto completion = std::make_shared<Completion>();
      completion->handle = channel.handle;
      warm_ups.push_back(completion);
    }
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const std::string where = what + ": first transfer on " + channel_name(mine[i]) + " (is the peer running?)";
      created[i]->handle->wait_ready(deadline, where);
      finish(*warm_ups[i], created[i]->stream->get());
      NcclPending(warm_ups[i], byte, timeout(), where).wait();
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
                      [&](void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
                        return ncclAllReduce(data, data, count, type, ncclSum, collective_->comm, stream);
                      });
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    if (!tensor.is_cuda()) return host_->broadcast(tensor, root);
    collective(tensor, "broadcast from rank " + std::to_string(global_rank(root)), /*reduces=*/false,
               [&](void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
                 return ncclBroadcast(data, data, count, type, root, collective_->comm, stream);
               })
        ->wait();
  }

  void barrier() override { host_->barrier(); }

  void all_gather(const at::Tensor& whole, const at::Tensor& shard) override {
    if (!whole.is_cuda()) return host_->all_gather(whole, shard);
    const std::string what = "all-gather in group " + name();
    check_shards(whole, shard, size(), what);
    check_contiguous(shard, what);
    collective(whole, what, /*reduces=*/false, [&](void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
      c10::cuda::CUDACachingAllocator::recordStream(shard.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
      return ncclAllGather(shard.data_ptr(), data, count / static_cast<size_t>(size()), type, collective_->comm, stream);
    })->wait();
  }

  void reduce_scatter_sum(const at::Tensor& shard, const at::Tensor& whole) override {
    if (!shard.is_cuda()) return host_->reduce_scatter_sum(shard, whole);
    const std::string what = "reduce-scatter in group " + name();
    check_shards(whole, shard, size(), what);
    check_contiguous(whole, what);
    collective(shard, what, /*reduces=*/true, [&](void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
      c10::cuda::CUDACachingAllocator::recordStream(whole.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, device_.index()));
      return ncclReduceScatter(whole.data_ptr(), data, count, type, ncclSum, collective_->comm, stream);
    })->wait();
  }

 private:
  struct Channel {
    std::shared_ptr<NcclHandle> handle;
    std::unique_ptr<Stream> stream;
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
    if (result != ncclSuccess) throw CommError(what + " failed: NCCL: " + nccl_error_text(result, nullptr));
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

  std::vector<std::shared_ptr<NcclHandle>> create(const std::vector<ncclUniqueId>& ids, const std::vector<int>& sizes,
                                                  const std::vector<int>& ranks, const std::string& what) {
    c10::cuda::CUDAGuard guard(device_);
    std::vector<std::shared_ptr<NcclHandle>> handles;
    const auto deadline = Clock::now() + timeout();
    check_plain(ncclGroupStart(), what);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      handles.push_back(std::make_shared<NcclHandle>());
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t result = ncclCommInitRankConfig(&handles.back()->comm, sizes[i], ids[i], ranks[i], &config);
      if (result != ncclSuccess && result != ncclInProgress) {
        ncclGroupEnd();
        throw CommError(what + " failed: NCCL: " + nccl_error_text(result, nullptr));
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (ended != ncclSuccess && ended != ncclInProgress) {
      throw CommError(what + " failed: NCCL: " + nccl_error_text(ended, nullptr));
    }
    for (auto& handle : handles) handle->wait_ready(deadline, what + " (is every member of the group running?)");
    return handles;
  }

  // An in-place collective on the group's communicator and stream.
  template <typename Launch>
  std::unique_ptr<Pending> collective(const at::Tensor& tensor, const std::string& what, bool reduces, Launch launch) {
    check_contiguous(tensor, what);
    const auto type = nccl_type(tensor.scalar_type(), reduces, what);
    const auto deadline = Clock::now() + timeout();
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = collective_stream_->get();
    auto completion = start(collective_, stream, tensor);
    collective_->check(launch(tensor.data_ptr(), element_count(tensor, type), type, stream), deadline, what);
    finish(*completion, stream);
    return std::make_unique<NcclPending>(completion, tensor, timeout(), what);
  }

  // The operation's stream waits for what the caller queued on its current stream (the tensor's producer), and
  // the caching allocator learns that the tensor is in use on that stream: should the caller drop it before the
  // operation completes (an exception unwinding), its memory is not handed out again until then.
  std::shared_ptr<Completion> start(const std::shared_ptr<NcclHandle>& handle, cudaStream_t stream,
                                    const at::Tensor& tensor) {
    handle->throw_if_aborted("group " + name());
    c10::cuda::CUDAGuard guard(device_);
    Event ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    ready.block(stream);
    c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(stream, device_.index()));
    auto completion = std::make_shared<Completion>();
    completion->handle = handle;
    return completion;
  }
  void finish(Completion& completion, cudaStream_t stream) {
    completion.done = std::make_unique<Event>();
    completion.done->record(stream);
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
      channel.handle->check(sending ? ncclSend(tensor.data_ptr(), element_count(tensor, type), type, other,
                                               channel.handle->comm, stream)
                                    : ncclRecv(tensor.data_ptr(), element_count(tensor, type), type, other,
                                               channel.handle->comm, stream),
                            deadline, what);
      finish(*completion, stream);
    }
    return std::make_unique<NcclPending>(completion, tensor, timeout(), what);
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
    auto& handle = *channel.handle;
    check_plain(ncclGroupStart(), what);
    const ncclResult_t sent = ncclSend(source.data_ptr(), element_count(source, type), type, 0, handle.comm, stream);
    const ncclResult_t received = ncclRecv(target.data_ptr(), element_count(target, type), type, 0, handle.comm, stream);
    const ncclResult_t ended = ncclGroupEnd();
    handle.check(sent != ncclSuccess ? sent : received != ncclSuccess ? received : ended, deadline, what);
    finish(*completion, stream);
    other_completion->done = std::make_unique<Event>();
    other_completion->done->record(stream);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<Communicator> host_;
  c10::Device device_;
  std::shared_ptr<NcclHandle> collective_;
  std::unique_ptr<Stream> collective_stream_;
  std::map<std::pair<int, int>, Channel> channels_;
};

}  // namespace

bool nccl_available() { return true; }

std::shared_ptr<Communicator> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              std::shared_ptr<Communicator> host_group, c10::Device device) {
  return std::make_shared<NcclCommunicator>(store, std::move(host_group), device);
}

}  // namespace smp::comm
