#include "smp/config.h"

#include "smp/scheduler/schedule.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

namespace smp {
namespace {

using nlohmann::json;

const std::vector<std::string>& known_keys() {
  static const std::vector<std::string> keys = {
      "partitions", "pipeline_parallel_degree", "tensor_parallel_degree", "sequence_parallel", "microbatches", "pipeline", "ddp", "placement_strategy",
      "active_microbatches", "auto_partition", "default_partition", "partition_overrides", "optimize",
      "memory_weight", "seed", "global_batch_size", "comm_timeout_s", "log_level", "virtual_stages", "schedule_file",
      "activation_checkpointing", "trace_dir", "trace_step", "checkpoint_dir", "checkpoint_interval",
      "checkpoints_kept", "resume", "nonfinite", "memory_limit_mb", "link_bandwidth_gbps", "bf16", "fp16",
      "device", "backend", "ddp_dist_backend", "shard_optimizer_state"};
  return keys;
}

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

 private:
  static std::string shown(const json& value) {
    std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
    if (text.size() > 40) text = text.substr(0, 37) + "...";
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

}  // namespace

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
    document = json::parse(text);
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
    const auto& keys = known_keys();
    for (auto it = document.begin(); it != document.end(); ++it) {
      if (it.key() == "smp") continue;
      // An smp key beside the section would otherwise be left to the application, which never reads it: the job
      // would run without checkpoints, or with the wrong batch, and say nothing.
      if (std::find(keys.begin(), keys.end(), it.key()) != keys.end()) {
        throw ConfigError(source + ": key \"" + it.key() + "\" is at the top level, beside the \"smp\" section; "
                          "smp reads it only inside that section");
      }
      (*sections)[it.key()] = it.value();
    }
  }
  config.application_sections = sections;

  for (auto it = smp_keys.begin(); it != smp_keys.end(); ++it) {
    const auto& keys = known_keys();
    if (std::find(keys.begin(), keys.end(), it.key()) != keys.end()) continue;
    std::string nearest;
    std::size_t nearest_distance = 4;  // suggest only plausible typos
    for (const auto& key : keys) {
      const std::size_t distance = edit_distance(it.key(), key);
      if (distance < nearest_distance) nearest_distance = distance, nearest = key;
    }
    throw ConfigError(source + ": unknown key \"" + it.key() + "\"" +
                      (nearest.empty() ? std::string(" (see README for the keys)") : " (did you mean \"" + nearest + "\"?)"));
  }

