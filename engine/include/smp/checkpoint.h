#pragma once
// Checkpoints that survive crashes: one file per pipeline rank, written by the first data-parallel replica of
// that rank (temporary file, fsync, rename), plus, when the optimizer state is sharded, one file per later replica
// with its share of that state; then a manifest with a checksum per file written last by rank 0.
// Resume picks the newest complete checkpoint; a crash mid-save leaves the previous one valid. Saves are written in
// the background: training waits only for the copy of its state.

#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <c10/core/Device.h>

#include "smp/checkpoint_files.h"
#include "smp/checkpoint_manifest.h"

#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"

namespace torch::optim {
class LRScheduler;
}

namespace smp {

// One replica's optimizer state in a checkpoint: what its optimizer's snapshot() serialized, and the names of the
// parameters that optimizer held (with sharded state its share; else all of this rank's).
struct SavedOptimizerShare {
  std::string path;  // the file it came from, for errors
  std::string bytes;
  std::vector<std::string> parameters;
};

// Optimizer state as a checkpoint holds it, sharded over `share_count` replicas ("shard_optimizer_state"; 1: not
// sharded). A load reads shares `first_share` .. `first_share + shares_to_read - 1` one at a time through `read`,
// so that no more than one share beyond this replica's own is in memory at once.
struct SavedOptimizerState {
  int share_count = 1;
  int first_share = 0;
  int shares_to_read = 1;
  std::function<SavedOptimizerShare(int share)> read;
};

// What a checkpoint keeps of the optimizer (and whatever else trains along with it). The Checkpointer makes the
// one of a DistributedOptimizer itself; the Python package passes one for torch.optim optimizers.
class OptimizerCheckpointState {
 public:
  virtual ~OptimizerCheckpointState() = default;
  // Called during the save's pause, while nothing changes the state. The function returned runs later on the
  // checkpoint writer's thread, while training goes on, and returns the serialized state as it was at the call.
  virtual std::function<std::string()> snapshot() = 0;
  // Restores the state of the parameters this replica's optimizer holds from the shares, whatever the sharding they
  // were saved with, onto `device`; throws on bytes that do not fit.
  virtual void load(const SavedOptimizerState& saved, c10::Device device) = 0;
  // The serialization's name, kept in the partition file: a checkpoint written in one format is refused by a job
  // whose optimizer reads another, with a message saying so.
  virtual std::string format() const = 0;
};

// The checkpoint a job resumes ("resume"): the newest complete one under checkpoint_dir as rank 0 finds it (every
// rank takes rank 0's choice through the store, under `key`), checked against this job's layout, modules and model
// signature (CheckpointError naming what differs); nullopt when there is none. DistributedModel then takes its
// partition.
std::optional<FoundCheckpoint> checkpoint_to_resume(Runtime& runtime, const std::string& key,
                                                    const std::vector<std::string>& module_names,
                                                    const std::string& model_signature,
                                                    const std::string& model_parameters = "");

class DirectoryLock;

// What a program keeps beside the model and its optimizer for a resume to continue exactly: an LR scheduler's step
// count (lr_scheduler_state), a data loader's position. `save` runs in the save's pause on the ranks that write a
// file (each stage's first replica; with sharded optimizer state every replica), so it must not communicate;
// resume() gives every rank's `load` the bytes its stage's writer saved: keep what is alike on every rank.
struct ProgramState {
  std::function<std::string()> save;
  std::function<void(const std::string& bytes)> load;
};
using ProgramStates = std::map<std::string, ProgramState>;

// A LibTorch LR scheduler's step count, which it keeps to itself: resumed, it goes on decaying at the steps the
// uninterrupted run would (the learning rate itself is the optimizer's, which the checkpoint restores). Stepping
// a fresh scheduler `first step` times instead decays the restored rate again.
ProgramState lr_scheduler_state(torch::optim::LRScheduler& scheduler);

class Checkpointer {
 public:
  // Uses the config's checkpoint_dir, checkpoint_interval, checkpoints_kept and resume.
  Checkpointer(DistributedModel& model, DistributedOptimizer& optimizer);
  // With the program's own state, by name (a resume of a checkpoint saved without one of them is refused).
  Checkpointer(DistributedModel& model, DistributedOptimizer& optimizer, ProgramStates program_state);
  Checkpointer(DistributedModel& model, std::unique_ptr<OptimizerCheckpointState> optimizer_state);

  bool enabled() const;
  // True when step (0-based, just completed) is a multiple-of-interval save point.
  bool due(std::int64_t step) const;
  // Saves the state after `step`. Every rank calls it. The call returns once the state is copied; a background
  // thread then writes (writers), and on rank 0 waits (bounded by comm_timeout_s) for every partition file,
  // writes the manifest and prunes old checkpoints; the other ranks' threads end when rank 0 says the checkpoint
  // is complete (or not). A save first waits for the previous one.
  void save(std::int64_t step);
  // Waits for the save in progress, on every rank until the checkpoint is complete (latest_checkpoint finds it);
  // throws CheckpointError if it failed. Call it before the program ends (the
  // destructor also waits, and when that save failed logs it and ends the process with status 1: a job must not
  // pass for saved). The constructor checks that checkpoint_dir can be written (CheckpointError).
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
  // This rank's file, its size and checksum (or why not) reported to rank 0 under the save's `key`.
  void write_own_file(std::int64_t step, const std::string& directory, const std::string& key,
                      c10::impl::GenericDict& contents, const std::function<std::string()>& optimizer_bytes);
  // Rank 0: once every file is reported, the manifest, which makes the checkpoint complete.
  void write_manifest(std::int64_t step, const std::string& directory, const std::string& key,
                      CheckpointManifest& manifest);
  // The other ranks: until rank 0 says how the save ended (CheckpointError when it failed).
  void wait_until_complete(std::int64_t step, const std::string& saved_key);
  // Rank 0, once a save is complete: temporary files a killed save of the same step left.
  void remove_leftover_temporaries(const std::string& directory);
  // Rank 0: until every other rank has read how the save ended.
  void wait_for_readers(const std::string& saved_key);

  DistributedModel& model_;
  std::unique_ptr<OptimizerCheckpointState> optimizer_state_;
  std::int64_t last_saved_ = -1;
  // With "checkpoint_frozen_parameters" false: each frozen parameter's CRC-32, taken at the first save.
  std::optional<std::vector<std::int64_t>> frozen_checksums_;
  bool said_disabled_ = false;
  bool resume_called_ = false;  // a save without it, where the config asked to resume, says so once
  std::future<void> pending_;  // the save being written
  std::unique_ptr<DirectoryLock> lock_;  // rank 0's, while it may save
  std::deque<std::string> saved_keys_;  // rank 0: the store keys of its last saves' outcome, until every rank read them
};

}  // namespace smp
