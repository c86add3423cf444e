#pragma once
// Devices that differ: each rank's relative compute speed for the partition (config "device_speeds"), given or
// measured at start-up.

#include <string>
#include <vector>

#include "smp/runtime.h"

namespace smp {

// Collective over the world (every rank calls it at the same point, with the same `exchange` prefix of store keys).
// Per rank, its relative speed (the fastest 1): config.device_speeds, or with "measure" the same matrix products
// timed on every rank at once, each rank's stretched by its emulated_slowdown. Empty when the config gives neither.
// Measured speeds within 10% of the fastest count as equal to it: a shared host's noise must not move the cut.
// Measured once per job (Runtime::remember_device_speeds): a later call returns them without measuring.
std::vector<double> device_speeds(Runtime& runtime, const std::string& exchange);

}  // namespace smp
