#pragma once
// smp::DistributedModel: wraps a model (a GraphModel, or a Sequential chain), keeps on this rank only the modules
// of its pipeline stages, and runs training steps across the pipeline and the data-parallel replicas.

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include "smp/checkpoint_files.h"
#include "smp/checkpoint_manifest.h"
#include "smp/errors.h"
#include "smp/executor.h"
#include "smp/graph_model.h"
#include "smp/optimizer_shards.h"
#include "smp/planned_layout.h"
#include "smp/runtime.h"
#include "smp/stage_plan.h"
#include "smp/stage_program.h"

namespace smp {

// A global batch whose share a replica is given (DistributedModel::next_call_takes_share_of).
struct GlobalBatch {
  ModelInputs inputs;
  at::Tensor targets;
  std::vector<bool> batched;
};

// What a step's loss function returns for a microbatch, and so how the step weighs it.
enum class LossReduction {
  // The mean over the microbatch's samples: each counts by its share of the global batch's samples (1 /
  // (microbatches x replicas) where the batch splits evenly), so that the step's loss is the global batch's mean.
  kMean,
  // The microbatch's part of the global batch's loss (a sum over its tokens divided by the global batch's count of
  // them): the step adds the microbatches' parts.
  kSum,
};

struct StepOutput {
  double loss = 0.0;     // mean loss over the global batch, the same on every rank
  bool skipped = false;  // non-finite loss or gradients with "nonfinite": "skip": gradients were zeroed
  double seconds = 0.0;  // wall time of the step on this rank
  int peak_stashed_microbatches = 0;
  int sends_posted = 0;          // to other ranks
  int sends_released_early = 0;  // sends proven delivered, whose tensors this rank dropped before the step's end
  int peak_sends_held = 0;       // the most sends whose tensors this rank held at once
  int forwards_overlapped = 0;   // forwards run beside a backward ("overlap_forward_backward")
  // Data parallelism: gradient buckets of this rank, and how many of them were all-reduced while backward still
  // ran (the rest waited for its end: parameters without a gradient).
  int gradient_buckets = 0;
  int buckets_overlapped = 0;
  // With keep_outputs, on the rank that runs the last stage: the model's outputs for this replica's share of the
  // batch, in its order, detached, on the stage's device (float32 under bf16/fp16), undefined on every other rank.
  // The microbatches' outputs are joined along their first dimension, which must be the batch's; a model whose
  // output per microbatch is a 0-dim tensor gets one value per microbatch. A step dropped for non-finite values
  // keeps its outputs too. `outputs` is the model's first output, `all_outputs` every one
  // (GraphModel::output_names order; empty on the other ranks).
  at::Tensor outputs;
  std::vector<at::Tensor> all_outputs;
};

class GradientSync;
class LossScaler;
class ModelRandomStream;

// Whether a model takes the checkpoint that the config's "resume" finds. kNever: a job's other model, which its
// Checkpointer does not save (a frozen teacher, a DPO reference built from pretrained weights), and which would
// otherwise be refused as another model than the checkpoint's.
enum class Resume { kAsConfigured, kNever };

class DistributedModel {
 public:
  // Every rank must build `model` the same way (same seed) so that each stage starts from the weights
  // single-process training would have. `sample_input` is one microbatch of model input: rank 0 profiles the
  // modules on it and publishes the partition, so that all ranks agree.
  DistributedModel(std::shared_ptr<Runtime> runtime, GraphModel model, const at::Tensor& sample_input,
                   Resume resume = Resume::kAsConfigured);
  // A model of several inputs: `sample` holds one microbatch of each, in GraphModel::input_names() order.
  // `materialize`, when given, is called once the partition is known, before this rank's parameters are collected
  // and moved to its device, with the nodes this rank runs: a model built on the meta device makes their tensors
  // real there (and may rebuild any node's module: GraphModel::replace_module).
  using MaterializeNodes = std::function<void(GraphModel& model, const std::vector<int>& local_nodes)>;
  DistributedModel(std::shared_ptr<Runtime> runtime, GraphModel model, const ModelInputs& sample,
                   const MaterializeNodes& materialize = {}, Resume resume = Resume::kAsConfigured);
  DistributedModel(std::shared_ptr<Runtime> runtime, const torch::nn::Sequential& model, const at::Tensor& sample_input,
                   Resume resume = Resume::kAsConfigured);
  // A model whose smp::tp layers are built over a group, given as its builder: with "tensor_parallel_degree": "auto"
  // (with_planned_layout) the planner builds it for each degree and the chosen layout's, once adopted, is built
  // over Runtime::tensor_parallel_group(); otherwise the same as building it over that group and passing it.
  DistributedModel(std::shared_ptr<Runtime> runtime, const ModelBuilder& build, const ModelInputs& sample,
                   const MaterializeNodes& materialize = {}, Resume resume = Resume::kAsConfigured);
  ~DistributedModel();

