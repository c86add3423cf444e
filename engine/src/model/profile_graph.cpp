// Profiling a graph model for its partition: each node's forward and backward time, its parameters, and what its
// forward keeps for backward (profile_graph in smp/stage_plan.h).
#include "smp/stage_plan.h"
#include "smp/cpu_tensor_meter.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/autograd.h>

#include "smp/collectives.h"
#include "smp/comm/communicator.h"
#include "smp/errors.h"
#include "smp/graph_model.h"
#include "smp/log.h"
#include "model/random_state.h"

namespace smp {
namespace {

// The least of the timed rounds: noise on a shared machine (other processes, frequency changes, page faults) only
// ever adds time, so the minimum is the estimate that repeats best from run to run.
double least(const std::vector<double>& values) {
  if (values.empty()) return 0.0;  // not timed (repeats = 0)
  return *std::min_element(values.begin(), values.end());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void drop_gradients(torch::nn::Module& module) {
  for (const auto& parameter : module.parameters()) {
    if (parameter.grad().defined()) parameter.mutable_grad() = at::Tensor();
  }
}

// Profiling runs the modules in training mode: batch norm updates its running statistics and dropout draws
// random numbers, and backward passes leave gradients. All are put back (the gradients dropped) when it ends, also
// when it throws, so that profiling on rank 0 changes nothing the training sees.
class TrainingStateKept {
 public:
  TrainingStateKept(const GraphModel& model, c10::Device device) {
    std::set<const void*> seen;
    for (const auto& node : model.nodes()) {
      if (!node.built()) continue;  // built apart for its profile, and dropped after
      modules_.push_back(node.module);
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
      for (const auto& module : modules_) drop_gradients(*module);
      for (auto& [buffer, saved] : buffers_) buffer.copy_(saved);
      random_.restore();
    } catch (const std::exception& error) {
      log::warn(std::string("profiling could not restore the model's buffers and random state: ") + error.what());
    }
  }
  TrainingStateKept(const TrainingStateKept&) = delete;
  TrainingStateKept& operator=(const TrainingStateKept&) = delete;

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;  // (live, saved)
  RandomState random_;
};


// Where a module's parameters and buffers live, to put it back there after profiling it elsewhere (the first
// tensor's device: a module split over devices is not one the engine can place anyway).
std::optional<c10::Device> device_of(torch::nn::Module& module) {
  for (const auto& parameter : module.parameters()) return parameter.device();
  for (const auto& buffer : module.buffers()) return buffer.device();
  return std::nullopt;
}

// A module on `device` for as long as this lives, then back where it was without the gradients its profile left,
// also when its profile throws (a caller that catches the error keeps its model as it was: a first train_step would
// otherwise add those gradients to its own).
class ModuleVisit {
 public:
  ModuleVisit(torch::nn::Module& module, c10::Device device) : module_(module), home_(device_of(module)) {
    // A module built on the meta device has no data to move: its forward (a captured node of the Python package)
    // runs on stand-ins of its own while it is profiled.
    if (home_ && *home_ != device && !home_->is_meta()) module_.to(device);
    else home_.reset();  // already there (or nothing to move)
  }
  ~ModuleVisit() {
    drop_gradients(module_);
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

// train_step's loss function is not known while the model is partitioned, yet the last stage runs it on every
// microbatch, and over a large vocabulary it costs as much as a block: the balance must see it. A model that computes
// its own loss has it in its graph (a 0-dim output). Otherwise the node of the largest floating-point output of two
// or more dimensions, the scores a classifier or language model ends with, is charged the cross-entropy over that
// output's last dimension most such models train with, timed like a node.
void charge_assumed_loss(const GraphModel& model, const std::map<std::string, at::Tensor>& values,
                         std::vector<ModuleProfile>& profiles, int repeats, int untimed_rounds,
                         const std::function<void()>& settle) {
  int scored = -1;
  at::Tensor scores;
  for (const auto& name : model.output_names()) {
    const auto found = values.find(name);
    if (found == values.end() || !found->second.defined()) continue;
    const at::Tensor& output = found->second;
    if (!at::isFloatingType(output.scalar_type())) continue;
    if (output.dim() == 0) return;
    const int node = model.index_of(name);
    if (output.dim() >= 2 && node >= 0 && (!scores.defined() || output.numel() > scores.numel())) {
      scores = output;
      scored = node;
    }
  }
  if (scored < 0) return;
  const at::Tensor rows = scores.flatten(0, -2);
  const at::Tensor classes = at::zeros({rows.size(0)}, rows.options().dtype(at::kLong));
  std::vector<double> forward_times, backward_times;
  for (int repeat = -untimed_rounds; repeat < repeats; ++repeat) {
    const at::Tensor leaf = rows.detach().clone().requires_grad_(true);
    settle();
    auto start = std::chrono::steady_clock::now();
    const at::Tensor loss = at::cross_entropy_loss(leaf, classes);
    settle();
    const double forward_s = seconds_since(start);
    start = std::chrono::steady_clock::now();
    torch::autograd::backward({loss});
    settle();
    if (repeat < 0) continue;
    forward_times.push_back(forward_s);
    backward_times.push_back(seconds_since(start));
  }
  ModuleProfile& charged = profiles.at(static_cast<std::size_t>(scored));
  const double forward_s = least(forward_times), backward_s = least(backward_times);
  charged.forward_s += forward_s;
  charged.backward_s += backward_s;
  charged.assumed_loss_s = forward_s + backward_s;
}

// Nodes timed one at a time, each on inputs it just saw, with its backward right after its forward, sum to less than
// the model takes whole: there a backward finds its activations long out of the caches, and each node's inputs come
// cold from the one before. A plan predicts whole steps, so the nodes are scaled, forward and backward apart, to
// one pass of the whole model on the same sample (the least of `repeats`), their relative costs kept. Not done
// (factors 1) where the model cannot run whole here: a node built on demand, or a module on another device.
void scale_to_whole_model(const GraphModel& model, const std::vector<at::Tensor>& sample, c10::Device device,
                          std::vector<ModuleProfile>& profiles, int repeats, int untimed_rounds,
                          const std::function<void()>& settle) {
  for (const auto& node : model.nodes()) {
    if (!node.built()) return;
    const auto home = device_of(*node.module);
    if (home && *home != device) return;
  }
  double forward_sum = 0, backward_sum = 0;
  for (const auto& profile : profiles) {
    forward_sum += profile.forward_s;
    backward_sum += profile.backward_s;
  }
  if (forward_sum <= 0 || backward_sum <= 0) return;
  std::vector<double> forward_times, backward_times;
  for (int repeat = -untimed_rounds; repeat < repeats; ++repeat) {
    settle();
    auto start = std::chrono::steady_clock::now();
    const std::vector<at::Tensor> outputs = model.forward(sample);
    settle();
    const double forward_s = seconds_since(start);
    std::vector<at::Tensor> roots, seeds;
    for (const auto& output : outputs) {
      if (output.defined() && output.requires_grad()) {
        roots.push_back(output);
        seeds.push_back(at::ones_like(output));
      }
    }
    if (roots.empty()) return;  // nothing to differentiate: the nodes' backward times are all there is
    start = std::chrono::steady_clock::now();
    torch::autograd::backward(roots, seeds);
    settle();
    const double backward_s = seconds_since(start);
    if (repeat < 0) continue;
    forward_times.push_back(forward_s);
    backward_times.push_back(backward_s);
  }
  for (const auto& node : model.nodes()) drop_gradients(*node.module);
  const double forward_factor = least(forward_times) / forward_sum;
  const double backward_factor = least(backward_times) / backward_sum;
  for (auto& profile : profiles) {
    profile.forward_s *= forward_factor;
    profile.backward_s *= backward_factor;
    profile.backward_input_s *= backward_factor;
    profile.backward_weight_s *= backward_factor;
  }
  log::debug("profile scaled to the whole model: forward x " + std::to_string(forward_factor) + ", backward x " +
             std::to_string(backward_factor));
}

void set_collectives(ModuleProfile& profile, const SkippedCollectives& forward, const SkippedCollectives& backward) {
  profile.tp_forward_collectives = forward.count;
  profile.tp_forward_ring_bytes = forward.ring_bytes;
  profile.tp_backward_collectives = backward.count;
  profile.tp_backward_ring_bytes = backward.ring_bytes;
}

}  // namespace

std::vector<ModuleProfile> profile_graph(const GraphModel& model, const at::Tensor& sample, int repeats) {
  return profile_graph(model, std::vector<at::Tensor>{sample}, repeats);
}

std::vector<ModuleProfile> profile_graph(const GraphModel& model, const std::vector<at::Tensor>& sample, int repeats,
                                         const SplitBackwardTimer& time_split, bool scale_to_whole) {
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
  std::optional<CpuTensorMeter> meter;
  if (!on_accelerator) meter.emplace();
  auto live_bytes = [&] { return on_accelerator ? device_allocated_bytes(device) : meter->live_bytes(); };
  std::set<const void*> counted;  // a tied parameter's bytes count at its first node here, and at its last below
  std::map<std::string, std::int64_t> counted_bytes;  // by parameter name
  // Nodes of equal profile keys on inputs of equal shapes compute the same thing: one measurement for all of them,
  // so that noise cannot tell identical blocks apart (and profiling a deep model takes a few blocks' time).
  struct Measured {
    double forward_s, backward_s;
    std::int64_t activation_bytes;
    at::Tensor output;
    double backward_input_s, backward_weight_s;
    std::int64_t weight_pass_bytes;
    SkippedCollectives forward_collectives, backward_collectives;
  };
  std::map<std::string, Measured> measured;
  // Untimed rounds first: first calls pay for allocations and lazy initialisation, and TorchScript modules (the
  // Python package's) run their profiling executor's instrumented and then compiling calls, for the forward graph
  // and then again for the backward graph it derives, before they run optimized code.
  constexpr int kUntimedRounds = 3;
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
      profile.holds_parameters = true;
      if (built_apart || counted.insert(parameter.unsafeGetTensorImpl()).second) {
        const std::int64_t bytes = parameter.numel() * static_cast<std::int64_t>(parameter.element_size());
        counted_bytes[name] = bytes;
        profile.parameter_bytes += bytes;
        if (!parameter.requires_grad()) {
          profile.frozen_parameter_bytes += bytes;
          profile.frozen_parameters.push_back(name);
        }
        profile.largest_parameter_bytes = std::max(profile.largest_parameter_bytes, bytes);
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
      profile.backward_input_s = found->second.backward_input_s;
      profile.backward_weight_s = found->second.backward_weight_s;
      profile.weight_pass_bytes = found->second.weight_pass_bytes;
      set_collectives(profile, found->second.forward_collectives, found->second.backward_collectives);
      profile.output_bytes = found->second.output.numel() * static_cast<std::int64_t>(found->second.output.element_size());
      profiles.push_back(profile);
      values[node.name] = found->second.output;
      for (const auto& input : node.inputs) {
        if (last_reader.at(input) == index) values.erase(input);
      }
      continue;
    }
    const ModuleVisit visit(*node.module, device);
    std::vector<double> forward_times, backward_times, input_pass_times, weight_pass_times;
    std::int64_t weight_pass_bytes = -1;  // the least over the rounds, as activation_bytes
    std::int64_t activation_bytes = -1;  // the least over the rounds: the first pays for one-time allocations
    at::Tensor output;
    SkippedCollectives forward_collectives, backward_collectives;  // in the last round (each round runs the same)
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
        const SkippedCollectives skipped_before = skipped_collectives();
        at::Tensor produced = node.forward(arguments);
        settle();
        forward_s = seconds_since(start);
        const SkippedCollectives skipped_forward = skipped_collectives();
        const std::int64_t kept = live_bytes() - before -
                                  produced.numel() * static_cast<std::int64_t>(produced.element_size());
        activation_bytes = activation_bytes < 0 ? std::max<std::int64_t>(kept, 0)
                                                : std::min(activation_bytes, std::max<std::int64_t>(kept, 0));
        output = produced;
        start = std::chrono::steady_clock::now();
        if (output.requires_grad()) torch::autograd::backward({output}, {at::ones_like(output)});
        settle();
        backward_s = seconds_since(start);
        const SkippedCollectives skipped_backward = skipped_collectives();
        forward_collectives = {skipped_forward.count - skipped_before.count,
                               skipped_forward.ring_bytes - skipped_before.ring_bytes};
        backward_collectives = {skipped_backward.count - skipped_forward.count,
                                skipped_backward.ring_bytes - skipped_forward.ring_bytes};
        if (time_split && output.requires_grad() && repeat >= 0) {
          drop_gradients(*node.module);
          std::vector<at::Tensor> fresh;
          for (const auto& argument : arguments) {
            at::Tensor leaf = argument.defined() ? argument.detach().clone() : argument;
            if (leaf.defined() && at::isFloatingType(leaf.scalar_type())) leaf.requires_grad_(true);
            fresh.push_back(GraphModel::writable_input(leaf));
          }
          const std::int64_t before_split = live_bytes();
          at::Tensor split_output = node.forward(fresh);
          const std::int64_t split_output_bytes =
              split_output.numel() * static_cast<std::int64_t>(split_output.element_size());
          const SplitBackwardTiming timing =
              time_split(std::exchange(split_output, at::Tensor()), fresh, node.module->parameters(), live_bytes);
          input_pass_times.push_back(timing.input_s);
          weight_pass_times.push_back(timing.weight_s);
          // The output is still held while the timer runs (its caller's argument); it is not an activation.
          const std::int64_t held = std::max<std::int64_t>(timing.live_bytes_between - before_split - split_output_bytes, 0);
          weight_pass_bytes = weight_pass_bytes < 0 ? held : std::min(weight_pass_bytes, held);
        }
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
    profile.forward_s = least(forward_times);
    profile.backward_s = least(backward_times);
    if (!input_pass_times.empty()) {
      profile.backward_input_s = least(input_pass_times);
      profile.backward_weight_s = least(weight_pass_times);
      profile.weight_pass_bytes = std::min(weight_pass_bytes, std::max<std::int64_t>(activation_bytes, 0));
    }
    profile.output_bytes = output.numel() * static_cast<std::int64_t>(output.element_size());
    profile.activation_bytes = std::max<std::int64_t>(activation_bytes, 0);
    set_collectives(profile, forward_collectives, backward_collectives);
    profiles.push_back(profile);
    values[node.name] = output.detach();
    if (!key.empty()) {
      measured[key] = {profile.forward_s,         profile.backward_s,         profile.activation_bytes,
                       values[node.name],         profile.backward_input_s,   profile.backward_weight_s,
                       profile.weight_pass_bytes, forward_collectives,        backward_collectives};
    }
    for (const auto& input : node.inputs) {
      if (last_reader.at(input) == index) values.erase(input);
    }
  }
  measured.clear();
  meter.reset();  // the whole model runs as training runs it, without counting
  if (repeats > 0 && scale_to_whole) scale_to_whole_model(model, sample, device, profiles, repeats, kUntimedRounds, settle);
  if (repeats > 0) charge_assumed_loss(model, values, profiles, repeats, kUntimedRounds, settle);
  values.clear();
  // A tied parameter (an embedding and the head reading it) also counts at its last holder: the stage holding it
  // keeps a copy with its gradient and optimizer state, and the two are most often far apart (stage 0 and the
  // last). Not at every holder: blocks sharing one layer's weights (ALBERT) mostly sit together, where counting
  // each would multiply one copy; a holder in between alone on a stage still goes uncounted. parameter_shapes, the
  // model's signature, lists it once.
  for (const auto& tie : model.ties()) {
    for (int holder : tie.nodes) profiles.at(static_cast<std::size_t>(holder)).holds_parameters = true;
    if (tie.nodes.size() < 2 || tie.nodes.back() == tie.nodes.front()) continue;
    const auto bytes = tie.tensor.defined() ? tie.tensor.numel() * static_cast<std::int64_t>(tie.tensor.element_size())
                                            : counted_bytes[tie.parameter];
    ModuleProfile& last = profiles.at(static_cast<std::size_t>(tie.nodes.back()));
    last.parameter_bytes += bytes;
    if (tie.tensor.defined() && !tie.tensor.requires_grad()) last.frozen_parameter_bytes += bytes;
    last.largest_parameter_bytes = std::max(last.largest_parameter_bytes, bytes);
  }
  // The cached blocks go back to the device: processes sharing a GPU (over Gloo) need them more than rank 0 does.
  if (on_accelerator) at::accelerator::emptyCache();
  return profiles;
}

}  // namespace smp
