#pragma once
// Activation checkpointing: work that drops a forward's activations and runs the forward again in backward.
// Whole stages (config "activation_checkpointing": true or stage indices) are recomputed by the executor; single
// modules ("activation_checkpointing": ["module", ...]) by checkpointed_forward, whose output's gradient function
// recomputes just that module. Either way the second run must equal the first: the same random numbers (dropout
// keeps the same units), the same autocast setting, and batch norm's running statistics updated once.

#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "pipeline/autocast_scope.h"
#include "model/random_state.h"
#include "smp/graph_model.h"

namespace smp {

// Around a forward run again: sets the random generators to what the first run drew from, and recomputing() on this
// thread; when it ends, puts the generators back as they were before it (the sequence goes on as if there had been
// no recompute) and `buffers` as the first run left them.
class RecomputeScope {
 public:
  RecomputeScope(const RandomState& first_run, const std::vector<at::Tensor>& buffers, c10::Device device);
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  RandomState before_;
  bool was_recomputing_;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;  // (live, as the first run left it)
};

// Runs `node` on `inputs` as a checkpointed module: no graph and nothing kept but the inputs; the output's
// gradient function recomputes the module and returns the gradients of the inputs and of the module's parameters
// (which accumulate into .grad as usual, hooks included). Without grad mode, or when nothing the module reads
// needs a gradient, it is just node.forward(inputs).
at::Tensor checkpointed_forward(const GraphModel::Node& node, const std::vector<at::Tensor>& inputs,
                                std::optional<AutocastSetting> autocast, c10::Device device);

}  // namespace smp
