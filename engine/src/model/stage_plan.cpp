#include "smp/stage_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CPUAllocator.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <map>
#include <set>

#include "smp/comm/communicator.h"
#include "smp/config.h"
#include "smp/errors.h"
#include "smp/graph_model.h"
#include "smp/log.h"
#include "smp/partitioner/graph_partition.h"
#include "smp/scheduler/simulator.h"
#include "model/random_state.h"

namespace smp {
namespace {

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) bytes /= 1024.0, ++unit;
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

}  // namespace

std::vector<int> StagePlan::modules_of_stage(int stage) const {
  std::vector<int> modules;
  for (std::size_t i = 0; i < stage_of_module.size(); ++i) {
    if (stage_of_module[i] == stage) modules.push_back(static_cast<int>(i));
  }
  return modules;
}

std::int64_t StagePlan::stage_sent_bytes(int stage) const {
  // Each output leaves once per consumer stage, however many nodes there read it.
  std::set<std::pair<int, int>> sent;  // (producer node, consumer stage)
  for (std::size_t consumer = 0; consumer < modules.size(); ++consumer) {
    for (int producer : modules[consumer].producers) {
      if (stage_of_module[producer] == stage && stage_of_module[consumer] != stage) {
        sent.insert({producer, stage_of_module[consumer]});
      }
    }
  }
  std::int64_t bytes = 0;
  for (const auto& [producer, consumer_stage] : sent) bytes += modules[producer].output_bytes;
  return bytes;
}

double StagePlan::stage_time(int stage) const {
  double total = 0.0;
  for (int i : modules_of_stage(stage)) total += modules[i].forward_s + modules[i].backward_s;
  return static_cast<int>(stage_speeds.size()) == num_stages ? total / stage_speeds[stage] : total;
}

std::string StagePlan::report() const {
  std::ostringstream text;
  double slowest = 0.0, sum = 0.0;
  for (int stage = 0; stage < num_stages; ++stage) {
    slowest = std::max(slowest, stage_time(stage));
    sum += stage_time(stage);
  }
  text << "partition into " << num_stages << " stages (imbalance slowest/mean = ";
  char imbalance[32];
  std::snprintf(imbalance, sizeof imbalance, "%.3f", sum > 0 ? slowest / (sum / num_stages) : 1.0);
  text << imbalance << "):";
  for (int stage = 0; stage < num_stages; ++stage) {
    const auto members = modules_of_stage(stage);
    std::int64_t parameter_bytes = 0, frozen_bytes = 0, kept_bytes = 0;
    for (int i : members) {
      parameter_bytes += modules[i].parameter_bytes;
      frozen_bytes += modules[i].frozen_parameter_bytes;
      kept_bytes += modules[i].activation_bytes + modules[i].output_bytes;
    }
    // A stage that trains nothing has no parameters for an optimizer built over the trainable ones alone.
    const std::string frozen = frozen_bytes == 0 ? ""
                               : frozen_bytes == parameter_bytes
                                   ? " all frozen"
                                   : " (" + format_bytes(static_cast<double>(frozen_bytes)) + " frozen)";
    const double copies = static_cast<int>(activation_copies.size()) == num_stages ? activation_copies[stage] : 1.0;
    // A lone stage has nothing to balance, and its modules are not timed (profile_graph with no repeats).
    char time[48] = "not timed";
    if (sum > 0) std::snprintf(time, sizeof time, "%.3f ms", stage_time(stage) * 1e3);
    char numbers[256];
    std::snprintf(numbers, sizeof numbers,
                  "), params %s%s, activations %s per microbatch x %g held, est. fwd+bwd %s, sends %s",
                  format_bytes(static_cast<double>(parameter_bytes)).c_str(), frozen.c_str(),
                  format_bytes(static_cast<double>(kept_bytes)).c_str(), copies, time,
                  stage + 1 < num_stages ? format_bytes(static_cast<double>(stage_sent_bytes(stage))).c_str() : "-");
    if (static_cast<int>(stage_speeds.size()) == num_stages) {
      const std::size_t used = std::strlen(numbers);
      std::snprintf(numbers + used, sizeof numbers - used, ", on a device of speed %.3g", stage_speeds[stage]);
    }
    // Module names may be long: only the numbers go through a fixed buffer.
    text << "\n  stage " << stage << ": modules " << modules[members.front()].name << ".."
         << modules[members.back()].name << " (" << members.size() << numbers;
    double assumed_loss_s = 0.0;
    for (int i : members) assumed_loss_s += modules[i].assumed_loss_s;
    if (assumed_loss_s > 0.0) {
      std::snprintf(numbers, sizeof numbers, "%.3f ms", assumed_loss_s * 1e3);
      text << " (of it, " << numbers << " for a cross-entropy loss on the output, as train_step's loss is assumed)";
    }
  }
  return text.str();
}

