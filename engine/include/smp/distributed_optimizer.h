#pragma once
// smp::DistributedOptimizer: any torch::optim optimizer over this rank's stage parameters, plus what needs the
// whole model: the global gradient norm across pipeline stages, and, with "shard_optimizer_state", the share of
// the parameters this replica updates (the optimizer is left holding only those) and the exchange of the
// updated parameters after each step.

#include <memory>
#include <vector>

#include <torch/optim/optimizer.h>

#include "smp/distributed_model.h"

namespace smp {

class DistributedOptimizer {
 public:
  // `optimizer` must have been built over model.parameters(), and not have stepped yet when the state is sharded.
  DistributedOptimizer(DistributedModel& model, std::unique_ptr<torch::optim::Optimizer> optimizer);

  void zero_grad();  // every parameter's gradient (DistributedModel::zero_grad)
  void step();
  // DistributedModel::clip_grad_norm: the global gradient norm over all stages, clipped to max_norm.
  double clip_grad_norm(double max_norm);

  // The wrapped optimizer, for its options and state. With sharded state it holds only this replica's parameters:
  // step and zero_grad must then go through this class (its own step would not share the updates, its own zero_grad
  // would leave the other parameters' gradients to pile up).
  torch::optim::Optimizer& local() { return *optimizer_; }
  DistributedModel& model() { return model_; }
  // Each group's parameters as the optimizer was built with them, before sharding kept this replica's share.
  const std::vector<std::vector<at::Tensor>>& built_param_groups() const { return built_param_groups_; }

 private:
  DistributedModel& model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<std::vector<at::Tensor>> built_param_groups_;
};

}  // namespace smp
