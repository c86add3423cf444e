#include "smp/distributed_optimizer.h"

namespace smp {

DistributedOptimizer::DistributedOptimizer(DistributedModel& model, std::unique_ptr<torch::optim::Optimizer> optimizer)
    : model_(model), optimizer_(std::move(optimizer)) {
  std::size_t count = 0;
  for (const auto& group : optimizer_->param_groups()) count += group.params().size();
  if (count != model_.parameters().size()) {
    throw ConfigError("DistributedOptimizer: the optimizer holds " + std::to_string(count) +
                      " parameters but this rank's stage has " + std::to_string(model_.parameters().size()) +
                      "; build it over model.parameters()");
  }
}

void DistributedOptimizer::zero_grad() { optimizer_->zero_grad(); }

void DistributedOptimizer::step() {
  // A skipped step must not move the weights: even zero gradients would, through momentum.
  if (!model_.last_step_skipped()) optimizer_->step();
}

double DistributedOptimizer::clip_grad_norm(double max_norm) { return model_.clip_grad_norm(max_norm); }

}  // namespace smp
