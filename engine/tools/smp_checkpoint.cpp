// smp_checkpoint: inspect and convert checkpoints without starting a job.
//   smp_checkpoint list ROOT          every checkpoint under ROOT, complete or not, and why not
//   smp_checkpoint verify DIR         checks the manifest and every file's size and checksum
//   smp_checkpoint export DIR FILE    merges the partitions into one full-model file (parameters and buffers by name)
//   smp_checkpoint export-safetensors DIR OUTDIR [MAX_SHARD_BYTES]
//                                     the same as Hugging Face safetensors shards and index (from_pretrained's layout)

#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <string>

#include "smp/checkpoint.h"
#include "smp/checkpoint_manifest.h"
#include "smp/config.h"
#include "smp/main.h"

namespace {

// Its state is spread over more files than one a stage: say so where it is listed.
std::string sharding(const smp::CheckpointManifest& manifest) {
  std::string said;
  if (manifest.tensor_parallel_degree > 1) {
    said += ", each stage's tensors split over " + std::to_string(manifest.tensor_parallel_degree) +
            " tensor-parallel ranks";
  }
  if (manifest.expert_parallel_degree > 1) {
    said += ", experts divided over " + std::to_string(manifest.expert_parallel_degree) +
            " replicas (a file each, -epNN)";
  }
  if (manifest.optimizer_shards > 1) {
    said += ", optimizer state sharded over " + std::to_string(manifest.optimizer_shards) + " replicas";
  }
  return said;
}

// Saved without its frozen parameters ("checkpoint_frozen_parameters": false, a LoRA job's): an export of it holds
// the trained ones alone, and a resume needs the base loaded first.
std::string frozen_left_out(const smp::CheckpointManifest& manifest) {
  try {
    if (smp::Config::from_json_text(manifest.config_json, "manifest").checkpoint_frozen_parameters) return "";
  } catch (const smp::ConfigError&) {  // a config this version no longer reads: nothing to say
    return "";
  }
  return ", frozen parameters left out (its exports hold the trained ones alone; a resume loads the base first)";
}

bool is_checkpoint(const std::filesystem::path& directory) {
  return std::filesystem::exists(directory / "manifest.json") ||
         std::filesystem::exists(directory / smp::partition_file_name(0, -1));
}

int run(int argc, char** argv) {
  const std::string usage =
      "usage: smp_checkpoint list ROOT                 every checkpoint under ROOT (checkpoint_dir), complete or not\n"
      "       smp_checkpoint verify DIR                one checkpoint's manifest, files, sizes and checksums\n"
      "       smp_checkpoint export DIR FILE           the partitions merged into one full-model file\n"
      "       smp_checkpoint export-safetensors DIR OUTDIR [MAX_SHARD_BYTES]\n"
      "                                                Hugging Face safetensors shards and index (5 GB shards)";
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("%s\n", usage.c_str());
    return 0;
  }
  if (argc < 3) throw std::runtime_error(usage);
  const std::string command = argv[1];
  if ((command == "list" || command == "verify" || command == "export" || command == "export-safetensors") &&
      !std::filesystem::is_directory(argv[2])) {
    throw std::runtime_error(std::string(argv[2]) + (std::filesystem::exists(argv[2]) ? " is not a directory" : " does not exist") +
                             (command == "list" ? ": give checkpoint_dir, the directory of the checkpoints"
                                                : ": give one checkpoint's directory (smp_checkpoint list ROOT lists them)"));
  }
  if (command == "list" && argc == 3) {
    if (is_checkpoint(argv[2])) {
      throw std::runtime_error(std::string(argv[2]) + " is one checkpoint, not a directory of them: smp_checkpoint "
                               "verify " + argv[2] + " checks it");
    }
    std::vector<std::filesystem::path> directories;
    for (const auto& entry : std::filesystem::directory_iterator(argv[2])) {
      if (entry.is_directory()) directories.push_back(entry.path());
    }
    std::sort(directories.begin(), directories.end());
    if (directories.empty()) std::printf("no checkpoints under %s\n", argv[2]);
    for (const auto& directory : directories) {
      try {
        const auto manifest = smp::verify_checkpoint(directory.string());
        std::printf("%s: complete, step %lld, %d partitions%s%s\n", directory.c_str(),
                    static_cast<long long>(manifest.step), manifest.partitions, sharding(manifest).c_str(),
                    frozen_left_out(manifest).c_str());
      } catch (const smp::CheckpointError& error) {
        std::printf("%s: incomplete: %s\n", directory.c_str(), error.what());
      }
    }
    return 0;
  }
  if (command == "verify" && argc == 3) {
    if (!is_checkpoint(argv[2]) && std::filesystem::is_directory(argv[2])) {
      for (const auto& entry : std::filesystem::directory_iterator(argv[2])) {
        if (entry.is_directory() && is_checkpoint(entry.path())) {
          throw std::runtime_error(std::string(argv[2]) + " holds checkpoints (" + entry.path().filename().string() +
                                   ", ...), it is not one: verify one of them, or smp_checkpoint list " + argv[2]);
        }
      }
    }
    const auto manifest = smp::verify_checkpoint(argv[2]);
    std::printf("%s: complete, step %lld, %d partitions x %d virtual stages, saved by %d replicas%s%s\n", argv[2],
                static_cast<long long>(manifest.step), manifest.partitions, manifest.virtual_stages, manifest.replicas,
                sharding(manifest).c_str(), frozen_left_out(manifest).c_str());
    return 0;
  }
  if (command == "export" && argc == 4) {
    smp::export_checkpoint(argv[2], argv[3]);
    std::printf("wrote %s\n", argv[3]);
    return 0;
  }
  if (command == "export-safetensors" && (argc == 4 || argc == 5)) {
    std::int64_t max_shard_bytes = smp::kDefaultShardBytes;
    if (argc == 5) {
      std::size_t used = 0;
      try {
        max_shard_bytes = std::stoll(argv[4], &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || argv[4][used] != '\0' || max_shard_bytes <= 0) {
        throw std::runtime_error("MAX_SHARD_BYTES must be a positive number of bytes, got " + std::string(argv[4]));
      }
    }
    for (const auto& file : smp::export_checkpoint_safetensors(argv[2], argv[3], max_shard_bytes)) {
      std::printf("wrote %s/%s\n", argv[3], file.c_str());
    }
    return 0;
  }
  throw std::runtime_error(usage);
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
