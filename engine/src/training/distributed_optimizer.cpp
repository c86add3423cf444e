#include "smp/distributed_optimizer.h"

#include <torch/optim/lbfgs.h>

namespace smp {

DistributedOptimizer::DistributedOptimizer(DistributedModel& model, std::unique_ptr<torch::optim::Optimizer> optimizer)
    : model_(model), optimizer_(std::move(optimizer)) {
  std::size_t count = 0;
  for (const auto& group : optimizer_->param_groups()) {
    count += group.params().size();
    built_param_groups_.push_back(group.params());
  }
  if (count != model_.parameters().size()) {
    throw ConfigError("DistributedOptimizer: the optimizer holds " + std::to_string(count) +
                      " parameters but this rank's stage has " + std::to_string(model_.parameters().size()) +
                      "; build it over model.parameters()");
  }
  if (model_.optimizer_state_shards() > 1) {
    // Its state is kept per parameter from the first step on: dropping the others now means none is ever made.
    if (!optimizer_->state().empty()) {
      throw ConfigError("DistributedOptimizer: with \"shard_optimizer_state\" the optimizer must not have stepped "
                        "yet (it already holds state for every parameter); wrap it right after building it");
    }
    if (dynamic_cast<torch::optim::LBFGS*>(optimizer_.get()) != nullptr) {
      throw ConfigError("DistributedOptimizer: LBFGS cannot have its state sharded (it needs every parameter and a "
                        "closure); leave \"shard_optimizer_state\" off");
    }
    // Groups keep their places (possibly empty), so that checkpoints of the state line up group by group.
    for (auto& group : optimizer_->param_groups()) {
      std::vector<at::Tensor> kept;
      for (const auto& parameter : group.params()) {
        if (model_.updates_parameter(parameter)) kept.push_back(parameter);
      }
      group.params() = std::move(kept);
    }
  }
}

void DistributedOptimizer::zero_grad() { model_.zero_grad(); }

void DistributedOptimizer::step() {
  Runtime& runtime = model_.runtime();
  runtime.refuse_after_leaving("DistributedOptimizer::step");
  // A skipped step must not move the weights: even zero gradients would, through momentum. Nor may the train_steps
  // accumulated after one step on their part of the gradient.
  const bool dropped = model_.gradients_dropped();
  model_.forget_dropped_gradients();
  if (dropped) return;
  // A rank whose update failed holds other weights than its replicas (and, with sharded state, leaves them
  // waiting for its shares).
  runtime.with_peers("the optimizer's step", [&] {
    optimizer_->step();
    model_.share_updated_parameters();
  });
}

double DistributedOptimizer::clip_grad_norm(double max_norm) {
  Runtime& runtime = model_.runtime();
  runtime.refuse_after_leaving("DistributedOptimizer::clip_grad_norm");
  double norm = 0.0;
  runtime.with_peers("clip_grad_norm", [&] { norm = model_.clip_grad_norm(max_norm); });
  return norm;
}

}  // namespace smp
