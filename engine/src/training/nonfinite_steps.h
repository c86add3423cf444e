#pragma once
// What a training step whose loss or gradients are not finite does (DistributedModel::train_step asks once the
// world has summed the loss and every rank has said whether its gradients are finite).

#include <string>

#include "smp/config.h"
#include "training/loss_scaler.h"

namespace smp {

// Under fp16 with a finite loss, non-finite gradients are the loss scale overflowing, not a broken model: the scale
// halves and the step is skipped. Anything else non-finite stops the job with NonFiniteError naming the step and the
// ranks, unless the config says "nonfinite": "skip", which skips the step. `nonfinite_ranks` names the ranks whose
// gradients were not finite (empty: none). Returns whether the step is skipped (its gradients are then to be
// zeroed); a step taken counts toward the scale's growth. Rank 0 logs what it did (`logs`).
bool skips_step(const Config& config, long long step, double loss, const std::string& nonfinite_ranks,
                LossScaler& scaler, bool logs);

}  // namespace smp
