#pragma once
// smp::DistributedOptimizer: any torch::optim optimizer over this rank's stage parameters, plus what needs the
// whole model: the global gradient norm across pipeline stages.

#include <memory>

#include <torch/optim/optimizer.h>

#include "smp/distributed_model.h"

namespace smp {

class DistributedOptimizer {
 public:
  // `optimizer` must have been built over model.parameters().
  DistributedOptimizer(DistributedModel& model, std::unique_ptr<torch::optim::Optimizer> optimizer);

  void zero_grad();
  void step();
  // Scales gradients so that the 2-norm over the whole model (all stages) is at most max_norm, as
  // torch::nn::utils::clip_grad_norm_ does on one process; returns the norm before clipping.
  double clip_grad_norm(double max_norm);

  torch::optim::Optimizer& local() { return *optimizer_; }

 private:
  DistributedModel& model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

}  // namespace smp
