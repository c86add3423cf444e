#include "smp/device_speeds.h"

#include <algorithm>
#include <cstdio>

#include "training/timed_work.h"

namespace smp {

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
  std::snprintf(seconds, sizeof seconds, "%.9g", TimedMatrixWork(runtime.device()).fastest_seconds(9, slowdown));
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
