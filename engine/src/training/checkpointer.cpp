// The Checkpointer: a DistributedModel's and its optimizer's state saved in the background after a step (every
// writer a partition file, rank 0 the manifest last), and resumed.
#include "smp/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/input-archive.h>

#include "checkpoint/directory_lock.h"
#include "checkpoint/optimizer_snapshot.h"
#include "smp/stage_plan.h"
#include "training/model_random_stream.h"
#include "checkpoint/partition_file.h"
#include "smp/log.h"
#include "smp/timeline.h"

namespace smp {
namespace {

// The parameters whose state replica `share` of `shares` keeps: its share of the trainable ones (all of them when
// not sharded) and every frozen one, as DistributedOptimizer and smp.DistributedOptimizer filter their groups.
std::vector<std::string> optimizer_parameter_names(const DistributedModel& model, int shares, int share) {
  const std::vector<int> owners = model.optimizer_shard_owners(shares);
  std::vector<std::string> names;
  for (std::size_t i = 0; i < owners.size(); ++i) {
    if (owners[i] == -1 || owners[i] == share) names.push_back(model.named_parameters()[i].first);
  }
  return names;
}

// A LibTorch optimizer's state in LibTorch's archive format (Optimizer::save / load).
// With the program's state (ProgramState), which every share holds and the first one read restores.
class LibTorchOptimizerState final : public OptimizerCheckpointState {
 public:
  LibTorchOptimizerState(DistributedOptimizer& optimizer, ProgramStates program_state)
      : optimizer_(optimizer), program_state_(std::move(program_state)) {}
  std::function<std::string()> snapshot() override {
    std::map<std::string, std::string> program_bytes;
    for (const auto& [name, state] : program_state_) program_bytes[name] = state.save();
    return snapshot_optimizer(optimizer_.local(), std::move(program_bytes));
  }

  // Optimizer::load matches saved state to the groups' parameters by position, and adds to the state it has. So
  // each share loads while the groups hold exactly the parameters its replica's optimizer held; then the groups
  // get this replica's parameters back, and the state of those another replica now updates goes at once.
  void load(const SavedOptimizerState& saved, c10::Device device) override {
    torch::optim::Optimizer& optimizer = optimizer_.local();
    auto& groups = optimizer.param_groups();
    const auto& built = optimizer_.built_param_groups();
    if (groups.size() != built.size()) {
      throw CheckpointError("the optimizer has " + std::to_string(groups.size()) + " parameter groups but had " +
                            std::to_string(built.size()) + " when DistributedOptimizer wrapped it (groups added "
                            "later are not in its checkpoints)");
    }
    std::unordered_map<std::string, const void*> by_name;
    for (const auto& [name, parameter] : optimizer_.model().named_parameters()) {
      by_name.emplace(name, parameter.unsafeGetTensorImpl());
    }
    std::vector<std::vector<at::Tensor>> held;
    std::unordered_set<const void*> kept;
    for (const auto& group : groups) {
      held.push_back(group.params());
      for (const auto& parameter : group.params()) kept.insert(parameter.unsafeGetTensorImpl());
    }
    const auto restore_groups = [&] {
      for (std::size_t g = 0; g < groups.size(); ++g) groups[g].params() = held[g];
    };
    std::vector<double> rates_built;
    for (const auto& group : groups) rates_built.push_back(group.options().get_lr());
    std::optional<std::map<std::string, std::string>> program_bytes;
    std::string missing_program_state;
    for (int share = saved.first_share; share < saved.first_share + saved.shares_to_read; ++share) {
      SavedOptimizerShare current = saved.read(share);
      try {
        std::unordered_set<const void*> saved_with;
        for (const auto& name : current.parameters) {
          const auto found = by_name.find(name);
          if (found != by_name.end()) saved_with.insert(found->second);
        }
        for (std::size_t g = 0; g < groups.size(); ++g) {
          std::vector<at::Tensor> params;
          for (const auto& parameter : built[g]) {
            if (saved_with.count(parameter.unsafeGetTensorImpl())) params.push_back(parameter);
          }
          groups[g].params() = std::move(params);
        }
        std::istringstream stream(current.bytes);
        current.bytes.clear();
        torch::serialize::InputArchive archive;
        archive.load_from(stream, device);  // saved from CPU copies (optimizer_snapshot.h)
        check_saved_optimizer_class(archive, optimizer);
        if (share == saved.first_share) {
          program_bytes = saved_program_state(archive);
          missing_program_state = program_state_missing(program_bytes.value_or(std::map<std::string, std::string>{}));
        }
        if (missing_program_state.empty()) optimizer.load(archive);
      } catch (const std::exception& error) {
        restore_groups();
        optimizer.state().clear();  // no half-loaded state: it would train on some replicas' moments only
        throw CheckpointError(current.path + ": optimizer state does not fit this optimizer: " +
                              comm::brief_message(error));
      }
      if (!missing_program_state.empty()) {  // before the optimizer's state is loaded
        restore_groups();
        throw CheckpointError(current.path + ": " + missing_program_state);
      }
      restore_groups();
      std::vector<void*> dropped;
      for (const auto& [key, state] : optimizer.state()) {
        if (!kept.count(key)) dropped.push_back(key);
      }
      for (void* key : dropped) optimizer.state().erase(key);
    }
    // Optimizer::load takes the saved groups' options, as torch.optim's load_state_dict does: a learning rate the
    // program changed for the resumed run would be dropped without a word.
    std::string replaced;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const double now = groups[g].options().get_lr();
      if (now != rates_built[g]) {
        replaced += (replaced.empty() ? "" : "; ") + std::string("group ") + std::to_string(g) + " lr " +
                    c10::str(rates_built[g]) + " -> " + c10::str(now);
      }
    }
    // Said, not warned: a program that schedules the rate by hand sets its own at the next step anyway.
    if (!replaced.empty() && optimizer_.model().runtime().rank() == 0) {
      log::info("resume: the optimizer's learning rate is the checkpoint's (" + replaced + "), as Optimizer::load "
                "restores it; to train on with another, set it in param_groups() after resume()");
    }
    restore_program_state(program_bytes.value_or(std::map<std::string, std::string>{}));
  }
  std::string format() const override { return "libtorch"; }

