#pragma once
// smp::DistributedModel: wraps a chain model, keeps on this rank only its pipeline stage's modules, and runs
// training steps across the pipeline and the data-parallel replicas.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include "smp/executor.h"
#include "smp/runtime.h"
#include "smp/stage_plan.h"

namespace smp {

struct StepOutput {
  double loss = 0.0;     // mean loss over the global batch, the same on every rank
  double seconds = 0.0;  // wall time of the step on this rank
  int peak_stashed_microbatches = 0;
};

class DistributedModel {
 public:
  // Every rank must build `model` the same way (same seed) so that each stage starts from the weights
  // single-process training would have. `sample_input` is one microbatch of first-stage input: rank 0 profiles
  // the modules on it and publishes the partition, so that all ranks agree.
  DistributedModel(std::shared_ptr<Runtime> runtime, torch::nn::Sequential model, const at::Tensor& sample_input);

  // One step on this replica's share of the global batch (Runtime::replica_slice): split into microbatches,
  // run the pipeline schedule, average gradients over replicas. Gradients accumulate into .grad (clear them
  // with DistributedOptimizer::zero_grad). Every rank passes the batch; only the first stage reads `inputs`
  // and only the last reads `targets`.
  StepOutput train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss);

  // This rank's parameters, named as in the full model (e.g. "3.weight").
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_parameters_; }
  std::vector<at::Tensor> parameters() const;
  const StagePlan& plan() const { return plan_; }
  int stage() const { return runtime_->pp_rank(); }
  Runtime& runtime() { return *runtime_; }

 private:
  void average_gradients_over_replicas();

  std::shared_ptr<Runtime> runtime_;
  StagePlan plan_;
  torch::nn::Sequential stage_modules_;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters_;
  std::unique_ptr<PipelineExecutor> executor_;
  long long step_ = 0;  // steps run so far, for error messages
};

}  // namespace smp