  // One step on this replica's share of the global batch (Runtime::replica_slice): split into microbatches,
  // run the pipeline schedule, average gradients over replicas. Gradients accumulate into .grad (clear them
  // with DistributedOptimizer::zero_grad). Every rank passes the batch; only the first stage reads `inputs`
  // and only the last reads `targets`. keep_outputs: StepOutput::outputs holds the model's outputs (for metrics such
  // as accuracy; they stay in memory until the caller drops them).
  StepOutput train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss,
                        bool keep_outputs = false);
  // The mean loss over the global batch without gradients (validation): the training schedule's forwards alone,
  // keeping nothing for a backward, with this rank's modules in eval mode (dropout off, batch norm on its running
  // statistics) and back in their own mode after. Called like train_step, by every rank; .grad, the parameters
  // and the buffers stay as they are. Fills StepOutput's loss, seconds, send counts and, with keep_outputs, outputs.
  StepOutput evaluate(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss,
                      bool keep_outputs = false);
  // The general forms, for models of several inputs or outputs. `inputs` in GraphModel::input_names() order: a
  // tensor whose first dimension is the batch's (that of `targets`, or without targets of the first input with a
  // dimension) is split into microbatches; any other (undefined, 0-dim, or another first dimension: a position
  // table of one row, a flag) goes to every microbatch as it is. `targets` may be undefined (a loss the model
  // computes itself); `loss` gets the model's outputs in GraphModel::output_names() order.
  // `batched`, when given, says which inputs are split (decided on the global batch by a caller that passes a
  // replica's share: a share's size can match an input that is not the batch's).
  // `reduction` says what the loss function returns (LossReduction).
  StepOutput train_step(const ModelInputs& inputs, const at::Tensor& targets, const OutputsLossFunction& loss,
                        bool keep_outputs = false, const std::vector<bool>& batched = {},
                        LossReduction reduction = LossReduction::kMean);
  StepOutput evaluate(const ModelInputs& inputs, const at::Tensor& targets, const OutputsLossFunction& loss,
                      bool keep_outputs = false, const std::vector<bool>& batched = {},
                      LossReduction reduction = LossReduction::kMean);
  // The same with the inputs by name; every model input must be there, and nothing else.
  StepOutput train_step(const std::map<std::string, at::Tensor>& inputs, const at::Tensor& targets,
                        const OutputsLossFunction& loss, bool keep_outputs = false);
  StepOutput evaluate(const std::map<std::string, at::Tensor>& inputs, const at::Tensor& targets,
                      const OutputsLossFunction& loss, bool keep_outputs = false);
  // Which of a step's inputs are split into microbatches (the rest goes to every microbatch), by the rule above.
  // ConfigError (after `caller`) for targets whose rows no input has.
  static std::vector<bool> batched_inputs(const ModelInputs& inputs, const at::Tensor& targets,
                                          const char* caller = "train_step");
  const GraphModel& model() const { return model_; }

