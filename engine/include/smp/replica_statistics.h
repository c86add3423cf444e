#pragma once
// Statistics pooled over the data-parallel replicas inside a stage's compute: a synchronized batch norm's
// per-channel sums, each microbatch's over the same microbatch of every replica of the stage (all replicas run the
// same schedule, so they meet at it in the same order). torch.ops.smp.replica_sum, for C++ and Python alike.

#include <memory>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"

namespace smp {

// The sum of `input` over the replicas of this rank's stages (not differentiable: the operation pooling a statistic
// states its gradient). Without a replica group, or under WithoutCollectives (rank 0 profiling alone), a copy.
at::Tensor replica_sum(const at::Tensor& input);

// The group replica_sum sums over (Runtime::use_replica_statistics sets it; null: none). Held weakly.
void use_as_replica_group(const std::shared_ptr<comm::Communicator>& group);
std::shared_ptr<comm::Communicator> replica_group();

}  // namespace smp
