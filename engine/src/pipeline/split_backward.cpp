#include "pipeline/split_backward.h"

#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace smp {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// Keeps what flows into a node during I.
struct CaptureHook final : torch::autograd::FunctionPreHook {
  explicit CaptureHook(variable_list* slot) : slot(slot) {}
  variable_list operator()(const variable_list& grads) override {
    *slot = grads;
    return grads;
  }
  variable_list* slot;
};

// A weight node's edges to its input-gradient side, which W cuts: W then runs every weight node in one engine call
// that goes nowhere but to the parameters (one call per group would each walk the graph below its roots, input side
// included, to find what it needs).
struct InputSide {
  std::shared_ptr<Node> node;
  std::vector<uint32_t> edges;
};

}  // namespace

struct WeightPass::State {
  bool weight_nodes_only = false;
  // W by weight nodes: where it starts, with what, and the parameters it ends at.
  std::vector<Edge> roots_of_w;
  variable_list grads_of_w;
  std::vector<Edge> accumulators_of_w;
  std::vector<InputSide> input_sides;
  // Fallback: one backward pass from the stage's outputs to its parameters.
  std::vector<at::Tensor> roots, root_grads, parameters;
};

WeightPass::WeightPass() = default;
WeightPass::~WeightPass() = default;
WeightPass::WeightPass(WeightPass&&) noexcept = default;
WeightPass& WeightPass::operator=(WeightPass&&) noexcept = default;

bool WeightPass::pending() const { return state_ != nullptr; }
bool WeightPass::runs_weight_nodes_only() const { return state_ && state_->weight_nodes_only; }

