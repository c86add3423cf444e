#pragma once
// Which modules of a chain model run on which pipeline stage, and why: the profile behind the choice.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/scheduler/schedule.h"
#include "smp/topology.h"

namespace smp {

struct Config;
class GraphModel;

// A mixture-of-experts layer's routing as counted: tokens per expert, one row per sample (a sequence's tokens route
// alike more than tokens drawn at random, so the spread between rows tells chance from a lasting skew).
using ExpertRouting = std::vector<std::vector<std::int64_t>>;

struct ModuleProfile {
  std::string name;              // path in the model, e.g. "3" or "blocks.3"
  double forward_s = 0.0;        // the least over repeats, on the trial microbatch
  double backward_s = 0.0;
  std::int64_t parameter_bytes = 0;  // a tied parameter at its first and its last holder (profile_graph)
  std::int64_t output_bytes = 0;  // what crosses to a consumer on another stage, if cut there
  std::vector<int> producers;      // nodes whose outputs this one reads (the model input is not a node)
  // What its forward keeps alive for backward besides its output (saved tensors, intermediates), per microbatch.
  std::int64_t activation_bytes = 0;
  // "name:d0,d1,;" for each parameter first held here (not sent to other ranks): what the model's signature is made
  // of. parameter_bytes also counts a tied parameter at its last holder (profile_graph), which this does not list.
  std::string parameter_shapes;
  // Part of forward_s + backward_s: the loss train_step will compute on this node's output, assumed (profile_graph).
  double assumed_loss_s = 0.0;
  // The zero-bubble split of backward_s, when profiled with a SplitBackwardTimer (0 otherwise): the input-gradient
  // pass (I) and the weight-gradient pass (W), which together cost more than backward_s on small operations.
  double backward_input_s = 0.0;
  double backward_weight_s = 0.0;
  // Of activation_bytes, what its graph still holds between I and W (what W reads: its matrix products' inputs and
  // the gradients that reached them); -1 when not profiled with a SplitBackwardTimer.
  std::int64_t weight_pass_bytes = -1;
  std::int64_t largest_parameter_bytes = 0;  // of those parameter_bytes counts
  // The tensor-parallel collectives its forward and its backward run, when profiled at a degree above 1 with them
  // skipped (WithoutCollectives): how many, and their bytes as smp::SkippedCollectives counts them, per microbatch
  // of the profile. The planner prices them on the measured links; forward_s and backward_s leave them out.
  std::int64_t tp_forward_collectives = 0, tp_backward_collectives = 0;
  std::int64_t tp_forward_ring_bytes = 0, tp_backward_ring_bytes = 0;
  // Of parameter_bytes, a mixture-of-experts layer's stacked experts' (which expert parallelism divides over its
  // group), and the token rows those experts read per microbatch of the profile (tokens x top-k x hidden x element
  // size): what an expert-parallel group exchanges to dispatch them and again to combine their results, forward and
  // backward.
  std::int64_t expert_parameter_bytes = 0;
  std::int64_t expert_token_bytes = 0;
  // Of largest_parameter_bytes' candidates, the largest experts tensor and the largest other: dividing the experts
  // shrinks the first, and with it the optimizer step's temporaries where it was the largest.
  std::int64_t largest_expert_parameter_bytes = 0;
  std::int64_t largest_other_parameter_bytes = 0;
  // For each experts layer whose parameters it holds: the tokens its router sent each expert, one row per sample
  // counted (empty: routing assumed even). Under expert parallelism the rank holding the most-chosen experts receives
  // more than its share of rows, and the layer's exchanges wait for it (routing_imbalance).
  std::vector<ExpertRouting> expert_routing{};
  // Of its compute and activations, the experts' share (their work per token against its other parameters'): what
  // the busiest rank's extra rows scale.
  double expert_compute_share = 0.0;
  // It holds parameters, its own or tied ones that parameter_bytes counts elsewhere: a rank whose stages hold none
  // cannot build its optimizer (the planner rejects such a layout).
  bool holds_parameters = false;
  // Of parameter_bytes, those frozen when profiled (requires_grad false: LoRA's base weights, a frozen backbone or
  // teacher): held, but without a gradient, optimizer state, or a reduction over replicas.
  std::int64_t frozen_parameter_bytes = 0;
  std::vector<std::string> frozen_parameters{};  // their paths, for mark_experts
  std::int64_t frozen_expert_parameter_bytes = 0;  // of frozen_parameter_bytes, the experts' (mark_experts)

