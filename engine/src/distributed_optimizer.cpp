#include "smp/distributed_optimizer.h"

#include <cmath>

#include <ATen/ATen.h>

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

double DistributedOptimizer::clip_grad_norm(double max_norm) {
  // On the parameters' device: the pipeline group reduces it there (NCCL on a GPU).
  at::Tensor squares = at::zeros({1}, at::TensorOptions(at::kDouble).device(model_.runtime().device()));
  for (const auto& parameter : model_.norm_parameters()) {
    if (parameter.grad().defined()) squares += parameter.grad().to(at::kDouble).pow(2).sum();
  }
  // Replicas hold identical averaged gradients, so the pipeline group alone sees the whole model.
  model_.runtime().pipeline().all_reduce_sum(squares);
  const double norm = std::sqrt(squares.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    for (const auto& parameter : model_.parameters()) {
      if (parameter.grad().defined()) parameter.grad().mul_(scale);
    }
  }
  return norm;
}

}  // namespace smp