  // Copies this rank's parameters and buffers, by name, from a full-model file (export_checkpoint) or from
  // safetensors (a .safetensors file, or a directory with model.safetensors or shards and their index, as
  // from_pretrained reads them; only this rank's tensors are read): a model trained under another partitioning,
  // pretrained weights, or for inference. Every name and shape is checked before anything is copied:
  // CheckpointError names a missing or mis-shaped tensor and its file.
  void load_parameters(const std::string& path);
  // `left_in_place`: parameters the source does not hold, kept as they are (a checkpoint without the frozen ones).
  void load_state(const TensorSource& source, const std::set<std::string>& left_in_place = {});
  // Of named_parameters(), those frozen (requires_grad false) when the model was built, which they stay.
  std::vector<std::string> frozen_parameter_names() const;
  // The checkpoint this model took its partition from (config "resume"), for Checkpointer::resume.
  const std::optional<FoundCheckpoint>& resumed_from() const { return resumed_from_; }
  // Built with Resume::kNever: no Checkpointer saves it.
  bool never_resumes() const { return never_resumes_; }
  // Checkpointer::resume loaded it: a train_step or evaluate of a resumed model before that says so once.
  void mark_state_resumed() { state_resumed_ = true; }
  // Parameter names and shapes of the whole model, so a checkpoint of another model is refused.
  const std::string& model_signature() const { return model_signature_; }
  // What the signature covers, "name:d0,d1,;" each (rank 0, which profiled the whole model; empty elsewhere).
  const std::string& model_parameters() const { return model_parameters_; }
  // The next train_step or evaluate is given this replica's share of this global batch (Python's train_step takes
  // it): that call also checks that every rank was given the same global batch.
  void next_call_takes_share_of(const ModelInputs& inputs, const at::Tensor& targets,
                                const std::vector<bool>& batched = {});
  bool last_step_skipped() const { return last_step_skipped_; }
  // Whether a train_step whose gradients .grad holds (since zero_grad or the last optimizer step) was dropped, or
  // threw: the optimizer step on them is not taken, as GradScaler skips a step any of whose accumulated backward
  // passes overflowed (the steps after a dropped one would step on part of the gradient).
  bool gradients_dropped() const { return gradients_dropped_; }
  void forget_dropped_gradients() {
    gradients_dropped_ = false;
    left_gradients_.clear();
  }
  // fp16 dynamic loss scaling: the scale and the steps since it last changed (checkpoints keep both).
  double loss_scale() const;
  long long steps_since_scale_change() const;
  void restore_loss_scale(double scale, long long steps_since_change);
  // The next train_step is step `step` of the job (after a resume), for messages and trace_step.
  void resume_at(long long step);
  // A train_step (or evaluate) that a rank refused before any transfer (its batch failed a check) still counts as
  // a call there. Where every rank refuses alike the counts stay alike and the call can be retried; where only some
  // do (each replica checks its own share), their next call's number differs from the peers' and the transfers
  // and closing sums fail naming the calls, rather than pair this rank's next batch with the peers' refused one.
  // Refusals before the engine is reached (Python's checks) call it; the engine's own do so themselves.
  void count_refused_call(bool train_step);
  // The stream the model's modules draw their random numbers from in train_step and evaluate (checkpoints keep it).
  ModelRandomStream& random_stream() { return *random_stream_; }
  // Starts that stream anew from `seed` (with the model's number in the job, the rank's stage and replica), as
  // at::manual_seed does for one process: every rank calls it alike, between steps.
  void seed_random_stream(std::uint64_t seed);

