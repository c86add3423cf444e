#include "smp/config.h"

#include "smp/scheduler/schedule.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

namespace smp {
namespace {

using nlohmann::json;

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

class Reader {
 public:
  Reader(const json& object, std::string source) : object_(object), source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw ConfigError(source_ + ": key \"" + key + "\": " + problem);
  }

  bool has(const std::string& key) const { return object_.contains(key); }

  long long integer(const std::string& key, long long low, long long high) const {
    const json& value = object_.at(key);
    if (!value.is_number_integer()) fail(key, "expected an integer, got " + shown(value));
    // Parsed as unsigned when it does not fit a signed 64-bit integer; either way compare in range first.
    if (value.is_number_unsigned() && value.get<unsigned long long>() > static_cast<unsigned long long>(high)) {
      fail(key, "must be at most " + std::to_string(high) + ", got " + value.dump());
    }
    const long long number = value.get<long long>();
    if (number < low || number > high) {
      fail(key, "must be in [" + std::to_string(low) + ", " + std::to_string(high) + "], got " + value.dump());
    }
    return number;
  }

  double real(const std::string& key, double low, double high) const {
    const json& value = object_.at(key);
    if (!value.is_number()) fail(key, "expected a number, got " + shown(value));
    const double number = value.get<double>();
    if (!std::isfinite(number) || number < low || number > high) {
      std::ostringstream range;
      range << "must be in [" << low << ", " << high << "], got " << value.dump();
      fail(key, range.str());
    }
    return number;
  }

  bool boolean(const std::string& key) const {
    const json& value = object_.at(key);
    if (!value.is_boolean()) fail(key, "expected true or false, got " + shown(value));
    return value.get<bool>();
  }

  std::string choice(const std::string& key, const std::vector<std::string>& allowed) const {
    const json& value = object_.at(key);
    std::string list;
    for (const auto& option : allowed) list += (list.empty() ? "\"" : ", \"") + option + "\"";
    if (!value.is_string()) fail(key, "expected one of " + list + ", got " + shown(value));
    const std::string text = value.get<std::string>();
    if (std::find(allowed.begin(), allowed.end(), text) == allowed.end()) {
      fail(key, "expected one of " + list + ", got \"" + text + "\"");
    }
    return text;
  }

  std::string string(const std::string& key) const {
    const json& value = object_.at(key);
    if (!value.is_string()) fail(key, "expected a string, got " + shown(value));
    return value.get<std::string>();
  }

  const json& raw(const std::string& key) const { return object_.at(key); }

  // A non-empty list of numbers in [low, high]; `expected` says what the list is.
  std::vector<double> reals(const std::string& key, double low, double high, const std::string& expected) const {
    const json& value = object_.at(key);
    if (!value.is_array() || value.empty()) fail(key, "expected " + expected + ", got " + shown(value));
    std::vector<double> numbers;
    for (std::size_t i = 0; i < value.size(); ++i) {
      const json& item = value[i];
      const double number = item.is_number() ? item.get<double>() : std::nan("");
      if (!std::isfinite(number) || number < low || number > high) {
        std::ostringstream problem;
        problem << "entry " << i << " must be a number in [" << low << ", " << high << "], got " << shown(item);
        fail(key, problem.str());
      }
      numbers.push_back(number);
    }
    return numbers;
  }

 private:
  static std::string shown(const json& value) {
    std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
    if (text.size() > 40) text = text.substr(0, 37) + "...";
    if (value.is_null()) return "null";  // its type's name is its text
    return std::string(value.type_name()) + " " + text;
  }

