#pragma once
// Matrix work the size of a model's layers, timed on one rank's device: the device-speed probe (device_speeds.cpp)
// compares ranks by it, and the planner (planned_layout.cpp) measures with it how many processors a host's ranks get
// when they compute at once. Model-sized (on a CPU, 8 blocks of a d 256 MLP on 256 rows: 12 MB of weights, more than
// a core's caches), so that memory traffic and cache contention count as they will in training.

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace smp {

class TimedMatrixWork {
 public:
  explicit TimedMatrixWork(c10::Device device);
  // One pass, finished on the device when it returns.
  void run() const;
  // Seconds of one pass: the fastest of `rounds` after one untimed, each stretched by `slowdown` as an emulated slow
  // device's work is (emulate_slow_device). The fastest, not the median: on a busy host a round that the scheduler
  // preempts measures the host's other work (a rank emulating a device 3 times slower once measured as fast as its
  // peer beside another job).
  double fastest_seconds(int rounds, double slowdown = 1.0) const;

 private:
  std::vector<at::Tensor> up_, down_;
  at::Tensor rows_;
};

}  // namespace smp
