#pragma once
// The manifest of a checkpoint and the rules that make a checkpoint complete: every file it lists is present
// with the size and CRC-32 it records. Plain C++, so the reader can be fuzzed without LibTorch.
//
// Layout under checkpoint_dir:  step-00000042/manifest.json, step-00000042/partition-0003.pt, ...
// The manifest is written last and atomically, so a directory without a valid manifest is an interrupted save.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace smp {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CheckpointFile {
  std::string name;  // relative to the checkpoint directory, no '/'
  int pp_rank = 0;
  std::uint64_t size = 0;
  std::uint32_t crc32 = 0;
  // -1: the pipeline rank's partition file (parameters, RNG, and the optimizer state of replica 0, or of all
  // replicas when it is not sharded). Else the optimizer state shard of that replica (1 .. optimizer_shards - 1;
  // under expert parallelism from expert_parallel_degree, whose first replicas write partition files).
  int dp_rank = -1;
  // Under tensor parallelism each shard of a pipeline rank has its files: this one's tensors are shard tp_rank's.
  int tp_rank = 0;
  // Under expert parallelism each share of the experts has its partition file (written by the first block's
  // replica ep_rank): this one's experts are share ep_rank's, the rest the same as in share 0's.
  int ep_rank = 0;
};

struct CheckpointManifest {
  static constexpr int kFormatVersion = 1;
  std::int64_t step = 0;             // the last completed step; training resumes at step + 1
  int partitions = 0;
  int virtual_stages = 1;
  int replicas = 0;                  // when saved; any number may load it
  // The replicas the optimizer state was sharded over (shard_optimizer_state); 1: the partition files hold it all.
  // Any job may resume it: one sharded otherwise (or not at all) reads every share and keeps its own (not under
  // expert parallelism, whose resume keeps the sharding).
  int optimizer_shards = 1;
  // The shards of each layer a tensor-parallel model split (absent, 1, in checkpoints written before): a resume
  // needs the same degree; an export puts the shards together.
  int tensor_parallel_degree = 1;
  // The shares the experts were divided into (absent, 1, when not): a resume needs the same degree; an export puts
  // the shares together.
  int expert_parallel_degree = 1;
  std::string schedule;              // generator name, for the record
  std::vector<std::string> module_names;
  std::vector<int> stage_of_module;  // the partition
  std::string model_signature;       // parameter names and shapes, to refuse a different model
  // The parameters the signature covers, "name:d0,d1,;" each (absent in checkpoints written before): a refusal
  // names the first that differs.
  std::string model_parameters;
  std::uint64_t seed = 0;
  std::string config_json;           // the job's config as given
  std::vector<CheckpointFile> files;

  std::string to_json() const;
  // Strict: wrong types, missing keys, unknown versions, unsafe file names, or files that do not cover every
  // pipeline rank and tensor-parallel shard (and, with sharded optimizer state, every replica after the first)
  // exactly once are
  // CheckpointErrors naming `source`.
  static CheckpointManifest parse(const std::string& text, const std::string& source);
};

// How a checkpoint directory without a manifest (a save that never finished) is described: a resume tells such a
// crash's leftover from a damaged checkpoint by it.
inline constexpr const char* kUnfinishedSave = "(the save did not finish)";

std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc = 0);
// CRC-32 and size of a file; CheckpointError naming the path when it cannot be read.
std::pair<std::uint32_t, std::uint64_t> crc32_of_file(const std::string& path);

std::string checkpoint_directory_name(std::int64_t step);  // "step-00000042"
// Under tensor parallelism (tp_rank >= 0) the names end in the shard: "partition-0003-tp01.pt"; a share of the
// experts after the first (ep_rank > 0) in it too: "partition-0003-ep01.pt".
std::string partition_file_name(int pp_rank, int tp_rank = -1, int ep_rank = 0);  // "partition-0003.pt"
std::string optimizer_shard_file_name(int pp_rank, int dp_rank, int tp_rank = -1);  // "optimizer-0003-0001.pt"

// Reads and checks one checkpoint directory: the manifest parses and every file matches its size and checksum.
CheckpointManifest verify_checkpoint(const std::string& directory);
// The manifest alone, for a rank that checks only its own file as it loads it.
CheckpointManifest read_manifest(const std::string& directory);

struct FoundCheckpoint {
  std::string directory;
  CheckpointManifest manifest;
};
// The newest complete checkpoint under `root` (by step), skipping incomplete or corrupt ones; each skipped
// directory's reason is appended to `skipped` when given. nullopt when there is none.
std::optional<FoundCheckpoint> find_latest_checkpoint(const std::string& root, std::vector<std::string>* skipped = nullptr);

// Removes all but the newest `keep` complete checkpoints, and any incomplete one older than the newest complete.
// Complete here: the manifest parses and every file has its size (checksums are read when a checkpoint is loaded or
// verified, not at every save, which would read every kept checkpoint whole).
void prune_checkpoints(const std::string& root, int keep);

// The highest step under `root` whose save finished (its manifest written), if any.
std::optional<std::int64_t> highest_saved_step(const std::string& root);

}  // namespace smp
