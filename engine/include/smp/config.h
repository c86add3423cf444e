#pragma once
// The job configuration: the only place that knows key names, types, ranges and defaults. Keys follow
// SageMaker model parallelism (SMP) where SMP has one. Validation happens before any communication.

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace smp {

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Config {
  int partitions = 1;            // pipeline stages (alias pipeline_parallel_degree)
  // Shards of every tensor-parallel layer (smp::tp): each stage of each replica runs on this many ranks. The world
  // is tensor_parallel_degree x partitions x replicas.
  int tensor_parallel_degree = 1;
  // Megatron's sequence parallelism: between tensor-parallel layers the activations are split along the sequence
  // over the group (norms, dropout and residuals hold 1/tp of them). Models read it (the example GPT, smp.tp's
  // plans); no effect with tensor_parallel_degree 1.
  bool sequence_parallel = false;
  // Expert parallelism: each mixture-of-experts layer's experts divided over this many data-parallel ranks (which
  // it divides), tokens moved to them by all-to-all; each rank holds num_experts / expert_parallel_degree experts.
  int expert_parallel_degree = 1;
  int microbatches = 1;          // per data-parallel replica and step
  // A schedule of sched::schedule_kinds(), by SMP's name ("simple": GPipe; "interleaved": 1F1B, Megatron's
  // interleaved 1F1B when virtual_stages > 1; "zero_bubble", "zero_bubble_h2") or its generator's ("zb_v", ...).
  std::string pipeline = "interleaved";
  bool ddp = false;              // data parallelism over world_size / (partitions x tensor_parallel_degree) replicas
  // ZeRO stage 1, as SMP's key: each replica keeps (and updates) the optimizer state of its share of the
  // parameters only, then sends the updated parameters to the other replicas. No effect with one replica.
  bool shard_optimizer_state = false;
  // "cluster" ("DPT"), "spread" ("TPD"), or an order of the letters D, P and T, slowest-varying first (Topology).
  std::string placement_strategy = "cluster";
  int virtual_stages = 1;        // model chunks per pipeline rank (interleaved 1F1B; 2 for the V schedules)
  std::string schedule_file;     // a CSV schedule (scheduler/src/csv.cpp) to run instead of a generated one
  int active_microbatches = 0;   // cap on microbatches in flight per rank; 0 = the schedule's natural bound
  // Stages that drop their activations after forward and recompute them in backward (empty: none).
  std::vector<int> checkpointed_stages;
  // Modules checkpointed one by one (keeping only their inputs; backward recomputes each): node names, a name also
  // covering the children "<name>.<child>" a Sequential node was expanded into.
  std::vector<std::string> checkpointed_modules;
  // A forward and the backward of another microbatch (or stage) that the schedule puts right after it run at once,
  // the forward on a second thread with collectives of its own (DualPipeV's overlapped pairs): one's communication
  // hides behind the other's compute.
  bool overlap_forward_backward = false;
  std::string trace_dir;         // when set, the timeline of step trace_step is written here
  int trace_step = 1;
  std::string checkpoint_dir;    // empty: no checkpoints
  int checkpoint_interval = 0;   // save after every K-th step; 0: only when the program asks (e.g. at the end)
  int checkpoints_kept = 3;
  // false: partition files leave out the parameters frozen when the model was built (a LoRA job's base), which a
  // resume then finds in place (loaded from pretrained weights before resume(), checked by checksum).
  bool checkpoint_frozen_parameters = true;
  bool resume = false;           // continue from the newest complete checkpoint in checkpoint_dir, if any
  bool skip_nonfinite_steps = false;
  // Mixed precision (SMP's keys): stages run under autocast in bfloat16 or float16; parameters, gradients and
  // the optimizer stay float32. fp16 adds dynamic loss scaling.
  bool bf16 = false;
  bool fp16 = false;  // "nonfinite": "skip" drops a step whose loss or gradients are NaN/Inf
  // "auto": this process's GPU (LOCAL_RANK's) when the host has one for each of its processes, else the CPU.
  // "cuda": LOCAL_RANK's GPU, an error without one (with "backend": "gloo", processes may share a GPU).
  std::string device = "auto";
  // How tensors move between ranks: "auto" follows the device (NCCL for GPU tensors, Gloo for CPU ones);
  // "gloo" stages GPU tensors through host memory. SMP calls the key ddp_dist_backend.
  std::string backend = "auto";
  bool auto_partition = true;
  int default_partition = 0;     // stage for every module when auto_partition is false
  std::map<std::string, int> partition_overrides;  // module path -> stage, honoured in both modes
  // "speed" or "memory". SMP's default is "memory"; smp's is "speed": a pipeline's step is its slowest stage's, and
  // memory_limit_mb (or "auto") keeps a cut within memory where it must.
  std::string optimize = "speed";
  // Weight of memory balancing against compute balancing in the partition objective (0: compute only,
  // 1: memory only); as SMP's, 0.2 with optimize "speed" and 0.8 with "memory".
  double memory_weight = 0.2;
  double memory_limit_mb = 0;        // per rank, for the partition search (parameters, gradients, Adam state)
  double link_bandwidth_gbps = 10;   // GB/s between stages, to weigh what a cut sends against compute
  // Devices that differ, one entry per rank (empty: alike): relative compute speed, and memory in MiB (0: the
  // rank takes memory_limit_mb). A pipeline rank counts its slowest and smallest device over its replicas and
  // tensor-parallel shards; its stages get the model in proportion (plan_stages).
  std::vector<double> device_speeds;
  bool measure_device_speeds = false;  // "device_speeds": "measure": each rank times the same work at start-up
  std::vector<double> device_memory_mb;
  // Benchmarks and tests: per rank (empty: none), a factor >= 1 by which its compute actions (and the speed
  // measurement) are stretched, by sleeping (factor - 1) times each one's duration after it: a slow device on a
  // host whose devices are alike.
  std::vector<double> emulated_slowdown;
  std::uint64_t seed = 0;
  int global_batch_size = 0;     // 0: not fixed in the config (train_step checks every batch it gets)
  double comm_timeout_s = 300.0; // every blocking wait fails after this long, naming the peer
  std::string log_level = "info";
  // Layout keys given as "auto" (planned_keys()), in the order read: the planner chooses them once the model is
  // known (smp.DistributedModel), every rank adopting rank 0's choice. Until then provisional_layout() stands in.
  std::vector<std::string> auto_keys;
  std::string source = "<config>";  // file name used in error messages
  std::string text;                 // the document as given, kept in checkpoint manifests
  // Top-level sections beside "smp" that belong to the application (e.g. "model"); see application().
  std::shared_ptr<const nlohmann::json> application_sections;

  // Parses and validates one JSON document. The smp keys are either the whole top-level object or the
  // object under "smp"; in the latter case the other top-level keys belong to the application and are left
  // alone (see application_section).
  static Config from_json_text(const std::string& text, const std::string& source);
  static Config from_file(const std::string& path);
  // Every key the reader takes, aliases included, in the order it reads them (README's config table lists each).
  static std::vector<std::string> keys();

  // The keys that may be "auto": those the planner chooses (smp::plan_layouts' Layout).
  static const std::vector<std::string>& planned_keys();
  // Whether `key` was given as "auto" (auto_keys): the planner chooses it.
  bool plans(const std::string& key) const;
  // This config with its "auto" keys replaced by a layout any world of `world_size` ranks can start with (every
  // rank a replica, one microbatch, its given schedule): what the job runs under until the layout is chosen. Its
  // auto_keys stay: the choice is still to come.
  Config provisional_layout(int world_size) const;

  // The data-parallel degree for a world size, as SMP defines it, or ConfigError naming the fix.
  int replicas_for_world(int world_size) const;
  // ConfigError unless global_batch_size splits evenly into replicas x microbatches (what layouts are planned for),
  // or with `given_to_step` unless a step's batch has a sample at least for each (it may split unevenly).
  void check_batch(int global_batch, int replicas, bool given_to_step = false) const;

  int num_stages() const { return partitions * virtual_stages; }
  // The scheduler's generator name for `pipeline` and `virtual_stages` (see sched::make_schedule).
  std::string schedule_name() const;
  // Whether that schedule splits backward into input and weight gradients (I and W).
  bool splits_backward() const;
  std::string describe() const;  // one line for the start-of-job log

  // The application's own top-level section (e.g. "model"); a null json when absent.
  const nlohmann::json& application(const std::string& name) const;
  // ConfigError naming a top-level section beside "smp" that is not among `known` (the sections the application
  // reads): a misspelled or misplaced section is otherwise ignored without a word.
  void check_sections(const std::vector<std::string>& known) const;
};

}  // namespace smp