std::string StagePlan::to_json() const {
  nlohmann::json document;
  document["num_stages"] = num_stages;
  document["stage_of_module"] = stage_of_module;
  document["activation_copies"] = activation_copies;
  if (!stage_speeds.empty()) document["stage_speeds"] = stage_speeds;
  for (const auto& module : modules) {
    document["modules"].push_back({{"name", module.name},
                                   {"forward_s", module.forward_s},
                                   {"backward_s", module.backward_s},
                                   {"parameter_bytes", module.parameter_bytes},
                                   {"output_bytes", module.output_bytes},
                                   {"activation_bytes", module.activation_bytes},
                                   {"producers", module.producers},
                                   {"assumed_loss_s", module.assumed_loss_s},
                                   {"holds_parameters", module.holds_parameters},
                                   {"frozen_parameter_bytes", module.frozen_parameter_bytes}});
  }
  return document.dump();
}

StagePlan StagePlan::from_json(const std::string& text) {
  const auto document = nlohmann::json::parse(text);
  StagePlan plan;
  plan.num_stages = document.at("num_stages").get<int>();
  plan.stage_of_module = document.at("stage_of_module").get<std::vector<int>>();
  plan.activation_copies = document.value("activation_copies", std::vector<double>{});
  plan.stage_speeds = document.value("stage_speeds", std::vector<double>{});
  for (const auto& module : document.at("modules")) {
    plan.modules.push_back({module.at("name").get<std::string>(), module.at("forward_s").get<double>(),
                            module.at("backward_s").get<double>(), module.at("parameter_bytes").get<std::int64_t>(),
                            module.at("output_bytes").get<std::int64_t>(),
                            module.at("producers").get<std::vector<int>>(),
                            module.value("activation_bytes", std::int64_t{0}), std::string(),
                            module.value("assumed_loss_s", 0.0)});
    plan.modules.back().holds_parameters =
        module.value("holds_parameters", plan.modules.back().parameter_bytes > 0);
    plan.modules.back().frozen_parameter_bytes = module.value("frozen_parameter_bytes", std::int64_t{0});
  }
  return plan;
}

std::vector<bool> checkpointed_modules(const std::vector<std::string>& module_names, const Config& config) {
  std::vector<bool> selected(module_names.size(), false);
  for (const auto& wanted : config.checkpointed_modules) {
    bool found = false;
    for (std::size_t i = 0; i < module_names.size(); ++i) {
      const std::string& name = module_names[i];
      if (cut_from(name, wanted)) selected[i] = found = true;
    }
    if (!found) {
      constexpr std::size_t kNamed = 40;  // a large model's hundreds would bury the message
      std::string names;
      for (std::size_t i = 0; i < module_names.size() && i < kNamed; ++i) {
        names += (names.empty() ? "" : ", ") + module_names[i];
      }
      if (module_names.size() > kNamed) names += ", ... (" + std::to_string(module_names.size() - kNamed) + " more)";
      throw ConfigError(config.source + ": key \"activation_checkpointing\": no module \"" + wanted +
                        "\" in the model: a name is a module's path, or a path its modules extend (\"layers.1\" "
                        "takes \"layers.1.attn\" and the rest of layer 1), not a class name or a pattern (its "
                        "modules: " + names + ")");
    }
  }
  return selected;
}