  const json& object_;
  std::string source_;
};

// SMP's placement letters: D (data), P (pipeline), T (tensor). The order names the dimensions from the
// slowest-varying to the fastest-varying over consecutive ranks; without T, T varies fastest.
bool is_placement_order(const std::string& text) {
  std::string letters = text;
  std::sort(letters.begin(), letters.end());
  return letters == "DP" || letters == "DPT";
}

constexpr long long kMaxCount = 1 << 20;

// Every key smp reads, in the order it reads them (a key's checks may use the keys before it): `read` runs when
// the key is given, `after` whether or not (what follows from the keys so far: defaults, checks across keys).
struct Key {
  const char* name;
  void (*read)(const Reader&, Config&);
  void (*after)(const Reader&, Config&) = nullptr;
};

const std::vector<Key>& key_table() {
  static const std::vector<Key> table = {
      {"partitions",
       [](const Reader& r, Config& c) {
         if (r.has("pipeline_parallel_degree")) {
           r.fail("pipeline_parallel_degree", "is an alias of \"partitions\"; give only one of them");
         }
         c.partitions = static_cast<int>(r.integer("partitions", 1, 4096));
       }},
      {"pipeline_parallel_degree",
       [](const Reader& r, Config& c) { c.partitions = static_cast<int>(r.integer("pipeline_parallel_degree", 1, 4096)); }},
      {"tensor_parallel_degree",
       [](const Reader& r, Config& c) { c.tensor_parallel_degree = static_cast<int>(r.integer("tensor_parallel_degree", 1, 4096)); }},
      {"sequence_parallel", [](const Reader& r, Config& c) { c.sequence_parallel = r.boolean("sequence_parallel"); }},
      {"expert_parallel_degree",
       [](const Reader& r, Config& c) {
         c.expert_parallel_degree = static_cast<int>(r.integer("expert_parallel_degree", 1, 4096));
         // Each tensor-parallel rank would route its own slice of the sequence; the experts' gradients would then
         // need a sum over the tensor-parallel group too.
         if (c.expert_parallel_degree > 1 && c.sequence_parallel && c.tensor_parallel_degree > 1) {
           r.fail("expert_parallel_degree", "with \"sequence_parallel\" is not supported yet");
         }
       }},
      {"microbatches", [](const Reader& r, Config& c) { c.microbatches = static_cast<int>(r.integer("microbatches", 1, kMaxCount)); }},
      {"pipeline",
       [](const Reader& r, Config& c) {
         // SMP's names first, then the generators' (what smp_schedule and schedule files call them).
         std::vector<std::string> names;
         for (const auto& kind : sched::schedule_kinds()) {
           if (*kind.config_alias && std::find(names.begin(), names.end(), kind.config_alias) == names.end()) {
             names.emplace_back(kind.config_alias);
           }
         }
         for (const auto& kind : sched::schedule_kinds()) names.emplace_back(kind.name);
         c.pipeline = r.choice("pipeline", names);
       },
       [](const Reader&, Config& c) {
         if (sched::find_schedule_kind(c.pipeline).stages_per_rank == 2) c.virtual_stages = 2;  // a V: two per rank
       }},
      {"active_microbatches",
       [](const Reader& r, Config& c) { c.active_microbatches = static_cast<int>(r.integer("active_microbatches", 0, kMaxCount)); }},
      {"virtual_stages",
       [](const Reader& r, Config& c) {
         c.virtual_stages = static_cast<int>(r.integer("virtual_stages", 1, 64));
         const auto& chosen = sched::find_schedule_kind(c.pipeline, c.virtual_stages);
         if (chosen.stages_per_rank == 1 && c.virtual_stages > 1) {
           std::string several;
           for (const auto& kind : sched::schedule_kinds()) {
             if (kind.stages_per_rank == 1) continue;
             several += std::string(several.empty() ? "" : ", ") + "\"" +
                        (*kind.config_alias ? kind.config_alias : kind.name) + "\"";
           }
           r.fail("virtual_stages", "needs a \"pipeline\" of several stages per rank (" + several + "); \"" +
                                        c.pipeline + "\" runs one stage per rank");
         }
         if (chosen.stages_per_rank == 2 && c.virtual_stages != 2) {
           r.fail("virtual_stages", "must be 2 with \"pipeline\": \"" + c.pipeline +
                                        "\", which runs two stages per rank in a V");
         }
       }},
      {"schedule_file", [](const Reader& r, Config& c) { c.schedule_file = r.string("schedule_file"); },
       [](const Reader& r, Config& c) {
         if (c.active_microbatches > 0 && !sched::find_schedule_kind(c.pipeline, c.virtual_stages).takes_cap) {
           r.fail("active_microbatches",
                  "has no effect with \"pipeline\": \"" + c.pipeline +
                      "\", whose own order decides what a rank holds (it takes no cap); use \"interleaved\" to cap microbatches "
                      "in flight");
         }
         if (c.active_microbatches > 0 && c.active_microbatches < c.virtual_stages) {
           r.fail("active_microbatches",
                  "must be 0 or at least \"virtual_stages\" (" + std::to_string(c.virtual_stages) + ")");
         }
       }},
      {"activation_checkpointing",
       [](const Reader& r, Config& c) {
         const json& value = r.raw("activation_checkpointing");
         const int stages = c.partitions * c.virtual_stages;
         if (value.is_boolean()) {
           if (value.get<bool>()) {
             for (int stage = 0; stage < stages; ++stage) c.checkpointed_stages.push_back(stage);
           }
         } else if (value.is_array()) {
           for (const auto& item : value) {
             if (item.is_string() && !item.get<std::string>().empty()) {
               c.checkpointed_modules.push_back(item.get<std::string>());
               continue;
             }
             if (!item.is_number_integer() || item.get<long long>() < 0 || item.get<long long>() >= stages) {
               r.fail("activation_checkpointing", item.is_number_integer()
                          ? "stage " + item.dump() + " is not in [0, " + std::to_string(stages - 1) + "]"
                          : item.dump() + " is neither a stage index nor a module name");
             }
             c.checkpointed_stages.push_back(item.get<int>());
           }
         } else {
           r.fail("activation_checkpointing", "expected true, false, or a list of stage indices and module names");
         }
       }},
      {"overlap_forward_backward",
       [](const Reader& r, Config& c) { c.overlap_forward_backward = r.boolean("overlap_forward_backward"); },
       [](const Reader& r, Config& c) {
         // A recompute replays the random draws its forward made, and an overlapped forward draws from the same
         // generator as the backward running beside it.
         if (c.overlap_forward_backward && (!c.checkpointed_stages.empty() || !c.checkpointed_modules.empty())) {
           r.fail("overlap_forward_backward", "cannot be combined with \"activation_checkpointing\" (a recompute "
                                              "must replay its forward's random draws, which an overlapped forward "
                                              "shares with the backward beside it)");
         }
       }},
      {"trace_dir", [](const Reader& r, Config& c) { c.trace_dir = r.string("trace_dir"); }},
      {"trace_step", [](const Reader& r, Config& c) { c.trace_step = static_cast<int>(r.integer("trace_step", 0, 1 << 30)); }},
      {"checkpoint_dir", [](const Reader& r, Config& c) { c.checkpoint_dir = r.string("checkpoint_dir"); }},
      {"checkpoint_interval",
       [](const Reader& r, Config& c) { c.checkpoint_interval = static_cast<int>(r.integer("checkpoint_interval", 0, 1 << 30)); }},
      {"checkpoints_kept",
       [](const Reader& r, Config& c) { c.checkpoints_kept = static_cast<int>(r.integer("checkpoints_kept", 1, 1000)); }},
      {"checkpoint_frozen_parameters",
       [](const Reader& r, Config& c) { c.checkpoint_frozen_parameters = r.boolean("checkpoint_frozen_parameters"); }},
      {"resume", [](const Reader& r, Config& c) { c.resume = r.boolean("resume"); },
       [](const Reader& r, Config& c) {
         if ((c.checkpoint_interval > 0 || c.resume) && c.checkpoint_dir.empty()) {
           r.fail(c.resume ? "resume" : "checkpoint_interval", "needs \"checkpoint_dir\"");
         }
       }},
      {"bf16", [](const Reader& r, Config& c) { c.bf16 = r.boolean("bf16"); }},
      {"fp16", [](const Reader& r, Config& c) { c.fp16 = r.boolean("fp16"); },
       [](const Reader& r, Config& c) {
         if (c.bf16 && c.fp16) r.fail("fp16", "and \"bf16\" are both true; pick one");
       }},
      {"device", [](const Reader& r, Config& c) { c.device = r.choice("device", {"auto", "cpu", "cuda"}); }},
      {"backend",
       [](const Reader& r, Config& c) {
         if (r.has("ddp_dist_backend")) r.fail("ddp_dist_backend", "is an alias of \"backend\"; give only one of them");
         c.backend = r.choice("backend", {"auto", "gloo", "nccl"});
       }},
      {"ddp_dist_backend", [](const Reader& r, Config& c) { c.backend = r.choice("ddp_dist_backend", {"auto", "gloo", "nccl"}); },
       [](const Reader& r, Config& c) {
         if (c.device == "cpu" && c.backend == "nccl") {
           r.fail(r.has("backend") ? "backend" : "ddp_dist_backend",
                  "\"nccl\" moves GPU tensors only, and \"device\" is \"cpu\"; use \"gloo\" or \"auto\"");
         }
       }},
      {"nonfinite",
       [](const Reader& r, Config& c) { c.skip_nonfinite_steps = r.choice("nonfinite", {"stop", "skip"}) == "skip"; }},
      {"ddp", [](const Reader& r, Config& c) { c.ddp = r.boolean("ddp"); }},
      {"shard_optimizer_state",
       [](const Reader& r, Config& c) { c.shard_optimizer_state = r.boolean("shard_optimizer_state"); }},
      {"placement_strategy",
       [](const Reader& r, Config& c) {
         const std::string text = r.string("placement_strategy");
         if (text != "cluster" && text != "spread" && !is_placement_order(text)) {
           r.fail("placement_strategy", "expected \"cluster\", \"spread\", or an order of the letters D, P and T "
                                        "such as \"DPT\", got \"" + text + "\"");
         }
         c.placement_strategy = text;
       }},
      {"auto_partition", [](const Reader& r, Config& c) { c.auto_partition = r.boolean("auto_partition"); }},
      {"default_partition",
       [](const Reader& r, Config& c) { c.default_partition = static_cast<int>(r.integer("default_partition", 0, 4095)); }},
      {"partition_overrides",
       [](const Reader& r, Config& c) {
         const json& overrides = r.raw("partition_overrides");
         if (!overrides.is_object()) r.fail("partition_overrides", "expected an object of module path -> stage");
         for (auto it = overrides.begin(); it != overrides.end(); ++it) {
           const long long stages = static_cast<long long>(c.partitions) * c.virtual_stages;
           if (!it.value().is_number_integer() || it.value().get<long long>() < 0 ||
               it.value().get<long long>() >= stages) {
             r.fail("partition_overrides", "module \"" + it.key() + "\" must map to a stage in [0, " +
                                               std::to_string(stages - 1) + "], got " + it.value().dump());
           }
           c.partition_overrides[it.key()] = it.value().get<int>();
         }
       }},
      {"optimize", [](const Reader& r, Config& c) { c.optimize = r.choice("optimize", {"speed", "memory"}); },
       [](const Reader&, Config& c) { c.memory_weight = c.optimize == "speed" ? 0.2 : 0.8; }},
      {"memory_weight", [](const Reader& r, Config& c) { c.memory_weight = r.real("memory_weight", 0.0, 1.0); }},
      {"memory_limit_mb", [](const Reader& r, Config& c) { c.memory_limit_mb = r.real("memory_limit_mb", 0.0, 1e12); }},
      {"link_bandwidth_gbps",
       [](const Reader& r, Config& c) { c.link_bandwidth_gbps = r.real("link_bandwidth_gbps", 0.0, 1e6); }},
      {"device_speeds",
       [](const Reader& r, Config& c) {
         if (r.raw("device_speeds") == "measure") {
           c.measure_device_speeds = true;
         } else {
           c.device_speeds = r.reals("device_speeds", 1e-6, 1e6, "a list of relative speeds, one per rank, or \"measure\"");
         }
       }},
      {"device_memory_mb",
       [](const Reader& r, Config& c) { c.device_memory_mb = r.reals("device_memory_mb", 0.0, 1e12, "a list of MiB, one per rank"); }},
      {"emulated_slowdown",
       [](const Reader& r, Config& c) { c.emulated_slowdown = r.reals("emulated_slowdown", 1.0, 1e3, "a list of factors, one per rank"); }},
      {"seed",
       [](const Reader& r, Config& c) {
         c.seed = static_cast<std::uint64_t>(r.integer("seed", 0, std::numeric_limits<long long>::max()));
       }},
      {"global_batch_size",
       [](const Reader& r, Config& c) { c.global_batch_size = static_cast<int>(r.integer("global_batch_size", 1, 1LL << 30)); }},
      {"comm_timeout_s", [](const Reader& r, Config& c) { c.comm_timeout_s = r.real("comm_timeout_s", 0.1, 7 * 24 * 3600.0); }},
      {"log_level",
       [](const Reader& r, Config& c) {
         // Python's logging says "warning" (and "critical") where spdlog says "warn"; both are taken.
         c.log_level = r.choice("log_level", {"trace", "debug", "info", "warn", "warning", "error", "critical", "off"});
         if (c.log_level == "warning") c.log_level = "warn";
         if (c.log_level == "critical") c.log_level = "error";
       }},
  };
  return table;
}

std::vector<std::string> words_of(const std::string& key) {
  std::vector<std::string> words;
  std::size_t start = 0;
  for (std::size_t end = 0; end <= key.size(); ++end) {
    if (end < key.size() && key[end] != '_') continue;
    if (end > start) words.push_back(key.substr(start, end - start));
    start = end + 1;
  }
  return words;
}

// What other frameworks (Megatron, DeepSpeed, torch.distributed.pipelining, Hugging Face's Trainer) call smp's keys.
const std::vector<std::pair<std::string, std::string>>& other_frameworks_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"pp", "partitions"}, {"pp_size", "partitions"}, {"pipeline_parallel_size", "partitions"},
      {"pipeline_model_parallel_size", "partitions"}, {"num_stages", "partitions"}, {"stages", "partitions"},
      {"pp_degree", "partitions"}, {"tp_degree", "tensor_parallel_degree"}, {"ep_degree", "expert_parallel_degree"},
      {"tp", "tensor_parallel_degree"}, {"tp_size", "tensor_parallel_degree"},
      {"tensor_parallel_size", "tensor_parallel_degree"}, {"tensor_model_parallel_size", "tensor_parallel_degree"},
      {"ep", "expert_parallel_degree"}, {"ep_size", "expert_parallel_degree"},
      {"expert_parallel_size", "expert_parallel_degree"}, {"expert_model_parallel_size", "expert_parallel_degree"},
      {"virtual_pipeline_model_parallel_size", "virtual_stages"}, {"chunks", "microbatches"},
      {"num_microbatches", "microbatches"}, {"n_microbatches", "microbatches"},
      {"gradient_accumulation_steps", "microbatches"}, {"schedule", "pipeline"}, {"pipeline_schedule", "pipeline"},
      {"save_steps", "checkpoint_interval"}, {"save_interval", "checkpoint_interval"},
      {"checkpoint_every", "checkpoint_interval"}, {"save_total_limit", "checkpoints_kept"},
      {"zero_stage", "shard_optimizer_state"}, {"gradient_checkpointing", "activation_checkpointing"},
      {"recompute_granularity", "activation_checkpointing"}, {"timeout", "comm_timeout_s"},
      {"amp", "bf16"}, {"mixed_precision", "bf16"}, {"fp16_enabled", "fp16"}, {"bf16_enabled", "bf16"},
  };
  return names;
}

