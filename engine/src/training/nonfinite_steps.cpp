#include "training/nonfinite_steps.h"

#include <cmath>
#include <cstdio>

#include "smp/errors.h"
#include "smp/log.h"

namespace smp {

bool skips_step(const Config& config, long long step, double loss, const std::string& nonfinite_ranks,
                LossScaler& scaler, bool logs) {
  const bool loss_finite = std::isfinite(loss);
  if (loss_finite && nonfinite_ranks.empty()) {
    scaler.stepped();
    return false;
  }
  if (config.fp16 && loss_finite) {
    scaler.overflowed();
    if (logs) {
      char scale[32];
      std::snprintf(scale, sizeof scale, "%g", scaler.scale());
      log::info("step " + std::to_string(step) + ": fp16 gradients overflowed; skipping the step, loss scale now " +
                scale);
    }
    return true;
  }
  const std::string what = "step " + std::to_string(step) + ": " +
                           (!loss_finite ? "the loss is " + std::to_string(loss) : std::string()) +
                           (!loss_finite && !nonfinite_ranks.empty() ? "; " : "") +
                           (nonfinite_ranks.empty() ? "" : "non-finite gradients on " + nonfinite_ranks);
  // A mean over no elements is the usual NaN loss of a step whose inputs are fine: say it before offering to skip.
  const std::string empty_mean = !loss_finite && std::isnan(loss)
                                     ? "; if a microbatch's loss is a mean over no elements (every label ignored, -100), "
                                       "it is NaN: weigh tokens over the global batch instead (the README's token-weighted loss)"
                                     : "";
  if (!config.skip_nonfinite_steps) {
    throw NonFiniteError(what + empty_mean + " (set \"nonfinite\": \"skip\" to skip such steps)");
  }
  if (logs) log::warn(what + "; skipping the step");
  return true;
}

}  // namespace smp
