// Checkpoint files read back: partition files, their export as one full-model file or as safetensors, and the
// sources DistributedModel::load_state reads named tensors from.
#include "smp/checkpoint_files.h"

#include "checkpoint/partition_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "smp/comm/communicator.h"
#include "smp/safetensors.h"
#include "smp/timeline.h"
#include "smp/tp.h"

namespace smp {

namespace {

// A dictionary's tensors (a partition file's parameters and buffers, a full-model file's) as a source.
TensorSource dictionary_source(std::string description, c10::Dict<std::string, at::Tensor> tensors, bool has_buffers) {
  TensorSource source;
  source.description = description;
  source.has_buffers = has_buffers;
  source.shape = [tensors](const std::string& name) -> std::optional<std::vector<std::int64_t>> {
    const auto found = tensors.find(name);
    if (found == tensors.end()) return std::nullopt;
    return found->value().sizes().vec();
  };
  source.read = [tensors](const std::string& name) { return tensors.at(name); };
  source.file_of = [description](const std::string&) { return description; };
  return source;
}

}  // namespace

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw CheckpointError(path + ": cannot open");
  std::vector<char> bytes(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) throw CheckpointError(path + ": read error");
  return bytes;
}

at::Tensor bytes_tensor(const std::string& bytes) {
  at::Tensor tensor = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

void fsync_directory(const std::string& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// A partition file's parameters and buffers (absent in files written before buffers were kept).
TensorSource state_in(const c10::impl::GenericDict& contents, const std::string& path) {
  c10::Dict<std::string, at::Tensor> tensors;
  for (const char* kind : {"parameters", "buffers"}) {
    if (!contents.contains(kind)) continue;
    for (const auto& entry : contents.at(kind).toGenericDict()) tensors.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  return dictionary_source(path, std::move(tensors), contents.contains("buffers"));
}

// A partition file, or an optimizer shard file (CheckpointFile::dp_rank >= 0, which holds no parameters).
c10::impl::GenericDict load_partition_file(const std::string& path, const CheckpointFile& expected) {
  const auto bytes = read_bytes(path);
  if (bytes.size() != expected.size || crc32(bytes.data(), bytes.size()) != expected.crc32) {
    throw CheckpointError(path + ": size or checksum differs from the manifest (the file is corrupt)");
  }
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception& error) {
    throw CheckpointError(path + ": unreadable: " + comm::brief_message(error));
  }
  if (!value.isGenericDict()) throw CheckpointError(path + ": not an smp partition file");
  auto dict = value.toGenericDict();
  const char* payload = expected.dp_rank >= 0 ? "optimizer" : "parameters";
  if (!dict.contains("format") || dict.at("format").toInt() != kPartitionFormat || !dict.contains(payload)) {
    throw CheckpointError(path + ": not an smp partition file of format " + std::to_string(kPartitionFormat));
  }
  return dict;
}

FullModel read_full_model(const std::string& full_model_file) {
  std::vector<char> bytes = read_bytes(full_model_file);
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception& error) {
    throw CheckpointError(full_model_file + ": unreadable: " + comm::brief_message(error));
  }
  if (!value.isGenericDict() || !value.toGenericDict().contains("parameters") ||
      !value.toGenericDict().at("parameters").isGenericDict()) {
    throw CheckpointError(full_model_file + ": not an smp model file");
  }
  const auto dict = value.toGenericDict();
  FullModel model;
  for (const auto& entry : dict.at("parameters").toGenericDict()) {
    model.parameters.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  model.has_buffers = dict.contains("buffers");
  if (model.has_buffers) {
    for (const auto& entry : dict.at("buffers").toGenericDict()) {
      model.buffers.insert(entry.key().toStringRef(), entry.value().toTensor());
    }
  }
  return model;
}

namespace {

// Calls `take(name, tensor, is_buffer)` for the parameters and buffers of the checkpoint's partition files, one file
// at a time (what an export streams). Returns the checkpoint's step.
std::int64_t for_each_saved_tensor(const std::string& checkpoint_directory,
                                   const std::function<void(const std::string&, const at::Tensor&, bool)>& take) {
  const auto manifest = verify_checkpoint(checkpoint_directory);
  // A pipeline rank's files are read together, one per tensor-parallel shard (in shard order) and share of the
  // experts: a sharded tensor is written whole, its shards put together, and a layer's experts all of them, in
  // the shares' order.
  std::map<int, std::vector<CheckpointFile>> partition_files;
  for (const auto& file : manifest.files) {
    if (file.dp_rank < 0) partition_files[file.pp_rank].push_back(file);  // else an optimizer shard: no parameters
  }
  std::set<std::string> taken;  // a tied parameter is in the file of every rank holding a copy: the same values
  for (auto& [pp_rank, files] : partition_files) {
    std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) {
      return std::make_pair(a.ep_rank, a.tp_rank) < std::make_pair(b.ep_rank, b.tp_rank);
    });
    std::vector<c10::impl::GenericDict> shards, shares;  // share 0's files by tp rank; tp rank 0's by share
    for (const auto& file : files) {
      auto contents = load_partition_file(checkpoint_directory + "/" + file.name, file);
      if (file.ep_rank == 0) shards.push_back(contents);
      if (file.tp_rank == 0) shares.push_back(std::move(contents));
    }
    const auto& contents = shards.front();
    std::set<std::string> experts;
    if (contents.contains("expert_shards")) {
      for (const auto& name : contents.at("expert_shards").toListRef()) experts.insert(name.toStringRef());
    }
    std::map<std::string, std::pair<std::int64_t, std::int64_t>> layouts;
    if (contents.contains("shards")) {
      for (const auto& entry : contents.at("shards").toGenericDict()) {
        const auto dims = entry.value().toIntList();
        layouts[entry.key().toStringRef()] = {dims.get(0), dims.get(1)};
      }
    }
    for (const char* kind : {"parameters", "buffers"}) {
      if (!contents.contains(kind)) continue;  // buffers: absent in files written before they were kept
      for (const auto& entry : contents.at(kind).toGenericDict()) {
        const std::string& name = entry.key().toStringRef();
        if (!taken.insert(name).second) continue;
        at::Tensor tensor = entry.value().toTensor();
        if (const auto layout = layouts.find(name); layout != layouts.end()) {
          std::vector<at::Tensor> pieces;
          for (const auto& shard : shards) pieces.push_back(shard.at(kind).toGenericDict().at(name).toTensor());
          tensor = tp::whole_of(pieces, layout->second.first, layout->second.second);
        } else if (experts.count(name)) {
          std::vector<at::Tensor> pieces;
          for (const auto& share : shares) pieces.push_back(share.at(kind).toGenericDict().at(name).toTensor());
          tensor = at::cat(pieces);
        }
        take(name, tensor, std::string(kind) == "buffers");
      }
    }
  }
  return manifest.step;
}

}  // namespace

