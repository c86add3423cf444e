#pragma once
// Checkpoints that survive crashes: one file per pipeline rank, written by the first data-parallel replica of
// that rank (temporary file, fsync, rename), then a manifest with a checksum per file written last by rank 0.
// Resume picks the newest complete checkpoint; a crash mid-save leaves the previous one valid.

#include <cstdint>
#include <string>

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
  // Saves the state after `step`. Every rank calls it; writers write, rank 0 also waits (bounded by
  // comm_timeout_s) for every partition file and then writes the manifest and prunes old checkpoints.
  void save(std::int64_t step);
  // When the config asks to resume and the model was built from a checkpoint (DistributedModel::resumed_from),
  // loads this rank's parameters, optimizer state and RNG state and returns the step to continue at; else 0.
  std::int64_t resume();

 private:
  DistributedModel& model_;
  DistributedOptimizer& optimizer_;
  std::int64_t last_saved_ = -1;
};

// Merges a complete checkpoint into one full-model file (parameters by name) for inference or for loading into
// a different partitioning with DistributedModel::load_parameters.
void export_checkpoint(const std::string& checkpoint_directory, const std::string& output_file);

}  // namespace smp
