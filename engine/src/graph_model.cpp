#include "smp/graph_model.h"

#include <algorithm>
#include <cstdint>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include "smp/config.h"

namespace smp {

GraphModel::GraphModel(std::string input_name) : GraphModel(std::vector<std::string>{std::move(input_name)}) {}

GraphModel::GraphModel(std::vector<std::string> input_names) : input_names_(std::move(input_names)) {
  if (input_names_.empty()) throw ConfigError("GraphModel: the model needs at least one input");
  std::set<std::string> seen;
  for (const auto& name : input_names_) {
    if (name.empty() || !seen.insert(name).second) {
      throw ConfigError("GraphModel: model input name \"" + name + "\" is empty or given twice");
    }
  }
}

int GraphModel::input_index(const std::string& name) const {
  const auto found = std::find(input_names_.begin(), input_names_.end(), name);
  return found == input_names_.end() ? -1 : static_cast<int>(found - input_names_.begin());
}

void GraphModel::replace_module(int node, std::shared_ptr<torch::nn::Module> module, Forward forward) {
  nodes_.at(static_cast<std::size_t>(node)).module = std::move(module);
  nodes_.at(static_cast<std::size_t>(node)).forward = std::move(forward);
}

void GraphModel::set_outputs(std::vector<std::string> outputs) {
  if (outputs.empty()) throw ConfigError("GraphModel: set_outputs needs at least one node");
  for (const auto& output : outputs) {
    if (!index_.count(output)) {
      throw ConfigError("GraphModel: output \"" + output + "\" is not a node of the model");
    }
  }
  output_names_ = std::move(outputs);
}

std::vector<std::string> GraphModel::output_names() const {
  if (!output_names_.empty()) return output_names_;
  if (nodes_.empty()) return {};
  return {nodes_.back().name};
}

GraphModel::Forward GraphModel::any_forward(torch::nn::AnyModule module, const std::string& name, std::size_t arity) {
  if (arity < 1 || arity > 3) {
    throw ConfigError("GraphModel node \"" + name + "\": " + std::to_string(arity) +
                      " inputs; add() with a module takes 1 to 3 (pass a forward function for more)");
  }
  auto shared = std::make_shared<torch::nn::AnyModule>(std::move(module));
  return [shared, arity](const std::vector<at::Tensor>& in) -> at::Tensor {
    switch (arity) {
      case 1: return shared->forward<at::Tensor>(in[0]);
      case 2: return shared->forward<at::Tensor>(in[0], in[1]);
      default: return shared->forward<at::Tensor>(in[0], in[1], in[2]);
    }
  };
}

at::Tensor GraphModel::writable_input(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.is_leaf() || !tensor.requires_grad() || !c10::GradMode::is_enabled()) return tensor;
  // Autograd does not count _unsafe_view as a view: in-place writes to it are fine, and its gradient (reshaped to
  // the same shape) goes to the leaf. It shares the leaf's version counter, which a stage on the same rank shares
  // with the producer's output: a write the producer's backward would read back is then refused by autograd, as
  // in plain PyTorch, instead of passing unnoticed.
  at::Tensor alias = at::_unsafe_view(tensor, tensor.sizes());
  torch::autograd::impl::set_version_counter(alias, torch::autograd::impl::version_counter(tensor));
  return alias;
}

GraphModel& GraphModel::add(const std::string& name, std::shared_ptr<torch::nn::Module> module, Forward forward,
                            std::vector<std::string> inputs, std::string parameter_prefix, bool names_from_root) {
  // Parameter names are "<node>.<parameter>": a dotted name (a module's path, "blocks.0") is fine unless one node's
  // name is a path prefix of another's, where "a" + "b.w" and "a.b" + "w" would both be "a.b.w".
  for (std::size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
    if (index_.count(name.substr(0, dot))) {
      throw ConfigError("GraphModel: node name \"" + name + "\" extends node \"" + name.substr(0, dot) +
                        "\"; their parameter names could collide");
    }
  }
  const auto after = index_.lower_bound(name + ".");
  if (after != index_.end() && after->first.rfind(name + ".", 0) == 0) {
    throw ConfigError("GraphModel: node name \"" + name + "\" is a prefix of node \"" + after->first +
                      "\"; their parameter names could collide");
  }
  return add_node({name, std::move(module), std::move(forward), std::move(inputs), std::move(parameter_prefix),
                   names_from_root});
}

GraphModel& GraphModel::add_node(Node node) {
  if (node.name.empty() || input_index(node.name) >= 0 || index_.count(node.name)) {
    throw ConfigError("GraphModel: node name \"" + node.name + "\" is empty, taken, or a model input's name");
  }
  for (const auto& input : node.inputs) {
    if (input_index(input) < 0 && !index_.count(input)) {
      throw ConfigError("GraphModel node \"" + node.name + "\" reads \"" + input +
                        "\", which is neither a model input nor an earlier node");
    }
  }
  index_[node.name] = static_cast<int>(nodes_.size());
  nodes_.push_back(std::move(node));
  return *this;
}

bool GraphModel::expandable(int node) const {
  const auto* sequential = dynamic_cast<const torch::nn::SequentialImpl*>(nodes_.at(node).module.get());
  return sequential && sequential->size() >= 2 && nodes_[node].inputs.size() == 1;
}