// SageMaker SMP's keys that smp has no counterpart of, and what to do instead: an SMP config ported as it is meets
// these, and "unknown key" (or a guess at a key like it) would not say that the key is SMP's and left out on purpose.
std::string smp_key_not_supported(const std::string& key) {
  static const std::string kZero1 = "sharded data parallelism (ZeRO-3) is not built; \"shard_optimizer_state\" "
                                    "shards the optimizer state over the replicas (ZeRO-1)";
  static const std::string kOffload = "activation offloading is not built; \"activation_checkpointing\" recomputes "
                                      "instead";
  static const std::string kSageMakerOptions = "SageMaker's modelparallel options: give their \"parameters\" "
                                               "object as smp's config";
  static const std::map<std::string, std::string> reasons = {
      {"fp16_params", "parameters stay float32 under \"fp16\" (autocast with loss scaling); remove it"},
      {"prescaled_batch", "the tensor-parallel ranks of a replica always take the same batch here (as SMP's "
                          "prescaled_batch true); remove it"},
      {"skip_tracing", "smp profiles each module on the sample to partition by cost; a model too large to build "
                       "whole is built on the meta device (smp.materialize, load_pretrained); remove it"},
      {"delayed_parameter_initialization", "build the model on the meta device: DistributedModel materializes "
                                           "only each rank's stages; remove it"},
      {"offload_activations", kOffload},
      {"activation_loading_horizon", kOffload},
      {"sharded_data_parallel_degree", kZero1},
      {"hybrid_shard_degree", kZero1},
      {"ddp_port", "the launcher gives the port (smprun --master-port, or MASTER_PORT); remove it"},
      {"horovod", "a TensorFlow key: smp's replicas reduce gradients themselves (\"ddp\"); remove it"},
      {"contiguous", "a TensorFlow key: smp's stages are contiguous; remove it"},
      {"deterministic_server", "each rank runs its actions in the schedule's order always; remove it"},
      {"fast_mode", "smp sends each stage's outputs to the stage that reads them; remove it"},
      {"predefined_hooks", "a captured Hugging Face model needs no hooks; remove it"},
      {"mpi", "SageMaker's MPI launch options: launch the processes with smprun -n N (or torchrun)"},
      {"processes_per_host", "SageMaker's MPI option: smprun -n N starts N processes"},
      {"custom_mpi_options", "SageMaker's MPI option: smprun needs none"},
      {"enabled", kSageMakerOptions},
      {"parameters", kSageMakerOptions},
      {"modelparallel", kSageMakerOptions},
      {"smdistributed", "SageMaker's distribution options: give distribution[\"smdistributed\"][\"modelparallel\"]"
                        "[\"parameters\"] as smp's config"},
  };
  const auto found = reasons.find(key);
  if (found != reasons.end()) return found->second;
  return key.rfind("sdp_", 0) == 0 ? kZero1 : std::string();
}

