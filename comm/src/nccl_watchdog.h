#pragma once
// Bounds the NCCL transfers whose completion the host does not wait for. A point-to-point wait() only orders the
// caller's stream after the transfer, so a peer that never sends (it died, or its program differs) would leave
// that stream, and the next host sync on it, blocked for good. The watchdog polls each such transfer from its own
// thread until it completes; when one fails or outlives its timeout it aborts the group's NCCL communicators, which
// ends their kernels and frees the blocked streams, and keeps the reason for the group's next call to throw.

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "nccl_primitives.h"

namespace smp::comm::nccl {

class Watchdog {
 public:
  // `abort_group` aborts every NCCL communicator of the group; it is called from the watchdog's thread, or from
  // wait_all's, without the watchdog's lock (others see the failure meanwhile). `device`: the group's GPU, which
  // the thread makes current (else querying an event would make a CUDA context on GPU 0 in every process).
  Watchdog(int device, std::function<void()> abort_group);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches an issued operation until it completes; `what` names it should it fail.
  void watch(std::shared_ptr<Completion> completion, Clock::time_point deadline, std::string what);
  // Waits on the host until every watched operation has completed; throws CommError on a failure, as later calls do.
  void wait_all();
  // Throws CommError when a watched operation has failed.
  void throw_if_failed();

 private:
  struct Watched {
    std::shared_ptr<Completion> completion;
    Clock::time_point deadline;
    std::string what;
  };
  void run();
  // Drops what completed; on an error or a timeout records the failure, stops watching, and returns true: the caller
  // then aborts the group, after releasing lock_. Needs lock_.
  bool sweep();
  bool fail(std::string reason);

  int device_;
  std::function<void()> abort_group_;
  std::mutex lock_;
  std::condition_variable wake_;
  std::vector<Watched> watched_;
  std::optional<std::string> failure_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace smp::comm::nccl