 private:
  // Why the program's state cannot be restored, or "": a program half restored would continue neither run.
  std::string program_state_missing(const std::map<std::string, std::string>& saved) const {
    std::string missing;
    for (const auto& [name, state] : program_state_) {
      if (!saved.count(name)) missing += (missing.empty() ? "\"" : ", \"") + name + "\"";
    }
    if (missing.empty()) return missing;
    return "the checkpoint holds no program state " + missing + " (saved by a Checkpointer given " +
           (saved.empty() ? std::string("none") : "other names") +
           "): that state would start over while the rest resumed; give the Checkpointer the state the saving run "
           "gave it";
  }

  void restore_program_state(const std::map<std::string, std::string>& saved) {
    std::string unused;
    for (const auto& [name, bytes] : saved) {
      const auto given = program_state_.find(name);
      if (given == program_state_.end()) {
        unused += (unused.empty() ? "\"" : ", \"") + name + "\"";
        continue;
      }
      try {
        given->second.load(bytes);
      } catch (const std::exception& error) {
        throw CheckpointError("program state \"" + name + "\" did not load: " + comm::brief_message(error));
      }
    }
    if (!unused.empty() && optimizer_.model().runtime().rank() == 0) {
      log::warn("resume: the checkpoint holds program state " + unused + ", which this Checkpointer was not given: "
                "not restored");
    }
  }

