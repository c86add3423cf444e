#pragma once
// ZeRO stage 1 over the data-parallel replicas of one pipeline rank (config "shard_optimizer_state"): each replica
// keeps optimizer state for, and updates, only its share of the trainable parameters; after the optimizer step
// the owners broadcast what they updated. Gradients are still all-reduced whole (GradientReducer), so every
// replica can compute the global gradient norm as before; what sharding saves is the optimizer state (Adam's two
// moments: half of a model's training memory in fp32), at the cost of one broadcast of the parameters per step.

#include <cstdint>
#include <set>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"

namespace smp {

// The replica that owns each parameter: whole parameters, largest first, each to the replica with the fewest
// bytes so far (ties to the lower replica), so that shares differ by at most the largest parameter. The same on
// every replica, as it depends on the sizes alone.
std::vector<int> assign_shard_owners(const std::vector<std::int64_t>& bytes, int replicas);

class OptimizerShards {
 public:
  // `parameters`: this rank's trainable parameters, in the same order on every replica; `owner`: the replica that
  // updates each (DistributedModel::optimizer_shard_owners, which checkpoints use too).
  OptimizerShards(const std::vector<at::Tensor>& parameters, const std::vector<int>& owner, comm::Communicator& replicas,
                  std::int64_t bucket_bytes);

  int replicas() const { return replicas_.size(); }
  // Whether this replica updates `parameter`. Frozen parameters (not given) count as owned everywhere: an
  // optimizer keeps no state for them, and they never change.
  bool owns(const at::Tensor& parameter) const { return !foreign_.count(parameter.unsafeGetTensorImpl()); }
  // After every replica's optimizer step: each parameter takes its owner's value. Every replica calls it.
  void share_updates();

 private:
  struct Bucket {
    int owner = 0;
    std::vector<at::Tensor> parameters;  // one dtype and device
    std::int64_t elements = 0;
  };
  comm::Communicator& replicas_;
  std::vector<Bucket> buckets_;
  std::set<const void*> foreign_;  // parameters another replica updates
};

}  // namespace smp
