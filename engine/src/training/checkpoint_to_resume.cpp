// Which checkpoint a model resumes from ("resume": true): rank 0 chooses the newest complete one, and every rank
// checks that it holds this model in this job's layout, naming what differs and how to carry it over.
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>

#include "smp/checkpoint.h"
#include "smp/checkpoint_manifest.h"
#include "smp/config.h"
#include "smp/log.h"
#include "smp/runtime.h"
#include "smp/stage_plan.h"

namespace smp {
namespace {

// ": the first parameter where two models' lists (ModuleProfile::parameter_shapes' form) part", or "" where either
// is unknown or unreadable.
std::string first_difference(const std::string& saved, const std::string& here) {
  if (saved.empty() || here.empty()) return "";
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> there, mine;
  try {
    ModuleProfile listed;
    listed.parameter_shapes = saved;
    there = parameter_shapes_of(listed);
    listed.parameter_shapes = here;
    mine = parameter_shapes_of(listed);
  } catch (const std::exception&) {  // a manifest edited by hand: the counts and CRCs still say it differs
    return "";
  }
  std::size_t i = 0;
  while (i < there.size() && i < mine.size() && there[i] == mine[i]) ++i;
  if (i == there.size() && i == mine.size()) return "";
  const auto described = [&](const auto& list) {
    return i < list.size() ? list[i].first + " " + c10::str(c10::IntArrayRef(list[i].second)) : std::string("none");
  };
  return ": parameter " + std::to_string(i) + " is " + described(there) + " there, " + described(mine) + " here";
}

// Rank 0's word, in place of a directory, that the job cannot resume, with why after it.
const std::string kNoUsableCheckpoint = "\x01";

}  // namespace

std::optional<FoundCheckpoint> checkpoint_to_resume(Runtime& runtime, const std::string& key,
                                                    const std::vector<std::string>& module_names,
                                                    const std::string& model_signature,
                                                    const std::string& model_parameters) {
  const Config& config = runtime.config();
  // Rank 0 chooses, so that every rank resumes from the same checkpoint even if another is being written.
  if (runtime.rank() == 0) {
    std::vector<std::string> skipped;
    const auto found = find_latest_checkpoint(config.checkpoint_dir, &skipped);
    for (const auto& reason : skipped) log::warn("skipping checkpoint: " + reason);
    // Saves that never finished (no manifest) are a crash's leftovers, and a fresh start is right. A damaged
    // checkpoint whose save finished is not: training from step 0 beside it would end at the first save, refused
    // as a run that was not resumed from the checkpoints there.
    std::string damaged;
    for (const auto& reason : skipped) {
      if (reason.find(kUnfinishedSave) == std::string::npos) damaged += (damaged.empty() ? "" : "; ") + reason;
    }
    if (!found && !damaged.empty()) {
      runtime.publish(key, kNoUsableCheckpoint + "\"resume\": no checkpoint in " + config.checkpoint_dir +
                               " can be resumed: " + damaged + ". Repair or remove them, or give the job another "
                               "checkpoint_dir to start from step 0");
    } else {
      if (!found && !std::filesystem::exists(config.checkpoint_dir)) {
        // A first run of a job that always says "resume" is fine; a mistyped path or a volume that did not mount
        // would start a long run over, and says so louder.
        log::warn("\"resume\": checkpoint_dir " + config.checkpoint_dir + " does not exist; starting from step 0 "
                  "(a first run; otherwise check the path)");
      } else if (!found) {
        log::info("no complete checkpoint in " + config.checkpoint_dir + "; starting from step 0");
      }
      runtime.publish(key, found ? found->directory : "");
    }
  }
  const std::string directory = runtime.fetch(key);
  if (directory.empty()) return std::nullopt;
  if (directory.rfind(kNoUsableCheckpoint, 0) == 0) throw CheckpointError(directory.substr(kNoUsableCheckpoint.size()));
  // Rank 0 verified every file; each rank checks its own again as Checkpointer::resume loads it.
  auto manifest = read_manifest(directory);
  if (runtime.rank() == 0) {
    // Legitimate at times (a batch grown mid-run), a mistake at others: the samples seen and a schedule by step are
    // the program's to adjust, so it is said.
    try {
      const Config saved = Config::from_json_text(manifest.config_json, directory);
      if (saved.global_batch_size > 0 && config.global_batch_size > 0 &&
          saved.global_batch_size != config.global_batch_size) {
        log::warn("resuming " + directory + ", saved with \"global_batch_size\" " +
                  std::to_string(saved.global_batch_size) + ", under " + std::to_string(config.global_batch_size) +
                  ": each step now trains on that many samples (samples seen, and an LR schedule by step, are the "
                  "program's to adjust)");
      }
    } catch (const ConfigError&) {  // a config this version no longer reads: nothing to compare
    }
  }
  if (manifest.partitions != config.partitions || manifest.virtual_stages != config.virtual_stages) {
    throw CheckpointError(directory + " was saved with " + std::to_string(manifest.partitions) + " partitions x " +
                          std::to_string(manifest.virtual_stages) + " virtual stages, this job has " +
                          std::to_string(config.partitions) + " x " + std::to_string(config.virtual_stages) +
                          ": a resume keeps the cut; export it whole (smp_checkpoint export-safetensors, or smp.export_safetensors in " +
                          "Python) and load that with load_parameters, which takes each rank's modules (the optimizer " +
                          "state starts anew)");
  }
  const int degree = runtime.topology().tensor_parallel_degree();
  if (manifest.tensor_parallel_degree != degree) {
    throw CheckpointError(directory + " was written with \"tensor_parallel_degree\" " +
                          std::to_string(manifest.tensor_parallel_degree) + ", this job has " + std::to_string(degree) +
                          ": a resume keeps the shards; export it whole (smp_checkpoint export-safetensors, or "
                          "smp.export_safetensors in Python) and load that with load_parameters, which cuts each rank's "
                          "shards (the optimizer state starts anew)");
  }
  const int expert_shares = runtime.topology().expert_parallel_degree();
  if (manifest.expert_parallel_degree != expert_shares) {
    throw CheckpointError(directory + " was written with \"expert_parallel_degree\" " +
                          std::to_string(manifest.expert_parallel_degree) + ", this job has " +
                          std::to_string(expert_shares) +
                          ": a resume keeps the experts where they were; export it whole (smp.export_safetensors, "
                          "smp_checkpoint export) and load it with load_parameters, which takes each rank's experts (the optimizer state "
                          "starts anew)");
  }
  const int shards = config.shard_optimizer_state ? runtime.topology().data_parallel_degree() : 1;
  if (expert_shares > 1 && manifest.optimizer_shards != shards) {
    // Every share names the experts' state alike, whoever's experts it was: a share of another replica could hand
    // this one the moments of experts it does not hold.
    const auto describe = [](int count) {
      return count > 1 ? "sharded over " + std::to_string(count) + " replicas" : std::string("not sharded");
    };
    throw CheckpointError(directory + ": its optimizer state is " + describe(manifest.optimizer_shards) +
                          ", this job's would be " + describe(shards) +
                          "; under expert parallelism a resume keeps the replicas and \"shard_optimizer_state\" as "
                          "they were (or export the parameters and load them with load_parameters)");
  }
  if (manifest.model_signature != model_signature) {
    // Every rank says rank 0's words: only rank 0 holds the model's parameter list that names the first difference.
    std::string why = directory + " holds another model (" + manifest.model_signature + "; this model: " +
                      model_signature + ")" + first_difference(manifest.model_parameters, model_parameters) +
                      "; a job's other model (a teacher, a reference), which its Checkpointer does not save, is built "
                      "not to resume: resume=False (C++: smp::Resume::kNever)";
    if (runtime.rank() == 0) {
      runtime.publish(key + "/another_model", why);
    } else {
      why = runtime.fetch(key + "/another_model");
    }
    throw CheckpointError(why);
  }
  if (module_names != manifest.module_names) {
    std::size_t i = 0;
    while (i < module_names.size() && i < manifest.module_names.size() && module_names[i] == manifest.module_names[i]) ++i;
    const auto named = [&](const std::vector<std::string>& names) {
      return i < names.size() ? "\"" + names[i] + "\"" : std::string("none");
    };
    // The parameters are the same (the signature above): only how finely the model was cut differs.
    std::string why = directory + ": the same model, cut into other modules (" +
                      std::to_string(manifest.module_names.size()) + " there, " + std::to_string(module_names.size()) +
                      " here: module " + std::to_string(i) + " is " + named(manifest.module_names) + " there, " +
                      named(module_names) + " here)";
    bool planned_cut = false;
    try {
      planned_cut = !Config::from_json_text(manifest.config_json, directory).partition_overrides.empty();
    } catch (const ConfigError&) {  // a config this version no longer reads says nothing of the cut
    }
    if (planned_cut && config.partition_overrides.empty()) {
      why += ": its job cut the model at the modules its \"partition_overrides\" name (given, or planned for "
             "\"auto\" keys), which a captured model is cut at; resume with those partition_overrides (in its "
             "manifest.json's config_json), or with \"auto\" layout keys (a resuming \"auto\" job keeps the "
             "checkpoint's layout)";
    } else {
      why += ": a captured model is cut as finely as its stages and pinned modules ask; resume with the layout keys "
             "it was saved with";
    }
    throw CheckpointError(why);
  }
  return FoundCheckpoint{directory, std::move(manifest)};
}

}  // namespace smp
