// Which replica's optimizer updates which parameter (shard_optimizer_state), and the gradient operations the
// optimizers call, handed to the model's GradientSync.
#include "smp/distributed_model.h"

#include "training/gradient_sync.h"

namespace smp {

double DistributedModel::clip_grad_norm(double max_norm) { return gradients_->clip_norm(max_norm); }

void DistributedModel::zero_grad(bool set_to_none) { gradients_->zero(set_to_none); }

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
  // groups even if requires_grad changes later.
  std::vector<std::int64_t> bytes;
  std::vector<std::size_t> trainable;
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    if (!trainable_at_build_[i]) continue;
    bytes.push_back(static_cast<std::int64_t>(named_parameters_[i].second.nbytes()));
    trainable.push_back(i);
  }
  const std::vector<int> owner_of_trainable = assign_shard_owners(bytes, replicas);
  std::vector<int> owners(named_parameters_.size(), -1);
  for (std::size_t k = 0; k < trainable.size(); ++k) owners[trainable[k]] = owner_of_trainable[k];
  return owners;
}

void DistributedModel::share_updated_parameters() {
  if (shards_) shards_->share_updates();
}

}  // namespace smp
