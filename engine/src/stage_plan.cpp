#include "smp/stage_plan.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
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
#include "random_state.h"

namespace smp {
namespace {

// Counts the bytes of the CPU tensors allocated while it is installed and not yet freed: how the profiler sees what a
// module's forward keeps alive for backward. Its pointers are plain (context == data, as raw_allocate requires), so
// it remembers each allocation of the base allocator by address; memory may outlive the installation.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& instance() {
    static CountingCpuAllocator allocator;
    return allocator;
  }
  std::int64_t live_bytes() const { return live_.load(); }

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr memory = base_->allocate(bytes);
    void* data = memory.get();
    if (data == nullptr) return memory;  // nothing allocated (zero bytes)
    const c10::Device device = memory.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      allocations_[data] = {std::move(memory), static_cast<std::int64_t>(bytes)};
    }
    live_ += static_cast<std::int64_t>(bytes);
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* destination, const void* source, std::size_t count) const override {
    base_->copy_data(destination, source, count);
  }

  // While one exists, CPU tensors come from the counting allocator.
  class Installed {
   public:
    // Nested or concurrent profiles share the outermost installation (only the first one installs and restores).
    Installed() {
      std::lock_guard<std::mutex> lock(installation_mutex());
      auto& counting = instance();
      if (counting.installations_++ > 0) return;
      counting.base_ = c10::GetCPUAllocator();
      c10::SetCPUAllocator(&counting, kPriority);
    }
    ~Installed() {
      std::lock_guard<std::mutex> lock(installation_mutex());
      auto& counting = instance();
      if (--counting.installations_ == 0) c10::SetCPUAllocator(counting.base_, kPriority);
    }
    Installed(const Installed&) = delete;
    Installed& operator=(const Installed&) = delete;
  };

 private:
  static constexpr std::uint8_t kPriority = 255;  // above LibTorch's own registration, and restored at the same
  struct Allocation {
    c10::DataPtr memory;
    std::int64_t bytes = 0;
  };
  static void release(void* data) {
    auto& self = instance();
    Allocation allocation;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto found = self.allocations_.find(data);
      if (found == self.allocations_.end()) return;
      allocation = std::move(found->second);
      self.allocations_.erase(found);
    }
    self.live_ -= allocation.bytes;
  }  // the base allocator's deleter frees the memory here

  static std::mutex& installation_mutex() {
    static std::mutex mutex;
    return mutex;
  }

  c10::Allocator* base_ = nullptr;
  int installations_ = 0;
  std::atomic<std::int64_t> live_{0};
  std::mutex mutex_;
  std::unordered_map<void*, Allocation> allocations_;
};

// The least of the timed rounds: noise on a shared machine (other processes, frequency changes, page faults) only
// ever adds time, so the minimum is the estimate that repeats best from run to run.
double least(const std::vector<double>& values) {
  if (values.empty()) return 0.0;  // not timed (repeats = 0)
  return *std::min_element(values.begin(), values.end());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) bytes /= 1024.0, ++unit;
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

// Profiling runs the modules in training mode: batch norm updates its running statistics and dropout draws
// random numbers. Both are put back when it ends, so that profiling on rank 0 changes nothing the training sees.
class TrainingStateKept {
 public:
  TrainingStateKept(const GraphModel& model, c10::Device device) {
    std::set<const void*> seen;
    for (const auto& node : model.nodes()) {
      if (!node.built()) continue;  // built apart for its profile, and dropped after
      for (const auto& buffer : node.module->buffers()) {
        if (seen.insert(buffer.unsafeGetTensorImpl()).second) buffers_.emplace_back(buffer, buffer.clone());
      }
    }
    random_ = RandomState::capture(device);
  }
  ~TrainingStateKept() {
    // Also while a profile's error unwinds, when a device may refuse further work (a CUDA device-side assert):
    // that error is the one to report, not this one, and a destructor must not throw.
    try {
      at::NoGradGuard no_graph;
      for (auto& [buffer, saved] : buffers_) buffer.copy_(saved);
      random_.restore();
    } catch (const std::exception& error) {
      log::warn(std::string("profiling could not restore the model's buffers and random state: ") + error.what());
    }
  }
  TrainingStateKept(const TrainingStateKept&) = delete;
  TrainingStateKept& operator=(const TrainingStateKept&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;  // (live, saved)
  RandomState random_;
};

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
  return total;
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
    std::int64_t parameter_bytes = 0, kept_bytes = 0;
    for (int i : members) {
      parameter_bytes += modules[i].parameter_bytes;
      kept_bytes += modules[i].activation_bytes + modules[i].output_bytes;
    }
    const double copies = static_cast<int>(activation_copies.size()) == num_stages ? activation_copies[stage] : 1.0;
    char numbers[200];
    std::snprintf(numbers, sizeof numbers,
                  "), params %s, activations %s per microbatch x %g held, est. fwd+bwd %.3f ms, sends %s",
                  format_bytes(static_cast<double>(parameter_bytes)).c_str(),
                  format_bytes(static_cast<double>(kept_bytes)).c_str(), copies, stage_time(stage) * 1e3,
                  stage + 1 < num_stages ? format_bytes(static_cast<double>(stage_sent_bytes(stage))).c_str() : "-");
    // Module names may be long: only the numbers go through a fixed buffer.
    text << "\n  stage " << stage << ": modules " << modules[members.front()].name << ".."
         << modules[members.back()].name << " (" << members.size() << numbers;
  }
  return text.str();
}

