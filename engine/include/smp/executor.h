#pragma once
// Runs one rank's action list of a lowered schedule: the one engine loop every schedule goes through.
// It owns the per-microbatch activation stash and nothing else; what a stage computes is a callback.

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"
#include "smp/scheduler/schedule.h"

namespace smp {

using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
using StageForward = std::function<std::vector<at::Tensor>(int stage, const std::vector<at::Tensor>& inputs)>;

struct MicrobatchData {
  std::vector<at::Tensor> inputs;   // first-stage inputs, one per microbatch
  std::vector<at::Tensor> targets;  // last-stage targets, one per microbatch
  LossFunction loss;
};

struct ExecutorStats {
  double loss_sum = 0.0;  // sum over this rank's last-stage microbatches of loss / microbatches
  bool has_loss = false;  // this rank runs the last stage
  int peak_stashed_microbatches = 0;
};

class PipelineExecutor {
 public:
  // `schedule` must be lowered and validated; `pipeline` is the group whose rank i runs pipeline rank i.
  PipelineExecutor(sched::Schedule schedule, sched::StageGraph graph, comm::Communicator& pipeline);

  // Runs this rank's actions once. Gradients accumulate into the stage parameters' .grad, scaled so that the
  // sum over microbatches is the gradient of the mean loss over the replica's batch.
  ExecutorStats run(const StageForward& forward, const MicrobatchData& data);

  const sched::Schedule& schedule() const { return schedule_; }

 private:
  sched::Schedule schedule_;
  sched::StageGraph graph_;
  comm::Communicator& pipeline_;
  int last_stage_;
};

}  // namespace smp
