#include "smp/graph_model.h"

#include <algorithm>
#include <cstdint>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/functional.h>

#include "smp/config.h"
#include "smp/errors.h"
#include "model/random_state.h"

namespace smp {

std::uint64_t module_seed(std::uint64_t seed, const std::string& path) {
  // FNV-1a over "<seed>/<path>", then splitmix64's finalizer to spread the bits; 63 bits, as torch's manual_seed
  // takes any of them and Python's int does not wrap.
  const std::string text = std::to_string(seed) + "/" + path;
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  for (const unsigned char c : text) hash = (hash ^ c) * 0x100000001b3ULL;
  hash = (hash ^ (hash >> 30)) * 0xbf58476d1ce4e5b9ULL;
  hash = (hash ^ (hash >> 27)) * 0x94d049bb133111ebULL;
  hash ^= hash >> 31;
  return hash & ((1ULL << 63) - 1);
}

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

void GraphModel::throw_sequential_arity(const std::string& name, std::size_t arity) {
  throw ConfigError("GraphModel node \"" + name + "\": a Sequential takes one input, given " + std::to_string(arity));
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

GraphModel& GraphModel::add_on_demand(const std::string& name, Factory factory, std::vector<std::string> inputs,
                                      std::vector<std::string> shared) {
  for (const auto& parameter : shared) {
    if (owner_of(parameter).first < 0) {
      throw ConfigError("GraphModel node \"" + name + "\" shares \"" + parameter +
                        "\", which names no earlier node's parameter (\"<node>.<parameter>\")");
    }
  }
  add(name, nullptr, Forward(), std::move(inputs));
  nodes_.back().factory = std::move(factory);
  nodes_.back().shared = std::move(shared);
  return *this;
}

std::pair<int, std::string> GraphModel::owner_of(const std::string& parameter) const {
  // The node whose prefix is the longest that the name extends (node names may hold dots: "blocks.0").
  int owner = -1;
  std::size_t longest = 0;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const std::string& prefix = nodes_[i].prefix();
    if (nodes_[i].names_from_root || prefix.size() <= longest || parameter.size() <= prefix.size() + 1) continue;
    if (parameter.compare(0, prefix.size(), prefix) == 0 && parameter[prefix.size()] == '.') {
      owner = static_cast<int>(i);
      longest = prefix.size();
    }
  }
  if (owner < 0) return {-1, {}};
  return {owner, parameter.substr(longest + 1)};
}

GraphModel::Built GraphModel::run_factory(int index, std::vector<at::Tensor>* shared_tensors) const {
  const Node& node = nodes_.at(static_cast<std::size_t>(index));
  // The tensors it shares come from their owners: built here, or built apart for the moment (their other tensors
  // go when this returns).
  for (const auto& parameter : node.shared) {
    const auto [owner, key] = owner_of(parameter);
    const Node source = built_apart(owner);
    at::Tensor tensor;
    for (const auto& [name, value] : node_parameters(source)) {
      if (name == parameter) tensor = value;
    }
    if (!tensor.defined()) {
      throw ModelError("GraphModel node \"" + node.name + "\" shares \"" + parameter + "\", but node \"" +
                       nodes_[owner].name + "\" has no such parameter");
    }
    shared_tensors->push_back(tensor);
  }
  // Its own generator state, whatever ran before: the weights depend on the seed and the node's name alone. The
  // default generators go back as they were, so building changes nothing else's random numbers.
  const RandomState kept = RandomState::capture(c10::Device(c10::kCPU));
  Built built;
  try {
    {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_current_seed(module_seed(build_seed_, node.name));
    }
    built = node.factory(*shared_tensors);
  } catch (...) {
    kept.restore();
    throw;
  }
  kept.restore();
  if (!built.module) throw ModelError("GraphModel node \"" + node.name + "\": its factory returned no module");
  return built;
}

void GraphModel::build(int index) {
  Node& node = nodes_.at(static_cast<std::size_t>(index));
  if (node.built()) return;
  std::vector<at::Tensor> shared;
  Built built = run_factory(index, &shared);
  node.module = std::move(built.module);
  node.forward = std::move(built.forward);
  node.shared_tensors = std::move(shared);
  if (node.profile_key.empty()) node.profile_key = profile_key_of(*node.module);
}

GraphModel& GraphModel::materialize(std::uint64_t seed) {
  build_seed_ = seed;
  for (std::size_t i = 0; i < nodes_.size(); ++i) build(static_cast<int>(i));
  return *this;
}

GraphModel::Node GraphModel::built_apart(int index) const {
  Node node = nodes_.at(static_cast<std::size_t>(index));
  if (node.built()) return node;
  Built built = run_factory(index, &node.shared_tensors);
  node.module = std::move(built.module);
  node.forward = std::move(built.forward);
  if (node.profile_key.empty()) node.profile_key = profile_key_of(*node.module);
  return node;
}

std::string GraphModel::profile_key_of(torch::nn::Module& module) {
  // A Functional's type says nothing of the function it wraps.
  if (dynamic_cast<torch::nn::FunctionalImpl*>(&module)) return {};
  std::string key = module.name();
  for (const auto& parameter : module.named_parameters()) {
    key += ";" + parameter.key() + ":" + c10::str(parameter.value().sizes(), parameter.value().scalar_type(),
                                                  parameter.value().requires_grad());
  }
  for (const auto& buffer : module.named_buffers()) {
    key += ";" + buffer.key() + ":" + c10::str(buffer.value().sizes(), buffer.value().scalar_type());
  }
  return key;
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
      result.nodes_.back().profile_key = profile_key_of(*child.ptr());
      previous = name;
    }
    last_child = previous;
  }
  for (const auto& output : output_names_) result.output_names_.push_back(output == node ? last_child : output);
  return result;
}

