// From the predictions to the job's layout: the report a person reads, the layouts a job's fixed keys exclude, the
// choice, and the config a job adopting it trains under.
#include "smp/layout_plan.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace smp {

namespace {

// How keep_what_the_config_fixes begins its reason, which the report counts apart.
constexpr const char* kFixedByConfig = "the config fixes ";

}  // namespace

std::string layout_report(const std::vector<LayoutPrediction>& predictions, int shown) {
  std::ostringstream text;
  char line[256];
  std::snprintf(line, sizeof line, "%-4s %-46s %12s %7s %14s\n", "", "layout", "step (pred.)", "bubble",
                "peak MiB/rank");
  text << line;
  int listed = 0, rejected = 0;
  for (const auto& prediction : predictions) {
    if (!prediction.rejected.empty()) {
      ++rejected;
      continue;
    }
    if (listed++ >= shown) continue;
    std::snprintf(line, sizeof line, "%-4d %-46s %9.1f ms %6.1f%% %14.1f\n", listed,
                  prediction.layout.describe().c_str(), prediction.step_s * 1e3, prediction.bubble_fraction * 100,
                  prediction.peak_memory_mib());
    text << line;
  }
  if (listed > shown) text << "     ... and " << listed - shown << " more that fit\n";
  // A job's plan excludes what its config fixes otherwise (keep_what_the_config_fixes): counted per key, after the
  // layouts rejected for what they need, whose reasons are listed.
  std::map<std::string, int> excluded_by_key;
  int excluded = 0;
  for (const auto& prediction : predictions) {
    const std::string& why = prediction.rejected;
    if (why.rfind(kFixedByConfig, 0) != 0) continue;
    ++excluded;
    const std::size_t key = std::strlen(kFixedByConfig);
    ++excluded_by_key[why.substr(key, why.find(' ', key) - key)];
  }
  if (rejected > excluded) {
    text << rejected - excluded << " rejected:\n";
    int told = 0;
    for (const auto& prediction : predictions) {
      if (prediction.rejected.empty() || prediction.rejected.rfind(kFixedByConfig, 0) == 0 || told++ >= shown) continue;
      text << "     " << prediction.layout.describe() << ": " << prediction.rejected << "\n";
    }
    if (told > shown) text << "     ... and " << told - shown << " more\n";
  }
  if (excluded > 0) {
    text << excluded << " excluded by the keys the config fixes (layouts that set them otherwise):";
    const char* separator = " ";
    for (const auto& [key, count] : excluded_by_key) {
      text << separator << key << " " << count;
      separator = ", ";
    }
    text << "\n";
  }
  if (listed == 0) {
    text << (excluded > 0 ? "no layout fits within the keys the config fixes\n" : "no layout fits\n");
    // What the limit would have to be: the least peak of those over it.
    const LayoutPrediction* least = nullptr;
    for (const auto& prediction : predictions) {
      if (prediction.over_memory_limit() && (least == nullptr || prediction.peak_memory_mib() < least->peak_memory_mib())) {
        least = &prediction;
      }
    }
    if (least != nullptr) {
      std::snprintf(line, sizeof line, "%.1f MiB", least->peak_memory_mib());
      text << "the least a layout considered needs: " << line << " per rank (" << least->layout.describe() << ")\n";
    }
  } else {
    const auto& best = *std::find_if(predictions.begin(), predictions.end(),
                                     [](const LayoutPrediction& prediction) { return prediction.rejected.empty(); });
    std::snprintf(line, sizeof line, "%.1f ms", best.step_s * 1e3);
    text << "chosen: " << best.layout.describe() << " (the fastest predicted that fits: " << line
         << "), config " << best.layout.config_json() << "\n";
    if (best.stages.size() > 1) {
      text << "        stages:";
      for (std::size_t stage = 0; stage < best.stages.size(); ++stage) text << " " << stage << ": " << best.stages[stage];
      text << "\n";
    }
  }
  return text.str();
}