std::string other_frameworks_name(const std::string& key) {
  for (const auto& [theirs, ours] : other_frameworks_names()) {
    if (theirs == key) return ours;
  }
  return {};
}

// A name that is no typo of smp's may share its words: the known keys with the most words in common with `key` (a
// word matching when one begins the other, as "checkpoint" and "checkpoints"; words that say little, such as
// "size" or "steps", not counted), at most four, or "".
std::string keys_sharing_a_word(const std::string& key) {
  constexpr std::size_t kShortestWord = 3, kShown = 4;
  static const std::set<std::string> vague = {"size", "step", "steps", "num", "number", "count", "max", "min",
                                              "degree", "total"};
  std::vector<std::string> words;
  for (std::string& word : words_of(key)) {
    if (word.size() >= kShortestWord && !vague.count(word)) words.push_back(std::move(word));
  }
  auto begins = [](const std::string& longer, const std::string& shorter) {
    return longer.compare(0, shorter.size(), shorter) == 0;
  };
  std::vector<std::pair<int, std::string>> shared;  // (-words in common, name): the most first, then by name
  for (const Key& known : key_table()) {
    int common = 0;
    for (const std::string& word : words) {
      for (const std::string& other : words_of(known.name)) {
        if (other.size() >= kShortestWord && !vague.count(other) && (begins(word, other) || begins(other, word))) {
          ++common;
          break;
        }
      }
    }
    if (common > 0) shared.emplace_back(-common, known.name);
  }
  std::sort(shared.begin(), shared.end());
  std::string text;
  for (std::size_t i = 0; i < shared.size() && i < kShown; ++i) text += (i ? ", \"" : "\"") + shared[i].second + "\"";
  return text;
}

