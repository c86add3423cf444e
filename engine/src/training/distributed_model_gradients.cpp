// What happens to a step's gradients between the backward passes and the optimizer: tied copies summed, checked
// for finite values (and unscaled under fp16), clipped, cleared, and which replica's optimizer updates which.
#include "smp/distributed_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include <ATen/ATen.h>

namespace smp {

void DistributedModel::sum_sequence_parallel_gradients() {
  // Every rank of the tensor-parallel group ran the same stage on its slice of the sequence: the same parameters
  // have gradients on each. One all-reduce per dtype.
  std::map<at::ScalarType, std::vector<at::Tensor>> gradients;
  for (const auto& parameter : sequence_parallel_parameters_) {
    if (parameter.grad().defined()) gradients[parameter.grad().scalar_type()].push_back(parameter.grad());
  }
  for (auto& [dtype, group] : gradients) {
    std::vector<at::Tensor> flat;
    for (const auto& gradient : group) flat.push_back(gradient.reshape({-1}));
    at::Tensor sum = at::cat(flat);
    runtime_->tensor_parallel().all_reduce_sum(sum);
    int64_t offset = 0;
    for (auto& gradient : group) {
      gradient.copy_(sum.narrow(0, offset, gradient.numel()).view_as(gradient));
      offset += gradient.numel();
    }
  }
}

void DistributedModel::sum_tied_gradients() {
  for (auto& tied : tied_) {
    // The copies' gradients and, last, how many holders had one: none leaves .grad undefined (the optimizer then
    // skips the parameter, as in plain training).
    const at::Tensor& parameter = tied.parameter;
    const bool has_gradient = parameter.grad().defined();
    const at::Tensor gradient =
        has_gradient ? parameter.grad().reshape({-1}) : at::zeros({parameter.numel()}, parameter.options());
    at::Tensor flat = at::cat({gradient, at::full({1}, has_gradient ? 1.0 : 0.0, parameter.options())});
    tied.holders->all_reduce_sum(flat);
    if (flat[-1].item<double>() == 0.0) {
      tied.parameter.mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor summed = flat.narrow(0, 0, parameter.numel()).view_as(parameter);
    if (has_gradient) {
      tied.parameter.mutable_grad().copy_(summed);
    } else {
      tied.parameter.mutable_grad() = summed.clone();
    }
  }
}

namespace {

// The gradients that .grad holds (a sparse one's values), grouped by device and dtype: the units of multi-tensor ops.
std::vector<std::vector<at::Tensor>> gradients_by_device_and_dtype(
    const std::vector<std::pair<std::string, at::Tensor>>& parameters) {
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& [name, parameter] : parameters) {
    const at::Tensor& gradient = parameter.grad();
    if (!gradient.defined()) continue;
    const at::Tensor values = gradient.is_sparse() ? gradient._values() : gradient;
    auto group = std::find_if(groups.begin(), groups.end(), [&](const std::vector<at::Tensor>& g) {
      return g.front().device() == values.device() && g.front().scalar_type() == values.scalar_type();
    });
    if (group == groups.end()) group = groups.insert(groups.end(), std::vector<at::Tensor>{});
    group->push_back(values);
  }
  return groups;
}

// Whether every element of these same-device, same-dtype tensors is finite: one multi-tensor reduction and one host
// wait, where a kernel and a host sync per parameter cost a GPT stage milliseconds per step on a GPU. The sum of the
// L1 norms is finite when every element is (a NaN or an infinity carries through |x| and every sum); half-precision
// values are summed in float32 and the norms in double. A float32 tensor whose |x| sum passes 3.4e38 would read as
// non-finite, far beyond anything a step that trains can produce.
bool all_finite(const std::vector<at::Tensor>& tensors) {
  const at::ScalarType type = tensors.front().scalar_type();
  const std::optional<at::ScalarType> accumulate =
      type == at::kHalf || type == at::kBFloat16 ? std::optional(at::kFloat) : std::nullopt;
  return std::isfinite(at::stack(at::_foreach_norm(tensors, 1, accumulate)).to(at::kDouble).sum().item<double>());
}

}  // namespace

bool DistributedModel::local_gradients_finite() const {
  for (const auto& group : gradients_by_device_and_dtype(named_parameters_)) {
    if (!all_finite(group)) return false;
  }
  return true;
}

bool DistributedModel::unscale_gradients_checking_finite() {
  // fp16: one pass over the gradients both divides them by the loss scale and finds non-finite values (the fused
  // kernel of PyTorch's GradScaler), one host sync per group. It checks its input: dividing by a scale above 1
  // cannot overflow, and the scale is a power of two (it only ever doubles or halves), so multiplying by its inverse
  // equals dividing. A scale below 1 (many overflows in a row), or a dtype the kernel lacks on the GPU (bfloat16),
  // divides first and checks the result.
  bool finite = true;
  for (auto& gradients : gradients_by_device_and_dtype(named_parameters_)) {
    const at::ScalarType type = gradients.front().scalar_type();
    if (loss_scale_ > 1.0 && (type == at::kFloat || type == at::kDouble || type == at::kHalf)) {
      at::Tensor found = at::zeros({1}, at::TensorOptions(at::kFloat).device(gradients.front().device()));
      const at::Tensor inverse = at::full({1}, 1.0 / loss_scale_, found.options());
      at::_amp_foreach_non_finite_check_and_unscale_(gradients, found, inverse);
      finite = finite && found.item<float>() == 0.0f;
    } else {
      at::_foreach_div_(gradients, loss_scale_);
      finite = finite && all_finite(gradients);
    }
  }
  return finite;
}

double DistributedModel::clip_grad_norm(double max_norm) {
  // On the parameters' device: the pipeline group reduces it there (NCCL on a GPU).
  const auto options = at::TensorOptions(at::kDouble).device(runtime_->device());
  at::Tensor squares = at::zeros({1}, options);
  at::Tensor expert_squares = at::zeros({1}, options);
  for (const auto& parameter : norm_parameters_) {
    if (!parameter.grad().defined()) continue;
    const bool expert = std::any_of(expert_parameters_.begin(), expert_parameters_.end(),
                                    [&](const at::Tensor& shard) { return shard.is_same(parameter); });
    (expert ? expert_squares : squares) += parameter.grad().to(at::kDouble).pow(2).sum();
  }
  // Each rank of an expert-parallel group holds other experts (with the same averaged gradients as the replicas
  // holding the same ones): the group's shares together are the layer's.
  if (runtime_->topology().expert_parallel_degree() > 1) runtime_->expert_parallel().all_reduce_sum(expert_squares);
  squares += expert_squares;
  // Replicas hold identical averaged gradients, so the pipeline groups of one replica see the whole model: each
  // shard on its rank, each parameter the tensor-parallel ranks all hold whole on tp rank 0 alone.
  runtime_->pipeline().all_reduce_sum(squares);
  if (runtime_->topology().tensor_parallel_degree() > 1) runtime_->tensor_parallel().all_reduce_sum(squares);
  const double norm = std::sqrt(squares.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    for (const auto& [name, parameter] : named_parameters_) {
      if (parameter.grad().defined()) parameter.grad().mul_(scale);
    }
  }
  return norm;
}

void DistributedModel::zero_grad(bool set_to_none) {
  for (const auto& [name, parameter] : named_parameters_) {
    at::Tensor& gradient = parameter.mutable_grad();
    if (!gradient.defined()) continue;
    if (set_to_none) {
      gradient.reset();
    } else {
      gradient = gradient.detach();  // as torch.optim does: a gradient with history would keep its graph
      gradient.zero_();
    }
  }
}

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