namespace {

// What a config asks of the pipeline and the replicas, the same for a planned layout's config and the job's.
auto layout_asked(const Config& config, int world_size) {
  const int replicas = config.ddp ? world_size / (config.partitions * config.tensor_parallel_degree) : 1;
  std::vector<int> stages = config.checkpointed_stages;
  std::sort(stages.begin(), stages.end());
  const bool every_stage = static_cast<int>(stages.size()) == config.num_stages() && config.checkpointed_modules.empty();
  const bool none = stages.empty() && config.checkpointed_modules.empty();
  const int recompute = none ? 0 : every_stage ? 1 : 2;  // 2: some, which no planned layout is
  // One stage runs every schedule in the same order (the planner names it GPipe).
  const std::string schedule = config.num_stages() == 1 ? std::string("one stage") : config.schedule_name();
  return std::make_tuple(config.tensor_parallel_degree, config.partitions, replicas, config.expert_parallel_degree,
                         config.virtual_stages, config.microbatches, schedule, recompute,
                         config.shard_optimizer_state && replicas > 1);
}

template <typename Settings, std::size_t... I>
std::string first_difference(const Settings& a, const Settings& b, const char* const* names, std::index_sequence<I...>) {
  std::string differs;
  ((differs.empty() && !(std::get<I>(a) == std::get<I>(b)) ? void(differs = names[I]) : void()), ...);
  return differs;
}

// The layout keys as the config names them, in the order of layout_asked's settings.
constexpr const char* kSettings[] = {"tensor_parallel_degree", "partitions",     "ddp",
                                     "expert_parallel_degree", "virtual_stages", "microbatches",
                                     "pipeline",               "activation_checkpointing", "shard_optimizer_state"};

// The first setting in which a job's config and a planned layout's differ ("" when none), as the report says it.
std::string setting_that_differs(const Config& job, const Config& planned, int world_size) {
  const auto asked = layout_asked(job, world_size);
  static_assert(std::tuple_size_v<decltype(asked)> == std::size(kSettings));
  return first_difference(asked, layout_asked(planned, world_size), kSettings,
                          std::make_index_sequence<std::size(kSettings)>{});
}

// The config document's smp keys: its "smp" section, or the whole document.
template <typename Json>
Json& smp_section(Json& document) {
  return document.contains("smp") ? document["smp"] : document;
}

// The first layout key the config's document fixes to another value than `layout_keys` gives it ("" when none).
std::string key_given_otherwise(const Config& given, const std::string& layout_keys) {
  const nlohmann::json document = nlohmann::json::parse(given.text);
  const nlohmann::json& section = smp_section(document);
  const nlohmann::json keys = nlohmann::json::parse(layout_keys);
  for (const char* name : kSettings) {
    if (given.plans(name) || !section.contains(name) || !keys.contains(name)) continue;
    if (section[name] != keys[name]) return name;
  }
  return {};
}

// The config a job adopting `layout_keys` trains under, and the first setting in which it differs from the layout.
std::pair<Config, std::string> adopted_config(const Config& given, const std::string& layout_keys, int world_size) {
  nlohmann::json document = nlohmann::json::parse(given.text);
  nlohmann::json& section = smp_section(document);
  const nlohmann::json keys = nlohmann::json::parse(layout_keys);
  for (const auto& key : given.auto_keys) section[key] = keys.at(key);
  Config chosen = Config::from_json_text(document.dump(), given.source);
  const Config planned = Config::from_json_text(layout_keys, "<planned layout>");
  std::string differs = setting_that_differs(chosen, planned, world_size);
  // The planned cut, which a config with "auto" keys cannot give itself (Config refuses both at once), where the
  // layout holds: its pins name stages a config fixing other settings may not have.
  if (differs.empty() && keys.contains("partition_overrides")) {
    section["partition_overrides"] = keys["partition_overrides"];
    chosen = Config::from_json_text(document.dump(), given.source);
  }
  return {std::move(chosen), std::move(differs)};
}

}  // namespace

std::optional<Config> adopting_layout(const Config& given, const std::string& layout_keys, int world_size) {
  auto [chosen, differs] = adopted_config(given, layout_keys, world_size);
  if (!differs.empty()) return std::nullopt;
  return std::move(chosen);
}

void keep_what_the_config_fixes(std::vector<LayoutPrediction>& predictions, const Config& given, int world_size) {
  if (given.auto_keys.empty()) return;
  for (auto& prediction : predictions) {
    // One over the memory limit too: excluded, it is not what the limit would have to be (layout_report's least).
    if (!prediction.rejected.empty() && !prediction.over_memory_limit()) continue;
    try {
      const std::string differs = adopted_config(given, prediction.config_json(), world_size).second;
      if (!differs.empty()) {
        prediction.rejected = kFixedByConfig + differs + " otherwise";
        prediction.timeline_svg.clear();  // drawn for the fastest layout, which the job may not take
      }
    } catch (const ConfigError& error) {
      // The layout's keys beside the fixed ones make no config ("pipeline": "zb_v" fixed, a layout's virtual_stages
      // 1): named by the first fixed key the config gives otherwise, where it gives one.
      prediction.rejected = std::string("the config's other keys refuse it: ") + error.what();
      const std::string fixed = key_given_otherwise(given, prediction.config_json());
      if (!fixed.empty()) prediction.rejected = kFixedByConfig + fixed + " otherwise";
      prediction.timeline_svg.clear();
    }
  }
  // Fitting layouts first, as plan_layouts leaves them, each part still in order of its predicted step.
  std::stable_partition(predictions.begin(), predictions.end(),
                        [](const LayoutPrediction& prediction) { return prediction.rejected.empty(); });
}

std::pair<LayoutPrediction, Config> choose_layout(const std::vector<LayoutPrediction>& predictions, const Config& given,
                                                  int world_size) {
  std::vector<std::string> reasons;
  for (const auto& prediction : predictions) {
    if (!prediction.rejected.empty()) continue;
    try {
      if (auto chosen = adopting_layout(given, prediction.config_json(), world_size)) {
        return {prediction, *chosen};
      }
      reasons.push_back(prediction.layout.describe() + ": not what the keys the config fixes ask");
    } catch (const ConfigError& error) {
      reasons.push_back(prediction.layout.describe() + ": " + error.what());
    }
  }
  // The first line must say why on its own: a rank's error line is the message's first.
  // A layout rejected for what it needs says more than one the config's keys exclude.
  auto rejected = std::find_if(predictions.begin(), predictions.end(), [](const LayoutPrediction& prediction) {
    return !prediction.rejected.empty() && prediction.rejected.rfind(kFixedByConfig, 0) != 0;
  });
  if (rejected == predictions.end()) {
    rejected = std::find_if(predictions.begin(), predictions.end(),
                            [](const LayoutPrediction& prediction) { return !prediction.rejected.empty(); });
  }
  const std::string example = !reasons.empty()                 ? reasons.front()
                              : rejected != predictions.end() ? rejected->layout.describe() + ": " + rejected->rejected
                                                               : "none planned";
  std::string text = given.source + ": no planned layout of " + std::to_string(world_size) +
                     " ranks fits and keeps the layout keys the config gives (" +
                     std::to_string(predictions.size()) + " considered; " + example + ")\n" +
                     layout_report(predictions);
  for (std::size_t index = 0; index < reasons.size() && index < 5; ++index) text += "\n" + reasons[index];
  throw ConfigError(text);
}

}  // namespace smp
