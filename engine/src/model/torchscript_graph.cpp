#include "smp/torchscript_graph.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/nn/module.h>

#include "smp/errors.h"

namespace smp {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// The module a value holds as a path from the forward's self ("" for self), when it is one.
std::optional<std::string> module_path(const Value* value, const Value* self) {
  if (value == self) return std::string();
  const Node* node = value->node();
  const auto type = value->type()->cast<c10::ClassType>();
  if (node->kind() != c10::prim::GetAttr || !type || !type->is_module()) return std::nullopt;
  const auto parent = module_path(node->input(0), self);
  if (!parent) return std::nullopt;
  const std::string& name = node->s(c10::attr::name);
  return parent->empty() ? name : *parent + "." + name;
}

torch::jit::Module submodule(const torch::jit::Module& root, const std::string& path) {
  torch::jit::Module module = root;
  std::size_t start = 0;
  while (start < path.size()) {
    const std::size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    module = module.attr(part).toModule();
    start = dot == std::string::npos ? path.size() : dot + 1;
  }
  return module;
}

std::string join(const std::string& prefix, const std::string& name) { return prefix.empty() ? name : prefix + "." + name; }

// The values a node reads: its inputs, and those its nested blocks (an if, a loop) read from outside it.
std::vector<Value*> reads(Node* node) {
  std::vector<Value*> found(node->inputs().begin(), node->inputs().end());
  std::function<void(torch::jit::Block*)> visit = [&](torch::jit::Block* block) {
    for (Node* inner : block->nodes()) {
      for (Value* input : inner->inputs()) {
        if (input->node()->owningBlock() == node->owningBlock() && std::find(found.begin(), found.end(), input) == found.end()) {
          found.push_back(input);
        }
      }
      for (auto* nested : inner->blocks()) visit(nested);
    }
    for (Value* output : block->outputs()) {
      if (output->node()->owningBlock() == node->owningBlock() && std::find(found.begin(), found.end(), output) == found.end()) {
        found.push_back(output);
      }
    }
  };
  for (auto* block : node->blocks()) visit(block);
  return found;
}

// The top-level node whose nested block holds `node` (or `node` itself).
Node* top_level(Node* node, const torch::jit::Block* top) {
  while (node->owningBlock() != top) node = node->owningBlock()->owningNode();
  return node;
}

bool is_call(const Node* node) { return node->kind() == c10::prim::CallMethod; }

// Whether running `node` draws random numbers: a random operation, or a call whose method (or what it calls) has one.
bool draws_random_numbers(const Node* node) {
  const std::string kind = node->kind().toQualString();
  if (kind.find("dropout") != std::string::npos || kind.rfind("aten::rand", 0) == 0 ||
      kind.rfind("aten::bernoulli", 0) == 0 || kind == "aten::normal" || kind == "aten::multinomial") {
    return true;
  }
  std::function<bool(const torch::jit::Block*)> any_in = [&](const torch::jit::Block* block) {
    for (const Node* inner : block->nodes()) {
      if (draws_random_numbers(inner)) return true;
      for (const auto* nested : inner->blocks()) {
        if (any_in(nested)) return true;
      }
    }
    return false;
  };
  if (node->kind() == c10::prim::CallMethod) {
    const auto type = node->input(0)->type()->cast<c10::ClassType>();
    torch::jit::Function* method = type ? type->findMethod(node->s(c10::attr::name)) : nullptr;
    torch::jit::GraphFunction* function = method ? torch::jit::tryToGraphFunction(*method) : nullptr;
    if (function && any_in(function->graph()->block())) return true;
  }
  for (const auto* nested : node->blocks()) {
    if (any_in(nested)) return true;
  }
  return false;
}

// An operation that writes into its first input (relu_, add_): across stages the write would not be seen.
bool writes_in_place(const Node* node) {
  const auto* schema = node->maybeSchema();
  if (!schema || schema->arguments().empty()) return false;
  const auto* alias = schema->arguments()[0].alias_info();
  return alias && alias->isWrite();
}

// The parameters and buffers of a node, under their paths in the whole module, and a train() that reaches the
// TorchScript module (dropout and batch norm read its training flag).
class ScriptedNodeModule : public torch::nn::Module {
 public:
  explicit ScriptedNodeModule(torch::jit::Module root) : root_(std::move(root)) {}

