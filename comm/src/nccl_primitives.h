#pragma once
// The CUDA and NCCL handles the NCCL communicator is built from (nccl_communicator.cpp, nccl_watchdog.cpp).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "smp/comm/communicator.h"

namespace smp::comm::nccl {

using Clock = std::chrono::steady_clock;

inline std::string error_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  }
  return text;
}

inline void check_cuda(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) throw CommError(what + ": CUDA error: " + cudaGetErrorString(status));
}

class Handles;

// A two-rank (or one-rank) NCCL communicator that remembers whether it was aborted. The watchdog aborts from its own
// thread, and ncclCommAbort frees the communicator: every call that touches `comm` holds `mutex`, and none is made
// after the abort.
class Handle {
 public:
  ncclComm_t comm = nullptr;

  Handle() = default;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  // Abort, never ncclCommDestroy: that waits for every operation issued, and after a failure (a model error, a
  // dead peer) a send whose receiver never came would make the exit hang.
  ~Handle() { abort(); }

  // Aborts this communicator alone; inside an NCCL group, NCCL reclaims it at the group's end. A failure aborts the
  // whole group instead (abort_group).
  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm != nullptr && !aborted_) {
      ncclCommAbort(comm);
      aborted_ = true;
    }
  }
  // Aborts every communicator of the group this one was added to (Handles::add), or this one when it has none.
  void abort_group();

  // Issues `call(comm)` (NCCL calls that enqueue work) and throws on an error it returns. The communicator may still
  // be busy with it (see wait_ready).
  template <typename Call>
  void enqueue(Call call, const std::string& what) {
    const ncclResult_t result = try_enqueue(call);
    if (result != ncclSuccess && result != ncclInProgress) fail(what + " failed: ", result);
  }
  // enqueue without failing: what NCCL returned (ncclInvalidUsage, and nothing called, once aborted). For calls
  // inside an NCCL group, where an abort would only be reclaimed at the group's end (see connect's first transfers).
  template <typename Call>
  ncclResult_t try_enqueue(Call call) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) return ncclInvalidUsage;
    return call(comm);
  }
  // Fails as a call that returned `result` does: the group aborted, a CommError thrown.
  [[noreturn]] void fail(const std::string& prefix, ncclResult_t result) {
    const std::string reason = describe(result);
    abort_group();
    throw CommError(prefix + reason);
  }
  // enqueue, then wait until the communicator can take the next call.
  template <typename Call>
  void issue(Call call, Clock::time_point deadline, const std::string& what) {
    enqueue(call, what);
    wait_ready(deadline, what);
  }

  // ncclSuccess, ncclInProgress, or the error NCCL reports for the communicator (ncclInvalidUsage once aborted).
  ncclResult_t state() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) return ncclInvalidUsage;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    return query != ncclSuccess ? query : state;
  }

  // What went wrong, for a state() that was neither success nor in progress.
  std::string describe(ncclResult_t state) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) return "the NCCL communicator was aborted after an earlier failure";
    return "NCCL: " + error_text(state, comm);
  }

  // A non-blocking communicator (every one is created so, that a member that never comes is timed out) may return
  // ncclInProgress, and must then be polled until it is ready for the next call; a blocking one is ready at once.
  void wait_ready(Clock::time_point deadline, const std::string& what) {
    while (true) {
      const ncclResult_t now = state();
      if (now == ncclSuccess) return;
      if (now != ncclInProgress) fail(what + " failed: ", now);
      if (Clock::now() > deadline) {
        abort_group();
        throw CommError(what + " timed out (NCCL); the group's communicators were aborted");
      }
      std::this_thread::yield();
    }
  }

 private:
  friend class Handles;
  std::mutex mutex_;
  bool aborted_ = false;
  std::weak_ptr<Handles> group_;
};

