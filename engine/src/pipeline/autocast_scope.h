#pragma once
// Mixed precision for the forwards a stage runs (config bf16 / fp16): autocast on the tensors' device type for as
// long as the scope lives, nested scopes and the previous state respected.

#include <optional>

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "smp/config.h"

namespace smp {

struct AutocastSetting {
  c10::DeviceType device;
  at::ScalarType dtype;
};

// The autocast a job's stages compute under: the config's bf16 or fp16 on its device; none in float32.
inline std::optional<AutocastSetting> stage_precision(const Config& config, c10::Device device) {
  if (!config.bf16 && !config.fp16) return std::nullopt;
  return AutocastSetting{device.type(), config.bf16 ? at::kBFloat16 : at::kHalf};
}

class AutocastScope {
 public:
  explicit AutocastScope(AutocastSetting setting)
      : device_(setting.device),
        was_enabled_(at::autocast::is_autocast_enabled(setting.device)),
        previous_dtype_(at::autocast::get_autocast_dtype(setting.device)) {
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, setting.dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, previous_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  at::ScalarType previous_dtype_;
};

}  // namespace smp