std::vector<double> activation_copies(const sched::Schedule& schedule, double weight_pass_share) {
  sched::Schedule compute = schedule;
  for (auto& actions : compute.ranks) {
    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [](const sched::Action& action) { return !sched::is_compute(action.kind); }),
                  actions.end());
  }
  auto costs = sched::SimulationCosts::uniform(schedule.num_stages);
  const bool shared = schedule.split_backward && weight_pass_share < 1.0;
  if (shared) {
    costs.weight_pass_share.assign(static_cast<std::size_t>(schedule.num_stages), std::clamp(weight_pass_share, 0.0, 1.0));
    costs.weight_pass_share.front() = 1.0;
  }
  const auto simulated = sched::simulate(compute, sched::StageGraph::chain(schedule.num_stages), costs);
  std::vector<double> copies(static_cast<std::size_t>(schedule.num_stages), 1.0);
  for (int stage = 0; stage < schedule.num_stages; ++stage) {
    const int rank = schedule.stage_to_rank.at(stage);
    const double stages_on_rank = static_cast<double>(schedule.stages_of_rank(rank).size());
    // Whole microbatches without the split; with it, the share a pending W holds counts as it is.
    copies[stage] = shared ? std::max(1.0, simulated.peak_activations.at(rank) / stages_on_rank)
                           : std::max(1.0, std::ceil(simulated.peak_in_flight.at(rank) / stages_on_rank));
  }
  return copies;
}

double weight_pass_share(const std::vector<ModuleProfile>& modules, const std::vector<int>& members) {
  double held = 0.0, kept = 0.0;
  for (int member : members) {
    const auto& module = modules.at(static_cast<std::size_t>(member));
    if (module.weight_pass_bytes < 0) continue;
    held += static_cast<double>(module.weight_pass_bytes);
    kept += static_cast<double>(module.activation_bytes);
  }
  return kept > 0 ? std::min(1.0, held / kept) : 1.0;
}

double weight_pass_share(const std::vector<ModuleProfile>& modules) {
  std::vector<int> all(modules.size());
  std::iota(all.begin(), all.end(), 0);
  return weight_pass_share(modules, all);
}

std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_shapes_of(const ModuleProfile& module) {
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes;
  std::istringstream entries(module.parameter_shapes);
  for (std::string entry; std::getline(entries, entry, ';');) {
    const auto colon = entry.rfind(':');
    if (colon == std::string::npos) continue;
    std::vector<std::int64_t> sizes;
    std::istringstream dimensions(entry.substr(colon + 1));
    for (std::string size; std::getline(dimensions, size, ',');) {
      if (!size.empty()) sizes.push_back(std::stoll(size));
    }
    shapes.emplace_back(entry.substr(0, colon), std::move(sizes));
  }
  return shapes;
}

bool StageDevices::alike() const {
  auto all_equal = [](const std::vector<double>& values) {
    return std::all_of(values.begin(), values.end(), [&](double value) { return value == values.front(); });
  };
  return all_equal(speeds) && all_equal(memory_mb);
}

StageDevices stage_devices(const Config& config, const Topology& topology, const std::vector<int>& stage_to_rank,
                           const std::vector<double>& speeds) {
  StageDevices devices;
  const std::vector<double>& per_rank_speeds = speeds.empty() ? config.device_speeds : speeds;
  if (!per_rank_speeds.empty()) {
    const auto least = topology.least_per_pipeline_rank(per_rank_speeds);
    for (int rank : stage_to_rank) devices.speeds.push_back(least.at(static_cast<std::size_t>(rank)));
  }
  if (!config.device_memory_mb.empty()) {
    std::vector<double> memory = config.device_memory_mb;
    // A rank without its own figure has memory_limit_mb, or no limit.
    for (double& megabytes : memory) {
      if (megabytes == 0) megabytes = config.memory_limit_mb > 0 ? config.memory_limit_mb : std::numeric_limits<double>::infinity();
    }
    const auto least = topology.least_per_pipeline_rank(memory);
    for (int rank : stage_to_rank) {
      const double megabytes = least.at(static_cast<std::size_t>(rank));
      devices.memory_mb.push_back(std::isfinite(megabytes) ? megabytes : 0.0);
    }
  }
  return devices;
}

