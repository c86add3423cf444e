#pragma once
// A group with a second communicator over the same members, for collectives issued from two threads at once: a
// pipeline's overlapped forward and backward (config "overlap_forward_backward") each post the collectives inside
// their compute (tensor parallelism's, expert parallelism's all-to-all) in their own order, and one communicator
// would match one thread's call on this rank with the other thread's on a peer. A thread marked with SecondLane
// uses the second communicator; every other thread the first. Every member marks the same computations.

#include <memory>

#include "smp/comm/communicator.h"

namespace smp::comm {

// While one lives, this thread's collectives on laned groups go over their second communicator.
class SecondLane {
 public:
  SecondLane();
  ~SecondLane();
  SecondLane(const SecondLane&) = delete;
  SecondLane& operator=(const SecondLane&) = delete;

 private:
  bool before_;
};
bool on_second_lane();

// `first` and `second`: communicators of the same members in the same order.
std::shared_ptr<Communicator> make_laned(std::shared_ptr<Communicator> first, std::shared_ptr<Communicator> second);

}  // namespace smp::comm
