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
//
// A node may also be given as a factory that builds its module (graph.add("block0", [=] { return Block(options); },
// {"embed"})): the model is then never whole in one process. A rank builds only the nodes of its own stages, rank 0
// builds each other node alone while it profiles it and frees it after, and each is initialized from a generator
// seeded by (build seed, node name), so that its weights do not depend on which process builds it or when.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

namespace smp {

namespace detail {
// A torch::nn::ModuleHolder (Linear, a TORCH_MODULE): what GraphModel::add takes as a module, not as a factory.
template <typename T, typename = void>
struct IsModuleHolder : std::false_type {};
template <typename T>
struct IsModuleHolder<T, std::void_t<decltype(std::declval<T&>().ptr())>> : std::true_type {};
}  // namespace detail

// The seed of the generator that initializes the module at `path` (a node's name, a Python module's path): the same
// in every process, different for every path.
std::uint64_t module_seed(std::uint64_t seed, const std::string& path);

class GraphModel {
 public:
  using Forward = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
  struct Built {
    std::shared_ptr<torch::nn::Module> module;
    Forward forward;
  };
  // Builds a node's module; gets the parameters of earlier nodes the node shares (add's `shared`), in that order.
  using Factory = std::function<Built(const std::vector<at::Tensor>& shared)>;

  struct Node {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;  // null while a node built on demand is not built in this process
    Forward forward;
    std::vector<std::string> inputs;  // tensor names: the model input or earlier nodes
    // Its module's parameters are named "<prefix>.<parameter>": the node's name unless set (a traced call site that
    // uses a child's parameters, or calls a child again, names them after the child's path).
    std::string parameter_prefix;
    // The module mirrors the whole model's tree (a captured node holding parameters from anywhere in the model):
    // its parameters' own paths are their names.
    bool names_from_root = false;
    // Nodes built on demand: the factory, the parameters of earlier nodes it shares ("embed.weight": a tied LM
    // head's matrix), and once built, the tensors it got for them (named after their owners, not after this node).
    Factory factory;
    std::vector<std::string> shared;
    std::vector<at::Tensor> shared_tensors;
    // Nodes with equal keys (a module type, its parameters' names and shapes) compute the same function of their
    // inputs: the profile measures one of them per input shape. Empty: measured on its own.
    std::string profile_key;
    bool built() const { return module != nullptr; }
    const std::string& prefix() const { return parameter_prefix.empty() ? name : parameter_prefix; }
    std::string parameter_name(const std::string& key) const { return names_from_root ? key : prefix() + "." + key; }
  };

  explicit GraphModel(std::string input_name = "input");
  explicit GraphModel(std::vector<std::string> input_names);

  // Adds a module whose forward takes one tensor per name in `inputs` (1 to 3) and returns one tensor.
  template <typename ModuleHolder, std::enable_if_t<detail::IsModuleHolder<ModuleHolder>::value, int> = 0>
  GraphModel& add(const std::string& name, ModuleHolder module, std::vector<std::string> inputs) {
    Forward forward = forward_of(module, name, inputs.size());
    add(name, module.ptr(), std::move(forward), std::move(inputs));
    nodes_.back().profile_key = profile_key_of(*module.ptr());
    return *this;
  }
  // Adds a node built on demand by `make` (a callable returning a module holder, as `add` above takes), only in the
  // processes that run it: `[=] { return Block(options); }`. With `shared`, `make` takes a
  // `const std::vector<at::Tensor>&` holding those parameters of earlier nodes (full names, "embed.weight"), and
  // registers them as its own: the same tensor where both nodes are built, tied across stages otherwise.
  template <typename Make, std::enable_if_t<!detail::IsModuleHolder<Make>::value, int> = 0>
  GraphModel& add(const std::string& name, Make make, std::vector<std::string> inputs,
                  std::vector<std::string> shared = {}) {
    const std::size_t arity = inputs.size();
    Factory factory = [make, name, arity](const std::vector<at::Tensor>& tensors) -> Built {
      auto holder = call_factory(make, tensors);
      return {holder.ptr(), forward_of(holder, name, arity)};
    };
    return add_on_demand(name, std::move(factory), std::move(inputs), std::move(shared));
  }
  GraphModel& add_on_demand(const std::string& name, Factory factory, std::vector<std::string> inputs,
                            std::vector<std::string> shared = {});
  // Adds a node with an explicit forward function over the module (any signature the function adapts).
  GraphModel& add(const std::string& name, std::shared_ptr<torch::nn::Module> module, Forward forward,
                  std::vector<std::string> inputs, std::string parameter_prefix = {}, bool names_from_root = false);
  // Nodes of equal keys share one profile measurement on inputs of equal shapes (Node::profile_key).
  void set_profile_key(int node, std::string key) { nodes_.at(static_cast<std::size_t>(node)).profile_key = std::move(key); }
  // Node `node` runs `module` with `forward` from now on, same inputs and name: its module rebuilt (a Python model
  // built on the meta device, whose tensors became real once the partition said which nodes this rank runs).
  void replace_module(int node, std::shared_ptr<torch::nn::Module> module, Forward forward);
  // The model's outputs: tensors of nodes (not model inputs), in the order the loss function receives them.
  // Throws ConfigError for a name that is no node.
  void set_outputs(std::vector<std::string> outputs);
  // The outputs set, or the last node.
  std::vector<std::string> output_names() const;

