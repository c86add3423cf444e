#pragma once
// A checkpoint's files read back, apart from the Checkpointer that writes them (smp/checkpoint.h): whole-model
// exports (one smp file, or Hugging Face safetensors) and the sources of named tensors that
// DistributedModel::load_state reads (an export, safetensors, a partition file).

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

namespace smp {

// Hugging Face's default shard size for save_pretrained.
constexpr std::int64_t kDefaultShardBytes = 5'000'000'000;

// Named tensors a model's state is loaded from, read one at a time: a checkpoint's partition file, a full-model
// file, safetensors (made here).
struct TensorSource {
  std::string description;  // the file or directory
  // The tensor's shape, or nullopt when the source has no tensor of that name.
  std::function<std::optional<std::vector<std::int64_t>>(const std::string& name)> shape;
  std::function<at::Tensor(const std::string& name)> read;
  std::function<std::string(const std::string& name)> file_of;  // where the tensor is, for errors
  bool has_buffers = true;  // false: written before buffers were kept; this model's buffers then stay as they are
};

// Merges a complete checkpoint into one full-model file (parameters and buffers by name) for inference or for
// loading into a different partitioning with DistributedModel::load_parameters.
void export_checkpoint(const std::string& checkpoint_directory, const std::string& output_file);
// The same as Hugging Face safetensors in `output_directory` (model.safetensors, or shards of at most
// max_shard_bytes and model.safetensors.index.json): what from_pretrained loads, by the model's state_dict names.
// Reads one partition file at a time and writes each shard once full, so it never holds the whole model. Returns
// the files written.
std::vector<std::string> export_checkpoint_safetensors(const std::string& checkpoint_directory,
                                                       const std::string& output_directory,
                                                       std::int64_t max_shard_bytes = kDefaultShardBytes);
// The tensors of a full-model file (export_checkpoint), by name. CheckpointError when it is not one. Files written
// before buffers were kept have none (has_buffers false).
struct FullModel {
  c10::Dict<std::string, at::Tensor> parameters;
  c10::Dict<std::string, at::Tensor> buffers;
  bool has_buffers = false;
};
FullModel read_full_model(const std::string& full_model_file);
// The tensors of a full-model file, or of safetensors (SafetensorsSource::is_safetensors), to load with
// DistributedModel::load_state.
TensorSource tensor_source(const std::string& path);

// Which of a rank's tensors are its part of a whole one: tensor-parallel shards (name -> (dim, blocks), as
// tp::shard_of cuts) and shares of a layer's experts (along dimension 0).
struct RankShards {
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> tensor_parallel;
  int tp_rank = 0;
  int tp_degree = 1;
  std::set<std::string> experts;
  int ep_rank = 0;
  int ep_degree = 1;
};
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
// Copies each of `parameters` and `buffers` (a rank's, by the whole model's names) from `source`: a tensor of its
// own shape as it is, a whole one cut to this rank's part. Every name and shape is checked before anything is
// copied: CheckpointError names a missing or mis-shaped tensor and its file. Buffers stay as they are when the
// source has none.
void load_rank_state(const TensorSource& source, const NamedTensors& parameters, const NamedTensors& buffers,
                     const RankShards& shards);

}  // namespace smp
