#include "pipeline/split_backward.h"

#include <algorithm>
#include <iterator>
#include <set>
#include <string>
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

// Weight nodes whose weight-side work is cheap beside what I does at the node anyway: a bias add, a norm's scale and
// shift (reductions of what I reads to compute the input's gradient). W running them again from memory I left cold
// cost more than they save (a GPT stage's bias sums took 2.7 times as long in W as in one backward), so I computes
// their weight-side gradients too, captured without accumulating, and W starts below them. Others (matrix products,
// a checkpointed module, anything unknown) leave their weight-side work to W.
bool weight_work_is_cheap(const Node& node) {
  static const std::unordered_set<std::string> cheap = {
      "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1",
      "DivBackward0", "DivBackward1", "NativeLayerNormBackward0", "FusedRmsNormBackward0", "NativeGroupNormBackward0",
      "NativeBatchNormBackward0", "NativeBatchNormLegitBackward0", "NativeBatchNormLegitBackward1",
      "BatchNormWithUpdateBackward0", "BatchNormNoUpdateBackward0"};
  return cheap.count(node.name()) > 0;
}

// Frees a node's saved tensors once I has run it, where W will not run it again: I keeps the graph for W, and
// without this it would keep every activation of the stage until W, not just what W reads (the zero-bubble
// schedules' memory), and the allocator would find no freed memory to reuse during I.
struct ReleaseAfterInputPass final : torch::autograd::FunctionPostHook {
  explicit ReleaseAfterInputPass(Node* node) : node(node) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    node->release_variables();
    return outputs;
  }
  Node* node;
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

  std::unordered_map<const Node*, std::size_t> parameter_of;  // by its gradient accumulator
  for (std::size_t i = 0; i < trainable.size(); ++i) {
    parameter_of[torch::autograd::impl::grad_accumulator(trainable[i]).get()] = i;
  }
  auto is_accumulator = [&](const Node* node) { return parameter_of.count(node) > 0; };
  std::vector<Edge> root_edges;
  for (const auto& root : roots) root_edges.push_back(torch::autograd::impl::gradient_edge(root));
  // What I and W need to know of each node: whether everything below it ends in this stage's parameter
  // accumulators ("parameters only"), whether I runs it (it leads to a differentiable input), and how many edges
  // come into it. One entry per node below the roots, made as the walk first meets it.
  struct NodeFacts {
    bool parameters_only = false;
    bool leads_to_input = false;
    int edges_into = 0;
  };
  std::unordered_map<const Node*, NodeFacts> facts;
  // The graph below the roots, in an order where every node comes after all nodes that feed it (reverse of a
  // depth-first post-order from the roots).
  std::vector<Node*> post_order;
  {
    std::vector<std::pair<Node*, std::size_t>> stack;  // node, next edge to look at
    for (const auto& edge : root_edges) {
      if (!edge.is_valid() || !facts.try_emplace(edge.function.get()).second) continue;
      stack.emplace_back(edge.function.get(), 0);
      while (!stack.empty()) {
        auto& [node, next] = stack.back();
        if (next < node->next_edges().size()) {
          const Edge& child = node->next_edges()[next++];
          if (child.is_valid() && facts.try_emplace(child.function.get()).second) {
            stack.emplace_back(child.function.get(), 0);
          }
        } else {
          post_order.push_back(node);
          stack.pop_back();
        }
      }
    }
  }
  std::vector<Edge> input_edges;
  std::vector<std::size_t> differentiable;
  std::unordered_set<const Node*> input_functions;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    input_edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    input_functions.insert(input_edges.back().function.get());
    differentiable.push_back(i);
  }
  for (Node* node : post_order) {  // children before parents
    NodeFacts& own = facts.at(node);
    bool has_children = false;
    bool children_parameters_only = true;
    for (const auto& child : node->next_edges()) {
      if (!child.is_valid()) continue;
      NodeFacts& below = facts.at(child.function.get());
      ++below.edges_into;
      has_children = true;
      children_parameters_only = children_parameters_only && below.parameters_only;
      own.leads_to_input = own.leads_to_input || input_functions.count(child.function.get()) || below.leads_to_input;
    }
    own.parameters_only = is_accumulator(node) || (has_children && children_parameters_only);
  }
  auto parameters_only = [&](const Node* node) { return facts.at(node).parameters_only; };

  std::vector<Node*> weight_nodes;      // W runs them again, for their weight outputs
  std::vector<Edge> below_cheap_nodes;  // I captures what flows along them; W starts there
  // W by weight nodes needs I to run every node W starts at or below, no stage output that depends on parameters
  // alone (its gradient reaches no weight node), and no hooks on the weight nodes' incoming gradients (I ran them
  // already; W would run them again): all known before I runs.
  bool by_weight_nodes = !root_edges.empty() && !input_edges.empty();
  for (const auto& edge : root_edges) {
    if (edge.is_valid() && parameters_only(edge.function.get())) by_weight_nodes = false;
  }
  // I captures below a cheap node only where the edge goes straight to a parameter that nothing else feeds: a capture
  // makes every node above it run in I, and a parameter fed from elsewhere too (a tied weight) would then get that
  // other gradient in I and again in W.
  for (Node* node : post_order) {
    if (parameters_only(node)) continue;
    const auto& edges = node->next_edges();
    auto weight_side = [&](const Edge& child) { return child.is_valid() && parameters_only(child.function.get()); };
    if (std::none_of(edges.begin(), edges.end(), weight_side)) continue;
    if (!facts.at(node).leads_to_input || input_functions.count(node)) by_weight_nodes = false;
    // A hook on a parameter's incoming gradient would run when I captures it and again when W accumulates it.
    const bool capturable = std::all_of(edges.begin(), edges.end(), [&](const Edge& child) {
      if (!weight_side(child)) return true;
      Node* below = child.function.get();
      return is_accumulator(below) && facts.at(below).edges_into == 1 && below->tensor_pre_hooks().empty() &&
             below->retains_grad_hooks().empty();
    });
    if (weight_work_is_cheap(*node) && capturable) {
      std::copy_if(edges.begin(), edges.end(), std::back_inserter(below_cheap_nodes), weight_side);
    } else {
      weight_nodes.push_back(node);
      if (!node->tensor_pre_hooks().empty() || !node->retains_grad_hooks().empty()) by_weight_nodes = false;
    }
  }
  if (weight_nodes.empty() && below_cheap_nodes.empty()) by_weight_nodes = false;
  if (!by_weight_nodes) below_cheap_nodes.clear();  // the fallback's one backward pass computes everything

  // I, recording what reaches each weight node.
  std::vector<variable_list> captured(weight_nodes.size());
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> pre_hooks;
  std::vector<std::pair<Node*, torch::autograd::FunctionPostHook*>> post_hooks;
  if (by_weight_nodes) {
    for (std::size_t i = 0; i < weight_nodes.size(); ++i) {
      auto hook = std::make_unique<CaptureHook>(&captured[i]);
      pre_hooks.emplace_back(weight_nodes[i], hook.get());
      weight_nodes[i]->add_pre_hook(std::move(hook));
    }
    const std::unordered_set<const Node*> rerun(weight_nodes.begin(), weight_nodes.end());
    for (Node* node : post_order) {
      if (parameters_only(node) || rerun.count(node) || !facts.at(node).leads_to_input) continue;
      auto hook = std::make_unique<ReleaseAfterInputPass>(node);
      post_hooks.emplace_back(node, hook.get());
      node->add_post_hook(std::move(hook));
    }
  }
  auto remove_hooks = [&] {
    for (const auto& [node, hook] : pre_hooks) {
      auto& list = node->pre_hooks();
      list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& held) { return held.get() == hook; }),
                 list.end());
    }
    for (const auto& [node, hook] : post_hooks) {
      auto& list = node->post_hooks();
      list.erase(std::remove_if(list.begin(), list.end(), [&](const auto& held) { return held.get() == hook; }),
                 list.end());
    }
  };
  std::vector<Edge> outputs_of_i = input_edges;
  outputs_of_i.insert(outputs_of_i.end(), below_cheap_nodes.begin(), below_cheap_nodes.end());
  variable_list grads_of_i;
  try {
    if (!input_edges.empty() && !root_edges.empty()) {
      grads_of_i = torch::autograd::Engine::get_default_engine().execute(
          root_edges, root_grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, outputs_of_i);
    }
  } catch (...) {
    remove_hooks();
    throw;
  }
  remove_hooks();
  std::vector<at::Tensor> gradients(inputs.size());
  for (std::size_t k = 0; k < differentiable.size() && k < grads_of_i.size(); ++k) {
    gradients[differentiable[k]] = grads_of_i[k];
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!gradients[i].defined()) gradients[i] = at::zeros_like(inputs[i]);
  }
  if (!by_weight_nodes) return {gradients, std::move(pass)};

  // W: every weight node, seeded with what reached it in I, and every edge below a cheap node, seeded with what I
  // captured there, to the parameters below them (one engine call, so that what reaches a parameter from several
  // places, a tied weight's uses, is summed before it accumulates once). A weight node that only undefined
  // gradients reached has nothing to give, as in one backward pass.
  std::set<std::size_t> reached;
  std::unordered_set<const Node*> seen;
  auto reach_parameters_below = [&](const Node* start) {
    std::vector<const Node*> stack{start};
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
  };
  for (std::size_t i = 0; i < weight_nodes.size(); ++i) {
    for (std::size_t slot = 0; slot < captured[i].size(); ++slot) {
      if (!captured[i][slot].defined()) continue;
      state.roots_of_w.emplace_back(weight_nodes[i]->getptr(), static_cast<uint32_t>(slot));
      state.grads_of_w.push_back(captured[i][slot]);
    }
    InputSide side{weight_nodes[i]->getptr(), {}};
    const auto& edges = weight_nodes[i]->next_edges();
    for (uint32_t index = 0; index < edges.size(); ++index) {
      if (!edges[index].is_valid()) continue;
      if (parameters_only(edges[index].function.get())) {
        reach_parameters_below(edges[index].function.get());
      } else {
        side.edges.push_back(index);
      }
    }
    state.input_sides.push_back(std::move(side));
  }
  for (std::size_t k = 0; k < below_cheap_nodes.size(); ++k) {
    const at::Tensor& grad = grads_of_i.at(differentiable.size() + k);
    if (!grad.defined()) continue;
    state.roots_of_w.push_back(below_cheap_nodes[k]);
    state.grads_of_w.push_back(grad);
    reach_parameters_below(below_cheap_nodes[k].function.get());
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