  // Runs of consecutive nodes of one stage that the model computes in one call: given the run's node indices (in
  // order) and the tensors it reads from outside (names, in first-read order), the fuser returns a function from
  // those tensors to every node's value in run order, or an empty function to leave the nodes apart. A captured
  // Python model fuses its generated nodes this way once the partition is known: a microbatch then costs one Python
  // call per stage rather than one per node.
  using RunForward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  using RunFuser = std::function<RunForward(const std::vector<int>& nodes, const std::vector<std::string>& inputs)>;
  void set_run_fuser(RunFuser fuser) { run_fuser_ = std::move(fuser); }
  const RunFuser& run_fuser() const { return run_fuser_; }

  // The seed nodes built on demand are initialized from (module_seed(seed, node name)); DistributedModel sets the
  // config's "seed".
  void set_build_seed(std::uint64_t seed) { build_seed_ = seed; }
  std::uint64_t build_seed() const { return build_seed_; }
  // Builds node `node` in this process, if it is built on demand and not built yet.
  void build(int node);
  // Builds every node: the whole model in one process (the single-process reference of a job, or inference). The
  // same weights as the job's with this build seed.
  GraphModel& materialize(std::uint64_t seed);
  // Node `node` as built apart from the model, which stays as it is (rank 0 profiles nodes built on demand one at a
  // time). A built node is returned as it is.
  Node built_apart(int node) const;
  // The node owning parameter `name` ("<node>.<parameter>") and the parameter's key in its module; -1 if none.
  std::pair<int, std::string> owner_of(const std::string& parameter) const;

  static GraphModel from_sequential(const torch::nn::Sequential& model, std::string input_name = "input");

  // The same model with node `node`, whose module must be a torch::nn::Sequential, replaced by a chain of its
  // children named "<node>.<child>" (so parameter names do not change). Throws ConfigError otherwise.
  GraphModel expanded(const std::string& node) const;
  // True when `node`'s module is a Sequential of two or more children with one input.
  bool expandable(int node) const;
  // Expands Sequential nodes, largest parameter count first, until at least `nodes` of them hold parameters (a
  // node not built here counted as one) or nothing is left to expand: granularity follows the module tree.
  GraphModel expanded_to(std::size_t nodes) const;
  // Expands the Sequential nodes that hold one of `paths` ("layer4.0.conv2" inside node "layer4") until a node is
  // at or under each path, where the module tree allows: partition_overrides name modules at any depth.
  GraphModel expanded_to_paths(const std::vector<std::string>& paths) const;

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

  // Every parameter of the built nodes once, named "<prefix>.<parameter>" after the first node (in node order)
  // that holds it: a parameter shared by several nodes (tied) has one name, the same on every rank; one a node got
  // through `shared` is named after its owner.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // The parameters of one (built) node under their model names; own_parameters leaves out those it shares with
  // an earlier node (counted there).
  static std::vector<std::pair<std::string, at::Tensor>> node_parameters(const Node& node);
  static std::vector<std::pair<std::string, at::Tensor>> own_parameters(const Node& node);
  // The buffers of the built nodes that are part of the model's state (all but those set_transient_buffers names),
  // each once, named like parameters.
  std::vector<std::pair<std::string, at::Tensor>> named_buffers() const;
  // Buffers the model recomputes rather than keeps (a Python module's non-persistent buffers: a rotary table), by
  // their model names: left out of checkpoints and exports.
  void set_transient_buffers(std::vector<std::string> names);
  // Groups of node indices that share a parameter, with that parameter's name (for ties across stages): tensors
  // shared between built nodes, and every parameter a node built on demand shares, built or not.
  struct Tie {
    std::string parameter;  // its name (named_parameters)
    at::Tensor tensor;      // the parameter itself; undefined when no holder is built here
    std::vector<int> nodes;
  };
  std::vector<Tie> ties() const;

 private:
  template <typename Make>
  static auto call_factory(const Make& make, const std::vector<at::Tensor>& shared) {
    if constexpr (std::is_invocable_v<const Make&, const std::vector<at::Tensor>&>) {
      return make(shared);
    } else {
      return make();
    }
  }
  // A module holder's forward over a node's inputs: a Sequential's (one input; AnyModule cannot hold one), or any
  // other's through AnyModule.
  template <typename Holder>
  static Forward forward_of(Holder holder, const std::string& name, std::size_t arity) {
    if constexpr (std::is_same_v<Holder, torch::nn::Sequential>) {
      if (arity != 1) throw_sequential_arity(name, arity);
      return [holder](const std::vector<at::Tensor>& in) mutable { return holder->forward(in[0]); };
    } else {
      return any_forward(torch::nn::AnyModule(holder), name, arity);
    }
  }
  [[noreturn]] static void throw_sequential_arity(const std::string& name, std::size_t arity);
  // The module's type and its parameters' and buffers' names, shapes and dtypes.
  static std::string profile_key_of(torch::nn::Module& module);
  Built run_factory(int node, std::vector<at::Tensor>* shared_tensors) const;
  static Forward any_forward(torch::nn::AnyModule module, const std::string& name, std::size_t arity);
  // Adds without the '.' check: expanded children are named "<node>.<child>" on purpose.
  GraphModel& add_node(Node node);

  std::vector<std::string> input_names_;
  std::vector<std::string> output_names_;  // empty: the last node
  std::vector<Node> nodes_;
  std::map<std::string, int> index_;
  std::uint64_t build_seed_ = 0;
  std::vector<std::string> transient_buffers_;
  RunFuser run_fuser_;
};

// Whether node `name` was cut from the module at `path`, which partition_overrides and checkpointed_modules name:
// the module itself, a part of it (a captured model's "model.layers.5" may be cut into "model.layers.5.self_attn"
// ...), or a second output or call of it ("model.layers.5#1").
bool cut_from(const std::string& name, const std::string& path);

}  // namespace smp