GraphModel GraphModel::expanded_to(std::size_t nodes) const {
  // Counted by the nodes holding parameters (one not built here may): a residual Add beside a Sequential body made
  // four nodes of four stages, the body left whole and a stage given the Add alone, nothing to train.
  const auto holding = [](const GraphModel& model) {
    std::size_t count = 0;
    for (const auto& node : model.nodes_) count += !node.built() || !node.module->parameters().empty();
    return count;
  };
  GraphModel result = *this;
  while (holding(result) < nodes) {
    int largest = -1;
    std::int64_t largest_parameters = -1;
    for (int i = 0; i < static_cast<int>(result.nodes_.size()); ++i) {
      if (!result.expandable(i)) continue;  // a node not built here: unknown, so not expanded on any rank
      std::int64_t parameters = 0;
      for (const auto& parameter : result.nodes_[i].module->parameters()) parameters += parameter.numel();
      if (parameters > largest_parameters) largest = i, largest_parameters = parameters;
    }
    if (largest < 0) break;
    result = result.expanded(result.nodes_[largest].name);
  }
  return result;
}

bool cut_from(const std::string& name, const std::string& path) {
  return name == path || (name.size() > path.size() && name.compare(0, path.size(), path) == 0 &&
                          (name[path.size()] == '.' || name[path.size()] == '#'));
}

GraphModel GraphModel::expanded_to_paths(const std::vector<std::string>& paths) const {
  GraphModel result = *this;
  for (const auto& path : paths) {
    for (;;) {
      int holder = -1;
      bool reached = false;
      for (int i = 0; i < static_cast<int>(result.nodes_.size()) && !reached; ++i) {
        const std::string& name = result.nodes_[i].name;
        reached = cut_from(name, path);
        if (cut_from(path, name) && result.expandable(i)) holder = i;
      }
      if (reached || holder < 0) break;
      result = result.expanded(result.nodes_[holder].name);
    }
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
    graph.nodes_.back().profile_key = profile_key_of(*module.ptr());
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
    if (!node.built()) {
      throw ModelError("GraphModel::forward: node \"" + node.name + "\" is built on demand and not built in this "
                       "process (GraphModel::materialize builds the whole model)");
    }
    std::vector<at::Tensor> arguments;
    for (const auto& name : node.inputs) arguments.push_back(values.at(name));
    values[node.name] = node.forward(arguments);
  }
  std::vector<at::Tensor> outputs;
  for (const auto& name : output_names()) outputs.push_back(values.at(name));
  return outputs;
}