StagePlan plan_stages(std::vector<ModuleProfile> modules, const Config& config,
                      std::vector<double> activation_copies, int optimizer_state_shards, const StageDevices* devices,
                      MemoryLimit memory_limit) {
  if (optimizer_state_shards < 1) throw std::invalid_argument("plan_stages: optimizer_state_shards must be positive");
  const int num_modules = static_cast<int>(modules.size());
  const int num_stages = config.num_stages();
  if (activation_copies.empty()) activation_copies.assign(num_stages, 1.0);
  if (static_cast<int>(activation_copies.size()) != num_stages) {
    throw std::invalid_argument("plan_stages: activation copies given for " +
                                std::to_string(activation_copies.size()) + " stages, the config has " +
                                std::to_string(num_stages));
  }
  std::vector<bool> recomputes(num_stages, false);
  for (int stage : config.checkpointed_stages) {
    if (stage < 0 || stage >= num_stages) {
      throw ConfigError(config.source + ": key \"activation_checkpointing\": stage " + std::to_string(stage) +
                        " is not in [0, " + std::to_string(num_stages - 1) + "]");
    }
    recomputes[stage] = true;
    activation_copies[stage] = 1.0;
  }
  std::vector<int> pinned(num_modules, config.auto_partition ? -1 : config.default_partition);
  for (const auto& [path, stage] : config.partition_overrides) {
    bool found = false;
    for (std::size_t i = 0; i < modules.size(); ++i) {
      if (cut_from(modules[i].name, path)) pinned[i] = stage, found = true;
    }
    if (!found) {
      std::string names;
      for (const auto& module : modules) names += (names.empty() ? "" : ", ") + module.name;
      throw ConfigError(config.source + ": key \"partition_overrides\": no module \"" + path +
                        "\" in the model (its modules: " + names + ")");
    }
  }
  if (!config.auto_partition) {
    // Every module is pinned then: a stage none is pinned to cannot be given one, which the search would only say
    // in its own terms.
    std::vector<bool> given(static_cast<std::size_t>(num_stages), false);
    for (int stage : pinned) {
      if (stage >= 0 && stage < num_stages) given[static_cast<std::size_t>(stage)] = true;
    }
    std::string empty;
    for (int stage = 0; stage < num_stages; ++stage) {
      if (!given[static_cast<std::size_t>(stage)]) empty += (empty.empty() ? "" : ", ") + std::to_string(stage);
    }
    if (!empty.empty()) {
      throw ConfigError(config.source + ": \"auto_partition\" is false, so every module not named in " +
                        "\"partition_overrides\" goes to \"default_partition\" (" +
                        std::to_string(config.default_partition) + "), which leaves stage " + empty +
                        " without a module: name modules for it in \"partition_overrides\", or set "
                        "\"auto_partition\": true");
    }
  }
  // The partition search sees the profile as a DAG: compute time, memory per node, and the bytes of every tensor
  // between nodes. Memory: parameters, and for those trained gradients and two optimizer moments (4x; the moments
  // divided among the replicas when they shard the optimizer state, assuming an even split, though replicas own
  // whole parameters), and what the
  // forward keeps for backward (its saved tensors and its output, which the next module saves) times the
  // microbatches each stage holds at once. A checkpointed stage keeps only its inputs between forward and backward
  // (not counted) and holds one microbatch's activations while it recomputes, for which it runs forward again.
  // A checkpointed module keeps its inputs (its producers' outputs, counted there) and its output, holds one
  // microbatch's activations while it recomputes, and runs its forward again in backward: twice under the
  // zero-bubble schedules (for the input gradients, then for the weight gradients).
  std::vector<std::string> names;
  for (const auto& module : modules) names.push_back(module.name);
  const std::vector<bool> recomputed_modules = checkpointed_modules(names, config);
  const double module_recomputes = config.splits_backward() ? 2.0 : 1.0;
  // Divided experts (expert_parameter_bytes) have their state sharded over the replicas holding the same experts.
  const int expert_state_shards = std::max(1, optimizer_state_shards / std::max(1, config.expert_parallel_degree));
  part::ModuleGraph graph;
  for (std::size_t i = 0; i < modules.size(); ++i) {
    const auto& module = modules[i];
    part::GraphNode node;
    node.name = module.name;
    node.compute_s =
        module.forward_s + module.backward_s + (recomputed_modules[i] ? module_recomputes * module.forward_s : 0.0);
    node.memory_bytes = static_cast<double>(module.parameter_bytes) +
                        (1.0 + 2.0 / optimizer_state_shards) * static_cast<double>(module.trained_dense_bytes()) +
                        (1.0 + 2.0 / expert_state_shards) * static_cast<double>(module.trained_expert_bytes()) +
                        (recomputed_modules[i] ? static_cast<double>(module.activation_bytes) : 0.0);
    node.parameter_bytes = static_cast<double>(module.parameter_bytes);
    node.activation_bytes =
        static_cast<double>((recomputed_modules[i] ? 0 : module.activation_bytes) + module.output_bytes);
    node.recompute_s = module.forward_s;
    graph.nodes.push_back(node);
  }
  for (int consumer = 0; consumer < num_modules; ++consumer) {
    for (int producer : modules[consumer].producers) {
      graph.edges.push_back({producer, consumer, static_cast<double>(modules[producer].output_bytes)});
    }
  }
  part::GraphPartitionOptions options;
  options.num_stages = num_stages;
  options.memory_weight = config.memory_weight;
  // The limit is a device's, i.e. a rank's; with virtual stages a rank holds several stages, each of which gets
  // an equal share (the simulator splits the rank's in-flight activations evenly among them too). Sound, though
  // a split that gave one of a rank's stages more than the others could fit where this finds nothing.
  options.memory_limit_bytes = config.memory_limit_mb * 1024.0 * 1024.0 / config.virtual_stages;
  options.bandwidth_bytes_per_s = config.link_bandwidth_gbps * 1e9;
  options.pinned = pinned;
  options.activation_copies = activation_copies;
  options.recomputes = recomputes;
  if (devices != nullptr) {
    for (const auto* values : {&devices->speeds, &devices->memory_mb}) {
      if (!values->empty() && static_cast<int>(values->size()) != num_stages) {
        throw std::invalid_argument("plan_stages: devices given for " + std::to_string(values->size()) +
                                    " stages, the config has " + std::to_string(num_stages));
      }
    }
    options.stage_speeds = devices->speeds;
    for (double megabytes : devices->memory_mb) {
      options.stage_memory_limit_bytes.push_back(megabytes * 1024.0 * 1024.0 / config.virtual_stages);
    }
  }
  StagePlan plan;
  try {
    try {
      plan.stage_of_module = part::partition_graph(graph, options).stage_of_node;
    } catch (const part::PartitionError& error) {
      const bool limited = options.memory_limit_bytes > 0 || !options.stage_memory_limit_bytes.empty();
      if (memory_limit != MemoryLimit::kGuides || !limited) throw;
      // Found without the limit, it was the limit the search could not meet: the caller's count judges.
      part::GraphPartitionOptions unlimited = options;
      unlimited.memory_limit_bytes = 0.0;
      unlimited.stage_memory_limit_bytes.clear();
      try {
        plan.stage_of_module = part::partition_graph(graph, unlimited).stage_of_node;
      } catch (const part::PartitionError&) {
        throw error;
      }
      plan.memory_limit_unmet = error.what();
    }
  } catch (const part::PartitionError& error) {
    std::string share;
    if (config.memory_limit_mb > 0 && config.virtual_stages > 1) {
      char megabytes[32];
      std::snprintf(megabytes, sizeof megabytes, "%.6g", config.memory_limit_mb / config.virtual_stages);
      share = " (memory_limit_mb is per rank: each of a rank's " + std::to_string(config.virtual_stages) +
              " virtual stages gets " + megabytes + " MiB)";
    }
    throw ConfigError(config.source + ": cannot partition the model: " + error.what() + share);
  }
  plan.modules = std::move(modules);
  plan.num_stages = num_stages;
  plan.activation_copies = std::move(activation_copies);
  if (devices != nullptr && !devices->speeds.empty() && !devices->alike()) plan.stage_speeds = devices->speeds;
  return plan;
}

}  // namespace smp