  void hold(const std::string& path, const at::Tensor& tensor, bool parameter) {
    torch::nn::Module* module = this;
    std::size_t start = 0;
    for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
      const std::string part = path.substr(start, dot - start);
      auto children = module->named_children();
      auto found = children.find(part);
      module = found ? found->get() : module->register_module(part, std::make_shared<torch::nn::Module>()).get();
      start = dot + 1;
    }
    const std::string name = path.substr(start);
    if (module->named_parameters(false).contains(name) || module->named_buffers(false).contains(name)) return;
    if (parameter) {
      module->register_parameter(name, tensor, tensor.requires_grad());
    } else {
      module->register_buffer(name, tensor);
    }
  }

  void train(bool on = true) override {
    root_.train(on);
    torch::nn::Module::train(on);
  }

 private:
  torch::jit::Module root_;
};

class Capture {
 public:
  Capture(const torch::jit::Module& module, int stages) : module_(module), stages_(std::max(stages, 1)) {
    graph_ = module.get_method("forward").graph()->copy();
    self_ = graph_->inputs()[0];
    for (const auto& parameter : module.named_parameters(/*recurse=*/true)) {
      const std::string& path = parameter.name;
      for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
        parameters_under_[path.substr(0, dot)] += parameter.value.numel();
      }
      parameters_under_[""] += parameter.value.numel();
    }
  }

  GraphModel build() {
    refine();
    classify();
    return assemble();
  }

 private:
  std::int64_t weight(Node* call) const {
    const auto path = module_path(call->input(0), self_);
    const auto found = path ? parameters_under_.find(*path) : parameters_under_.end();
    return found == parameters_under_.end() ? 0 : found->second;
  }

  torch::jit::GraphFunction* callee(Node* call) const {
    const auto type = call->input(0)->type()->expect<c10::ClassType>();
    torch::jit::Function* method = type->findMethod(call->s(c10::attr::name));
    return method ? torch::jit::tryToGraphFunction(*method) : nullptr;
  }

  bool expandable(Node* call) const {
    torch::jit::GraphFunction* function = callee(call);
    if (!function) return false;
    const auto graph = function->graph();
    return std::any_of(graph->nodes().begin(), graph->nodes().end(), [](Node* node) { return is_call(node); });
  }

  // Inlines the heaviest call while it holds more than a quarter of a stage's share of the parameters.
  void refine() {
    const double limit = static_cast<double>(parameters_under_[""]) / (4.0 * stages_);
    for (int round = 0; round < 100000; ++round) {
      Node* heaviest = nullptr;
      for (Node* node : graph_->nodes()) {
        if (is_call(node) && expandable(node) && (!heaviest || weight(node) > weight(heaviest))) heaviest = node;
      }
      if (!heaviest || static_cast<double>(weight(heaviest)) <= limit) return;
      torch::jit::inlineCallTo(heaviest, callee(heaviest), /*inline_optimized_graph=*/false);
    }
  }

  // Which values depend on parameters (dynamic), which node each belongs to, and which values cross nodes.
  void classify() {
    const auto* top = graph_->block();
    for (Node* node : graph_->nodes()) {
      bool dynamic = draws_random_numbers(node) || (is_call(node) && weight(node) > 0);
      if (node->kind() == c10::prim::GetAttr && node->output()->type()->isSubtypeOf(*c10::TensorType::get())) {
        const auto owner = module_path(node->input(0), self_);
        const auto type = node->input(0)->type()->expect<c10::ClassType>();
        const auto slot = type->findAttributeSlot(node->s(c10::attr::name));
        dynamic = dynamic || (owner && slot && type->is_parameter(*slot));
      }
      std::function<void(torch::jit::Block*)> nested = [&](torch::jit::Block* block) {
        for (Node* inner : block->nodes()) {
          dynamic = dynamic || draws_random_numbers(inner) || (is_call(inner) && weight(inner) > 0);
          if (inner->kind() == c10::prim::GetAttr && inner->output()->type()->isSubtypeOf(*c10::TensorType::get())) {
            dynamic = true;  // a parameter read inside an if or a loop
          }
          for (auto* b : inner->blocks()) nested(b);
        }
      };
      for (auto* block : node->blocks()) nested(block);
      for (Value* input : reads(node)) dynamic = dynamic || dynamic_.count(input);
      if (dynamic && writes_in_place(node)) {
        throw ModelError("the TorchScript module's forward writes in place into a value computed from parameters (" +
                         std::string(node->kind().toQualString()) + " on " + node->input(0)->debugName() +
                         "); write it out of place (or keep it inside a submodule's forward) so that it can be cut "
                         "into stages");
      }
      if (!dynamic) continue;
      for (Value* output : node->outputs()) dynamic_.insert(output);
      dynamic_nodes_.push_back(node);
    }
    // The model's outputs: the returned value, or the elements of a returned tuple.
    Value* returned = graph_->outputs()[0];
    if (returned->node()->kind() == c10::prim::TupleConstruct) {
      for (Value* element : returned->node()->inputs()) outputs_.push_back(element);
    } else {
      outputs_.push_back(returned);
    }
    for (Value* output : outputs_) {
      if (!output->type()->isSubtypeOf(*c10::TensorType::get())) {
        throw ModelError("the TorchScript module's forward returns " + output->type()->str() +
                         "; smp needs a tensor or a tuple of tensors");
      }
    }
    // Homes, users first: a call is its own; another node read by one node only joins that node's home.
    std::set<Value*> returned_values(outputs_.begin(), outputs_.end());
    for (auto it = dynamic_nodes_.rbegin(); it != dynamic_nodes_.rend(); ++it) {
      Node* node = *it;
      std::set<Node*> readers;
      bool is_output = false;
      for (Value* output : node->outputs()) {
        is_output = is_output || returned_values.count(output);
        for (const auto& use : output->uses()) {
          Node* reader = top_level(use.user, top);
          if (reader->kind() != c10::prim::Return && !(reader == returned->node() && returned_values.count(output))) {
            readers.insert(reader);
          }
        }
      }
      const bool tensor_valued = std::all_of(node->outputs().begin(), node->outputs().end(), [](Value* v) {
        return v->type()->isSubtypeOf(*c10::TensorType::get());
      });
      Node* joined = nullptr;
      if (!is_call(node) && readers.size() == 1 && !is_output && home_.count(*readers.begin())) {
        joined = home_.at(*readers.begin());
      } else if (!is_call(node) && !tensor_valued && !is_output) {
        // A tuple or list (a call's output unpacked): with its readers, or computed again in each of them.
        std::set<Node*> homes;
        for (Node* reader : readers) homes.insert(home_.count(reader) ? home_.at(reader) : nullptr);
        if (homes.size() == 1 && *homes.begin()) joined = *homes.begin();
        if (!joined) continue;  // recomputed
      }
      home_[node] = joined ? joined : node;
    }
    for (Node* node : graph_->nodes()) {
      if (!home_.count(node)) continue;
      for (Value* output : node->outputs()) {
        if (!output->type()->isSubtypeOf(*c10::TensorType::get())) continue;
        bool crosses = returned_values.count(output) > 0;
        for (const auto& use : output->uses()) {
          Node* reader = top_level(use.user, top);
          if (reader->kind() == c10::prim::Return || reader == returned->node()) continue;
          crosses = crosses || !home_.count(reader) || home_.at(reader) != home_.at(node);
        }
        if (crosses) materialized_.push_back(output);
      }
    }
  }

  std::string name_of(Value* value, std::set<std::string>& taken) const {
    Node* home = home_.at(value->node());
    std::string base;
    if (is_call(home)) {
      base = module_path(home->input(0), self_).value_or("call");
      if (base.empty()) base = "forward";
    } else {
      base = std::string(value->node()->kind().toUnqualString()) + "_" + value->debugName();
    }
    for (char& c : base) {
      if (c == '#') c = '_';
    }
    std::string candidate = base;
    for (int index = 1;; ++index) {
      const bool clash = taken.count(candidate) ||
                         std::any_of(taken.begin(), taken.end(), [&](const std::string& other) {
                           return other.rfind(candidate + ".", 0) == 0 || candidate.rfind(other + ".", 0) == 0;
                         });
      if (!clash) break;
      candidate = base + "#" + std::to_string(index);
    }
    taken.insert(candidate);
    return candidate;
  }

  GraphModel assemble() {
    std::vector<std::string> input_names;
    std::set<std::string> taken;
    std::map<Value*, std::string> value_name;
    for (std::size_t i = 1; i < graph_->inputs().size(); ++i) {
      Value* input = graph_->inputs()[i];
      std::string name = input->debugNameBase().empty() ? "input" + std::to_string(i) : input->debugNameBase();
      while (taken.count(name)) name += "_";
      taken.insert(name);
      input_names.push_back(name);
      value_name[input] = name;
    }
    GraphModel model(input_names);
    std::map<Value*, std::string> node_name;
    for (Value* value : materialized_) node_name[value] = value_name[value] = name_of(value, taken);
    const auto* top = graph_->block();
    for (Value* value : materialized_) {
      // What the node computes: everything `value` depends on back to other nodes' values and the model's inputs.
      std::set<Node*> needed;
      std::vector<Value*> sources;
      std::vector<Value*> stack{value};
      bool first = true;
      while (!stack.empty()) {
        Value* current = stack.back();
        stack.pop_back();
        if (!first && value_name.count(current)) {
          if (std::find(sources.begin(), sources.end(), current) == sources.end()) sources.push_back(current);
          continue;
        }
        first = false;
        if (current == self_) continue;
        Node* producer = top_level(current->node(), top);
        if (!needed.insert(producer).second) continue;
        for (Value* input : reads(producer)) stack.push_back(input);
      }
      std::sort(sources.begin(), sources.end(), [&](Value* a, Value* b) {
        const bool a_input = a->node()->kind() == c10::prim::Param, b_input = b->node()->kind() == c10::prim::Param;
        if (a_input != b_input) return a_input;
        if (a_input) return a->offset() < b->offset();
        return a->node()->isBefore(b->node());
      });
      auto graph = std::make_shared<Graph>();
      std::unordered_map<Value*, Value*> copies;
      Value* self = graph->addInput("self");
      self->setType(self_->type());
      copies[self_] = self;
      for (Value* source : sources) {
        Value* input = graph->addInput();
        input->setType(source->type());
        copies[source] = input;
      }
      auto module = std::make_shared<ScriptedNodeModule>(module_);
      for (Node* node : graph_->nodes()) {
        if (!needed.count(node)) continue;
        Node* copy = graph->createClone(node, [&](Value* v) { return copies.at(v); });
        graph->appendNode(copy);
        for (std::size_t i = 0; i < node->outputs().size(); ++i) copies[node->outputs()[i]] = copy->outputs()[i];
        hold_tensors_of(node, *module);
      }
      graph->registerOutput(copies.at(value));
      auto function = std::make_shared<torch::jit::GraphFunction>(node_name[value], graph, nullptr);
      const c10::IValue root = module_._ivalue();
      GraphModel::Forward forward = [function, root](const std::vector<at::Tensor>& inputs) {
        torch::jit::Stack stack{root};
        for (const auto& input : inputs) stack.emplace_back(input);
        function->run(stack);
        return stack.back().toTensor();
      };
      std::vector<std::string> inputs;
      for (Value* source : sources) inputs.push_back(value_name.at(source));
      model.add(node_name[value], module, std::move(forward), std::move(inputs), {}, /*names_from_root=*/true);
    }
    std::vector<std::string> outputs;
    for (Value* output : outputs_) {
      if (!node_name.count(output)) {
        throw ModelError("the TorchScript module returns " + output->debugName() +
                         ", which no parameter computes (an input or a constant); return what its modules compute");
      }
      outputs.push_back(node_name.at(output));
    }
    model.set_outputs(outputs);
    return model;
  }

  // The parameters and buffers a node's operations read: tensor attributes it reads, and everything a call holds.
  void hold_tensors_of(Node* node, ScriptedNodeModule& holder) const {
    std::function<void(Node*)> visit = [&](Node* inner) {
      if (inner->kind() == c10::prim::GetAttr && inner->output()->type()->isSubtypeOf(*c10::TensorType::get())) {
        if (const auto owner = module_path(inner->input(0), self_)) {
          const auto type = inner->input(0)->type()->expect<c10::ClassType>();
          const std::string& name = inner->s(c10::attr::name);
          const auto slot = type->findAttributeSlot(name);
          const at::Tensor tensor = submodule(module_, *owner).attr(name).toTensor();
          holder.hold(join(*owner, name), tensor, slot && type->is_parameter(*slot));
        }
      }
      if (is_call(inner)) {
        if (const auto owner = module_path(inner->input(0), self_)) {
          const torch::jit::Module called = submodule(module_, *owner);
          for (const auto& parameter : called.named_parameters(true)) {
            holder.hold(join(*owner, parameter.name), parameter.value, true);
          }
          for (const auto& buffer : called.named_buffers(true)) holder.hold(join(*owner, buffer.name), buffer.value, false);
        }
      }
      for (auto* block : inner->blocks()) {
        for (Node* nested : block->nodes()) visit(nested);
      }
    };
    visit(node);
  }

  torch::jit::Module module_;
  int stages_;
  std::shared_ptr<Graph> graph_;
  Value* self_ = nullptr;
  std::map<std::string, std::int64_t> parameters_under_;
  std::set<Value*> dynamic_;
  std::vector<Node*> dynamic_nodes_;
  std::map<Node*, Node*> home_;
  std::vector<Value*> materialized_;
  std::vector<Value*> outputs_;
};

}  // namespace

GraphModel graph_from_torchscript(const torch::jit::Module& module, int stages) {
  return Capture(module, stages).build();
}

}  // namespace smp