bool is_known_key(const std::string& name) {
  const auto& table = key_table();
  return std::any_of(table.begin(), table.end(), [&](const Key& key) { return name == key.name; });
}

}  // namespace

std::vector<std::string> Config::keys() {
  std::vector<std::string> names;
  for (const Key& key : key_table()) names.emplace_back(key.name);
  return names;
}

Config Config::from_json_text(const std::string& text, const std::string& source) {
  json document;
  try {
    // Depth is bounded by the parser's own recursion; reject absurd nesting before it can matter.
    std::size_t depth = 0, max_depth = 0;
    bool in_string = false, escaped = false;
    for (char c : text) {
      if (in_string) {
        if (escaped) escaped = false;
        else if (c == '\\') escaped = true;
        else if (c == '"') in_string = false;
        continue;
      }
      if (c == '"') in_string = true;
      else if (c == '{' || c == '[') max_depth = std::max(max_depth, ++depth);
      else if ((c == '}' || c == ']') && depth > 0) --depth;
    }
    if (max_depth > 64) throw ConfigError(source + ": nested " + std::to_string(max_depth) + " levels deep; at most 64 allowed");
    // A key given twice in one object: JSON parsers keep one of them silently (the last), so the job would run
    // with a layout its file seems not to give.
    std::vector<std::set<std::string>> keys_by_depth;
    const json::parser_callback_t refuse_repeated_keys = [&](int, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::object_start) keys_by_depth.emplace_back();
      if (event == json::parse_event_t::object_end && !keys_by_depth.empty()) keys_by_depth.pop_back();
      if (event == json::parse_event_t::key && !keys_by_depth.empty() &&
          !keys_by_depth.back().insert(parsed.get<std::string>()).second) {
        throw ConfigError(source + ": key \"" + parsed.get<std::string>() + "\" is given twice; give it once");
      }
      return true;
    };
    document = json::parse(text, refuse_repeated_keys);
  } catch (const json::exception& error) {
    throw ConfigError(source + ": not valid JSON: " + error.what());
  }
  if (!document.is_object()) throw ConfigError(source + ": expected a JSON object at the top level");

  Config config;
  config.source = source;
  config.text = text;
  json smp_keys = document;
  auto sections = std::make_shared<json>(json::object());
  if (document.contains("smp")) {
    if (!document["smp"].is_object()) throw ConfigError(source + ": key \"smp\": expected an object");
    smp_keys = document["smp"];
    for (auto it = document.begin(); it != document.end(); ++it) {
      if (it.key() == "smp") continue;
      // An smp key beside the section would otherwise be left to the application, which never reads it: the job
      // would run without checkpoints, or with the wrong batch, and say nothing.
      if (is_known_key(it.key())) {
        throw ConfigError(source + ": key \"" + it.key() + "\" is at the top level, beside the \"smp\" section; "
                          "smp reads it only inside that section");
      }
      (*sections)[it.key()] = it.value();
    }
  }
  config.application_sections = sections;

  // SMP keys whose false asks for what smp does anyway (an SMP config's defaults written out): taken as they are.
  // prescaled_batch false, SMP's default, splits a batch over the tensor-parallel ranks: the same without them.
  static const std::set<std::string> kFalseIsSmps = {"skip_tracing", "delayed_parameter_initialization",
                                                     "offload_activations", "fp16_params", "horovod"};
  const bool tensor_parallel = smp_keys.contains("tensor_parallel_degree") && smp_keys["tensor_parallel_degree"] != 1;
  for (auto it = smp_keys.begin(); it != smp_keys.end(); ++it) {
    if (is_known_key(it.key())) continue;
    if (it.value().is_boolean() && !it.value().get<bool>() &&
        (kFalseIsSmps.count(it.key()) || (it.key() == "prescaled_batch" && !tensor_parallel))) {
      continue;
    }
    std::string nearest;
    std::size_t nearest_distance = 4;  // suggest only plausible typos
    for (const Key& key : key_table()) {
      const std::size_t distance = edit_distance(it.key(), key.name);
      if (distance < nearest_distance) nearest_distance = distance, nearest = key.name;
    }
    // A section of the application's own (an object) in a file without an "smp" section.
    const bool section = it.value().is_object() && !document.contains("smp");
    if (const std::string instead = smp_key_not_supported(it.key()); !instead.empty()) {
      throw ConfigError(source + ": key \"" + it.key() + "\"" +
                        (section ? " (an application's own section? then put smp's keys under an \"smp\" section "
                                   "beside it; or SageMaker SMP's, which smp does not take: " + instead + ")"
                                 : " is SageMaker SMP's, which smp does not take: " + instead));
    }
    const std::string ours = other_frameworks_name(it.key());
    if (!ours.empty()) throw ConfigError(source + ": unknown key \"" + it.key() + "\" (smp's is \"" + ours + "\")");
    if (!nearest.empty()) throw ConfigError(source + ": unknown key \"" + it.key() + "\" (did you mean \"" + nearest + "\"?)");
    const std::string related = keys_sharing_a_word(it.key());
    throw ConfigError(source + ": unknown key \"" + it.key() + "\"" +
                      (section ? std::string(" (an application's own section? then put smp's keys under an \"smp\" "
                                             "section beside it)")
                               : related.empty() ? std::string(" (see README for the keys)")
                                                 : " (smp's keys like it: " + related + ")"));
  }

  // "auto" layout keys are left to their defaults here and chosen by the planner later.
  if (smp_keys.contains("pipeline_parallel_degree") && smp_keys["pipeline_parallel_degree"] == "auto") {
    if (smp_keys.contains("partitions")) {
      throw ConfigError(source + ": key \"pipeline_parallel_degree\": is an alias of \"partitions\"; give only one of them");
    }
    smp_keys["partitions"] = "auto";  // the alias's "auto" is partitions'
    smp_keys.erase("pipeline_parallel_degree");
  }
  for (const std::string& name : Config::planned_keys()) {
    if (!smp_keys.contains(name) || !smp_keys[name].is_string()) continue;
    const std::string value = smp_keys[name].get<std::string>();
    if (value == "auto") {
      config.auto_keys.push_back(name);
      smp_keys.erase(name);
      continue;
    }
    std::string lower = value;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower.rfind("auto", 0) == 0) {
      throw ConfigError(source + ": key \"" + name + "\": \"" + value + "\" (did you mean \"auto\"? the planner chooses it)");
    }
  }
  if (!config.auto_keys.empty()) {
    if (!smp_keys.contains("global_batch_size")) {
      throw ConfigError(source + ": key \"" + config.auto_keys.front() +
                        "\": \"auto\" needs \"global_batch_size\" (the batch each layout is planned for)");
    }
    for (const char* fixed : {"schedule_file", "partition_overrides", "default_partition"}) {
      if (smp_keys.contains(fixed)) {
        throw ConfigError(source + ": key \"" + fixed + "\" fixes stages, which \"" + config.auto_keys.front() +
                          "\": \"auto\" leaves to the planner; give the layout keys instead");
      }
    }
  }

  const Reader read(smp_keys, source);
  for (const Key& key : key_table()) {
    if (read.has(key.name)) key.read(read, config);
    if (key.after) key.after(read, config);
  }
  if (config.default_partition >= config.num_stages()) {
    read.fail("default_partition", "must be below the number of stages (" + std::to_string(config.num_stages()) +
                                       "), got " + std::to_string(config.default_partition));
  }
  if (config.global_batch_size > 0 && config.global_batch_size % config.microbatches != 0) {
    read.fail("global_batch_size", std::to_string(config.global_batch_size) + " does not split into " +
                                       std::to_string(config.microbatches) + " microbatches");
  }
  return config;
}

