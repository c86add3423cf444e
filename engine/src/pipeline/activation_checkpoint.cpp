#include "pipeline/activation_checkpoint.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "smp/errors.h"
#include "smp/executor.h"

namespace smp {

namespace {
// Per thread: a recompute runs in the thread that runs its backward (on a GPU, autograd's device thread), while
// another thread (an overlapped forward) may be running a first forward at the same time.
thread_local bool recomputing_now = false;
}  // namespace

bool recomputing() { return recomputing_now; }

RecomputeScope::RecomputeScope(const RandomState& first_run, const std::vector<at::Tensor>& buffers,
                               c10::Device device)
    : before_(RandomState::capture(device)), was_recomputing_(recomputing_now) {
  for (const auto& buffer : buffers) buffers_.emplace_back(buffer, buffer.clone());
  first_run.restore();
  recomputing_now = true;
}

RecomputeScope::~RecomputeScope() {
  recomputing_now = was_recomputing_;
  before_.restore();
  // Below autograd's version counting, as batch norm's own kernel updates them: the recomputed graph saved these
  // tensors and would refuse a backward through them after a counted in-place write.
  at::AutoDispatchBelowADInplaceOrView untracked;
  for (auto& [live, saved] : buffers_) live.copy_(saved);
}

namespace {

using torch::autograd::variable_list;

// While it lives, the parameters' tensor hooks are set aside: an inner pass that only computes their gradients
// (torch::autograd::grad runs the hooks of what it captures) must not run hooks that the outer pass, accumulating
// those gradients, runs again.
class ParameterHooksSetAside {
 public:
  explicit ParameterHooksSetAside(const std::vector<at::Tensor>& parameters) {
    for (const auto& parameter : parameters) {
      auto accumulator = torch::autograd::impl::try_get_grad_accumulator(parameter);
      if (!accumulator || accumulator->tensor_pre_hooks().empty()) continue;
      set_aside_.emplace_back(accumulator, std::move(accumulator->tensor_pre_hooks()));
      accumulator->tensor_pre_hooks().clear();
    }
  }
  ~ParameterHooksSetAside() {
    for (auto& [accumulator, hooks] : set_aside_) accumulator->tensor_pre_hooks() = std::move(hooks);
  }
  ParameterHooksSetAside(const ParameterHooksSetAside&) = delete;
  ParameterHooksSetAside& operator=(const ParameterHooksSetAside&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>,
                        std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>>>
      set_aside_;
};

// The gradient function of a checkpointed module's output. Its next edges are the module's inputs, then its
// parameters, so that their gradients flow on (and accumulate) exactly as without checkpointing.
class RecomputeBackward final : public torch::autograd::Node {
 public:
  RecomputeBackward(std::string name, GraphModel::Forward forward, const std::vector<at::Tensor>& inputs,
                    std::vector<uint32_t> input_versions, std::vector<at::Tensor> parameters,
                    std::vector<at::Tensor> buffers, RandomState random, std::optional<AutocastSetting> autocast,
                    c10::Device device)
      : name_(std::move(name)),
        forward_(std::move(forward)),
        input_versions_(std::move(input_versions)),
        parameters_(std::move(parameters)),
        buffers_(std::move(buffers)),
        random_(std::move(random)),
        autocast_(autocast),
        device_(device) {
    for (const auto& input : inputs) {
      inputs_.push_back(input.detach());
      input_requires_grad_.push_back(input.requires_grad());
    }
  }

  std::string name() const override { return "smp::RecomputeBackward"; }