void export_checkpoint(const std::string& checkpoint_directory, const std::string& output_file) {
  // Parameters and buffers apart, so that a reader can tell a file with no buffers from one written before
  // checkpoints kept them.
  c10::Dict<std::string, at::Tensor> parameters, buffers;
  const std::int64_t step =
      for_each_saved_tensor(checkpoint_directory, [&](const std::string& name, const at::Tensor& tensor, bool buffer) {
        (buffer ? buffers : parameters).insert(name, tensor);
      });
  c10::impl::GenericDict full(c10::StringType::get(), c10::AnyType::get());
  full.insert("format", kPartitionFormat);
  full.insert("step", step);
  full.insert("parameters", parameters);
  full.insert("buffers", buffers);
  const auto bytes = torch::jit::pickle_save(full);
  try {
    write_file_atomically(output_file, std::string_view(bytes.data(), bytes.size()));
  } catch (const std::exception& error) {  // a full disk, a directory not there or read-only: the export's error
    throw CheckpointError(std::string("exporting ") + checkpoint_directory + ": " + error.what());
  }
}

TensorSource tensor_source(const std::string& path) {
  if (!SafetensorsSource::is_safetensors(path)) {
    FullModel model = read_full_model(path);
    c10::Dict<std::string, at::Tensor> all = model.parameters;
    for (const auto& entry : model.buffers) all.insert(entry.key(), entry.value());
    return dictionary_source(path, std::move(all), model.has_buffers);
  }
  auto safetensors = std::make_shared<SafetensorsSource>(path);
  TensorSource source;
  source.description = path;
  source.shape = [safetensors](const std::string& name) -> std::optional<std::vector<std::int64_t>> {
    if (!safetensors->contains(name)) return std::nullopt;
    return safetensors->shape(name);
  };
  source.read = [safetensors](const std::string& name) { return safetensors->read(name); };
  source.file_of = [safetensors](const std::string& name) { return safetensors->file_of(name); };
  return source;
}

std::vector<std::string> export_checkpoint_safetensors(const std::string& checkpoint_directory,
                                                       const std::string& output_directory,
                                                       std::int64_t max_shard_bytes) {
  try {
    SafetensorsWriter writer(output_directory, max_shard_bytes);
    for_each_saved_tensor(checkpoint_directory,
                          [&](const std::string& name, const at::Tensor& tensor, bool) { writer.add(name, tensor); });
    return writer.finish();
  } catch (...) {
    // Caught here so that the writer's destructor removes what it wrote: a tool's main lets an exception end the
    // process without unwinding (smp::guarded_main).
    throw;
  }
}

}  // namespace smp