const std::vector<std::string>& Config::planned_keys() {
  static const std::vector<std::string> keys = {"partitions", "microbatches",   "pipeline",
                                                "virtual_stages", "ddp", "activation_checkpointing",
                                                "shard_optimizer_state", "tensor_parallel_degree",
                                                "expert_parallel_degree"};
  return keys;
}

bool Config::plans(const std::string& key) const {
  return std::find(auto_keys.begin(), auto_keys.end(), key) != auto_keys.end();
}

Config Config::provisional_layout(int world_size) const {
  Config config = *this;
  if (plans("partitions")) {
    // Every rank a replica where replicas may be had (as few stages as leave replicas that share the global batch
    // evenly); else every rank a stage. Only until the plan: the job then adopts the layout chosen.
    const bool replicas_allowed = plans("ddp") || ddp;
    const int ranks = std::max(1, world_size / std::max(1, tensor_parallel_degree));
    int partitions = replicas_allowed ? 1 : ranks;
    while (partitions < ranks && (ranks % partitions != 0 || global_batch_size % (ranks / partitions) != 0)) {
      ++partitions;
    }
    config.partitions = partitions;
  }
  if (plans("ddp")) config.ddp = world_size > config.partitions * config.tensor_parallel_degree;
  // Without replicas and with the stages fixed, the tensor-parallel ranks fill the world.
  if (plans("tensor_parallel_degree") && !config.ddp && world_size % config.partitions == 0) {
    config.tensor_parallel_degree = world_size / config.partitions;
  }
  if (plans("microbatches")) config.microbatches = 1;
  return config;
}