  // This rank's parameters, named as in the full model (e.g. "3.weight"); a tied parameter is named after its
  // first node (GraphModel::named_parameters) on every rank that holds it.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_parameters_; }
  // This rank's buffers that are part of the model's state (GraphModel::named_buffers), named the same way.
  const std::vector<std::pair<std::string, at::Tensor>>& named_buffers() const { return named_buffers_; }
  std::vector<at::Tensor> parameters() const;
  // This rank's parameters that are tensor-parallel shards, by name: where each sits in the whole tensor (dim,
  // blocks; tp::shard_of). Checkpoints record it; loading a whole tensor cuts this rank's shard with it.
  const std::map<std::string, std::pair<int64_t, int64_t>>& shard_dims() const;
  // This rank's parameters that are its share of a layer's experts (expert parallelism), by name: the experts
  // along dimension 0, share ep_rank of expert_parallel_degree.
  const std::set<std::string>& expert_shard_names() const;
  // The parameters that count toward the whole model's gradient norm here: a tied parameter counts only on the
  // rank of its first node, though every holder keeps (and updates) an identical copy.
  const std::vector<at::Tensor>& norm_parameters() const;
  // Scales this rank's gradients so that their 2-norm over the whole model (all stages) is at most max_norm, as
  // torch::nn::utils::clip_grad_norm_ does on one process; returns the norm before clipping. Every rank calls it.
  double clip_grad_norm(double max_norm);
  // Clears the gradients of all of this rank's parameters (set_to_none: undefined, else zeros), also those a
  // sharded optimizer does not hold. The optimizers' zero_grad calls it.
  void zero_grad(bool set_to_none = true);
  // "shard_optimizer_state": how many replicas this rank's optimizer state is split over (1: not sharded), and
  // whether this replica's optimizer keeps state for and updates `parameter`. The optimizers hold only those.
  int optimizer_state_shards() const;
  bool updates_parameter(const at::Tensor& parameter) const;
  // The replica (data-parallel rank) whose optimizer would hold each parameter (aligned with parameters()) were the
  // state sharded over `replicas`; -1 for a parameter frozen when the model was built, which every replica's
  // optimizer holds. What a checkpoint sharded over another number of replicas needs to tell whose state each share
  // file holds. Under expert parallelism an expert shard's owner is one of the replicas holding the same experts.
  std::vector<int> optimizer_shard_owners(int replicas) const;
  // After the optimizer step, on every rank: each replica takes the parameters other replicas updated.
  void share_updated_parameters();
  const StagePlan& plan() const { return plan_; }
  int stage() const { return runtime_->pp_rank(); }  // this rank's pipeline position
  std::vector<int> stages() const;  // the model stages this rank runs (several with virtual stages)
  // By local stage: the calls its forward makes per microbatch (fewer than its nodes where the model fuses runs).
  std::map<int, int> calls_per_microbatch() const;
  const sched::Schedule& schedule() const { return executor_->schedule(); }
  Runtime& runtime() { return *runtime_; }

 private:
  // Counts the call as refused (count_refused_call) when it throws before dismiss().
  class RefusedCallCounts {
   public:
    RefusedCallCounts(DistributedModel& model, bool train_step)
        : model_(&model), train_step_(train_step), exceptions_(std::uncaught_exceptions()) {}
    ~RefusedCallCounts() {
      if (model_ && std::uncaught_exceptions() > exceptions_) model_->count_refused_call(train_step_);
    }
    void dismiss() { model_ = nullptr; }

   private:
    DistributedModel* model_;
    bool train_step_;
    int exceptions_;
  };

  struct Planned {};  // the builder's form once the runtime has its layout
  DistributedModel(Planned, std::shared_ptr<Runtime> planned, const ModelBuilder& build, const ModelInputs& sample,
                   const MaterializeNodes& materialize, Resume resume);
  struct LocalStage {
    std::vector<int> nodes;  // in the model's (topological) order
    std::vector<NodeRun> runs;  // the nodes as the forward calls them
    std::vector<at::Tensor> parameters;
  };

