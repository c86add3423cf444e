#include "smp/optimizer_shards.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include <ATen/ATen.h>

namespace smp {

std::vector<int> assign_shard_owners(const std::vector<std::int64_t>& bytes, int replicas) {
  if (replicas < 1) throw std::invalid_argument("assign_shard_owners: replicas must be positive");
  std::vector<std::size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::int64_t> load(static_cast<std::size_t>(replicas), 0);
  std::vector<int> owner(bytes.size(), 0);
  for (std::size_t index : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[index] = static_cast<int>(least);
    load[static_cast<std::size_t>(least)] += bytes[index];
  }
  return owner;
}

OptimizerShards::OptimizerShards(const std::vector<at::Tensor>& parameters, const std::vector<int>& owner,
                                 comm::Communicator& replicas, std::int64_t bucket_bytes)
    : replicas_(replicas) {
  // Buckets in parameter order per owner, so that every replica posts the same broadcasts in the same order.
  for (int replica = 0; replica < replicas.size(); ++replica) {
    Bucket* open = nullptr;
    std::int64_t open_bytes = 0;
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      if (owner[i] != replica) continue;
      if (replica != replicas.rank()) foreign_.insert(parameters[i].unsafeGetTensorImpl());
      const at::Tensor& parameter = parameters[i];
      if (parameter.numel() == 0) continue;  // nothing to share
      const bool fits = open != nullptr && open->parameters.front().scalar_type() == parameter.scalar_type() &&
                        open->parameters.front().device() == parameter.device() &&
                        open_bytes + static_cast<std::int64_t>(parameter.nbytes()) <= bucket_bytes;
      if (!fits) {
        buckets_.push_back({replica, {}, 0});
        open = &buckets_.back();
        open_bytes = 0;
      }
      open->parameters.push_back(parameter);
      open->elements += parameter.numel();
      open_bytes += static_cast<std::int64_t>(parameter.nbytes());
    }
  }
}

void OptimizerShards::share_updates() {
  at::NoGradGuard no_graph;  // writes into leaves that require grad
  for (const Bucket& bucket : buckets_) {
    const bool mine = bucket.owner == replicas_.rank();
    at::Tensor flat;
    if (mine) {
      std::vector<at::Tensor> pieces;
      for (const auto& parameter : bucket.parameters) pieces.push_back(parameter.detach().reshape({-1}));
      flat = at::cat(pieces);
    } else {
      flat = at::empty({bucket.elements}, bucket.parameters.front().options());
    }
    replicas_.broadcast(flat, bucket.owner);
    if (mine) continue;
    std::int64_t offset = 0;
    for (const auto& parameter : bucket.parameters) {
      parameter.detach().copy_(flat.narrow(0, offset, parameter.numel()).view_as(parameter));
      offset += parameter.numel();
    }
  }
}

}  // namespace smp
