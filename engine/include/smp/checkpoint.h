#pragma once
// Checkpoints that survive crashes: one file per pipeline rank, written by the first data-parallel replica of
// that rank (temporary file, fsync, rename), then a manifest with a checksum per file written last by rank 0.
// Resume picks the newest complete checkpoint; a crash mid-save leaves the previous one valid. Saves are written in
// the background: training waits only for the copy of its state.

#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <string>

#include <ATen/core/Dict.h>

#include "smp/checkpoint_manifest.h"

#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"

namespace smp {

class Checkpointer {
 public:
  // Uses the config's checkpoint_dir, checkpoint_interval, checkpoints_kept and resume.
  Checkpointer(DistributedModel& model, DistributedOptimizer& optimizer);

  bool enabled() const;
  // True when step (0-based, just completed) is a multiple-of-interval save point.
  bool due(std::int64_t step) const;
  // Saves the state after `step`. Every rank calls it. The call returns once the state is copied; a background
  // thread then writes (writers), and on rank 0 waits (bounded by comm_timeout_s) for every partition file,
  // writes the manifest and prunes old checkpoints. A save first waits for the previous one.
  void save(std::int64_t step);
  // Waits for the save in progress; throws CheckpointError if it failed. Call it before the program ends (the
  // destructor also waits, but can only log a failure).
  void wait();
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  // When the config asks to resume and the model was built from a checkpoint (DistributedModel::resumed_from),
  // loads this rank's parameters, optimizer state and RNG state and returns the step to continue at; else 0.
  std::int64_t resume();

 private:
  // `optimizer_bytes` (snapshot_optimizer) is called here, on the writer's thread.
  void write_checkpoint(std::int64_t step, const std::string& directory, const std::string& key,
                        std::optional<c10::impl::GenericDict> contents, std::function<std::string()> optimizer_bytes,
                        std::optional<CheckpointManifest> manifest);

  DistributedModel& model_;
  DistributedOptimizer& optimizer_;
  std::int64_t last_saved_ = -1;
  std::future<void> pending_;  // the save being written
};

// Merges a complete checkpoint into one full-model file (parameters by name) for inference or for loading into
// a different partitioning with DistributedModel::load_parameters.
void export_checkpoint(const std::string& checkpoint_directory, const std::string& output_file);

}  // namespace smp