std::pair<std::vector<at::Tensor>, WeightPass> WeightPass::run_input_pass(const std::vector<at::Tensor>& roots,
                                                                          const std::vector<at::Tensor>& root_grads,
                                                                          const std::vector<at::Tensor>& inputs,
                                                                          const std::vector<at::Tensor>& parameters) {
  WeightPass pass;
  pass.state_ = std::make_unique<State>();
  State& state = *pass.state_;
  state.roots = roots;
  state.root_grads = root_grads;
  std::vector<at::Tensor> trainable;
  for (const auto& parameter : parameters) {
    if (parameter.requires_grad()) trainable.push_back(parameter);
  }
  state.parameters = trainable;

  // The graph below the roots, in an order where every node comes after all nodes that feed it (reverse of a
  // depth-first post-order from the roots).
  std::unordered_set<const Node*> accumulators;
  std::unordered_map<const Node*, std::size_t> parameter_of;
  for (std::size_t i = 0; i < trainable.size(); ++i) {
    const auto accumulator = torch::autograd::impl::grad_accumulator(trainable[i]);
    accumulators.insert(accumulator.get());
    parameter_of[accumulator.get()] = i;
  }
  std::vector<Edge> root_edges;
  for (const auto& root : roots) root_edges.push_back(torch::autograd::impl::gradient_edge(root));
  std::vector<Node*> post_order;
  {
    std::unordered_set<const Node*> visited;
    std::vector<std::pair<Node*, std::size_t>> stack;  // node, next edge to look at
    for (const auto& edge : root_edges) {
      if (!edge.is_valid() || !visited.insert(edge.function.get()).second) continue;
      stack.emplace_back(edge.function.get(), 0);
      while (!stack.empty()) {
        auto& [node, next] = stack.back();
        if (next < node->next_edges().size()) {
          const Edge& child = node->next_edges()[next++];
          if (child.is_valid() && visited.insert(child.function.get()).second) stack.emplace_back(child.function.get(), 0);
        } else {
          post_order.push_back(node);
          stack.pop_back();
        }
      }
    }
  }
  // A node "feeds only parameters" when everything below it ends in this stage's parameter accumulators.
  std::unordered_map<const Node*, bool> parameters_only;
  for (Node* node : post_order) {  // children before parents
    if (accumulators.count(node)) {
      parameters_only[node] = true;
      continue;
    }
    bool only = false;
    for (const auto& child : node->next_edges()) {
      if (!child.is_valid()) continue;
      only = parameters_only.at(child.function.get());
      if (!only) break;
    }
    parameters_only[node] = only;
  }
  std::vector<Node*> weight_nodes;
  for (Node* node : post_order) {
    if (parameters_only.at(node)) continue;
    const auto& edges = node->next_edges();
    if (std::any_of(edges.begin(), edges.end(),
                    [&](const Edge& child) { return child.is_valid() && parameters_only.at(child.function.get()); })) {
      weight_nodes.push_back(node);
    }
  }

  // I, recording what reaches each weight node.
  std::vector<variable_list> captured(weight_nodes.size());
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> hooks;
  for (std::size_t i = 0; i < weight_nodes.size(); ++i) {
    auto hook = std::make_unique<CaptureHook>(&captured[i]);
    hooks.emplace_back(weight_nodes[i], hook.get());
    weight_nodes[i]->add_pre_hook(std::move(hook));
  }
  auto remove_hooks = [&] {
    for (const auto& [node, hook] : hooks) {
      auto& list = node->pre_hooks();
      list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& held) { return held.get() == hook; }),
                 list.end());
    }
  };
  std::vector<Edge> input_edges;
  std::vector<std::size_t> differentiable;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    input_edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    differentiable.push_back(i);
  }
  variable_list input_grads;
  try {
    if (!input_edges.empty() && !root_edges.empty()) {
      input_grads = torch::autograd::Engine::get_default_engine().execute(
          root_edges, root_grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, input_edges);
    }
  } catch (...) {
    remove_hooks();
    throw;
  }
  remove_hooks();
  std::vector<at::Tensor> gradients(inputs.size());
  for (std::size_t k = 0; k < differentiable.size() && k < input_grads.size(); ++k) {
    gradients[differentiable[k]] = input_grads[k];
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!gradients[i].defined()) gradients[i] = at::zeros_like(inputs[i]);
  }

  // W by weight nodes needs every one of them to have been reached by I, no stage output that depends on
  // parameters alone (its gradient reaches no weight node), and no hooks on the weight nodes' incoming gradients
  // (I ran them already; W would run them again).
  for (const auto& edge : root_edges) {
    if (edge.is_valid() && parameters_only.at(edge.function.get())) return {gradients, std::move(pass)};
  }
  for (Node* node : weight_nodes) {
    if (!node->tensor_pre_hooks().empty() || !node->retains_grad_hooks().empty()) return {gradients, std::move(pass)};
  }
  const bool all_captured = !weight_nodes.empty() &&
                            std::all_of(captured.begin(), captured.end(), [](const variable_list& grads) {
                              return std::any_of(grads.begin(), grads.end(), [](const at::Tensor& g) { return g.defined(); });
                            });
  if (!all_captured) return {gradients, std::move(pass)};

  // W: every weight node, seeded with what reached it in I, to the parameters below it (one engine call, so that
  // what reaches a parameter from several weight nodes, a tied weight's uses, is summed before it accumulates once).
  std::set<std::size_t> reached;
  std::unordered_set<const Node*> seen;
  for (std::size_t i = 0; i < weight_nodes.size(); ++i) {
    for (std::size_t slot = 0; slot < captured[i].size(); ++slot) {
      if (!captured[i][slot].defined()) continue;
      state.roots_of_w.emplace_back(weight_nodes[i]->getptr(), static_cast<uint32_t>(slot));
      state.grads_of_w.push_back(captured[i][slot]);
    }
    InputSide side{weight_nodes[i]->getptr(), {}};
    std::vector<const Node*> stack;
    const auto& edges = weight_nodes[i]->next_edges();
    for (uint32_t index = 0; index < edges.size(); ++index) {
      if (!edges[index].is_valid()) continue;
      if (parameters_only.at(edges[index].function.get())) {
        stack.push_back(edges[index].function.get());
      } else {
        side.edges.push_back(index);
      }
    }
    state.input_sides.push_back(std::move(side));
    while (!stack.empty()) {
      const Node* node = stack.back();
      stack.pop_back();
      if (!seen.insert(node).second) continue;
      const auto parameter = parameter_of.find(node);
      if (parameter != parameter_of.end()) reached.insert(parameter->second);
      for (const auto& child : node->next_edges()) {
        if (child.is_valid()) stack.push_back(child.function.get());
      }
    }
  }
  for (std::size_t parameter : reached) {
    state.accumulators_of_w.push_back(torch::autograd::impl::gradient_edge(trainable[parameter]));
  }
  state.weight_nodes_only = true;
  // The weight nodes hold what W needs; the stage's outputs are not needed any more.
  state.roots.clear();
  state.root_grads.clear();
  return {gradients, std::move(pass)};
}

void WeightPass::run() {
  if (!state_) return;
  State state = std::move(*state_);
  state_.reset();
  auto& engine = torch::autograd::Engine::get_default_engine();
  if (state.weight_nodes_only) {
    // I is done with the input side, and the graph goes with this call: with those edges cut, a weight node computes
    // its weight outputs alone, and what reaches a parameter from several weight nodes is summed before it
    // accumulates, once, as in one backward pass.
    for (const auto& side : state.input_sides) {
      // Not set_next_edge, which refuses a node with parents: dropping a child keeps the graph's order valid.
      for (uint32_t index : side.edges) side.node->next_edges()[index] = Edge();
    }
    if (!state.roots_of_w.empty() && !state.accumulators_of_w.empty()) {
      engine.execute(state.roots_of_w, state.grads_of_w, /*keep_graph=*/false, /*create_graph=*/false,
                     /*accumulate_grad=*/true, state.accumulators_of_w);
    }
    return;
  }
  if (state.roots.empty() || state.parameters.empty()) return;
  std::vector<Edge> root_edges, accumulators;
  for (const auto& root : state.roots) root_edges.push_back(torch::autograd::impl::gradient_edge(root));
  for (const auto& parameter : state.parameters) accumulators.push_back(torch::autograd::impl::gradient_edge(parameter));
  engine.execute(root_edges, state.root_grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true,
                 accumulators);
}

}  // namespace smp
