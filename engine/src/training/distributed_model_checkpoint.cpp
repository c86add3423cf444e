// Where a model's state comes from other than its own steps: the step and loss scale of the checkpoint it resumes,
// and weights loaded by name.
#include "smp/distributed_model.h"

#include <c10/core/WrapDimMinimal.h>
#include <c10/util/StringUtil.h>

#include "smp/checkpoint_files.h"
#include "smp/log.h"
#include "smp/tp.h"
#include "training/loss_scaler.h"

namespace smp {

void DistributedModel::load_state(const TensorSource& source) {
  // A tensor-parallel shard takes its part of the whole tensor (an export, pretrained weights), or its own shard
  // (this degree's checkpoint).
  // A share of the experts takes its experts of a whole tensor likewise.
  const int degree = runtime_->topology().tensor_parallel_degree();
  const int expert_shares = runtime_->topology().expert_parallel_degree();
  const auto whole_shape = [&](const std::string& name, const at::Tensor& tensor) {
    auto shape = tensor.sizes().vec();
    if (const auto shard = shard_dims().find(name); shard != shard_dims().end()) {
      shape[static_cast<std::size_t>(c10::maybe_wrap_dim(shard->second.first, tensor.dim()))] *= degree;
    }
    if (expert_shard_names().count(name)) shape[0] *= expert_shares;
    return shape;
  };
  // Everything checked before anything is copied: a bad file leaves the model as it was.
  const auto check = [&](const std::string& name, const at::Tensor& tensor, const char* kind) {
    const auto shape = source.shape(name);
    if (!shape) {
      throw CheckpointError(source.description + ": no " + kind + " \"" + name + "\" (this rank's stages need it)");
    }
    if (*shape != tensor.sizes().vec() && *shape != whole_shape(name, tensor)) {
      throw CheckpointError(source.file_of(name) + ": " + kind + " \"" + name + "\" has shape " + c10::str(*shape) +
                            ", the model has " + c10::str(whole_shape(name, tensor)));
    }
  };
  for (const auto& [name, parameter] : named_parameters_) check(name, parameter, "parameter");
  if (source.has_buffers) {
    for (const auto& [name, buffer] : named_buffers_) check(name, buffer, "buffer");
  }
  c10::NoGradGuard no_grad;
  for (auto& [name, parameter] : named_parameters_) {
    const at::Tensor saved = source.read(name);
    const auto shard = shard_dims().find(name);
    if (saved.sizes() == parameter.sizes()) {
      parameter.copy_(saved);
    } else if (expert_shard_names().count(name)) {
      parameter.copy_(saved.chunk(expert_shares).at(static_cast<std::size_t>(runtime_->ep_rank())));
    } else if (shard == shard_dims().end()) {
      parameter.copy_(saved);
    } else {
      parameter.copy_(tp::shard_of(saved, shard->second.first, runtime_->tensor_parallel_group(), shard->second.second));
    }
  }
  if (source.has_buffers) {
    for (auto& [name, buffer] : named_buffers_) buffer.copy_(source.read(name));
  }
}

void DistributedModel::load_parameters(const std::string& path) { load_state(tensor_source(path)); }

void DistributedModel::resume_at(long long step) { step_ = step; }

void DistributedModel::restore_loss_scale(double scale, long long steps_since_change) {
  loss_scaler_->restore(scale, steps_since_change);
}

}  // namespace smp