std::string StagePlan::to_json() const {
  nlohmann::json document;
  document["num_stages"] = num_stages;
  document["stage_of_module"] = stage_of_module;
  document["activation_copies"] = activation_copies;
  for (const auto& module : modules) {
    document["modules"].push_back({{"name", module.name},
                                   {"forward_s", module.forward_s},
                                   {"backward_s", module.backward_s},
                                   {"parameter_bytes", module.parameter_bytes},
                                   {"output_bytes", module.output_bytes},
                                   {"activation_bytes", module.activation_bytes},
                                   {"producers", module.producers}});
  }
  return document.dump();
}

StagePlan StagePlan::from_json(const std::string& text) {
  const auto document = nlohmann::json::parse(text);
  StagePlan plan;
  plan.num_stages = document.at("num_stages").get<int>();
  plan.stage_of_module = document.at("stage_of_module").get<std::vector<int>>();
  plan.activation_copies = document.value("activation_copies", std::vector<double>{});
  for (const auto& module : document.at("modules")) {
    plan.modules.push_back({module.at("name").get<std::string>(), module.at("forward_s").get<double>(),
                            module.at("backward_s").get<double>(), module.at("parameter_bytes").get<std::int64_t>(),
                            module.at("output_bytes").get<std::int64_t>(),
                            module.at("producers").get<std::vector<int>>(),
                            module.value("activation_bytes", std::int64_t{0})});
  }
  return plan;
}

namespace {

// Where a module's parameters and buffers live, to put it back there after profiling it elsewhere (the first
// tensor's device: a module split over devices is not one the engine can place anyway).
std::optional<c10::Device> device_of(torch::nn::Module& module) {
  for (const auto& parameter : module.parameters()) return parameter.device();
  for (const auto& buffer : module.buffers()) return buffer.device();
  return std::nullopt;
}

// A module on `device` for as long as this lives, then back where it was, also when its profile throws (a caller
// that catches the ModelError keeps its model as it was).
class ModuleVisit {
 public:
  ModuleVisit(torch::nn::Module& module, c10::Device device) : module_(module), home_(device_of(module)) {
    // A module built on the meta device has no data to move: its forward (a captured node of the Python package)
    // runs on stand-ins of its own while it is profiled.
    if (home_ && *home_ != device && !home_->is_meta()) module_.to(device);
    else home_.reset();  // already there (or nothing to move)
  }
  ~ModuleVisit() {
    if (!home_) return;
    try {  // as in ~TrainingStateKept: the profile's own error, if any, is the one to report
      module_.to(*home_);
    } catch (const std::exception& error) {
      log::warn("profiling could not move a module back to " + home_->str() + ": " + error.what());
    }
  }
  ModuleVisit(const ModuleVisit&) = delete;
  ModuleVisit& operator=(const ModuleVisit&) = delete;

