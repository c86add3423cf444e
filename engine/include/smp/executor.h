#pragma once
// Runs one rank's action list of a lowered schedule: the one engine loop every schedule goes through.
// It owns the per-microbatch activation stash and the action timeline; what a stage computes is a callback.

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"
#include "smp/comm/tensor_transfer.h"
#include "smp/scheduler/schedule.h"
#include "smp/timeline.h"

namespace smp {

using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
// The general form, for models with several outputs (GraphModel::output_names, in that order) or a loss computed by
// the model itself: `target` is undefined when the step has no targets.
using OutputsLossFunction = std::function<at::Tensor(const std::vector<at::Tensor>& outputs, const at::Tensor& target)>;

// True on the thread running a checkpointed stage's or module's forward again for its backward (RecomputeScope): a
// module's own counters (tokens routed per expert) count each microbatch's forward once.
bool recomputing();

// One microbatch of the model's inputs, in GraphModel::input_names() order.
using ModelInputs = std::vector<at::Tensor>;

// Tensors exchanged between stages, keyed by the stage at the other end.
using TensorsByStage = std::map<int, std::vector<at::Tensor>>;

struct StageOutputs {
  TensorsByStage to_consumers;  // what each consumer stage receives
  std::vector<at::Tensor> model_outputs;  // set by the stage that holds the model's outputs (the last stage)
};

struct StageCallbacks {
  // Runs `stage` on the tensors received from each producer stage and, where the stage reads them, the model's
  // inputs for this microbatch.
  std::function<StageOutputs(int stage, const ModelInputs& model_inputs, const TensorsByStage& from_producers)> forward;
  std::function<std::vector<at::Tensor>(int stage)> parameters;  // what W (weight gradients) differentiates
  // The stage's buffers (batch norm's running statistics): a checkpointed stage's recompute puts them back as the
  // forward left them, so that they are updated once per microbatch, as without checkpointing.
  std::function<std::vector<at::Tensor>(int stage)> buffers;
  // When set, called at the end of every action, so that its timeline event spans the device's work and not only
  // the host's (GPU kernels run asynchronously); used on the traced step only.
  std::function<void()> synchronize;
  // config.emulated_slowdown's factor for this rank: every compute action is stretched by it.
  double emulated_slowdown = 1.0;
};

// A slow device emulated on a fast one (config.emulated_slowdown): after `busy_seconds` of work, sleeps
// (factor - 1) times as long.
void emulate_slow_device(double busy_seconds, double factor);

struct MicrobatchData {
  std::vector<ModelInputs> inputs;  // the model's inputs, one set per microbatch
  std::vector<at::Tensor> targets;  // last-stage targets, one per microbatch, or none (the loss gets undefined)
  OutputsLossFunction loss;
  double loss_scale = 1.0;  // fp16: backward starts from loss * scale; the reported loss is unscaled
  bool keep_outputs = false;  // ExecutorStats::outputs
  // Per microbatch, what its loss counts for in the step (the replica's share of the global batch's mean: its
  // samples over the global batch's, times the replicas, whose gradients are averaged); empty: 1/microbatches each.
  std::vector<double> loss_weights;
  // Their sizes differ (a batch that does not split evenly): kept outputs are then joined once the last arrives.
  bool uneven = false;
  // The program call these microbatches are of and their batch's signature, carried by every transfer (ProgramCall;
  // the DistributedModel sets them, unchecked by default).
  comm::TransferStamp stamp;
};

struct ExecutorStats {
  double loss_sum = 0.0;  // sum over this rank's last-stage microbatches of loss times its weight (loss_weights)
  bool has_loss = false;  // this rank runs the last stage
  int peak_stashed_microbatches = 0;  // (stage, microbatch) pairs holding activations at once
  int sends_posted = 0;               // to other ranks
  int sends_released_early = 0;       // sends proven delivered, and their tensors dropped, before the step's end
  int peak_sends_held = 0;            // the most posted sends whose tensors this rank held at once
  int forwards_overlapped = 0;        // forwards run beside a backward (overlap_forward_backward)
  std::vector<TimelineEvent> events;  // every action, in execution order
  // keep_outputs, on the last stage's rank: per model output, the microbatches' values, detached, in order in one
  // tensor (joined along the first dimension; a 0-dim output per microbatch gives one value per microbatch).
  std::vector<at::Tensor> outputs;
};

class PipelineExecutor {
 public:
  // `schedule` must be lowered and validated; `pipeline` is the group whose rank i runs pipeline rank i.
  // Stages in `checkpointed_stages` keep only their inputs after forward and recompute in backward.
  // With `overlap_forward_backward`, a forward and the backward the schedule puts right after it run at once
  // (sched::overlapped_pairs), the forward on a second thread whose in-compute collectives use their groups'
  // second communicators (laned_communicator.h).
  PipelineExecutor(sched::Schedule schedule, sched::StageGraph graph, comm::Communicator& pipeline,
                   std::vector<int> checkpointed_stages = {}, bool overlap_forward_backward = false);

  // Runs this rank's actions once. A forward_only schedule (evaluation) builds no graphs and keeps nothing past
  // its sends; otherwise gradients accumulate into the stage parameters' .grad, each microbatch's scaled by its
  // loss weight (MicrobatchData::loss_weights).
  ExecutorStats run(const StageCallbacks& stages, const MicrobatchData& data);

  const sched::Schedule& schedule() const { return schedule_; }

 private:
  class Step;  // one run of the action list (executor.cpp)

  sched::Schedule schedule_;
  sched::StageGraph graph_;
  comm::Communicator& pipeline_;
  std::vector<bool> checkpointed_;
  int last_stage_;
  // In-order transports only: per peer, this rank's receives from it in the peer's send order.
  std::map<int, std::vector<std::size_t>> receive_order_;
  // Per receive: the sends it proves delivered (sched::sends_delivered_by_receive).
  std::map<std::size_t, std::vector<std::size_t>> delivered_by_receive_;
  std::map<std::size_t, sched::OverlapWindow> overlapped_;  // by the forward's index
  // Evaluation: this rank may wait for its oldest send instead of holding every one until the step's end.
  bool wait_for_oldest_send_ = false;
  // Each transfer's layout as of its last step, at both ends: receives are posted ahead in it.
  comm::TransferLayouts layouts_;
};

}  // namespace smp