  DistributedOptimizer& optimizer_;
  ProgramStates program_state_;
};

// Reaches LRScheduler's step count, which it keeps protected, through a pointer to the member taken in a class
// derived from it (the access a derived class is granted), without subclassing the user's scheduler.
struct SchedulerSteps : torch::optim::LRScheduler {
  static unsigned& of(torch::optim::LRScheduler& scheduler) { return scheduler.*(&SchedulerSteps::step_count_); }
};

// CRC-32 of each named parameter's bytes, on the CPU: whether the frozen parameters a checkpoint left out are the
// ones it was saved beside, and which differs.
std::vector<std::int64_t> checksums_of(const DistributedModel& model, const std::vector<std::string>& names) {
  std::map<std::string, at::Tensor> by_name(model.named_parameters().begin(), model.named_parameters().end());
  std::vector<std::int64_t> checksums;
  for (const auto& name : names) {
    const at::Tensor bytes = by_name.at(name).detach().to(at::kCPU).contiguous();
    checksums.push_back(crc32(bytes.data_ptr(), static_cast<std::size_t>(bytes.nbytes())));
  }
  return checksums;
}

// Where a rank of replica `dp_rank` publishes its random state for the save under `key`: beside the other replicas
// of its pipeline and tensor-parallel rank, whose partition files gather them.
std::string random_state_key(const std::string& key, const Coordinates& rank) {
  return key + "random_state/" + std::to_string(rank.pp_rank) + "/" + std::to_string(rank.tp_rank) + "/" +
         std::to_string(rank.dp_rank);
}

// Every file's writer reports "size crc" (or "error ...") under its file's key; rank 0 collects them for the manifest.
std::string report_key(const std::string& key, int pp_rank, int dp_rank, int tp_rank) {
  return key + std::to_string(pp_rank) + "/" + std::to_string(dp_rank) + "/" + std::to_string(tp_rank);
}

// Under tensor parallelism every shard of a pipeline rank writes its files, named after it; under expert parallelism
// the first block's replicas write partition files, one per share of the experts.
std::string file_name_of(const Topology& topology, int pp_rank, int dp_rank, int tp_rank) {
  const int shard = topology.tensor_parallel_degree() > 1 ? tp_rank : -1;
  const int expert_shares = topology.expert_parallel_degree();
  if (expert_shares > 1 && dp_rank < expert_shares) return partition_file_name(pp_rank, shard, dp_rank);
  return dp_rank == 0 ? partition_file_name(pp_rank, shard) : optimizer_shard_file_name(pp_rank, dp_rank, shard);
}

// This rank's random states: the program's (the default generators' between calls: the CPU's and, on a GPU, its
// device's) and the model's stream's (ModelRandomStream), by name.
std::string random_state_bytes(const c10::Device& device, const ModelRandomStream& model_stream) {
  c10::Dict<std::string, c10::List<at::Tensor>> states;
  c10::List<at::Tensor> program;
  program.push_back(at::detail::getDefaultCPUGenerator().get_state());
  if (device.is_cuda()) program.push_back(at::globalContext().defaultGenerator(device).get_state());
  states.insert("program", program);
  c10::List<at::Tensor> model;
  for (const auto& state : model_stream.states()) model.push_back(state);
  states.insert("model", model);
  const std::vector<char> bytes = torch::jit::pickle_save(states);
  return std::string(bytes.data(), bytes.size());
}

// Whether the ranks of `replicas` (one per replica, the same stage) hold the same program generators now, before a
// resume restores them: a program that seeded them alike (every rank draws the global batch) rather than each
// replica its own (augmentation seeded by dp_rank). Every member calls it.
bool program_generators_alike(comm::Communicator& replicas, const c10::Device& device) {
  std::uint64_t digest = 1469598103934665603ULL;  // FNV-1a over the generators' states
  const auto mix = [&](const at::Tensor& state) {
    const at::Tensor bytes = state.contiguous();
    const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
    for (std::int64_t i = 0; i < bytes.numel(); ++i) digest = (digest ^ data[i]) * 1099511628211ULL;
  };
  mix(at::detail::getDefaultCPUGenerator().get_state());
  if (device.is_cuda()) mix(at::globalContext().defaultGenerator(device).get_state());
  // The first replica's digest (52 bits: exact in a double) against each member's, and the count that differ, so
  // that every member decides alike.
  const double mine = static_cast<double>(digest >> 12);
  at::Tensor first = at::tensor({mine}, at::kDouble);
  replicas.broadcast(first, 0);
  at::Tensor differing = at::tensor({first.item<double>() == mine ? 0.0 : 1.0}, at::kDouble);
  replicas.all_reduce_sum(differing);
  return differing.item<double>() == 0.0;
}

// `model_stream` null: the program's generators alone.
void restore_random_state(const at::Tensor& bytes, const c10::Device& device, ModelRandomStream* model_stream) {
  const char* data = static_cast<const char*>(bytes.data_ptr());
  const c10::IValue saved = torch::jit::pickle_load(std::vector<char>(data, data + bytes.numel()));
  c10::List<at::Tensor> program;
  if (saved.isTensorList()) {
    program = saved.toTensorList();  // written before the model's stream was its own: the program's alone
  } else {
    const auto states = c10::impl::toTypedDict<std::string, c10::List<at::Tensor>>(saved.toGenericDict());
    program = states.at("program");
    const auto model = states.at("model");
    // A CPU job's checkpoint resumed on a GPU: the model's stream keeps its seeding, as the GPU's generator does.
    if (model_stream) model_stream->take_states(std::vector<at::Tensor>(model.begin(), model.end()));
  }
  at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle on the default one
  generator.set_state(program.get(0));
  if (device.is_cuda() && program.size() > 1) {
    at::Generator cuda_generator = at::globalContext().defaultGenerator(device);  // a handle on the default one
    cuda_generator.set_state(program.get(1));
  }
}

}  // namespace

ProgramState lr_scheduler_state(torch::optim::LRScheduler& scheduler) {
  return {[&scheduler] { return std::to_string(SchedulerSteps::of(scheduler)); },
          [&scheduler](const std::string& bytes) {
            std::size_t used = 0;
            const unsigned long steps = std::stoul(bytes, &used);
            if (used != bytes.size()) throw std::invalid_argument("not a step count: " + bytes);
            SchedulerSteps::of(scheduler) = static_cast<unsigned>(steps);
          }};
}

Checkpointer::Checkpointer(DistributedModel& model, DistributedOptimizer& optimizer)
    : Checkpointer(model, optimizer, ProgramStates{}) {}

Checkpointer::Checkpointer(DistributedModel& model, DistributedOptimizer& optimizer, ProgramStates program_state)
    : Checkpointer(model, std::make_unique<LibTorchOptimizerState>(optimizer, std::move(program_state))) {}

Checkpointer::Checkpointer(DistributedModel& model, std::unique_ptr<OptimizerCheckpointState> optimizer_state)
    : model_(model), optimizer_state_(std::move(optimizer_state)) {
  if (!enabled()) return;
  if (model_.never_resumes() && model_.runtime().config().resume) {
    // Its saves would be resumed into the job's other model, the one that takes the checkpoint.
    throw CheckpointError("this model was built not to resume (resume=False, Resume::kNever), but the config says "
                          "\"resume\": true: a Checkpointer saves the model that resumes from checkpoint_dir; make it "
                          "for that one");
  }
  // Found now, not at the first save, which may come thousands of steps into training.
  const std::string& root = model_.runtime().config().checkpoint_dir;
  const std::string probe = root + "/.smp-write-probe-" + std::to_string(model_.runtime().rank()) + "-" +
                            std::to_string(::getpid());
  try {
    std::filesystem::create_directories(root);
    write_file_atomically(probe, "probe");
    std::filesystem::remove(probe);
  } catch (const std::exception& error) {
    std::error_code ignored;
    std::filesystem::remove(probe, ignored);
    throw CheckpointError("checkpoint_dir \"" + root + "\": rank " + std::to_string(model_.runtime().rank()) +
                          " cannot write there (" + comm::brief_message(error) + ")");
  }
  // Rank 0 writes the manifests and prunes: its lock keeps another job out. A run that is not to resume, in a
  // directory of an earlier run's checkpoints, would train until its first save and be refused there (save): said
  // now, before any training. Either refusal reaches every rank.
  Runtime& runtime = model_.runtime();
  const std::string refused = runtime.from_rank0("checkpoint/" + std::to_string(runtime.next_exchange()) + "/made",
                                                 [&] {
    lock_ = std::make_unique<DirectoryLock>(root);
    const auto highest = runtime.config().resume ? std::nullopt : highest_saved_step(root);
    if (!highest) return std::string();
    return root + " holds checkpoints up to step " + std::to_string(*highest) + " of an earlier run, and this run " +
           "is not resumed from them (\"resume\" is false): pruning keeps the highest steps, so its saves up to step " +
           std::to_string(*highest) + " would be deleted as written, and a resume would take the earlier run's. " +
           "Resume from them (\"resume\": true, then resume()), or give this run an empty checkpoint_dir";
  });
  if (!refused.empty()) throw CheckpointError(refused);
}

