#pragma once
// Expert parallelism's parameters: a module holding this rank's share of a mixture-of-experts layer's experts says
// which of its tensors those are (as tp::Sharded modules name their shards). Their gradients are averaged over the
// replicas holding the same experts, and the gradient norm adds the shares of the expert-parallel group.

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace smp {

class ExpertShards {
 public:
  virtual ~ExpertShards() = default;
  virtual std::vector<at::Tensor> expert_parameters() const = 0;
};

// The expert shards of `module` and its submodules.
inline std::vector<at::Tensor> expert_parameters_in(torch::nn::Module& module) {
  std::vector<at::Tensor> parameters;
  for (const auto& child : module.modules()) {
    if (const auto* holder = dynamic_cast<const ExpertShards*>(child.get())) {
      for (auto& parameter : holder->expert_parameters()) parameters.push_back(std::move(parameter));
    }
  }
  return parameters;
}

}  // namespace smp
