#pragma once
// What happens to this rank's gradients between a step's backward passes and the optimizer: averaged over the
// data-parallel replicas while backward runs (expert shards over the replicas holding the same experts), tied
// copies summed over the ranks holding them, those of sequence-parallel parameters over the tensor-parallel group;
// checked for finite values (and unscaled under fp16), their norm over the whole model clipped, cleared.
// DistributedModel's collaborator for gradients; it also says where each parameter sits (a tensor-parallel shard,
// a share of the experts), which checkpoints record.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"
#include "smp/gradient_reducer.h"
#include "smp/graph_model.h"
#include "smp/runtime.h"

namespace smp {

class GradientSync {
 public:
  // PyTorch DDP's default bucket size: large enough that per-call latency does not dominate, small enough that the
  // first bucket is ready early in the last backward pass. Sharded optimizer state shares its updates in the same.
  static constexpr std::int64_t kBucketBytes = 25 << 20;

  // One of this rank's stages: its nodes, and the parameters they read.
  struct LocalStage {
    const std::vector<int>* nodes;
    const std::vector<at::Tensor>* parameters;
  };
  // `named_parameters`: this rank's, as the model names them; `stage_rank[s]`: the pipeline rank running stage s;
  // `stage_of_node[n]`: the stage of node n; `group_prefix`: this model's prefix for the rendezvous keys of the
  // tied parameters' groups.
  GradientSync(Runtime& runtime, const GraphModel& model, const std::vector<LocalStage>& stages,
               const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
               const std::vector<int>& stage_of_node, const std::vector<int>& stage_rank,
               const std::string& group_prefix);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  // Tied copies start equal: every holder takes the lowest pipeline rank's values. A program seeding each rank apart would
  // otherwise train a tie whose copies differed from the start, silently (their gradients are summed, not their
  // values).
  void share_tied_copies();
  // Before the step's backward passes.
  void arm();
  // After them: the replicas' means, then the tied and the sequence-parallel sums. Returns the buckets the replicas
  // reduce and how many of them backward posted while it ran.
  std::pair<int, int> finish();
  // Whether every gradient of this rank is finite; with a loss scale above 1 (fp16), divides by it on the way.
  bool finite_unscaling(double loss_scale);
  // The gradients scaled so that their norm over the whole model is at most max_norm; returns the norm before.
  double clip_norm(double max_norm);
  void zero(bool set_to_none);

  // The parameters that count toward the whole model's gradient norm here: a tied parameter on the rank of its
  // first node only, a parameter every tensor-parallel rank holds whole on tp rank 0 only.
  const std::vector<at::Tensor>& norm_parameters() const { return norm_parameters_; }
  // By name: tensor-parallel shards (dim, blocks), and shares of the experts.
  const std::map<std::string, std::pair<int64_t, int64_t>>& shard_dims() const { return shard_dims_; }
  const std::set<std::string>& expert_shard_names() const { return expert_shard_names_; }
  bool has_expert_shards() const { return !expert_parameters_.empty(); }

 private:
  struct TiedParameter {
    at::Tensor parameter;
    std::shared_ptr<comm::Communicator> holders;  // this replica's ranks that hold a copy, the lowest first
    bool trained = true;                          // frozen copies need no sum, but start equal too
  };
  void sum_tied();
  void sum_sequence_parallel();

  Runtime& runtime_;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters_;
  std::vector<at::Tensor> replica_parameters_;
  std::vector<at::Tensor> expert_parameters_;
  std::set<const void*> expert_impls_;  // the same, to tell them apart where the gradients are walked
  std::vector<at::Tensor> norm_parameters_;
  std::vector<at::Tensor> sequence_parallel_parameters_;
  std::map<std::string, std::pair<int64_t, int64_t>> shard_dims_;
  std::set<std::string> expert_shard_names_;
  std::vector<TiedParameter> tied_;
  std::unique_ptr<GradientReducer> reducer_;         // with data-parallel replicas only
  std::unique_ptr<GradientReducer> expert_reducer_;  // with expert shards and replicas only
};

}  // namespace smp
