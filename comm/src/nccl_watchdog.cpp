#include "nccl_watchdog.h"

namespace smp::comm::nccl {
namespace {
// A timeout is seconds to minutes, and NCCL reports a failed peer within its own timeouts: polling each watched
// transfer every few milliseconds costs nothing that matters and notices soon enough.
constexpr auto kPollInterval = std::chrono::milliseconds(5);
}  // namespace

Watchdog::Watchdog(int device, std::function<void()> abort_group)
    : device_(device), abort_group_(std::move(abort_group)), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> guard(lock_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::watch(std::shared_ptr<Completion> completion, Clock::time_point deadline, std::string what) {
  bool was_idle;
  {
    std::lock_guard<std::mutex> guard(lock_);
    if (failure_) throw CommError(*failure_);
    was_idle = watched_.empty();
    watched_.push_back({std::move(completion), deadline, std::move(what)});
  }
  if (was_idle) wake_.notify_one();
}

void Watchdog::wait_all() {
  while (true) {
    std::string failure;
    bool failed_now = false;
    {
      std::lock_guard<std::mutex> guard(lock_);
      failed_now = sweep();
      if (failure_) {
        failure = *failure_;
      } else if (watched_.empty()) {
        return;
      }
    }
    if (failed_now) abort_group_();
    if (!failure.empty()) throw CommError(failure);
    std::this_thread::yield();
  }
}

void Watchdog::throw_if_failed() {
  std::lock_guard<std::mutex> guard(lock_);
  if (failure_) throw CommError(*failure_);
}

void Watchdog::run() {
  const bool on_device = cudaSetDevice(device_) == cudaSuccess;
  std::unique_lock<std::mutex> guard(lock_);
  if (!on_device) fail("the NCCL watchdog could not use GPU " + std::to_string(device_));
  while (!stopping_) {
    if (watched_.empty() || failure_) {
      wake_.wait(guard);
      continue;
    }
    if (sweep()) {
      guard.unlock();
      abort_group_();
      guard.lock();
      continue;
    }
    wake_.wait_for(guard, kPollInterval);
  }
}

bool Watchdog::sweep() {
  if (failure_) return false;
  try {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < watched_.size(); ++i) {
      Watched& entry = watched_[i];
      if (has_completed(entry.completion->done.get())) continue;
      if (auto failure = stalled(*entry.completion, entry.deadline, entry.what)) return fail(std::move(*failure));
      if (kept != i) watched_[kept] = std::move(entry);
      ++kept;
    }
    watched_.resize(kept);
  } catch (const CommError& error) {  // a CUDA error while querying
    return fail(error.what());
  }
  return false;
}

bool Watchdog::fail(std::string reason) {
  failure_ = std::move(reason);
  watched_.clear();
  return true;
}

}  // namespace smp::comm::nccl