 private:
  torch::nn::Module& module_;
  std::optional<c10::Device> home_;
};

// What the device's caching allocator holds for live tensors: on a GPU, what a forward keeps for its backward.
std::int64_t device_allocated_bytes(c10::Device device) {
  const auto stats = at::accelerator::getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

}  // namespace

std::vector<ModuleProfile> profile_graph(const GraphModel& model, const at::Tensor& sample, int repeats) {
  return profile_graph(model, std::vector<at::Tensor>{sample}, repeats);
}

std::vector<ModuleProfile> profile_graph(const GraphModel& model, const std::vector<at::Tensor>& sample, int repeats) {
  if (sample.size() != model.input_names().size()) {
    throw ModelError("the sample has " + std::to_string(sample.size()) + " inputs, the model takes " +
                     std::to_string(model.input_names().size()));
  }
  // On the sample's device: a GPU job's modules are timed on its GPU, where their relative costs differ from the
  // CPU's (and a large model's sample runs there far faster). Each module goes there for its own rounds and back
  // after, so that a model larger than the device is profiled one module at a time.
  c10::Device device(c10::kCPU);
  for (const auto& input : sample) {
    if (input.defined()) device = input.device();
  }
  const bool on_accelerator = !device.is_cpu();
  auto settle = [&] {  // time what ran, not what was queued
    if (on_accelerator) at::accelerator::synchronizeDevice(device.index());
  };
  const TrainingStateKept kept(model, device);
  std::vector<ModuleProfile> profiles;
  std::map<std::string, at::Tensor> values;
  for (std::size_t i = 0; i < sample.size(); ++i) values[model.input_names()[i]] = sample[i];
  // Each output is dropped after its last reader: on a GPU only the outputs still to be read stay there.
  std::map<std::string, std::size_t> last_reader;
  for (std::size_t i = 0; i < model.nodes().size(); ++i) {
    for (const auto& input : model.nodes()[i].inputs) last_reader[input] = i;
  }
  // What each forward keeps alive for its backward: CPU tensors through a counting allocator, a GPU's from its
  // caching allocator's statistics.
  std::optional<CountingCpuAllocator::Installed> counting;
  if (!on_accelerator) counting.emplace();
  const auto& meter = CountingCpuAllocator::instance();
  auto live_bytes = [&] { return on_accelerator ? device_allocated_bytes(device) : meter.live_bytes(); };
  std::set<const void*> counted;  // a tied parameter's bytes count once, at its first node
  // Nodes of equal profile keys on inputs of equal shapes compute the same thing: one measurement for all of them,
  // so that noise cannot tell identical blocks apart (and profiling a deep model takes a few blocks' time).
  struct Measured {
    double forward_s, backward_s;
    std::int64_t activation_bytes;
    at::Tensor output;
  };
  std::map<std::string, Measured> measured;
  for (std::size_t index = 0; index < model.nodes().size(); ++index) {
    // A node built on demand is built for its profile alone, and goes after it.
    const GraphModel::Node node = model.built_apart(static_cast<int>(index));
    ModuleProfile profile;
    profile.name = node.name;
    for (const auto& input : node.inputs) {
      if (model.input_index(input) < 0) profile.producers.push_back(model.index_of(input));
    }
    // A node built apart holds tensors of its own (what it shares is left out): an address a freed node's tensor
    // had says nothing about them.
    const bool built_apart = !model.nodes()[index].built();
    for (const auto& [name, parameter] : GraphModel::own_parameters(node)) {
      if (built_apart || counted.insert(parameter.unsafeGetTensorImpl()).second) {
        profile.parameter_bytes += parameter.numel() * static_cast<std::int64_t>(parameter.element_size());
        profile.parameter_shapes += name + ":";
        for (auto size : parameter.sizes()) profile.parameter_shapes += std::to_string(size) + ",";
        profile.parameter_shapes += ";";
      }
    }
    std::string key;
    if (!node.profile_key.empty()) {
      key = node.profile_key;
      for (const auto& input : node.inputs) {
        const at::Tensor& value = values.at(input);
        key += value.defined() ? "|" + c10::str(value.sizes(), value.scalar_type()) : std::string("|none");
      }
    }
    if (const auto found = measured.find(key); !key.empty() && found != measured.end()) {
      profile.forward_s = found->second.forward_s;
      profile.backward_s = found->second.backward_s;
      profile.activation_bytes = found->second.activation_bytes;
      profile.output_bytes = found->second.output.numel() * static_cast<std::int64_t>(found->second.output.element_size());
      profiles.push_back(profile);
      values[node.name] = found->second.output;
      for (const auto& input : node.inputs) {
        if (last_reader.at(input) == index) values.erase(input);
      }
      continue;
    }
    const ModuleVisit visit(*node.module, device);
    std::vector<double> forward_times, backward_times;
    std::int64_t activation_bytes = -1;  // the least over the rounds: the first pays for one-time allocations
    at::Tensor output;
    // Untimed rounds first: first calls pay for allocations and lazy initialisation, and TorchScript modules (the
    // Python package's) run their profiling executor's instrumented and then compiling calls, for the forward
    // graph and then again for the backward graph it derives, before they run optimized code.
    constexpr int kUntimedRounds = 3;
    for (int repeat = -kUntimedRounds; repeat < repeats; ++repeat) {
      std::vector<at::Tensor> arguments;
      for (const auto& input : node.inputs) {
        // A copy: a module that writes into its input must not change what the next round and the next module see.
        const at::Tensor& value = values.at(input);
        at::Tensor leaf = value.defined() ? value.detach().clone() : value;
        if (leaf.defined() && at::isFloatingType(leaf.scalar_type())) leaf.requires_grad_(true);
        arguments.push_back(GraphModel::writable_input(leaf));
      }
      settle();
      auto start = std::chrono::steady_clock::now();
      double forward_s = 0, backward_s = 0;
      try {
        const std::int64_t before = live_bytes();
        at::Tensor produced = node.forward(arguments);
        settle();
        forward_s = seconds_since(start);
        const std::int64_t kept = live_bytes() - before -
                                  produced.numel() * static_cast<std::int64_t>(produced.element_size());
        activation_bytes = activation_bytes < 0 ? std::max<std::int64_t>(kept, 0)
                                                : std::min(activation_bytes, std::max<std::int64_t>(kept, 0));
        output = produced;
        start = std::chrono::steady_clock::now();
        if (output.requires_grad()) torch::autograd::backward({output}, {at::ones_like(output)});
        settle();
        backward_s = seconds_since(start);
      } catch (const std::exception& error) {  // LibTorch's, or TorchScript's interpreter's
        std::string shapes;
        for (const auto& argument : arguments) shapes += (shapes.empty() ? "" : ", ") + c10::str(argument.sizes());
        throw ModelError("module \"" + profile.name + "\" fails on the sample microbatch (input " + shapes +
                         "): " + comm::brief_message(error));
      }
      if (repeat < 0) continue;
      forward_times.push_back(forward_s);
      backward_times.push_back(backward_s);
    }
    // The profile must leave no trace in the training state (buffers and random numbers: TrainingStateKept).
    for (const auto& parameter : node.module->parameters()) {
      if (parameter.grad().defined()) parameter.mutable_grad() = at::Tensor();
    }
    profile.forward_s = least(forward_times);
    profile.backward_s = least(backward_times);
    profile.output_bytes = output.numel() * static_cast<std::int64_t>(output.element_size());
    profile.activation_bytes = std::max<std::int64_t>(activation_bytes, 0);
    profiles.push_back(profile);
    values[node.name] = output.detach();
    if (!key.empty()) measured[key] = {profile.forward_s, profile.backward_s, profile.activation_bytes, values[node.name]};
    for (const auto& input : node.inputs) {
      if (last_reader.at(input) == index) values.erase(input);
    }
  }
  measured.clear();
  values.clear();
  // The cached blocks go back to the device: processes sharing a GPU (over Gloo) need them more than rank 0 does.
  if (on_accelerator) at::accelerator::emptyCache();
  return profiles;
}

namespace {

// Whether node `name` was cut from the module at `path`: the module itself, a part of it (a captured model's
// "model.layers.5" may be cut into "model.layers.5.self_attn" ...), or a second output of it ("model.layers.5#1").
bool cut_from(const std::string& name, const std::string& path) {
  return name == path || (name.size() > path.size() && name.compare(0, path.size(), path) == 0 &&
                          (name[path.size()] == '.' || name[path.size()] == '#'));
}

}  // namespace

std::vector<bool> checkpointed_modules(const std::vector<std::string>& module_names, const Config& config) {
  std::vector<bool> selected(module_names.size(), false);
  for (const auto& wanted : config.checkpointed_modules) {
    bool found = false;
    for (std::size_t i = 0; i < module_names.size(); ++i) {
      const std::string& name = module_names[i];
      if (cut_from(name, wanted)) selected[i] = found = true;
    }
    if (!found) {
      std::string names;
      for (const auto& name : module_names) names += (names.empty() ? "" : ", ") + name;
      throw ConfigError(config.source + ": key \"activation_checkpointing\": no module \"" + wanted +
                        "\" in the model (its modules: " + names + ")");
    }
  }
  return selected;
}

StagePlan plan_stages(std::vector<ModuleProfile> modules, const Config& config,
                      std::vector<double> activation_copies, int optimizer_state_shards) {
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
  // The partition search sees the profile as a DAG: compute time, memory per node, and the bytes of every tensor
  // between nodes. Memory: parameters, gradients and two optimizer moments (4x the parameter bytes; the moments
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
  part::ModuleGraph graph;
  for (std::size_t i = 0; i < modules.size(); ++i) {
    const auto& module = modules[i];
    part::GraphNode node;
    node.name = module.name;
    node.compute_s =
        module.forward_s + module.backward_s + (recomputed_modules[i] ? module_recomputes * module.forward_s : 0.0);
    node.memory_bytes = (2.0 + 2.0 / optimizer_state_shards) * static_cast<double>(module.parameter_bytes) +
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
  StagePlan plan;
  try {
    plan.stage_of_module = part::partition_graph(graph, options).stage_of_node;
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
  return plan;
}

}  // namespace smp
