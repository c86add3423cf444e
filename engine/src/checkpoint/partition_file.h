#pragma once
// A checkpoint's partition file as the Checkpointer writes it and exports read it: a pickled dictionary (format,
// parameters, buffers, optimizer bytes, ...), checked against the manifest's size and CRC-32 when read.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "smp/checkpoint_files.h"
#include "smp/checkpoint_manifest.h"

namespace smp {

constexpr std::int64_t kPartitionFormat = 1;

std::vector<char> read_bytes(const std::string& path);
at::Tensor bytes_tensor(const std::string& bytes);
void fsync_directory(const std::string& directory);
// A partition file's parameters and buffers (absent in files written before buffers were kept).
TensorSource state_in(const c10::impl::GenericDict& contents, const std::string& path);
// A partition file, or an optimizer shard file (CheckpointFile::dp_rank >= 0, which holds no parameters).
c10::impl::GenericDict load_partition_file(const std::string& path, const CheckpointFile& expected);

}  // namespace smp