  const Reader read(smp_keys, source);
  constexpr long long kMaxCount = 1 << 20;
  if (read.has("partitions") && read.has("pipeline_parallel_degree")) {
    read.fail("pipeline_parallel_degree", "is an alias of \"partitions\"; give only one of them");
  }
  if (read.has("partitions")) config.partitions = static_cast<int>(read.integer("partitions", 1, 4096));
  if (read.has("pipeline_parallel_degree")) {
    config.partitions = static_cast<int>(read.integer("pipeline_parallel_degree", 1, 4096));
  }
  if (read.has("tensor_parallel_degree")) {
    config.tensor_parallel_degree = static_cast<int>(read.integer("tensor_parallel_degree", 1, 4096));
  }
  if (read.has("sequence_parallel")) config.sequence_parallel = read.boolean("sequence_parallel");
  if (read.has("microbatches")) config.microbatches = static_cast<int>(read.integer("microbatches", 1, kMaxCount));
  if (read.has("pipeline")) {
    // SMP's names first, then the generators' (what smp_schedule and schedule files call them).
    std::vector<std::string> names;
    for (const auto& kind : sched::schedule_kinds()) {
      if (*kind.config_alias && std::find(names.begin(), names.end(), kind.config_alias) == names.end()) {
        names.emplace_back(kind.config_alias);
      }
    }
    for (const auto& kind : sched::schedule_kinds()) names.emplace_back(kind.name);
    config.pipeline = read.choice("pipeline", names);
  }
  if (read.has("active_microbatches")) {
    config.active_microbatches = static_cast<int>(read.integer("active_microbatches", 0, kMaxCount));
  }
  const auto& kind = sched::find_schedule_kind(config.pipeline);
  if (kind.stages_per_rank == 2) config.virtual_stages = 2;  // a V: two stages per rank, always
  if (read.has("virtual_stages")) {
    config.virtual_stages = static_cast<int>(read.integer("virtual_stages", 1, 64));
    const auto& chosen = sched::find_schedule_kind(config.pipeline, config.virtual_stages);
    if (chosen.stages_per_rank == 1 && config.virtual_stages > 1) {
      read.fail("virtual_stages", "needs \"pipeline\": \"interleaved\" (interleaved 1F1B) or a V schedule; \"" +
                                      config.pipeline + "\" runs one stage per rank");
    }
    if (chosen.stages_per_rank == 2 && config.virtual_stages != 2) {
      read.fail("virtual_stages", "must be 2 with \"pipeline\": \"" + config.pipeline +
                                      "\", which runs two stages per rank in a V");
    }
  }
  if (read.has("schedule_file")) config.schedule_file = read.string("schedule_file");
  if (config.active_microbatches > 0 && !sched::find_schedule_kind(config.pipeline, config.virtual_stages).takes_cap) {
    read.fail("active_microbatches", "has no effect with \"pipeline\": \"" + config.pipeline + "\" (" +
                                         (config.pipeline == "simple" || config.pipeline == "gpipe"
                                              ? "GPipe runs every forward first); use \"interleaved\" to cap microbatches in flight"
                                              : "it holds what its own order bounds)"));
  }
  if (config.active_microbatches > 0 && config.active_microbatches < config.virtual_stages) {
    read.fail("active_microbatches", "must be 0 or at least \"virtual_stages\" (" +
                                         std::to_string(config.virtual_stages) + ")");
  }
  if (read.has("activation_checkpointing")) {
    const json& value = read.raw("activation_checkpointing");
    const int stages = config.partitions * config.virtual_stages;
    if (value.is_boolean()) {
      if (value.get<bool>()) {
        for (int stage = 0; stage < stages; ++stage) config.checkpointed_stages.push_back(stage);
      }
    } else if (value.is_array()) {
      for (const auto& item : value) {
        if (item.is_string() && !item.get<std::string>().empty()) {
          config.checkpointed_modules.push_back(item.get<std::string>());
          continue;
        }
        if (!item.is_number_integer() || item.get<long long>() < 0 || item.get<long long>() >= stages) {
          read.fail("activation_checkpointing", item.is_number_integer()
                        ? "stage " + item.dump() + " is not in [0, " + std::to_string(stages - 1) + "]"
                        : item.dump() + " is neither a stage index nor a module name");
        }
        config.checkpointed_stages.push_back(item.get<int>());
      }
    } else {
      read.fail("activation_checkpointing", "expected true, false, or a list of stage indices and module names");
    }
  }
  if (read.has("trace_dir")) config.trace_dir = read.string("trace_dir");
  if (read.has("trace_step")) config.trace_step = static_cast<int>(read.integer("trace_step", 0, 1 << 30));
  if (read.has("checkpoint_dir")) config.checkpoint_dir = read.string("checkpoint_dir");
  if (read.has("checkpoint_interval")) {
    config.checkpoint_interval = static_cast<int>(read.integer("checkpoint_interval", 0, 1 << 30));
  }
  if (read.has("checkpoints_kept")) config.checkpoints_kept = static_cast<int>(read.integer("checkpoints_kept", 1, 1000));
  if (read.has("resume")) config.resume = read.boolean("resume");
  if ((config.checkpoint_interval > 0 || config.resume) && config.checkpoint_dir.empty()) {
    read.fail(config.resume ? "resume" : "checkpoint_interval", "needs \"checkpoint_dir\"");
  }
  if (read.has("bf16")) config.bf16 = read.boolean("bf16");
  if (read.has("fp16")) config.fp16 = read.boolean("fp16");
  if (config.bf16 && config.fp16) read.fail("fp16", "and \"bf16\" are both true; pick one");
  if (read.has("device")) config.device = read.choice("device", {"auto", "cpu", "cuda"});
  if (read.has("backend") && read.has("ddp_dist_backend")) {
    read.fail("ddp_dist_backend", "is an alias of \"backend\"; give only one of them");
  }
  for (const char* key : {"backend", "ddp_dist_backend"}) {
    if (read.has(key)) config.backend = read.choice(key, {"auto", "gloo", "nccl"});
  }
  if (config.device == "cpu" && config.backend == "nccl") {
    read.fail(read.has("backend") ? "backend" : "ddp_dist_backend",
              "\"nccl\" moves GPU tensors only, and \"device\" is \"cpu\"; use \"gloo\" or \"auto\"");
  }
  if (read.has("nonfinite")) config.skip_nonfinite_steps = read.choice("nonfinite", {"stop", "skip"}) == "skip";
  if (read.has("ddp")) config.ddp = read.boolean("ddp");
  if (read.has("shard_optimizer_state")) config.shard_optimizer_state = read.boolean("shard_optimizer_state");
  if (read.has("placement_strategy")) {
    const std::string text = read.string("placement_strategy");
    if (text != "cluster" && text != "spread" && !is_placement_order(text)) {
      read.fail("placement_strategy",
                "expected \"cluster\", \"spread\", or an order of the letters D, P and T such as \"DPT\", got \"" + text + "\"");
    }
    config.placement_strategy = text;
  }
  if (read.has("auto_partition")) config.auto_partition = read.boolean("auto_partition");
  if (read.has("default_partition")) config.default_partition = static_cast<int>(read.integer("default_partition", 0, 4095));
  if (read.has("partition_overrides")) {
    const json& overrides = read.raw("partition_overrides");
    if (!overrides.is_object()) read.fail("partition_overrides", "expected an object of module path -> stage");
    for (auto it = overrides.begin(); it != overrides.end(); ++it) {
      const long long stages = static_cast<long long>(config.partitions) * config.virtual_stages;
      if (!it.value().is_number_integer() || it.value().get<long long>() < 0 || it.value().get<long long>() >= stages) {
        read.fail("partition_overrides", "module \"" + it.key() + "\" must map to a stage in [0, " +
                                             std::to_string(stages - 1) + "], got " + it.value().dump());
      }
      config.partition_overrides[it.key()] = it.value().get<int>();
    }
  }
  if (read.has("optimize")) config.optimize = read.choice("optimize", {"speed", "memory"});
  config.memory_weight = config.optimize == "speed" ? 0.2 : 0.8;
  if (read.has("memory_weight")) config.memory_weight = read.real("memory_weight", 0.0, 1.0);
  if (read.has("memory_limit_mb")) config.memory_limit_mb = read.real("memory_limit_mb", 0.0, 1e12);
  if (read.has("link_bandwidth_gbps")) config.link_bandwidth_gbps = read.real("link_bandwidth_gbps", 0.0, 1e6);
  if (read.has("seed")) config.seed = static_cast<std::uint64_t>(read.integer("seed", 0, std::numeric_limits<long long>::max()));
  if (read.has("global_batch_size")) {
    config.global_batch_size = static_cast<int>(read.integer("global_batch_size", 1, 1LL << 30));
  }
  if (read.has("comm_timeout_s")) config.comm_timeout_s = read.real("comm_timeout_s", 0.1, 7 * 24 * 3600.0);
  if (read.has("log_level")) config.log_level = read.choice("log_level", {"trace", "debug", "info", "warn", "error", "off"});

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
  if (replicas > 1 && !ddp) {
    throw ConfigError(source + ": world size " + std::to_string(world_size) + " with " + model_degrees + " gives " +
                      std::to_string(replicas) + " replicas, but \"ddp\" is false; set \"ddp\": true or launch " +
                      std::to_string(model_ranks) + " processes");
  }
  if (global_batch_size > 0) check_batch(global_batch_size, replicas);
  return replicas;
}

