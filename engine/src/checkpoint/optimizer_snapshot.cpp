#include "checkpoint/optimizer_snapshot.h"

#include <cstring>
#include <memory>
#include <sstream>
#include <utility>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <c10/util/Type.h>

#include "smp/checkpoint_manifest.h"

namespace smp {
namespace {

// Recorded beside LibTorch's own keys: Optimizer::load reads another class's state as its own, and fails on an
// internal assert (or, between classes of alike state, not at all) instead of naming the two.
constexpr const char* kClassKey = "smp_optimizer_class";
constexpr const char* kProgramStateKey = "smp_program_state";

using ProgramBytes = std::map<std::string, std::string>;

std::string class_name(const torch::optim::Optimizer& optimizer) { return c10::demangle(typeid(optimizer).name()); }

// On the CPU: a GPU job's save must not hold a second copy of the optimizer state in device memory (a resume maps
// the state back to the job's device).
at::Tensor copy_of(const at::Tensor& tensor) {
  return tensor.defined() ? tensor.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : tensor;
}

void copy_tensors(torch::optim::AdamParamState& state) {
  state.exp_avg(copy_of(state.exp_avg()));
  state.exp_avg_sq(copy_of(state.exp_avg_sq()));
  state.max_exp_avg_sq(copy_of(state.max_exp_avg_sq()));
}
void copy_tensors(torch::optim::AdamWParamState& state) {
  state.exp_avg(copy_of(state.exp_avg()));
  state.exp_avg_sq(copy_of(state.exp_avg_sq()));
  state.max_exp_avg_sq(copy_of(state.max_exp_avg_sq()));
}
void copy_tensors(torch::optim::SGDParamState& state) { state.momentum_buffer(copy_of(state.momentum_buffer())); }
void copy_tensors(torch::optim::RMSpropParamState& state) {
  state.square_avg(copy_of(state.square_avg()));
  state.momentum_buffer(copy_of(state.momentum_buffer()));
  state.grad_avg(copy_of(state.grad_avg()));
}

// `live_class`: the live optimizer's, which a twin of its base class (a subclass's snapshot) does not have.
std::string serialized(const torch::optim::Optimizer& optimizer, const std::string& live_class,
                       const ProgramBytes& program_state) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  archive.write(kClassKey, c10::IValue(live_class));
  if (!program_state.empty()) {
    // Bytes as uint8 tensors: a program's state need not be text.
    c10::Dict<std::string, at::Tensor> entries;
    for (const auto& [name, bytes] : program_state) {
      at::Tensor tensor = at::empty({static_cast<std::int64_t>(bytes.size())}, at::kByte);
      std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
      entries.insert(name, tensor);
    }
    archive.write(kProgramStateKey, c10::IValue(entries));
  }
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

// The twin has the same parameter groups (the same parameter tensors, which saving names by address only, and
// copies of the options) and a deep copy of the state; LibTorch's own save() then writes the archive.
template <typename Kind, typename State, typename Options>
std::function<std::string()> snapshot_as(const Kind& live, std::string live_class, ProgramBytes program_state) {
  auto twin = std::make_shared<Kind>(live.param_groups(), static_cast<const Options&>(live.defaults()));
  twin->state().clear();  // some optimizers start with state of their own; the live one's replaces it
  for (const auto& [key, state] : live.state()) {
    auto copy = std::make_unique<State>(static_cast<const State&>(*state));
    copy_tensors(*copy);
    twin->state()[key] = std::move(copy);
  }
  return [twin, live_class = std::move(live_class), program_state = std::move(program_state)] {
    return serialized(*twin, live_class, program_state);
  };
}

}  // namespace

std::function<std::string()> snapshot_optimizer(torch::optim::Optimizer& optimizer, ProgramBytes program_state) {
  using namespace torch::optim;
  std::string live_class = class_name(optimizer);
  if (const auto* adamw = dynamic_cast<const AdamW*>(&optimizer)) {
    return snapshot_as<AdamW, AdamWParamState, AdamWOptions>(*adamw, std::move(live_class), std::move(program_state));
  }
  if (const auto* adam = dynamic_cast<const Adam*>(&optimizer)) {
    return snapshot_as<Adam, AdamParamState, AdamOptions>(*adam, std::move(live_class), std::move(program_state));
  }
  if (const auto* sgd = dynamic_cast<const SGD*>(&optimizer)) {
    return snapshot_as<SGD, SGDParamState, SGDOptions>(*sgd, std::move(live_class), std::move(program_state));
  }
  if (const auto* rmsprop = dynamic_cast<const RMSprop*>(&optimizer)) {
    return snapshot_as<RMSprop, RMSpropParamState, RMSpropOptions>(*rmsprop, std::move(live_class), std::move(program_state));
  }
  // Another kind: its state cannot be copied generically.
  return [bytes = serialized(optimizer, live_class, program_state)] { return bytes; };
}

std::optional<ProgramBytes> saved_program_state(torch::serialize::InputArchive& archive) {
  c10::IValue saved;
  if (!archive.try_read(kProgramStateKey, saved)) return std::nullopt;
  if (!saved.isGenericDict()) throw CheckpointError("its program state is not a dictionary of bytes");
  ProgramBytes state;
  for (const auto& entry : saved.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor() || entry.value().toTensor().scalar_type() != at::kByte) {
      throw CheckpointError("its program state is not a dictionary of bytes");
    }
    const at::Tensor bytes = entry.value().toTensor().contiguous().cpu();
    state.emplace(entry.key().toStringRef(),
                  std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel())));
  }
  return state;
}

void check_saved_optimizer_class(torch::serialize::InputArchive& archive, const torch::optim::Optimizer& optimizer) {
  c10::IValue saved;
  if (!archive.try_read(kClassKey, saved)) return;  // written before the class was recorded
  const std::string expected = class_name(optimizer);
  if (saved.isString() && saved.toStringRef() != expected) {
    throw CheckpointError("it was saved by a " + saved.toStringRef() + ", this job's optimizer is a " + expected +
                          " (resume with the optimizer class that saved it, or load the parameters alone: "
                          "smp_checkpoint export, then load_parameters)");
  }
}

}  // namespace smp
