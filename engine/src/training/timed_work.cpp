#include "training/timed_work.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "smp/executor.h"

namespace smp {

TimedMatrixWork::TimedMatrixWork(c10::Device device) {
  // A GPU gets layers of its own scale: at a CPU's sizes it would time its kernel launches.
  const int64_t width = device.is_cpu() ? 256 : 1024, hidden = device.is_cpu() ? 688 : 2752;
  const int64_t rows = device.is_cpu() ? 256 : 2048;
  // Drawn from a generator of its own: measuring must not move the job's random numbers (its initialization, dropout).
  auto generator = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/7);
  const auto draw = [&](int64_t height, int64_t breadth, double scale) {
    return (at::rand({height, breadth}, generator) / scale).to(device);
  };
  for (int block = 0; block < 8; ++block) {
    up_.push_back(draw(width, hidden, width / 16.0));
    down_.push_back(draw(hidden, width, hidden / 26.0));
  }
  rows_ = draw(rows, width, 1.0);
}

void TimedMatrixWork::run() const {
  at::Tensor state = rows_;
  for (std::size_t block = 0; block < up_.size(); ++block) state = at::mm(at::silu(at::mm(state, up_[block])), down_[block]);
  (void)state.sum().item<double>();  // waits for a GPU's kernels
}

double TimedMatrixWork::fastest_seconds(int rounds, double slowdown) const {
  using Clock = std::chrono::steady_clock;
  run();  // warm
  double fastest = std::numeric_limits<double>::infinity();
  for (int round = 0; round < rounds; ++round) {
    const auto start = Clock::now();
    run();
    emulate_slow_device(std::chrono::duration<double>(Clock::now() - start).count(), slowdown);
    fastest = std::min(fastest, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return fastest;
}

}  // namespace smp