GraphModel GraphModel::expanded(const std::string& node) const {
  const int target = index_of(node);
  if (target < 0 || !expandable(target)) {
    throw ConfigError("GraphModel: node \"" + node + "\" is not a Sequential of two or more modules with one input");
  }
  auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(nodes_[target].module.get());
  GraphModel result(input_names_);
  std::string last_child;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    Node copy = nodes_[i];
    // Whoever read the expanded node now reads its last child, which produces the same tensor.
    for (auto& input : copy.inputs) {
      if (input == node) input = last_child;
    }
    if (static_cast<int>(i) != target) {
      result.add_node(std::move(copy));
      continue;
    }
    const auto children = sequential->named_children();
    std::string previous = copy.inputs.front();
    std::size_t index = 0;
    for (const auto& child : *sequential) {
      const std::string& key = children[index++].key();
      const std::string name = node + "." + key;
      // A child's parameters keep the names they had under the Sequential's node.
      result.add_node({name, child.ptr(), any_forward(child, name, 1), {previous},
                       copy.parameter_prefix.empty() ? std::string() : copy.parameter_prefix + "." + key,
                       copy.names_from_root});
      previous = name;
    }
    last_child = previous;
  }
  for (const auto& output : output_names_) result.output_names_.push_back(output == node ? last_child : output);
  return result;
}

GraphModel GraphModel::expanded_to(std::size_t nodes) const {
  GraphModel result = *this;
  while (result.nodes_.size() < nodes) {
    int largest = -1;
    std::int64_t largest_parameters = -1;
    for (int i = 0; i < static_cast<int>(result.nodes_.size()); ++i) {
      if (!result.expandable(i)) continue;
      std::int64_t parameters = 0;
      for (const auto& parameter : result.nodes_[i].module->parameters()) parameters += parameter.numel();
      if (parameters > largest_parameters) largest = i, largest_parameters = parameters;
    }
    if (largest < 0) break;
    result = result.expanded(result.nodes_[largest].name);
  }
  return result;
}

GraphModel GraphModel::from_sequential(const torch::nn::Sequential& model, std::string input_name) {
  GraphModel graph(std::move(input_name));
  const auto children = model->named_children();
  std::string previous = graph.input_name();
  std::size_t index = 0;
  for (const auto& module : *model) {
    const std::string& name = children[index++].key();
    torch::nn::AnyModule any = module;
    graph.add(name, module.ptr(), any_forward(any, name, 1), {previous});
    previous = name;
  }
  return graph;
}

int GraphModel::index_of(const std::string& node) const {
  const auto found = index_.find(node);
  return found == index_.end() ? -1 : found->second;
}

at::Tensor GraphModel::forward(const at::Tensor& input) const {
  if (input_names_.size() != 1) {
    throw ConfigError("GraphModel::forward: the model takes " + std::to_string(input_names_.size()) + " inputs");
  }
  return forward(std::vector<at::Tensor>{input}).front();
}

std::vector<at::Tensor> GraphModel::forward(const std::vector<at::Tensor>& inputs) const {
  if (nodes_.empty()) throw ConfigError("GraphModel: no nodes");
  if (inputs.size() != input_names_.size()) {
    throw ConfigError("GraphModel::forward: " + std::to_string(inputs.size()) + " inputs for a model of " +
                      std::to_string(input_names_.size()));
  }
  std::map<std::string, at::Tensor> values;
  for (std::size_t i = 0; i < inputs.size(); ++i) values[input_names_[i]] = inputs[i];
  for (const auto& node : nodes_) {
    std::vector<at::Tensor> arguments;
    for (const auto& name : node.inputs) arguments.push_back(values.at(name));
    values[node.name] = node.forward(arguments);
  }
  std::vector<at::Tensor> outputs;
  for (const auto& name : output_names()) outputs.push_back(values.at(name));
  return outputs;
}

std::vector<std::pair<std::string, at::Tensor>> GraphModel::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::set<const void*> seen;
  for (const auto& node : nodes_) {
    for (const auto& parameter : node.module->named_parameters()) {
      if (seen.insert(parameter.value().unsafeGetTensorImpl()).second) {
        named.emplace_back(node.parameter_name(parameter.key()), parameter.value());
      }
    }
  }
  return named;
}

std::vector<GraphModel::Tie> GraphModel::ties() const {
  std::map<const void*, Tie> by_tensor;
  std::vector<const void*> order;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    for (const auto& parameter : nodes_[i].module->named_parameters()) {
      const void* key = parameter.value().unsafeGetTensorImpl();
      auto [entry, created] = by_tensor.try_emplace(key);
      if (created) {
        entry->second.parameter = nodes_[i].parameter_name(parameter.key());
        entry->second.tensor = parameter.value();
        order.push_back(key);
      }
      if (entry->second.nodes.empty() || entry->second.nodes.back() != static_cast<int>(i)) {
        entry->second.nodes.push_back(static_cast<int>(i));
      }
    }
  }
  std::vector<Tie> ties;
  for (const void* key : order) {
    if (by_tensor[key].nodes.size() > 1) ties.push_back(by_tensor[key]);
  }
  return ties;
}

}  // namespace smp
