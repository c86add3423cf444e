#pragma once
// What CPU tensors hold: the bytes allocated through LibTorch's CPU allocator while a meter exists and not yet
// freed, and their peak. The profile measures what a module's forward keeps for its backward with it, the
// planner's benchmark a training step's memory beside its prediction.

#include <cstdint>

namespace smp {

class CpuTensorMeter {
 public:
  // Installs the counting allocator (nested or concurrent meters share the outermost installation; tensors
  // allocated before are not counted, and memory counted may outlive the meter).
  CpuTensorMeter();
  ~CpuTensorMeter();
  CpuTensorMeter(const CpuTensorMeter&) = delete;
  CpuTensorMeter& operator=(const CpuTensorMeter&) = delete;

  std::int64_t live_bytes() const;
  std::int64_t peak_bytes() const;  // the most live at once since the first meter or the last reset_peak
  void reset_peak();
};

}  // namespace smp