Config Config::from_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw ConfigError(path + ": cannot open the config file");
  constexpr std::streamsize kMaxBytes = 16 << 20;
  std::string text;
  text.resize(kMaxBytes + 1);
  file.read(text.data(), kMaxBytes + 1);
  if (file.gcount() > kMaxBytes) throw ConfigError(path + ": larger than 16 MiB; not a config file");
  text.resize(static_cast<std::size_t>(file.gcount()));
  return from_json_text(text, path);
}

int Config::replicas_for_world(int world_size) const {
  if (world_size < 1) throw ConfigError("world size must be positive, got " + std::to_string(world_size));
  const int model_ranks = partitions * tensor_parallel_degree;
  const std::string model_degrees =
      tensor_parallel_degree == 1 ? "\"partitions\" (" + std::to_string(partitions) + ")"
                                  : "\"partitions\" x \"tensor_parallel_degree\" (" + std::to_string(partitions) +
                                        " x " + std::to_string(tensor_parallel_degree) + ")";
  if (world_size % model_ranks != 0) {
    throw ConfigError(source + ": world size " + std::to_string(world_size) + " is not a multiple of " + model_degrees +
                      "; launch " + (tensor_parallel_degree == 1 ? "partitions" : "partitions x tensor_parallel_degree") +
                      " x replicas processes");
  }
  const int replicas = world_size / model_ranks;
  if (replicas > 1 && !ddp && std::find(auto_keys.begin(), auto_keys.end(), "ddp") != auto_keys.end()) {
    throw ConfigError(source + ": \"ddp\" is \"auto\": the planner chooses the replicas when the model is given to "
                      "DistributedModel; until then the runtime's topology() is the provisional layout's");
  }
  if (replicas > 1 && !ddp) {
    throw ConfigError(source + ": world size " + std::to_string(world_size) + " with " + model_degrees + " gives " +
                      std::to_string(replicas) + " replicas, but \"ddp\" is false; set \"ddp\": true or launch " +
                      std::to_string(model_ranks) + " processes");
  }
  if (replicas % expert_parallel_degree != 0) {
    throw ConfigError(source + ": \"expert_parallel_degree\" " + std::to_string(expert_parallel_degree) +
                      " does not divide the " + std::to_string(replicas) + " data-parallel replicas (world size " +
                      std::to_string(world_size) + " / " + model_degrees +
                      "); the experts are spread over data-parallel ranks, so launch a multiple of " +
                      std::to_string(model_ranks * expert_parallel_degree) + " processes");
  }
  if (global_batch_size > 0) check_batch(global_batch_size, replicas);
  return replicas;
}

