#include "checkpoint/optimizer_snapshot.h"

#include <memory>
#include <sstream>
#include <utility>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/output-archive.h>

namespace smp {
namespace {

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

std::string serialized(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

// The twin has the same parameter groups (the same parameter tensors, which saving names by address only, and
// copies of the options) and a deep copy of the state; LibTorch's own save() then writes the archive.
template <typename Kind, typename State, typename Options>
std::function<std::string()> snapshot_as(const Kind& live) {
  auto twin = std::make_shared<Kind>(live.param_groups(), static_cast<const Options&>(live.defaults()));
  twin->state().clear();  // some optimizers start with state of their own; the live one's replaces it
  for (const auto& [key, state] : live.state()) {
    auto copy = std::make_unique<State>(static_cast<const State&>(*state));
    copy_tensors(*copy);
    twin->state()[key] = std::move(copy);
  }
  return [twin] { return serialized(*twin); };
}

}  // namespace

std::function<std::string()> snapshot_optimizer(torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  if (const auto* adamw = dynamic_cast<const AdamW*>(&optimizer)) {
    return snapshot_as<AdamW, AdamWParamState, AdamWOptions>(*adamw);
  }
  if (const auto* adam = dynamic_cast<const Adam*>(&optimizer)) {
    return snapshot_as<Adam, AdamParamState, AdamOptions>(*adam);
  }
  if (const auto* sgd = dynamic_cast<const SGD*>(&optimizer)) return snapshot_as<SGD, SGDParamState, SGDOptions>(*sgd);
  if (const auto* rmsprop = dynamic_cast<const RMSprop*>(&optimizer)) {
    return snapshot_as<RMSprop, RMSpropParamState, RMSpropOptions>(*rmsprop);
  }
  return [bytes = serialized(optimizer)] { return bytes; };  // another kind: its state cannot be copied generically
}

}  // namespace smp