std::vector<std::pair<std::string, at::Tensor>> GraphModel::node_parameters(const Node& node) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  if (!node.built()) return named;
  for (const auto& parameter : node.module->named_parameters()) {
    std::string name = node.parameter_name(parameter.key());
    for (std::size_t i = 0; i < node.shared_tensors.size(); ++i) {
      if (node.shared_tensors[i].is_same(parameter.value())) name = node.shared[i];
    }
    named.emplace_back(std::move(name), parameter.value());
  }
  return named;
}

std::vector<std::pair<std::string, at::Tensor>> GraphModel::own_parameters(const Node& node) {
  auto named = node_parameters(node);
  named.erase(std::remove_if(named.begin(), named.end(),
                             [&](const auto& entry) {
                               return std::any_of(node.shared_tensors.begin(), node.shared_tensors.end(),
                                                  [&](const at::Tensor& t) { return t.is_same(entry.second); });
                             }),
              named.end());
  return named;
}

std::vector<std::pair<std::string, at::Tensor>> GraphModel::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::set<const void*> seen;
  for (const auto& node : nodes_) {
    for (auto& [name, parameter] : node_parameters(node)) {
      if (seen.insert(parameter.unsafeGetTensorImpl()).second) named.emplace_back(std::move(name), parameter);
    }
  }
  return named;
}

void GraphModel::set_transient_buffers(std::vector<std::string> names) { transient_buffers_ = std::move(names); }

std::vector<std::pair<std::string, at::Tensor>> GraphModel::named_buffers() const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::set<const void*> seen;
  for (const auto& node : nodes_) {
    if (!node.built()) continue;
    for (const auto& buffer : node.module->named_buffers()) {
      std::string name = node.parameter_name(buffer.key());
      if (std::find(transient_buffers_.begin(), transient_buffers_.end(), name) != transient_buffers_.end()) continue;
      if (seen.insert(buffer.value().unsafeGetTensorImpl()).second) named.emplace_back(std::move(name), buffer.value());
    }
  }
  return named;
}

std::vector<GraphModel::Tie> GraphModel::ties() const {
  std::vector<Tie> ties;
  // Declared by nodes built on demand: known on every rank, whichever nodes are built here.
  std::map<std::string, std::size_t> declared;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    for (std::size_t k = 0; k < nodes_[i].shared.size(); ++k) {
      const std::string& parameter = nodes_[i].shared[k];
      auto [entry, created] = declared.try_emplace(parameter, ties.size());
      if (created) {
        Tie tie;
        tie.parameter = parameter;
        tie.nodes.push_back(owner_of(parameter).first);
        ties.push_back(std::move(tie));
      }
      Tie& tie = ties[entry->second];
      if (std::find(tie.nodes.begin(), tie.nodes.end(), static_cast<int>(i)) == tie.nodes.end()) {
        tie.nodes.push_back(static_cast<int>(i));
      }
      if (!tie.tensor.defined() && nodes_[i].built()) tie.tensor = nodes_[i].shared_tensors[k];
    }
  }
  for (auto& tie : ties) {
    std::sort(tie.nodes.begin(), tie.nodes.end());
    if (tie.tensor.defined()) continue;
    for (const auto& [name, tensor] : node_parameters(nodes_[tie.nodes.front()])) {
      if (name == tie.parameter) tie.tensor = tensor;
    }
  }
  // Tensors shared between built nodes.
  std::map<const void*, Tie> by_tensor;
  std::vector<const void*> order;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    for (const auto& [name, tensor] : node_parameters(nodes_[i])) {
      const void* key = tensor.unsafeGetTensorImpl();
      auto [entry, created] = by_tensor.try_emplace(key);
      if (created) {
        entry->second.parameter = name;
        entry->second.tensor = tensor;
        order.push_back(key);
      }
      if (entry->second.nodes.empty() || entry->second.nodes.back() != static_cast<int>(i)) {
        entry->second.nodes.push_back(static_cast<int>(i));
      }
    }
  }
  for (const void* key : order) {
    const Tie& tie = by_tensor[key];
    if (tie.nodes.size() > 1 && !declared.count(tie.parameter)) ties.push_back(tie);
  }
  return ties;
}

}  // namespace smp