// Every NCCL communicator of a group. They fail together: ncclCommAbort waits for the kernels already queued on its
// communicator, and one can sit behind another communicator's stuck transfer (a channel's stream waits for the
// compute stream, which waits for received tensors), so aborted one at a time the first could wait forever. Inside
// one NCCL group every abort flag is raised before any communicator is reclaimed.
class Handles : public std::enable_shared_from_this<Handles> {
 public:
  void add(const std::shared_ptr<Handle>& handle) {
    std::lock_guard<std::mutex> guard(lock_);
    handle->group_ = weak_from_this();
    all_.push_back(handle);
  }
  void abort_all() {
    std::lock_guard<std::mutex> guard(lock_);
    ncclGroupStart();
    for (auto& handle : all_) handle->abort();
    ncclGroupEnd();
  }

 private:
  std::mutex lock_;
  std::vector<std::shared_ptr<Handle>> all_;
};

inline void Handle::abort_group() {
  if (const auto group = group_.lock()) {
    group->abort_all();
  } else {
    abort();
  }
}

// CUDA events cost a driver call to make and one to free: every transfer records two, so they are kept for reuse.
// A stream that waits on an event waits for what was recorded when it was told to, so an event can be recorded
// again as soon as nobody will query it.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  struct GiveBack {
    std::shared_ptr<EventPool> pool;
    void operator()(cudaEvent_t event) const { pool->give_back(event); }
  };
  using Event = std::unique_ptr<CUevent_st, GiveBack>;

  ~EventPool() {
    for (cudaEvent_t event : free_) cudaEventDestroy(event);
  }

  // An event recorded on `stream` now.
  Event record(cudaStream_t stream) {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        event = free_.back();
        free_.pop_back();
      }
    }
    if (event == nullptr) check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "creating a CUDA event");
    Event owned(event, GiveBack{shared_from_this()});
    check_cuda(cudaEventRecord(event, stream), "recording a CUDA event");
    return owned;
  }

 private:
  void give_back(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(event);
  }

  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// NCCL sends to itself only with the receive in the same group call.
inline ncclResult_t self_pair(ncclComm_t comm, const void* source, void* target, size_t count, ncclDataType_t type,
                              cudaStream_t stream) {
  const ncclResult_t started = ncclGroupStart();
  if (started != ncclSuccess) return started;
  const ncclResult_t sent = ncclSend(source, count, type, 0, comm, stream);
  const ncclResult_t received = ncclRecv(target, count, type, 0, comm, stream);
  const ncclResult_t ended = ncclGroupEnd();
  return sent != ncclSuccess ? sent : received != ncclSuccess ? received : ended;
}

// `stream` waits (on the GPU, not the host) for what `event` recorded.
inline void order_after(cudaStream_t stream, cudaEvent_t event) {
  check_cuda(cudaStreamWaitEvent(stream, event, 0), "ordering CUDA streams");
}

inline bool has_completed(cudaEvent_t event) {
  const cudaError_t status = cudaEventQuery(event);
  if (status == cudaErrorNotReady) return false;
  check_cuda(status, "waiting for a CUDA event");
  return true;
}

// Completion of one NCCL operation; for a self transfer, possibly not issued yet (see NcclCommunicator::pair_self).
struct Completion {
  std::shared_ptr<Handle> handle;
  std::shared_ptr<CUevent_st> done;  // null until the operation is issued; a self pair's two share one
};

// For an operation that has not completed: why it never will (its communicator's error, or `deadline` passed), or
// nothing while it still may.
inline std::optional<std::string> stalled(const Completion& operation, Clock::time_point deadline,
                                          const std::string& what) {
  const ncclResult_t state = operation.handle->state();
  if (state != ncclSuccess && state != ncclInProgress) return what + " failed: " + operation.handle->describe(state);
  if (Clock::now() > deadline) return what + " timed out (NCCL); the group's communicators were aborted";
  return std::nullopt;
}

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

}  // namespace smp::comm::nccl