void Config::check_batch(int global_batch, int replicas, bool given_to_step) const {
  const long long pieces = static_cast<long long>(replicas) * microbatches;
  const std::string split = std::to_string(replicas) + " replicas x " + std::to_string(microbatches) + " microbatches";
  if (given_to_step) {
    // A step's batch may split unevenly (an epoch's last), but every microbatch needs a sample.
    if (global_batch >= pieces) return;
    throw ConfigError("the step's batch: a global batch of " + std::to_string(global_batch) + " samples is fewer than " +
                      split + ", each of which needs a sample at least");
  }
  if (global_batch % pieces != 0) {
    throw ConfigError(source + ": a global batch of " + std::to_string(global_batch) + " does not split into " + split +
                      "; make \"global_batch_size\" a multiple of " + std::to_string(pieces));
  }
}

std::string Config::schedule_name() const { return sched::find_schedule_kind(pipeline, virtual_stages).name; }

bool Config::splits_backward() const { return sched::find_schedule_kind(pipeline, virtual_stages).split_backward; }

std::string Config::describe() const {
  std::ostringstream text;
  text << "partitions=" << partitions
       << (tensor_parallel_degree > 1 ? " tensor_parallel_degree=" + std::to_string(tensor_parallel_degree) : "")
       << (tensor_parallel_degree > 1 && sequence_parallel ? " sequence_parallel" : "")
       << (expert_parallel_degree > 1 ? " expert_parallel_degree=" + std::to_string(expert_parallel_degree) : "")
       << " microbatches=" << microbatches << " schedule="
       << (schedule_file.empty() ? schedule_name() : "file:" + schedule_file)
       << (overlap_forward_backward ? " overlap_forward_backward" : "") << " virtual_stages=" << virtual_stages
       << " ddp=" << (ddp ? "true" : "false") << (shard_optimizer_state ? " shard_optimizer_state=true" : "")
       << " placement=" << placement_strategy << " active_microbatches=" << active_microbatches
       << " auto_partition=" << (auto_partition ? "true" : "false") << " memory_weight=" << memory_weight << " seed=" << seed << " device=" << device
       << " backend=" << backend;
  if (global_batch_size > 0) text << " global_batch_size=" << global_batch_size;
  if (!checkpointed_stages.empty()) {
    text << " activation_checkpointing=stages:";
    for (std::size_t i = 0; i < checkpointed_stages.size(); ++i) text << (i ? "," : "") << checkpointed_stages[i];
  }
  if (!checkpointed_modules.empty()) text << " activation_checkpointing=" << checkpointed_modules.size() << " modules";
  if (bf16) text << " bf16";
  if (fp16) text << " fp16";
  if (!auto_keys.empty()) {
    text << " (planned when the model is known:";
    for (const auto& key : auto_keys) text << " " << key;
    text << ")";
  }
  return text.str();
}

void Config::check_sections(const std::vector<std::string>& known) const {
  if (!application_sections) return;
  for (auto it = application_sections->begin(); it != application_sections->end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) != known.end()) continue;
    std::string expected = "\"smp\"";
    for (const auto& name : known) expected += ", \"" + name + "\"";
    throw ConfigError(source + ": unknown top-level key \"" + it.key() + "\" (this program reads " + expected + ")");
  }
}

const nlohmann::json& Config::application(const std::string& name) const {
  static const json null_section;
  if (!application_sections || !application_sections->contains(name)) return null_section;
  return application_sections->at(name);
}

}  // namespace smp