bool Checkpointer::enabled() const { return !model_.runtime().config().checkpoint_dir.empty(); }

bool Checkpointer::due(std::int64_t step) const {
  const int interval = model_.runtime().config().checkpoint_interval;
  return enabled() && interval > 0 && (step + 1) % interval == 0;
}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& error) {
    log::error(std::string("checkpoint failed: ") + error.what());
    if (std::uncaught_exceptions() > 0) return;  // the program is failing already, and will say why
    // Nothing called wait(): the program would end as if its last checkpoint were saved.
    log::error("the last checkpoint was not saved and nothing called Checkpointer::wait(); exiting with status 1");
    std::fflush(nullptr);
    std::_Exit(1);
  }
}

void Checkpointer::wait() {
  if (pending_.valid()) pending_.get();
}

void Checkpointer::save(std::int64_t step) {
  if (!enabled()) {
    // An explicit save with nowhere to save to: said once, not silently skipped (a program may save at its end
    // whatever the config, as the examples do when checkpoints are on).
    if (!said_disabled_ && model_.runtime().rank() == 0) {
      log::warn("Checkpointer::save(" + std::to_string(step) + "): the config gives no \"checkpoint_dir\", so " +
                "nothing is saved");
    }
    said_disabled_ = true;
    return;
  }
  if (step == last_saved_) return;
  wait();  // one save at a time; a failure of the previous one surfaces here
  Runtime& runtime = model_.runtime();
  const Config& config = runtime.config();
  // Pruning keeps the highest steps: a lower one than a checkpoint already there would be deleted as soon as written,
  // and a resume would take the other. Every rank refuses alike, before anything is written.
  if (last_saved_ >= 0 && step < last_saved_) {
    throw CheckpointError("save(" + std::to_string(step) + ") after save(" + std::to_string(last_saved_) +
                          "): checkpoints are kept by step, the highest " + std::to_string(config.checkpoints_kept) +
                          ", so a lower step would be deleted at once; give save() a step that only grows (the "
                          "global step, not the step within an epoch)");
  }
  if (last_saved_ < 0) {  // this run's first save, not resumed: is the directory another run's?
    const std::string earlier = runtime.from_rank0("checkpoint/" + std::to_string(runtime.next_exchange()) +
                                                   "/earlier", [&] {
      const auto highest = highest_saved_step(config.checkpoint_dir);
      if (!highest || *highest < step) return std::string();
      return config.checkpoint_dir + " holds checkpoints up to step " + std::to_string(*highest) +
             " of an earlier run, and this run, not resumed from them, saves step " + std::to_string(step) +
             ": pruning keeps the highest steps, so this run's checkpoints would be deleted as written and a resume "
             "would take the earlier run's. Resume from them (\"resume\": true, then resume()), or give this run an "
             "empty checkpoint_dir";
    });
    if (!earlier.empty()) throw CheckpointError(earlier);
  }
  if (model_.resumed_from() && !resume_called_ && runtime.rank() == 0) {
    log::warn("\"resume\" is true and " + model_.resumed_from()->directory + " was found, but resume() was not called: "
              "this job trained from its start, and saves step " + std::to_string(step) + " beside the older checkpoints");
  }
  resume_called_ = true;  // said once
  const std::string directory = config.checkpoint_dir + "/" + checkpoint_directory_name(step);
  const std::string key = "checkpoint/" + std::to_string(runtime.next_exchange()) + "/";

  // The snapshot is all the step waits for: copies on the CPU of what training goes on changing in place. Writing,
  // checksumming, the manifest and pruning happen on a background thread.
  std::optional<c10::impl::GenericDict> contents;
  std::function<std::string()> optimizer_bytes;  // serialized on the writer's thread
  const int shards = model_.optimizer_state_shards();
  const bool tensor_parallel = runtime.topology().tensor_parallel_degree() > 1;
  const int expert_shares = runtime.topology().expert_parallel_degree();
  // The first replica writes the partition file; with sharded optimizer state, each other replica a file with its
  // share of that state and nothing else. Under expert parallelism each replica of the first block writes a
  // partition file: the experts it holds, and its optimizer's state of them (its share, when sharded).
  const bool writes_partition = runtime.dp_rank() < expert_shares;
  if (writes_partition || shards > 1) {
    optimizer_bytes = optimizer_state_->snapshot();
    contents.emplace(c10::StringType::get(), c10::AnyType::get());
    contents->insert("format", kPartitionFormat);
    contents->insert("optimizer_format", optimizer_state_->format());
    // Which parameters this optimizer holds, by name: a resume under another sharding loads the state by them.
    c10::List<std::string> held;
    for (const auto& name : optimizer_parameter_names(model_, shards, shards > 1 ? runtime.dp_rank() : 0)) {
      held.push_back(name);
    }
    contents->insert("optimizer_parameters", held);
    contents->insert("step", step);
    contents->insert("pp_rank", static_cast<std::int64_t>(runtime.pp_rank()));
    if (tensor_parallel) contents->insert("tp_rank", static_cast<std::int64_t>(runtime.tp_rank()));
  }
  if (!writes_partition && shards > 1) {
    contents->insert("dp_rank", static_cast<std::int64_t>(runtime.dp_rank()));
  } else if (writes_partition) {
    std::set<std::string> left_out;
    if (!config.checkpoint_frozen_parameters) {
      // The frozen ones (a LoRA job's base) stay as the program loaded them: the file names them, with a checksum a
      // resume checks them against.
      const std::vector<std::string> frozen = model_.frozen_parameter_names();
      left_out.insert(frozen.begin(), frozen.end());
      if (!frozen_checksums_) frozen_checksums_ = checksums_of(model_, frozen);  // they do not change
      c10::List<std::string> names;
      for (const auto& name : frozen) names.push_back(name);
      contents->insert("frozen_parameters", names);
      contents->insert("frozen_crc32", c10::List<std::int64_t>(*frozen_checksums_));
    }
    c10::Dict<std::string, at::Tensor> parameters;
    for (const auto& [name, parameter] : model_.named_parameters()) {
      if (left_out.count(name)) continue;
      parameters.insert(name, parameter.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
    }
    contents->insert("parameters", parameters);
    c10::Dict<std::string, at::Tensor> buffers;  // batch norm's statistics: part of the state a resume continues
    for (const auto& [name, buffer] : model_.named_buffers()) {
      buffers.insert(name, buffer.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
    }
    contents->insert("buffers", buffers);
    if (tensor_parallel) {  // where each shard sits in its whole tensor, for exports
      c10::Dict<std::string, c10::List<std::int64_t>> layouts;
      for (const auto& [name, dims] : model_.shard_dims()) layouts.insert(name, c10::List<std::int64_t>({dims.first, dims.second}));
      contents->insert("shards", layouts);
    }
    if (expert_shares > 1) {  // which tensors are this share's experts, for exports
      c10::List<std::string> experts;
      for (const auto& name : model_.expert_shard_names()) experts.push_back(name);
      contents->insert("expert_shards", experts);
      contents->insert("ep_rank", static_cast<std::int64_t>(runtime.ep_rank()));
    }
    contents->insert("rng", at::detail::getDefaultCPUGenerator().get_state());
    const c10::Device device = runtime.device();
    if (device.is_cuda()) contents->insert("cuda_rng", at::globalContext().defaultGenerator(device).get_state());
    contents->insert("loss_scale", model_.loss_scale());
    contents->insert("steps_since_scale_change", static_cast<std::int64_t>(model_.steps_since_scale_change()));
  }
  // Every rank's random state, the replicas' included: each replica draws its own (per-replica augmentation, seeded
  // by dp_rank), and a resume must continue each one's sequence, not give them all the first replica's. The
  // partition files' writers gather them by replica.
  runtime.publish(random_state_key(key, runtime.topology().coordinates_of(runtime.rank())),
                  random_state_bytes(runtime.device(), model_.random_stream()));
  std::optional<CheckpointManifest> manifest;
  if (runtime.rank() == 0) {
    manifest.emplace();
    manifest->step = step;
    manifest->partitions = config.partitions;
    manifest->virtual_stages = config.virtual_stages;
    manifest->replicas = runtime.topology().data_parallel_degree();
    manifest->optimizer_shards = shards;
    manifest->tensor_parallel_degree = runtime.topology().tensor_parallel_degree();
    manifest->expert_parallel_degree = expert_shares;
    manifest->schedule = model_.schedule().name;
    for (const auto& module : model_.plan().modules) manifest->module_names.push_back(module.name);
    manifest->stage_of_module = model_.plan().stage_of_module;
    manifest->model_signature = model_.model_signature();
    manifest->model_parameters = model_.model_parameters();
    manifest->seed = config.seed;
    manifest->config_json = config.text;
  }
  last_saved_ = step;
  pending_ = std::async(std::launch::async, [this, step, directory, key, contents = std::move(contents),
                                             optimizer_bytes = std::move(optimizer_bytes),
                                             manifest = std::move(manifest)]() mutable {
    write_checkpoint(step, directory, key, std::move(contents), std::move(optimizer_bytes), std::move(manifest));
  });
}

void Checkpointer::write_checkpoint(std::int64_t step, const std::string& directory, const std::string& key,
                                    std::optional<c10::impl::GenericDict> contents,
                                    std::function<std::string()> optimizer_bytes,
                                    std::optional<CheckpointManifest> manifest) {
  Runtime& runtime = model_.runtime();
  // Every rank's save ends when the checkpoint is complete (manifest written), so that after wait() any rank finds
  // it: rank 0 says how its part ended under `saved_key`, whatever way it ends.
  const std::string saved_key = key + "saved";
  if (!manifest) {
    if (contents) {
      try {
        write_own_file(step, directory, key, *contents, optimizer_bytes);
      } catch (const std::exception&) {
        runtime.count(saved_key + "/read", 1);  // rank 0 waits for no word from this rank (wait_for_readers)
        throw;
      }
    }
    wait_until_complete(step, saved_key);
    return;
  }
  try {
    if (contents) write_own_file(step, directory, key, *contents, optimizer_bytes);
    write_manifest(step, directory, key, *manifest);
    remove_leftover_temporaries(directory);
  } catch (const std::exception& error) {
    runtime.publish(saved_key, "error " + comm::brief_message(error));
    wait_for_readers(saved_key);
    throw;
  }
  runtime.publish(saved_key, "ok");
  // Every rank has read the one of two saves ago: its save waited for that one's before it began the last.
  saved_keys_.push_back(saved_key);
  if (saved_keys_.size() > 2) {
    runtime.forget(saved_keys_.front());
    runtime.forget(saved_keys_.front() + "/read");
    saved_keys_.pop_front();
  }
  prune_checkpoints(runtime.config().checkpoint_dir, runtime.config().checkpoints_kept);
  log::info("saved checkpoint " + directory);
  wait_for_readers(saved_key);
}

// A save killed while it wrote left its temporary file (a partition's "<file>.tmp.<pid>", as large as the partition)
// in the step's directory; saved again and complete, every rank's file is in place, so what is left is dead.
void Checkpointer::remove_leftover_temporaries(const std::string& directory) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    if (entry.path().filename().string().find(".tmp.") == std::string::npos) continue;
    std::error_code ignored;
    std::filesystem::remove(entry.path(), ignored);
    if (!ignored) log::info("removed " + entry.path().string() + ", left by a save that did not finish");
  }
}