  variable_list apply(variable_list&& output_grads) override {
    // Fresh leaves for the inputs, so that the recomputed graph ends here and not in the outer graph.
    std::vector<at::Tensor> inputs;
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      // Recomputing from an input changed since would differentiate another function: refuse, as autograd does.
      if (inputs_[i]._version() != input_versions_[i]) {
        throw ModelError("checkpointed module \"" + name_ + "\": its input " + std::to_string(i) +
                         " was modified in place after its forward, so its backward cannot recompute it");
      }
      at::Tensor leaf = inputs_[i].detach();
      if (input_requires_grad_[i]) leaf.requires_grad_(true);
      inputs.push_back(leaf);
    }
    at::Tensor output;
    {
      const RecomputeScope same_as_first_run(random_, buffers_, device_);
      c10::AutoGradMode grad(true);
      std::optional<AutocastScope> scope;
      if (autocast_) scope.emplace(*autocast_);
      output = forward_(inputs);
    }
    // What this backward pass asks of us (the zero-bubble input pass wants the inputs' gradients alone, its weight
    // pass the parameters'), in the order of the next edges; undefined elsewhere. The outer pass accumulates the
    // parameters' gradients, running their hooks (the user's, the gradient reducer's) once.
    variable_list wanted;
    std::vector<std::size_t> slot;
    std::vector<at::Tensor> wanted_parameters;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad() && task_should_compute_output(i)) {
        wanted.push_back(inputs[i]);
        slot.push_back(i);
      }
    }
    for (std::size_t i = 0; i < parameters_.size(); ++i) {
      if (parameters_[i].requires_grad() && task_should_compute_output(inputs.size() + i)) {
        wanted.push_back(parameters_[i]);
        wanted_parameters.push_back(parameters_[i]);
        slot.push_back(inputs.size() + i);
      }
    }
    variable_list grads(inputs.size() + parameters_.size());
    if (!wanted.empty() && output.requires_grad() && output_grads.at(0).defined()) {
      const ParameterHooksSetAside once(wanted_parameters);
      const auto computed = torch::autograd::grad({output}, wanted, {output_grads[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
      for (std::size_t k = 0; k < computed.size(); ++k) grads[slot[k]] = computed[k];
    }
    return grads;
  }

 private:
  std::string name_;
  GraphModel::Forward forward_;
  std::vector<uint32_t> input_versions_;  // as the first run found them
  std::vector<at::Tensor> inputs_;        // detached: the one thing a checkpoint keeps
  std::vector<bool> input_requires_grad_;
  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> buffers_;
  RandomState random_;
  std::optional<AutocastSetting> autocast_;
  c10::Device device_;
};

}  // namespace

at::Tensor checkpointed_forward(const GraphModel::Node& node, const std::vector<at::Tensor>& inputs,
                                std::optional<AutocastSetting> autocast, c10::Device device) {
  const GraphModel::Forward& forward = node.forward;
  // Each tensor once: a parameter registered in two submodules must get its gradient once.
  std::vector<at::Tensor> parameters;
  {
    std::set<const void*> seen;
    for (const auto& parameter : node.module->parameters()) {
      if (seen.insert(parameter.unsafeGetTensorImpl()).second) parameters.push_back(parameter);
    }
  }
  const auto needs_grad = [](const at::Tensor& tensor) { return tensor.defined() && tensor.requires_grad(); };
  if (!c10::GradMode::is_enabled() ||
      (std::none_of(inputs.begin(), inputs.end(), needs_grad) &&
       std::none_of(parameters.begin(), parameters.end(), needs_grad))) {
    return forward(inputs);
  }
  RandomState random = RandomState::capture(device);
  std::vector<uint32_t> versions;
  for (const auto& input : inputs) versions.push_back(input.defined() ? input._version() : 0);
  at::Tensor output;
  {
    c10::AutoGradMode no_graph(false);
    output = forward(inputs);
  }
  // Without a graph nothing stops a module from writing into its input (ReLU(inplace=true) first), which would
  // change the producer's output and what the recompute starts from.
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i]._version() != versions[i]) {
      throw ModelError("module \"" + node.name + "\" modifies its input " + std::to_string(i) +
                       " in place (an in-place first operation?), so it cannot be checkpointed; make that "
                       "operation out of place or leave the module out of \"activation_checkpointing\"");
    }
  }
  // The output gets our gradient function; one that aliases an input or a parameter (an identity module, a view)
  // would hand it to that tensor too, so it becomes a tensor of its own first.
  const bool aliases = output.is_view() || std::any_of(inputs.begin(), inputs.end(), [&](const at::Tensor& input) {
                         return input.defined() && input.is_alias_of(output);
                       }) || std::any_of(parameters.begin(), parameters.end(), [&](const at::Tensor& parameter) {
                         return parameter.is_alias_of(output);
                       });
  if (aliases) {
    c10::AutoGradMode no_graph(false);
    output = output.clone();
  }
  if (!at::isFloatingType(output.scalar_type()) && !at::isComplexType(output.scalar_type())) return output;
  auto gradient_function = std::shared_ptr<RecomputeBackward>(
      new RecomputeBackward(node.name, forward, inputs, std::move(versions), parameters, node.module->buffers(),
                            std::move(random), autocast, device),
      torch::autograd::deleteNode);
  gradient_function->set_next_edges(torch::autograd::collect_next_edges(inputs, parameters));
  torch::autograd::create_gradient_edge(output, gradient_function);
  return output;
}

}  // namespace smp
