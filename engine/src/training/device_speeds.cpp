#include "smp/device_speeds.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <ATen/ATen.h>

#include "smp/executor.h"

namespace smp {
namespace {

// Seconds for a fixed amount of matrix products on the rank's device: the fastest of 9 rounds after one untimed.
// The fastest, not the median: on a busy host a round of a few milliseconds that the scheduler preempts measures the
// host's other work (a rank emulating a device 3 times slower measured as fast as its peer beside another job).
double probe_seconds(c10::Device device, double slowdown) {
  const int64_t size = device.is_cpu() ? 192 : 2048;
  constexpr int kProductsPerRound = 8, kRounds = 10;
  const at::Tensor a = at::randn({size, size}, at::TensorOptions().device(device));
  std::vector<double> rounds;
  for (int round = 0; round < kRounds; ++round) {
    const auto start = std::chrono::steady_clock::now();
    at::Tensor product = a;
    for (int i = 0; i < kProductsPerRound; ++i) product = at::matmul(product, a).tanh_();
    (void)product.sum().item<double>();  // waits for a GPU's kernels
    const double busy = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    emulate_slow_device(busy, slowdown);
    if (round > 0) rounds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return *std::min_element(rounds.begin(), rounds.end());
}

}  // namespace

std::vector<double> device_speeds(Runtime& runtime, const std::string& exchange) {
  const Config& config = runtime.config();
  if (!config.measure_device_speeds) return config.device_speeds;
  if (runtime.measured_device_speeds()) return *runtime.measured_device_speeds();
  const int world = runtime.world_size(), me = runtime.rank();
  // Every rank measures at once, as the job will compute: first a barrier through the store.
  runtime.publish(exchange + "speed_probe/" + std::to_string(me), "");
  for (int rank = 0; rank < world; ++rank) runtime.fetch(exchange + "speed_probe/" + std::to_string(rank));
  const double slowdown = config.emulated_slowdown.empty() ? 1.0 : config.emulated_slowdown.at(static_cast<std::size_t>(me));
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.9g", probe_seconds(runtime.device(), slowdown));
  runtime.publish(exchange + "speed/" + std::to_string(me), seconds);
  std::vector<double> speeds;
  for (int rank = 0; rank < world; ++rank) speeds.push_back(1.0 / std::stod(runtime.fetch(exchange + "speed/" + std::to_string(rank))));
  const double fastest = *std::max_element(speeds.begin(), speeds.end());
  for (double& speed : speeds) {
    speed /= fastest;
    if (speed >= 0.9) speed = 1.0;
  }
  runtime.remember_device_speeds(speeds);
  return speeds;
}

}  // namespace smp