void Config::check_batch(int global_batch, int replicas) const {
  const long long pieces = static_cast<long long>(replicas) * microbatches;
  if (global_batch % pieces != 0) {
    throw ConfigError(source + ": a global batch of " + std::to_string(global_batch) + " does not split into " +
                      std::to_string(replicas) + " replicas x " + std::to_string(microbatches) +
                      " microbatches; make \"global_batch_size\" a multiple of " + std::to_string(pieces));
  }
}

std::string Config::schedule_name() const { return sched::find_schedule_kind(pipeline, virtual_stages).name; }

bool Config::splits_backward() const { return sched::find_schedule_kind(pipeline, virtual_stages).split_backward; }

std::string Config::describe() const {
  std::ostringstream text;
  text << "partitions=" << partitions
       << (tensor_parallel_degree > 1 ? " tensor_parallel_degree=" + std::to_string(tensor_parallel_degree) : "")
       << (tensor_parallel_degree > 1 && sequence_parallel ? " sequence_parallel" : "")
       << " microbatches=" << microbatches << " schedule="
       << (schedule_file.empty() ? schedule_name() : "file:" + schedule_file) << " virtual_stages=" << virtual_stages
       << " ddp=" << (ddp ? "true" : "false") << (shard_optimizer_state ? " shard_optimizer_state=true" : "")
       << " placement=" << placement_strategy << " active_microbatches=" << active_microbatches
       << " auto_partition=" << (auto_partition ? "true" : "false") << " seed=" << seed << " device=" << device
       << " backend=" << backend;
  if (global_batch_size > 0) text << " global_batch_size=" << global_batch_size;
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
