#pragma once
// A model as a DAG of modules with named tensors between them: residual connections, branches, several
// consumers of one tensor, and parameters shared between modules (a tied embedding and LM head). A
// torch::nn::Sequential is the trivial case (from_sequential).
//
//   smp::GraphModel graph("tokens");
//   graph.add("embed", Embedding(...), {"tokens"});
//   graph.add("block0", Block(...), {"embed"});
//   graph.add("mix", Add(), {"block0", "embed"});   // a residual around block0
//   graph.add("head", Head(...), {"mix"});            // the last node is the model's output
//
// Node names double as the names of their output tensors; every node reads named tensors produced earlier
// (or a model input), so the nodes are always in a topological order. A model may take several named inputs
// (GraphModel({"input_ids", "attention_mask"})) and return several tensors (set_outputs); by default it takes one
// input and its last node is its output.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

namespace smp {

class GraphModel {
 public:
  using Forward = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

  struct Node {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    Forward forward;
    std::vector<std::string> inputs;  // tensor names: the model input or earlier nodes
    // Its module's parameters are named "<prefix>.<parameter>": the node's name unless set (a traced call site that
    // uses a child's parameters, or calls a child again, names them after the child's path).
    std::string parameter_prefix;
    // The module mirrors the whole model's tree (a captured node holding parameters from anywhere in the model):
    // its parameters' own paths are their names.
    bool names_from_root = false;
    const std::string& prefix() const { return parameter_prefix.empty() ? name : parameter_prefix; }
    std::string parameter_name(const std::string& key) const { return names_from_root ? key : prefix() + "." + key; }
  };

  explicit GraphModel(std::string input_name = "input");
  explicit GraphModel(std::vector<std::string> input_names);

  // Adds a module whose forward takes one tensor per name in `inputs` (1 to 3) and returns one tensor.
  template <typename ModuleHolder>
  GraphModel& add(const std::string& name, ModuleHolder module, std::vector<std::string> inputs) {
    Forward forward = any_forward(torch::nn::AnyModule(module), name, inputs.size());
    return add(name, module.ptr(), std::move(forward), std::move(inputs));
  }
  // Adds a node with an explicit forward function over the module (any signature the function adapts).
  GraphModel& add(const std::string& name, std::shared_ptr<torch::nn::Module> module, Forward forward,
                  std::vector<std::string> inputs, std::string parameter_prefix = {}, bool names_from_root = false);
  // Node `node` runs `module` with `forward` from now on, same inputs and name: its module rebuilt (a Python model
  // built on the meta device, whose tensors became real once the partition said which nodes this rank runs).
  void replace_module(int node, std::shared_ptr<torch::nn::Module> module, Forward forward);
  // The model's outputs: tensors of nodes (not model inputs), in the order the loss function receives them.
  // Throws ConfigError for a name that is no node.
  void set_outputs(std::vector<std::string> outputs);
  // The outputs set, or the last node.
  std::vector<std::string> output_names() const;

  static GraphModel from_sequential(const torch::nn::Sequential& model, std::string input_name = "input");

  // The same model with node `node`, whose module must be a torch::nn::Sequential, replaced by a chain of its
  // children named "<node>.<child>" (so parameter names do not change). Throws ConfigError otherwise.
  GraphModel expanded(const std::string& node) const;
  // True when `node`'s module is a Sequential of two or more children with one input.
  bool expandable(int node) const;
  // Expands Sequential nodes, largest parameter count first, until there are at least `nodes` of them or nothing
  // is left to expand: granularity follows the module tree.
  GraphModel expanded_to(std::size_t nodes) const;

  const std::string& input_name() const { return input_names_.front(); }  // the first input
  const std::vector<std::string>& input_names() const { return input_names_; }
  int input_index(const std::string& name) const;  // -1 when `name` is no model input
  const std::vector<Node>& nodes() const { return nodes_; }
  int index_of(const std::string& node) const;  // -1 when absent

  // The whole graph in one process, as plain LibTorch would run it: the reference the pipeline must match. The
  // first form is for a model of one input, and returns its first output.
  at::Tensor forward(const at::Tensor& input) const;
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& inputs) const;  // inputs in input_names() order
  // A tensor a stage received (a leaf that takes a gradient) as a node may take it: under grad mode a non-leaf
  // alias of the same memory, so that a module may write into its input in place (ReLU(inplace=true)) as it may in
  // single-process training, where that input is another module's output. Anything else as it is.
  static at::Tensor writable_input(const at::Tensor& tensor);

  // Every parameter once, named "<prefix>.<parameter>" after the first node (in node order) that holds it: a
  // parameter shared by several nodes (tied) has one name, the same on every rank.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // Groups of node indices that share a parameter, with that parameter's name (for ties across stages).
  struct Tie {
    std::string parameter;  // its name (named_parameters)
    at::Tensor tensor;      // the parameter itself
    std::vector<int> nodes;
  };
  std::vector<Tie> ties() const;

 private:
  static Forward any_forward(torch::nn::AnyModule module, const std::string& name, std::size_t arity);
  // Adds without the '.' check: expanded children are named "<node>.<child>" on purpose.
  GraphModel& add_node(Node node);

  std::vector<std::string> input_names_;
  std::vector<std::string> output_names_;  // empty: the last node
  std::vector<Node> nodes_;
  std::map<std::string, int> index_;
};

}  // namespace smp
