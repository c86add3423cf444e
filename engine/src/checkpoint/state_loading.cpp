// A rank's tensors filled from a source of named tensors: its own (this layout's checkpoint), or its part of whole
// ones (an export, pretrained weights), cut where the rank holds a shard.
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "smp/checkpoint_files.h"
#include "smp/checkpoint_manifest.h"
#include "smp/tp.h"

namespace smp {

void load_rank_state(const TensorSource& source, const NamedTensors& parameters, const NamedTensors& buffers,
                     const RankShards& shards) {
  const auto tensor_parallel = [&](const std::string& name) { return shards.tensor_parallel.find(name); };
  const auto whole_shape = [&](const std::string& name, const at::Tensor& tensor) {
    auto shape = tensor.sizes().vec();
    if (const auto shard = tensor_parallel(name); shard != shards.tensor_parallel.end()) {
      shape[static_cast<std::size_t>(c10::maybe_wrap_dim(shard->second.first, tensor.dim()))] *= shards.tp_degree;
    }
    if (shards.experts.count(name)) shape[0] *= shards.ep_degree;
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
  for (const auto& [name, parameter] : parameters) check(name, parameter, "parameter");
  if (source.has_buffers) {
    for (const auto& [name, buffer] : buffers) check(name, buffer, "buffer");
  }
  const at::NoGradGuard no_grad;
  for (const auto& [name, parameter] : parameters) {
    at::Tensor target = parameter;
    const at::Tensor saved = source.read(name);
    const auto shard = tensor_parallel(name);
    if (saved.sizes() == parameter.sizes() || (!shards.experts.count(name) && shard == shards.tensor_parallel.end())) {
      target.copy_(saved);
    } else if (shards.experts.count(name)) {
      target.copy_(saved.chunk(shards.ep_degree).at(static_cast<std::size_t>(shards.ep_rank)));
    } else {
      target.copy_(tp::shard_of(saved, shard->second.first, shards.tp_rank, shards.tp_degree, shard->second.second));
    }
  }
  if (source.has_buffers) {
    for (const auto& [name, buffer] : buffers) {
      at::Tensor target = buffer;
      target.copy_(source.read(name));
    }
  }
}

}  // namespace smp
