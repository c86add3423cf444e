#pragma once
// Choosing the parallel layout by simulation: for a world of N ranks and a model's profile, every layout of
// pipeline stages x data-parallel replicas, schedule, microbatch count, recompute and optimizer-state sharding is
// partitioned as a job would partition it, its step predicted by the schedule simulator and its memory per rank by
// the partition search's model; those that do not fit memory_limit_mb are rejected, the rest ranked by predicted
// step time. The report is what `smp.plan` prints.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "smp/config.h"
#include "smp/stage_plan.h"

namespace smp {

struct Layout {
  int partitions = 1;      // pipeline ranks
  int replicas = 1;        // data-parallel replicas
  int virtual_stages = 1;  // stages per pipeline rank
  int microbatches = 1;    // per replica and step
  std::string pipeline = "simple";  // the config's name of the schedule
  bool recompute = false;           // every stage checkpointed (activation_checkpointing: true)
  bool shard_optimizer_state = false;
  int tensor_parallel = 1;  // ranks per tensor-parallel group (each holding a shard of the planned layers)
  int experts = 1;          // expert-parallel degree: consecutive replicas dividing the stacked experts among them
  // "pp 2 x dp 2, zb_v, m 8, recompute, ZeRO-1" ("tp 8 x pp 2 x ..." with tp, "dp 4, ep 2, ..." with ep)
  std::string describe() const;
  std::string config_json() const;  // the smp keys that ask for it
};

// What the job's step costs beside the profile: per transfer between stages and per byte the replicas reduce (ring
// all-reduce: each rank sends and receives 2 (dp - 1) / dp of its gradient bytes), and how much slower a rank
// computes in the job than the profile measured it alone (ranks sharing a host's cores: ranks / cores).
// The optimizer's step: seconds per byte of the parameters a rank updates (AdamW on this device, measured).
struct PlanningCosts {
  double latency_s = 50e-6;
  double p2p_bytes_per_s = 1e9;
  double all_reduce_bytes_per_s = 1e9;
  double compute_scale = 1.0;
  double optimizer_s_per_byte = 0.0;
  // Processors a host's ranks (ranks_per_node of them, or the whole world when 0) share when they outnumber them
  // (CPU cores; 0: each rank a device of its own): a rank computes at min(1, processors / ranks computing at once),
  // so a pipeline's fill and drain run faster than its steady state, and the optimizer steps of every rank at once
  // take ranks / processors as long.
  double shared_processors = 0.0;
  // Where ranks share cores (0 otherwise, and in a job that plans no tensor parallelism): a collective between
  // ranks that each computed up to it, as tensor-parallel peers do, finds its peer off its core; measured
  // (measured_planning_costs) as a fixed part per round trip and a bandwidth, each worse than idle links'. A
  // tensor-parallel collective of a group of n costs n - 1 round trips (at least two latencies each) and (n - 1) / n
  // of its ring bytes at the lower bandwidth.
  double synchronization_s = 0.0;
  double synchronized_bytes_per_s = 0.0;
  // Several nodes (ranks_per_node > 0): a pipeline longer than a node sends between nodes, and replicas of a world
  // larger than a node reduce across nodes (the ring is as fast as its slowest link), at these costs.
  int ranks_per_node = 0;
  double inter_node_latency_s = 0.0;
  double inter_node_bytes_per_s = 0.0;
  // How the optimizer steps, for the temporaries of Adam's step (sqrt of the second moment, then its quotient),
  // which a rank holds after its activations are gone: false, one parameter at a time (LibTorch's optimizers,
  // torch.optim's on a CPU), two of the rank's largest parameter; true, all of a rank's at once (torch.optim's
  // foreach default on a GPU), one copy of its parameters.
  bool optimizer_foreach = false;
};

// The model's nodes measured (profile_graph) on a microbatch of `batch` samples and, when given, of `larger_batch`:
// a node's time is then a fixed part plus a part per sample, through the two (a stage call costs something however
// small its microbatch); with one measurement, all of it per sample. Bytes that grow with the batch are per sample.
struct ModelProfile {
  std::vector<ModuleProfile> modules;
  int batch = 1;
  std::vector<ModuleProfile> larger;
  int larger_batch = 0;
  // What every mixture-of-experts layer's count of experts divides into (their greatest common divisor): an
  // expert-parallel degree must divide it; 0: no experts.
  int experts = 0;
  // How many tensor-parallel ranks the profile's experts are split over at ep 1 and held whole at ep > 1 (the
  // experts' nodes then hold and compute 1 / experts_split of them, and sum their outputs over the group): a profile
  // at tp t of a model whose own plan splits its experts, as a job at ep 1 does and at ep > 1 does not. A layout
  // dividing the experts (ep > 1) undoes the split first (divide_experts). 1 where a given plan's split stays.
  int experts_split = 1;
  // The microbatch sizes the model takes, in samples (a captured model's range of its inputs' first dimension:
  // export keeps sizes 0 and 1 apart from a dimension that may change, so a capture on a sample of 2 takes at least
  // 2); a layout outside them is rejected. most_microbatch 0: no upper bound.
  int least_microbatch = 1;
  int most_microbatch = 0;
  // The profile on a microbatch of `samples`, compute times `compute_scale`.
  std::vector<ModuleProfile> at(int samples, double compute_scale = 1.0) const;
  // A mixture-of-experts model's experts: {experts module's path: the token rows' bytes it reads per microbatch of
  // the profile}, `experts_per_layer` (ModelProfile::experts) and `split` (experts_split). Each node holding
  // parameters under such a path counts their bytes in expert_parameter_bytes, and the first of them the rows in
  // expert_token_bytes. `routed` (optional, by the same paths): the tokens each expert of that layer was sent on
  // the sample, which the busiest rank of a layout dividing the experts pays for (routing_imbalance);
  // `experts_per_token` (top-k; 0: unknown, all of a node's compute counted as its experts') tells the experts' share
  // of a node's compute from its parameters.
  void mark_experts(const std::map<std::string, std::int64_t>& token_bytes, int experts_per_layer, int split = 1,
                    const std::map<std::string, ExpertRouting>& routed = {}, int experts_per_token = 0);
};

// How many times its even share of a layer's rows the busiest of `ep` ranks receives, expected, in an exchange of
// `samples` samples routed as the rows of `routing` were (each rank holding a consecutive block of the experts, as
// expert parallelism divides them): the rows' mean share per block, shrunk towards even by what the spread between
// rows says of its noise, plus the spread an exchange of that many samples keeps. 1 for none counted.
double routing_imbalance(const ExpertRouting& routing, int ep, int samples);

// How a layout rejected for its peak memory says so, after "needs X MiB on pipeline rank R" (LayoutPrediction::
// rejected), and before the rank's limit.
inline constexpr const char* kOverMemoryLimit = ", over its memory limit of ";

struct LayoutPrediction {
  Layout layout;
  std::string rejected;  // empty when it fits and partitions
  bool over_memory_limit() const;  // rejected for its peak memory alone (memory_mib says what it needs)
  double step_s = 0.0;   // the pipeline's makespan, then the replicas' reduction and the optimizer step
  double pipeline_s = 0.0;
  double gradient_sync_s = 0.0;  // the all-reduce (and ZeRO-1's broadcast) after the last backward, not overlapped
  double optimizer_s = 0.0;      // the fullest rank's optimizer step
  double bubble_fraction = 0.0;
  // Per pipeline rank: parameters, gradients, optimizer state, and the more of the activations held at once and the
  // optimizer step's temporaries.
  std::vector<double> memory_mib;
  std::vector<std::string> stages;  // per stage, its modules as the partition search cut them: "first..last"
  // The cut as partition_overrides (every module pinned to its stage): a job adopting the layout
  // trains the stages its memory and step were predicted for, rather than cutting again from a profile of its own.
  // Empty with expert parallelism: a job dividing the experts captures another graph than the profile's.
  std::map<std::string, int> cut;
  // The layout's keys with the cut ("partition_overrides"): what a job adopts.
  std::string config_json() const;
  double peak_memory_mib() const;
  // The first fitting layout's simulated step (the one a job chooses) as a timeline SVG (to_svg: one row per
  // pipeline rank, its predicted compute and waits); empty for the others.
  std::string timeline_svg;
};

// A stage plan's cut as partition_overrides (LayoutPrediction::cut): pins that make plan_stages cut the same way
// whatever profile it is given.
std::map<std::string, int> pinned_cut(const StagePlan& plan);

// The divisors of n, ascending: the degrees n ranks (or devices of a node) divide into.
std::vector<int> divisors(int n);

// `profile`: the model's, scaled to each layout's microbatch. `base`: the job's config (global_batch_size,
// memory_limit_mb, memory_weight, partition_overrides...; its layout keys are replaced). `optimizer_moments`: the
// optimizer's state per parameter, in parameter sizes (Adam 2, SGD with momentum 1). Fitting layouts come first,
// fastest first; a layout the partition search cannot place is rejected with its reason.
std::vector<LayoutPrediction> plan_layouts(const ModelProfile& profile, const Config& base, int world_size, const PlanningCosts& costs = {},
                                           double optimizer_moments = 2.0, bool for_a_job = false);
// Expert parallelism ("expert_parallel_degree" fixed, or "auto": every degree dividing the replicas and
// ModelProfile::experts) is planned from the same profile (at each tensor-parallel degree: a model's own plan leaves
// the experts whole at ep > 1, ModelProfile::experts_split, so each tp rank divides its experts with the same tp rank
// of other replicas; not with sequence parallelism): each rank holds 1 / ep of the experts' parameters, gradients
// and optimizer state (ZeRO-1 shares them over the replicas / ep that hold the same experts, which also reduce their
// gradients), and every experts layer's exchanges (its counts, its token rows out and back, their gradients) are
// priced on the point-to-point links.
// With tensor parallelism: the model's profile at each degree considered (sharded for it: a shard's compute,
// parameters and activations, its collectives counted, not run), and for each degree tp dividing world_size every
// layout of the world_size / tp groups as above. A group computes as one rank of the pipeline; its collectives are
// priced on `costs`' all-reduce links, and the processors a host shares (costs.shared_processors, ranks_per_node)
// count per group. `for_a_job`: the layouts a job under `base` cannot adopt rejected too (keep_what_the_config_fixes),
// so that the first fitting one, the one drawn, is the one it chooses.
std::vector<LayoutPrediction> plan_layouts(const std::map<int, ModelProfile>& by_degree, const Config& base,
                                           int world_size, const PlanningCosts& costs = {},
                                           double optimizer_moments = 2.0, bool for_a_job = false);

// `given`, a config with "auto" layout keys (Config::auto_keys), with those keys set from `layout_keys` (a layout's
// Layout::config_json()): the config a job adopting that layout trains under; nullopt when the layout differs from
// what `given` fixes (its prediction would not hold; its cut is then not checked against that config). ConfigError
// when the result is no valid config.
std::optional<Config> adopting_layout(const Config& given, const std::string& layout_keys, int world_size);

// For a job whose config has "auto" keys (nothing otherwise): each layout it cannot adopt (adopting_layout) rejected,
// naming the setting the config fixes otherwise, so that its report ranks what the job chooses from; the fitting
// layouts stay first.
void keep_what_the_config_fixes(std::vector<LayoutPrediction>& predictions, const Config& given, int world_size);

// For a job whose config has "auto" keys: the fastest fitting prediction it can adopt, with the config it then
// trains under. ConfigError with the report and the reasons when there is none.
std::pair<LayoutPrediction, Config> choose_layout(const std::vector<LayoutPrediction>& predictions, const Config& given,
                                                  int world_size);

// `layout`'s simulated step, as plan_layouts predicts it, drawn as a timeline SVG (to_svg: one row per pipeline
// rank, its compute and its waits); empty when the layout does not fit. `profile`: at the layout's tensor-parallel
// degree.
std::string layout_timeline_svg(const ModelProfile& profile, const Config& base, int world_size, const Layout& layout,
                                const PlanningCosts& costs = {}, double optimizer_moments = 2.0);

// A table a person reads: the first `shown` fitting layouts, the count of those the config's fixed keys exclude (per
// key), the others rejected with why, and the choice.
std::string layout_report(const std::vector<LayoutPrediction>& predictions, int shown = 15);

}  // namespace smp
