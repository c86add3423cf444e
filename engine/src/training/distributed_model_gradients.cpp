// Which replica's optimizer updates which parameter (shard_optimizer_state), and the gradient operations the
// optimizers call, handed to the model's GradientSync.
#include "smp/distributed_model.h"

#include <algorithm>
#include <set>

#include "smp/config.h"
#include "training/gradient_sync.h"

namespace smp {

double DistributedModel::clip_grad_norm(double max_norm) { return gradients_->clip_norm(max_norm); }

void DistributedModel::zero_grad(bool set_to_none) {
  gradients_->zero(set_to_none);
  forget_dropped_gradients();
}

const std::vector<at::Tensor>& DistributedModel::norm_parameters() const { return gradients_->norm_parameters(); }

const std::map<std::string, std::pair<int64_t, int64_t>>& DistributedModel::shard_dims() const {
  return gradients_->shard_dims();
}

const std::set<std::string>& DistributedModel::expert_shard_names() const { return gradients_->expert_shard_names(); }

int DistributedModel::optimizer_state_shards() const {
  // From the config, not from shards_: a rank without trainable parameters has none, yet its checkpoint files
  // must follow the same layout as every other rank's.
  return runtime_->config().shard_optimizer_state ? runtime_->topology().data_parallel_degree() : 1;
}

std::vector<int> DistributedModel::optimizer_shard_owners(int replicas) const {
  // The trainable parameters as the constructor found them, so that the owners stay those of the optimizer's
  // groups even if requires_grad changes later. Expert shards go to the replicas holding the same experts (every
  // ep-th from this one's expert-parallel rank), the rest to all.
  const int shares = runtime_->topology().expert_parallel_degree();
  const bool by_holders = shares > 1 && replicas > 1;
  if (by_holders && replicas % shares != 0) {
    throw ConfigError("optimizer state sharded over " + std::to_string(replicas) + " replicas cannot be divided by " +
                      "\"expert_parallel_degree\" " + std::to_string(shares));
  }
  const std::set<std::string>& experts = expert_shard_names();
  std::vector<std::int64_t> bytes, expert_bytes;
  std::vector<std::size_t> dense, expert;
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    if (!trainable_at_build_[i]) continue;
    const bool held_by_some = by_holders && experts.count(named_parameters_[i].first);
    (held_by_some ? expert_bytes : bytes).push_back(static_cast<std::int64_t>(named_parameters_[i].second.nbytes()));
    (held_by_some ? expert : dense).push_back(i);
  }
  std::vector<int> owners(named_parameters_.size(), -1);
  const std::vector<int> dense_owner = assign_shard_owners(bytes, replicas);
  for (std::size_t k = 0; k < dense.size(); ++k) owners[dense[k]] = dense_owner[k];
  if (by_holders) {
    const std::vector<int> holder = assign_shard_owners(expert_bytes, replicas / shares);
    for (std::size_t k = 0; k < expert.size(); ++k) owners[expert[k]] = runtime_->ep_rank() + holder[k] * shares;
  }
  return owners;
}

void DistributedModel::make_optimizer_shards() {
  const std::vector<int> owners = optimizer_shard_owners(runtime_->topology().data_parallel_degree());
  const int shares = runtime_->topology().expert_parallel_degree();
  const std::set<std::string>& experts = expert_shard_names();
  std::vector<at::Tensor> dense, expert;
  std::vector<int> dense_owner, expert_holder;
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    if (owners[i] < 0) continue;
    if (experts.count(named_parameters_[i].first)) {
      expert.push_back(named_parameters_[i].second);
      expert_holder.push_back(owners[i] / shares);  // its rank in the expert-data-parallel group
    } else {
      dense.push_back(named_parameters_[i].second);
      dense_owner.push_back(owners[i]);
    }
  }
  if (!dense.empty()) {
    shards_.push_back(std::make_unique<OptimizerShards>(dense, dense_owner, runtime_->data_parallel(),
                                                        GradientSync::kBucketBytes));
  }
  if (!expert.empty() && runtime_->expert_data_parallel().size() > 1) {
    shards_.push_back(std::make_unique<OptimizerShards>(expert, expert_holder, runtime_->expert_data_parallel(),
                                                        GradientSync::kBucketBytes));
  }
}

bool DistributedModel::updates_parameter(const at::Tensor& parameter) const {
  return std::all_of(shards_.begin(), shards_.end(), [&](const auto& shards) { return shards->owns(parameter); });
}

void DistributedModel::share_updated_parameters() {
  for (const auto& shards : shards_) shards->share_updates();
}

}  // namespace smp