void Checkpointer::wait_for_readers(const std::string& saved_key) {
  // Rank 0 holds the store: a program that ends after wait() must not take it away before the others have read how
  // the save ended (they poll). Each says it has; not waited for past comm_timeout_s (a rank gone).
  Runtime& runtime = model_.runtime();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<long long>(runtime.config().comm_timeout_s * 1000.0));
  while (runtime.count(saved_key + "/read", 0) < runtime.world_size() - 1 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void Checkpointer::write_own_file(std::int64_t step, const std::string& directory, const std::string& key,
                                  c10::impl::GenericDict& contents, const std::function<std::string()>& optimizer_bytes) {
  Runtime& runtime = model_.runtime();
  const std::string file_name = file_name_of(runtime.topology(), runtime.pp_rank(), runtime.dp_rank(), runtime.tp_rank());
  std::string report;
  try {
    contents.insert("optimizer", bytes_tensor(optimizer_bytes()));
    if (runtime.dp_rank() < runtime.topology().expert_parallel_degree()) {  // a partition file
      c10::List<at::Tensor> by_replica;
      for (int replica = 0; replica < runtime.topology().data_parallel_degree(); ++replica) {
        by_replica.push_back(
            bytes_tensor(runtime.fetch(random_state_key(key, {runtime.pp_rank(), replica, runtime.tp_rank()}))));
      }
      contents.insert("random_states_by_replica", by_replica);
    }
    std::filesystem::create_directories(directory);
    const auto bytes = torch::jit::pickle_save(contents);
    write_file_atomically(directory + "/" + file_name, std::string_view(bytes.data(), bytes.size()));
    report = std::to_string(bytes.size()) + " " + std::to_string(crc32(bytes.data(), bytes.size()));
  } catch (const std::exception& error) {
    report = "error " + comm::brief_message(error);
  }
  runtime.publish(report_key(key, runtime.pp_rank(), runtime.dp_rank(), runtime.tp_rank()), report);
  if (report.rfind("error ", 0) == 0) {
    throw CheckpointError("rank " + std::to_string(runtime.rank()) + " could not save step " + std::to_string(step) +
                          ": " + report.substr(6));
  }
}

void Checkpointer::wait_until_complete(std::int64_t step, const std::string& saved_key) {
  // Polled rather than waited for in one fetch: rank 0's part (its own file, every report, the manifest) may outlast
  // comm_timeout_s on a large model, and a waiting fetch would hold this rank's store client all along (the main
  // thread's exchanges would stall behind it). Bounded by rank 0's own: its waits for reports by comm_timeout_s, its
  // writes by the file system; a rank 0 that is gone fails the poll.
  Runtime& runtime = model_.runtime();
  try {
    while (!runtime.published(saved_key)) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } catch (const std::exception& error) {
    throw CheckpointError("step " + std::to_string(step) + ": rank 0 did not say that the checkpoint was complete (" +
                          comm::brief_message(error) + ")");
  }
  const std::string said = runtime.fetch(saved_key);
  runtime.count(saved_key + "/read", 1);
  if (said.rfind("error ", 0) == 0) {
    throw CheckpointError("step " + std::to_string(step) + ": the checkpoint was left incomplete: " + said.substr(6));
  }
}

void Checkpointer::write_manifest(std::int64_t step, const std::string& directory, const std::string& key,
                                  CheckpointManifest& manifest) {
  Runtime& runtime = model_.runtime();
  const Config& config = runtime.config();
  const int expert_shares = runtime.topology().expert_parallel_degree();
  for (int pp = 0; pp < config.partitions; ++pp) {
    for (int tp = 0; tp < runtime.topology().tensor_parallel_degree(); ++tp) {
      for (int dp = 0; dp < std::max(manifest.optimizer_shards, expert_shares); ++dp) {
        const int writer = runtime.topology().rank_of({pp, dp, tp});
        std::string report;
        try {
          report = runtime.fetch(report_key(key, pp, dp, tp));
        } catch (const comm::CommError& error) {
          throw CheckpointError("step " + std::to_string(step) + ": rank " + std::to_string(writer) +
                                " did not report its checkpoint file; the checkpoint is left incomplete (" + error.what() + ")");
        }
        if (report.rfind("error ", 0) == 0) {
          throw CheckpointError("step " + std::to_string(step) + ": rank " + std::to_string(writer) + " failed to save: " +
                                report.substr(6));
        }
        CheckpointFile file;
        file.name = file_name_of(runtime.topology(), pp, dp, tp);
        file.pp_rank = pp;
        const bool partition_file = dp < expert_shares;
        file.dp_rank = partition_file ? -1 : dp;
        file.tp_rank = tp;
        file.ep_rank = partition_file ? dp : 0;
        std::istringstream fields(report);
        fields >> file.size >> file.crc32;
        manifest.files.push_back(file);
      }
    }
  }
  // Every partition file's writer has read the random states it gathers (it reported after writing).
  for (int rank = 0; rank < runtime.world_size(); ++rank) {
    runtime.forget(random_state_key(key, runtime.topology().coordinates_of(rank)));
  }
  write_file_atomically(directory + "/manifest.json", manifest.to_json());
  fsync_directory(directory);
  fsync_directory(config.checkpoint_dir);
}

std::int64_t Checkpointer::resume() {
  resume_called_ = true;
  model_.mark_state_resumed();
  const auto& origin = model_.resumed_from();
  if (!origin) return 0;
  Runtime& runtime = model_.runtime();
  const auto& [directory, manifest] = *origin;
  const int shards = model_.optimizer_state_shards();
  // Each replica reads the partition file of the experts it holds (all are share 0's without expert parallelism).
  const auto file_of = [&](int dp_rank) -> const CheckpointFile& {
    for (const auto& file : manifest.files) {
      if (file.pp_rank == runtime.pp_rank() && file.dp_rank == dp_rank && file.tp_rank == runtime.tp_rank() &&
          file.ep_rank == (dp_rank < 0 ? runtime.ep_rank() : 0)) {
        return file;
      }
    }
    throw CheckpointError(directory + ": the manifest lists no file for this rank");  // parse() rules this out
  };
  const auto& file = file_of(-1);
  const std::string path = directory + "/" + file.name;
  auto contents = load_partition_file(path, file);
  // The optimizer state: replica 0's share (or all of it, unsharded) is in the partition file, a later replica's
  // in a file of its own. Sharded as this job shards it, each replica reads its own share; sharded otherwise (or
  // not at all), each reads every share and keeps what it now updates.
  SavedOptimizerState saved;
  saved.share_count = manifest.optimizer_shards;
  if (saved.share_count == shards && shards > 1) {
    saved.first_share = runtime.dp_rank();
  } else {
    saved.shares_to_read = saved.share_count;
    if (saved.share_count != shards && runtime.rank() == 0) {
      const auto describe = [](int count) {
        return count > 1 ? "sharded over " + std::to_string(count) + " replicas" : std::string("not sharded");
      };
      log::info(directory + ": its optimizer state is " + describe(saved.share_count) + ", this job's " +
                describe(shards) + ": every replica reads all " + std::to_string(saved.share_count) +
                " share(s) and keeps its own");
    }
  }
  saved.read = [&](int share) {
    SavedOptimizerShare read;
    read.path = path;
    auto share_contents = contents;
    // Shares below the expert-parallel degree are in partition files: this rank's share is in the one it loaded
    // (a resume under expert parallelism keeps the sharding, so each replica reads its own share only).
    if (share >= manifest.expert_parallel_degree) {
      const auto& shard = file_of(share);
      read.path = directory + "/" + shard.name;
      share_contents = load_partition_file(read.path, shard);
    }
    // Checkpoints written before the format was recorded all came from LibTorch optimizers.
    const std::string saved_format = share_contents.contains("optimizer_format")
                                         ? share_contents.at("optimizer_format").toStringRef()
                                         : "libtorch";
    if (saved_format != optimizer_state_->format()) {
      throw CheckpointError(read.path + ": its optimizer state was written by a " + saved_format +
                            " optimizer, but this job's optimizer reads " + optimizer_state_->format() +
                            " state (C++ jobs write libtorch state, Python jobs torch.optim state since the Python "
                            "package took torch.optim optimizers; resume with the kind of job that saved it, or load "
                            "the parameters alone: smp_checkpoint export, then load_parameters)");
    }
    if (share_contents.contains("optimizer_parameters")) {
      for (const auto& name : share_contents.at("optimizer_parameters").toListRef()) {
        read.parameters.push_back(name.toStringRef());
      }
    } else {
      // Written before the names were recorded: the owners as the saving job computed them, which holds while the
      // same parameters are trainable.
      read.parameters = optimizer_parameter_names(model_, saved.share_count, share);
    }
    const at::Tensor bytes = share_contents.at("optimizer").toTensor();
    read.bytes.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
    return read;
  };
  std::set<std::string> left_in_place;
  if (contents.contains("frozen_parameters")) {
    std::vector<std::string> frozen;
    for (const auto& name : contents.at("frozen_parameters").toListRef()) frozen.push_back(name.toStringRef());
    left_in_place.insert(frozen.begin(), frozen.end());
    const std::vector<std::string> here = model_.frozen_parameter_names();
    if (frozen != here) {
      throw CheckpointError(path + " was saved without its " + std::to_string(frozen.size()) + " frozen parameters "
                            "(\"checkpoint_frozen_parameters\": false), and this model has " +
                            std::to_string(here.size()) + " others frozen: freeze the same ones before building it");
    }
    const std::vector<std::int64_t> saved_checksums = contents.at("frozen_crc32").toIntVector();
    const std::vector<std::int64_t> here_checksums = checksums_of(model_, frozen);
    for (std::size_t i = 0; i < frozen.size(); ++i) {
      if (i < saved_checksums.size() && saved_checksums[i] == here_checksums[i]) continue;
      throw CheckpointError(path + " was saved without its frozen parameters (\"checkpoint_frozen_parameters\": "
                            "false), and this model's " + frozen[i] + " differs from the one it was saved beside: "
                            "load the same base (load_pretrained, load_parameters) before resume()");
    }
  }
  try {
    model_.load_state(state_in(contents, path), left_in_place);
  } catch (const CheckpointError& error) {
    if (manifest.schedule.empty() || manifest.schedule == model_.schedule().name) throw;
    throw CheckpointError(std::string(error.what()) + " (it was saved under the \"" + manifest.schedule +
                          "\" schedule, which places stages on ranks otherwise than this job's \"" +
                          model_.schedule().name + "\": resume with that pipeline, or export and load_parameters)");
  }
  optimizer_state_->load(saved, runtime.device());
  try {
    if (contents.contains("random_states_by_replica")) {
      const auto by_replica = contents.at("random_states_by_replica").toTensorList();
      // Asked of every replica (a collective) before any restores, where some replica is new to the checkpoint.
      const bool new_replicas = static_cast<int>(by_replica.size()) < runtime.topology().data_parallel_degree();
      const bool alike = new_replicas && program_generators_alike(runtime.data_parallel(), runtime.device());
      if (runtime.dp_rank() < static_cast<int>(by_replica.size())) {
        restore_random_state(by_replica.get(runtime.dp_rank()), runtime.device(), &model_.random_stream());
      } else {
        // A replica the saving job did not have. Where the program seeded its generators alike on every replica
        // (every rank draws the global batch), they continue the first replica's: a fresh state would draw another
        // batch, and fail the step. Where each replica seeded its own (augmentation seeded per replica), this one
        // keeps that seeding. The model's stream (dropout) keeps its own seeding, per replica, either way.
        if (alike) restore_random_state(by_replica.get(0), runtime.device(), nullptr);
        if (runtime.pp_rank() == 0 && runtime.tp_rank() == 0) {
          log::info(directory + " holds the random state of " + std::to_string(by_replica.size()) +
                    " replicas: replica " + std::to_string(runtime.dp_rank()) +
                    (alike ? " continues the first replica's program generators (the replicas' were seeded alike)"
                           : " keeps the program generators' seeding (each replica seeded its own)") +
                    ", and draws its dropout from a stream of its own");
        }
      }
    } else {  // written before each replica's state was kept: the first replica's
      auto generator = at::detail::getDefaultCPUGenerator();
      generator.set_state(contents.at("rng").toTensor());
      // A GPU job's dropout and other random kernels continue their sequence too (CPU jobs have no such state).
      const c10::Device device = runtime.device();
      if (device.is_cuda() && contents.contains("cuda_rng")) {
        at::Generator cuda_generator = at::globalContext().defaultGenerator(device);  // a handle on the default one
        cuda_generator.set_state(contents.at("cuda_rng").toTensor());
      }
    }
    if (contents.contains("loss_scale")) {  // absent in checkpoints written before it was saved
      model_.restore_loss_scale(contents.at("loss_scale").toDouble(),
                                contents.at("steps_since_scale_change").toInt());
    }
  } catch (const std::exception& error) {
    throw CheckpointError(path + ": its random state or loss scale does not load: " + comm::brief_message(error));
  }
  last_saved_ = manifest.step;
  model_.resume_at(manifest.step + 1);
  if (runtime.rank() == 0) log::info("resumed from " + directory + " (step " + std::to_string(manifest.step) + ")");
  return manifest.step + 1;
}

}  // namespace smp