  StageOutputs run_stage(int stage, const ModelInputs& model_inputs, const TensorsByStage& from_producers);
  StageCallbacks stage_callbacks();
  // The replica's batch checked and split into microbatches on the device (ConfigError naming `caller`), as
  // at::tensor_split splits it (the first microbatches a sample more where it does not split evenly), each
  // microbatch's loss weighed as `reduction` says. `global_samples`: the global batch's size where the call was
  // told it (next_call_takes_share_of), else none: the replicas' shares are then taken to be alike (checked after).
  // `short_allowed` (evaluation): a share of fewer samples than microbatches splits into one per sample, none for
  // an empty share.
  MicrobatchData microbatch_data(const char* caller, const ModelInputs& inputs, const at::Tensor& targets,
                                 const OutputsLossFunction& loss, const std::vector<bool>& batched,
                                 LossReduction reduction, std::optional<std::int64_t> global_samples,
                                 bool short_allowed = false) const;
  // The forward-only executor for `microbatches` microbatches (the config's: the training schedule's forwards;
  // fewer, for an evaluation's short last batch: the schedule generated for that many), made at first use.
  PipelineExecutor& evaluator(int microbatches);
  ModelInputs inputs_by_name(const char* caller, const std::map<std::string, at::Tensor>& inputs) const;
  static OutputsLossFunction of_first_output(const LossFunction& loss);
  void check_single_input(const char* caller, const at::Tensor& inputs, const at::Tensor& targets) const;
  void build_stages(const sched::Schedule& schedule);
  void make_optimizer_shards();
  // Replicas take replica 0's buffers after a step (batch norm's running statistics), as torch DDP's default
  // broadcast_buffers does: each updated its own from its share, so evaluation and checkpoints (replica 0's) would
  // otherwise depend on the replica. Not under expert parallelism, whose replicas hold different experts.
  void share_first_replica_buffers();
  void remember_gradients_left();
  void warn_if_not_resumed();
  bool gradients_left_as_they_were() const;
  // Every replica starts from the first replica's parameters: dense ones over the data-parallel group, expert shards
  // over the replicas holding the same experts.
  void share_first_replica_parameters();
  // Every rank of `replicas` takes its group rank 0's values of these tensors.
  void share_first_replicas(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                            comm::Communicator& replicas);
  // ModelError naming the first module or parameter where this rank's model parts from rank 0's, or from its
  // replicas' (ranks building different models would index rank 0's cut out of range, or all-reduce gradients of
  // other sizes).
  void check_same_modules(const std::string& rank0_modules) const;
  void check_replicas_alike();
  void write_timeline(const std::vector<TimelineEvent>& events);
  // Whether this rank's losses go into the step's: the tensor-parallel ranks of the last stage compute the same.
  bool counts_loss() const { return runtime_->tp_rank() == 0; }

  std::shared_ptr<Runtime> runtime_;
  GraphModel model_;
  StagePlan plan_;
  sched::StageGraph graph_;
  std::map<int, LocalStage> stages_;  // by stage index
  std::vector<bool> checkpointed_nodes_;  // by node: activation checkpointing of that module alone
  // Tensor names that stage `first` sends to stage `second`, in node order.
  std::map<std::pair<int, int>, std::vector<std::string>> transfers_;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters_;
  std::vector<std::pair<std::string, at::Tensor>> named_buffers_;
  std::vector<bool> trainable_at_build_;  // requires_grad of named_parameters_ when the reducer and ties were made
  std::unique_ptr<PipelineExecutor> executor_;
  std::map<int, std::unique_ptr<PipelineExecutor>> evaluators_;  // by microbatches (evaluator)
  std::unique_ptr<GradientSync> gradients_;  // averaged, summed, checked, clipped and cleared by it
  // With replicas and shard_optimizer_state only: the replicas' shares, and under expert parallelism those of the
  // replicas holding the same experts.
  std::vector<std::unique_ptr<OptimizerShards>> shards_;
  long long step_ = 0;  // train_step calls so far (refused ones too: count_refused_call), for error messages
  long long evaluations_since_step_ = 0;  // with step_, which program call this rank is in (ProgramCall)
  std::string exchange_;  // prefix of this model's store keys
  std::optional<FoundCheckpoint> resumed_from_;
  bool never_resumes_ = false;
  bool state_resumed_ = false;
  bool said_not_resumed_ = false;
  std::string model_signature_;
  std::string model_parameters_;
  bool last_step_skipped_ = false;
  bool said_replicas_alike_ = false;
  bool checked_foreign_gradients_ = false;  // ForeignGradients, on the first train_step
  bool gradients_dropped_ = false;
  // Each parameter's gradient as a dropped step's train_step left it (its tensor and version): a gradient since
  // replaced or written (zero_grad, with or without set_to_none) no longer holds the dropped step.
  std::vector<std::pair<const void*, std::uint32_t>> left_gradients_;
  std::optional<GlobalBatch> global_batch_;  // next_call_takes_share_of's, until that call
  std::unique_ptr<LossScaler> loss_scaler_;  // fp16's dynamic scale (1 without fp16)
  std::unique_ptr<ModelRandomStream> random_stream_;
  std::uint64_t random_stream_offset_ = 0;  // the model's number in the job, spread: a teacher's stream and a student's differ
};

}  // namespace smp