  // What trains (gradients, optimizer state, reductions), apart from the experts' (divided by expert parallelism,
  // their state over fewer replicas).
  std::int64_t trained_dense_bytes() const {
    return std::max<std::int64_t>(0, parameter_bytes - expert_parameter_bytes -
                                         (frozen_parameter_bytes - frozen_expert_parameter_bytes));
  }
  std::int64_t trained_expert_bytes() const {
    return std::max<std::int64_t>(0, expert_parameter_bytes - frozen_expert_parameter_bytes);
  }
};

struct StagePlan {
  std::vector<ModuleProfile> modules;
  std::vector<int> stage_of_module;  // non-decreasing, every stage non-empty
  int num_stages = 0;
  // Per stage (empty: 1 each): the microbatches whose activations it holds at once, as the partition search
  // counted them (1 on a checkpointed stage, which holds one microbatch's at a time while it recomputes).
  std::vector<double> activation_copies;
  // Per stage (empty: alike): the relative speed of the device it runs on; stage_time is the time there.
  std::vector<double> stage_speeds;
  // Under MemoryLimit::kGuides, why no split met the memory limit as the search counts it (empty: one did); the cut
  // is then the search's without the limit. Not carried to the other ranks (to_json).
  std::string memory_limit_unmet;

  std::vector<int> modules_of_stage(int stage) const;
  double stage_time(int stage) const;
  std::int64_t stage_sent_bytes(int stage) const;  // outputs read by later stages, once per consumer stage
  // A table per stage: modules, parameters, estimated time, bytes sent on, and the imbalance.
  std::string report() const;
  std::string to_json() const;
  static StagePlan from_json(const std::string& text);
};

// Measures every node of `model` on `sample` (one microbatch of model input): forward and backward time
// (the least of `repeats` after a warm-up; 0 when repeats is 0), parameter bytes (a tied parameter counts at its
// first node), output bytes, and the bytes its forward keeps for backward. Nodes of equal profile keys given inputs
// of equal shapes share one measurement. The loss function train_step will be given is not known yet: unless the
// model computes its own loss (a 0-dim output), the node of its largest floating-point output of two or more
// dimensions (class scores) is charged a cross-entropy over that output's last dimension, timed the same way
// (ModuleProfile::assumed_loss_s). Runs on the sample's device: each module goes there for its own
// measurement and back after; a node built on demand is built for it alone (GraphModel::built_apart) and dropped.
// Throws ModelError naming the node that fails on the sample.
// Times a node's split backward: given its output (seeded with ones), its inputs and its parameters, runs I then W
// and returns their seconds, and `live_bytes()` between them (less the input gradients I returned). The planner's
// callers pass one (smp::WeightPass's, which this room does not see).
struct SplitBackwardTiming {
  double input_s = 0.0, weight_s = 0.0;
  std::int64_t live_bytes_between = 0;
};
using SplitBackwardTimer = std::function<SplitBackwardTiming(
    const at::Tensor& output, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters,
    const std::function<std::int64_t()>& live_bytes)>;
// With `time_split`, each node's I and W are timed too (backward_input_s, backward_weight_s), on a forward of
// their own in each round. With `scale_to_whole`, the nodes' times are scaled so that they sum to one forward and
// one backward of the whole model on the sample (the planner's: nodes timed alone sum to less); not where the
// model cannot run whole on the sample's device.
std::vector<ModuleProfile> profile_graph(const GraphModel& model, const std::vector<at::Tensor>& sample,
                                         int repeats = 3, const SplitBackwardTimer& time_split = nullptr,
                                         bool scale_to_whole = false);  // one tensor per model input
std::vector<ModuleProfile> profile_graph(const GraphModel& model, const at::Tensor& sample, int repeats = 3);

// Which of the modules (their names, in model order) config.checkpointed_modules selects: a name selects that
// module and the children "<name>.<child>" a Sequential node was expanded into. Throws ConfigError naming a name
// that selects nothing.
std::vector<bool> checkpointed_modules(const std::vector<std::string>& module_names, const Config& config);

// Per stage of `schedule`: the microbatches whose activations it holds at once (under 1F1B, p - rank), as the
// partition search counts them: a rank's virtual stages share its count. From the compute actions alone, so that
// a schedule file's own transfers, which may follow skips the chain does not have, do not matter.
// `weight_pass_share`: of a microbatch's activations, what a stage after the first still holds from its I until its
// W under the zero-bubble split (the first stage's input takes no gradient: its W is the whole backward, and it
// holds everything); 1 counts the microbatch whole until W.
std::vector<double> activation_copies(const sched::Schedule& schedule, double weight_pass_share = 1.0);
// What the profiled modules hold from I until W, over what their forwards keep (weight_pass_bytes over
// activation_bytes); 1 when the profile has no split timings.
double weight_pass_share(const std::vector<ModuleProfile>& modules);
// The same over the modules at `members` (a stage's).
double weight_pass_share(const std::vector<ModuleProfile>& modules, const std::vector<int>& members);
// A node's parameters as ModuleProfile::parameter_shapes lists them: (name, sizes), in order.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_shapes_of(const ModuleProfile& module);

// Splits a profiled graph into config.num_stages() stages, each stage only feeding later ones: balanced by
// forward + backward time mixed with memory by memory_weight when auto_partition is true, else every module on
// default_partition; partition_overrides pin modules in both modes. Throws ConfigError naming the modules when
// the request cannot be met.
// `activation_copies` (per stage; empty: 1 each): the microbatches whose activations a stage holds at once under
// the job's schedule. Stages in config.checkpointed_stages count one copy and their forward time twice; modules in
// config.checkpointed_modules count their output alone as activations and their forward time twice.
// `optimizer_state_shards`: the replicas the optimizer state is split over (shard_optimizer_state), each rank
// holding that share of the two moments.
// `devices` (StageDevices; empty: alike): the speed and memory of the device each stage runs on; a faster stage
// gets more of the model, a smaller one less.
// `memory_limit`: kRefuses throws when no split keeps every stage within the limit as the search counts it: each
// module's parameters, gradients, two moments and activations added up, all held at once. That count is additive
// so that the search can sum it over any set of modules, and so it is cruder than the planner's per-rank peak
// (predict_layouts: activations freed as gradients appear, reduction buckets, the optimizer's temporaries), above
// it or below. kGuides, for a caller that judges the memory itself (the planner; a job adopting its plan): the
// limit steers the search, and where it cannot be met the cut is made without it (StagePlan::memory_limit_unmet).
enum class MemoryLimit { kRefuses, kGuides };
struct StageDevices;
StagePlan plan_stages(std::vector<ModuleProfile> modules, const Config& config,
                      std::vector<double> activation_copies = {}, int optimizer_state_shards = 1,
                      const StageDevices* devices = nullptr, MemoryLimit memory_limit = MemoryLimit::kRefuses);

// Per stage, the device it runs on: the speed of its pipeline rank's slowest device (relative; 1 when alike) and
// the memory limit of its smallest, in MiB for the rank (0: none). From config.device_speeds (or `speeds`, one per
// rank: measured ones) and config.device_memory_mb, through the topology and the schedule's stage_to_rank.
struct StageDevices {
  std::vector<double> speeds;
  std::vector<double> memory_mb;
  bool alike() const;
};
StageDevices stage_devices(const Config& config, const Topology& topology, const std::vector<int>& stage_to_rank,
                           const std::vector<double>& speeds);

}  // namespace smp
