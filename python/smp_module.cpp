// The Python extension smp._smp: the engine for models written in Python.
//
// A module crosses either as the Python object itself (EagerModule: its tensors, its forward called under the
// GIL) or, when the user scripted it, as TorchScript bytes (torch.jit.save in Python, torch::jit::load here:
// ScriptedModule, which then runs without Python). Only PyTorch's tensor conversion is needed from its Python
// internals. Tensors cross without copies.

#include <algorithm>
#include <functional>
#include <atomic>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>  // Runtime holds one: pybind11 instantiates its copy
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/nn/module.h>

#include "smp/checkpoint.h"
#include "smp/collectives.h"
#include "smp/comm/communicator.h"
#include "smp/config.h"
#include "smp/cpu_tensor_meter.h"
#include "smp/device_speeds.h"
#include "smp/distributed_model.h"
#include "smp/errors.h"
#include "smp/executor.h"
#include "smp/expert_shards.h"
#include "smp/graph_model.h"
#include "smp/layout_plan.h"
#include "smp/planned_layout.h"
#include "smp/runtime.h"
#include "smp/module_modes.h"
#include "smp/tp.h"

namespace py = pybind11;

namespace smp::python {
namespace {

// A TorchScript module seen as a torch::nn::Module: the same parameter and buffer tensors (so moving or updating
// one moves or updates the other), registered under the same names and submodules, so that parameter names match
// the Python model's state_dict.
class ScriptedModule : public torch::nn::Module {
 public:
  explicit ScriptedModule(torch::jit::Module module) : scripted_(std::move(module)) {
    for (const auto& parameter : scripted_.named_parameters(/*recurse=*/false)) {
      register_parameter(parameter.name, parameter.value, parameter.value.requires_grad());
    }
    for (const auto& buffer : scripted_.named_buffers(/*recurse=*/false)) register_buffer(buffer.name, buffer.value);
    for (const auto& child : scripted_.named_children()) {
      register_module(child.name, std::make_shared<ScriptedModule>(child.value));
    }
  }

  // The TorchScript module has a training flag of its own (dropout, batch norm read it): keep both in step.
  void train(bool on = true) override {
    scripted_.train(on);
    torch::nn::Module::train(on);
  }

  at::Tensor forward(const std::vector<at::Tensor>& inputs) {
    std::vector<c10::IValue> arguments(inputs.begin(), inputs.end());
    c10::IValue output = scripted_.forward(std::move(arguments));
    if (!output.isTensor()) {
      throw ModelError("a TorchScript module returned " + output.tagKind() + "; pipeline stages pass one tensor");
    }
    return output.toTensor();
  }

 private:
  torch::jit::Module scripted_;
};

// Called in a handler of the error a Python call raised: Ctrl-C's KeyboardInterrupt goes on through the engine as
// Interrupted (no layer wraps it, and the bindings give Python KeyboardInterrupt back); any other error as it is.
[[noreturn]] void rethrow_python_error(const py::error_already_set& error) {
  if (error.matches(PyExc_KeyboardInterrupt)) throw Interrupted("interrupted (KeyboardInterrupt)");
  throw;
}

// A Python object that the engine may drop while the GIL is released (a step, a checkpoint thread): the deleter
// takes the GIL.
std::shared_ptr<py::object> held_under_gil(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* held) {
    py::gil_scoped_acquire gil;
    delete held;
  });
}

// An eager PyTorch module: the same parameter and buffer tensors under the same names and submodules, and a
// forward that calls the Python module under the GIL (the engine runs with the GIL released), or `call` when given
// (a traced model's node: the module with the arguments its call site passes). Its autograd graph is LibTorch's
// like any other; only backward functions written in Python take the GIL again, as in PyTorch. A parameter tagged
// `_smp_shard` = (dim, blocks) (by smp.tp's layers; the tag stays on the tensor through a capture) is a shard; one
// tagged `_smp_sequence_parallel` sees a slice of the sequence (tp::SequenceParallel); one tagged
// `_smp_expert_shard` is this rank's share of a layer's experts (ExpertShards).
class EagerModule : public torch::nn::Module,
                    public tp::Sharded,
                    public tp::SequenceParallel,
                    public ExpertShards,
                    public ExternalModes {
 public:
  explicit EagerModule(const py::object& module, const py::object& call = py::none())
      : module_(held_under_gil(module)), call_(held_under_gil(call.is_none() ? module : call)) {
    py::gil_scoped_acquire gil;
    for (const auto& item : module.attr("named_parameters")(py::arg("recurse") = false)) {
      const auto pair = item.cast<py::tuple>();
      const auto tensor = pair[1].cast<at::Tensor>();
      register_parameter(pair[0].cast<std::string>(), tensor, tensor.requires_grad());
      if (py::hasattr(pair[1], "_smp_shard")) {
        const auto [dim, blocks] = pair[1].attr("_smp_shard").cast<std::pair<int64_t, int64_t>>();
        shards_.push_back({tensor, dim, blocks});
      }
      if (py::hasattr(pair[1], "_smp_sequence_parallel")) sequence_parallel_.push_back(tensor);
      if (py::hasattr(pair[1], "_smp_expert_shard")) experts_.push_back(tensor);
    }
    for (const auto& item : module.attr("named_buffers")(py::arg("recurse") = false)) {
      const auto pair = item.cast<py::tuple>();
      register_buffer(pair[0].cast<std::string>(), pair[1].cast<at::Tensor>());
    }
    for (const auto& item : module.attr("named_children")()) {
      const auto pair = item.cast<py::tuple>();
      register_module(pair[0].cast<std::string>(), std::make_shared<EagerModule>(pair[1]));
    }
  }

  std::vector<tp::ShardLayout> shard_layouts() const override { return shards_; }
  std::vector<at::Tensor> sequence_parallel_parameters() const override { return sequence_parallel_; }
  std::vector<at::Tensor> expert_parameters() const override { return experts_; }

  void train(bool on = true) override {
    {
      py::gil_scoped_acquire gil;
      module_->attr("train")(on);
    }
    torch::nn::Module::train(on);
  }

  // The Python modules hold the modes (the program's .eval() on a submodule reaches them, not this wrapper's flags):
  // each one's is put back as it was.
  std::function<void()> enter_eval() override {
    py::gil_scoped_acquire gil;
    auto modules = held_under_gil(py::list(module_->attr("modules")()));
    std::vector<bool> training;
    for (const auto& each : modules->cast<py::list>()) training.push_back(each.attr("training").cast<bool>());
    module_->attr("eval")();
    // Back through train(), as the program's own calls went (a module's override may do more than set its flag:
    // a LoRA layer's merges and unmerges its adapter): the root's mode, then, in pre-order, each module whose mode
    // still differs from its own.
    return [modules, training] {
      py::gil_scoped_acquire gil;
      const auto list = modules->cast<py::list>();
      for (std::size_t i = 0; i < training.size(); ++i) {
        if (i == 0 || list[i].attr("training").cast<bool>() != training[i]) list[i].attr("train")(training[i]);
      }
    };
  }

  // The same Python module and call seen anew: its tensors as they are now (made real after a meta-device build).
  std::shared_ptr<EagerModule> rebuilt() const {
    py::gil_scoped_acquire gil;
    auto module = std::make_shared<EagerModule>(*module_, *call_);
    module->torch::nn::Module::train(is_training());
    return module;
  }

  at::Tensor forward(const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_acquire gil;
    py::tuple arguments(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) arguments[i] = py::cast(inputs[i]);
    py::object output;
    try {
      output = (*call_)(*arguments);
    } catch (const py::error_already_set& error) {
      rethrow_python_error(error);
    }
    try {
      return output.cast<at::Tensor>();
    } catch (const py::cast_error&) {
      throw ModelError("a module returned " + std::string(py::str(py::type::of(output))) +
                       "; pipeline stages pass one tensor");
    }
  }

 private:
  std::shared_ptr<py::object> module_;
  std::shared_ptr<py::object> call_;
  std::vector<tp::ShardLayout> shards_;
  std::vector<at::Tensor> sequence_parallel_;
  std::vector<at::Tensor> experts_;
};

std::shared_ptr<ScriptedModule> load_scripted(const py::bytes& serialized) {
  std::istringstream stream(std::string(serialized), std::ios::binary);
  torch::jit::Module module = torch::jit::load(stream);
  module.train();
  return std::make_shared<ScriptedModule>(std::move(module));
}

// GraphModel.add for a module of either kind: the node runs the module's forward on its inputs.
template <typename Module>
GraphModel& add_node(GraphModel& graph, const std::string& name, const std::shared_ptr<Module>& module,
                     std::vector<std::string> inputs, std::string parameter_prefix, bool names_from_root,
                     std::string profile_key) {
  GraphModel::Forward forward = [module](const std::vector<at::Tensor>& values) { return module->forward(values); };
  graph.add(name, module, std::move(forward), std::move(inputs), std::move(parameter_prefix), names_from_root);
  graph.set_profile_key(static_cast<int>(graph.nodes().size()) - 1, std::move(profile_key));
  return graph;
}

// GraphModel::set_run_fuser with a Python fuser: fuser(node indices, input names) returns None or a callable from the
// run's input tensors to its nodes' values.
void set_run_fuser(GraphModel& graph, const py::object& fuser) {
  auto held = held_under_gil(fuser);
  graph.set_run_fuser([held](const std::vector<int>& nodes, const std::vector<std::string>& inputs) {
    py::gil_scoped_acquire gil;
    py::object fused = (*held)(nodes, inputs);
    if (fused.is_none()) return GraphModel::RunForward();
    auto call = held_under_gil(fused);
    return GraphModel::RunForward([call](const std::vector<at::Tensor>& values) {
      py::gil_scoped_acquire gil;
      py::tuple arguments(values.size());
      for (std::size_t i = 0; i < values.size(); ++i) arguments[i] = py::cast(values[i]);
      try {
        return (*call)(*arguments).cast<std::vector<at::Tensor>>();
      } catch (const py::error_already_set& error) {
        rethrow_python_error(error);
      }
    });
  });
}

// None crosses as an undefined tensor, and back.
using OptionalTensors = std::vector<std::optional<at::Tensor>>;
ModelInputs defined_or_not(const OptionalTensors& tensors) {
  ModelInputs result;
  for (const auto& tensor : tensors) result.push_back(tensor.value_or(at::Tensor()));
  return result;
}

// A Python loss function `loss(outputs, target)` (the model's outputs as a list; target None when the step has none),
// called from the engine with the GIL released around the step.
OutputsLossFunction python_loss(py::function loss) {
  auto holder = held_under_gil(std::move(loss));
  return [holder](const std::vector<at::Tensor>& outputs, const at::Tensor& target) {
    py::gil_scoped_acquire gil;
    py::object result;
    try {
      result = (*holder)(outputs, target.defined() ? py::cast(target) : py::none());
    } catch (const py::error_already_set& error) {
      rethrow_python_error(error);
    }
    try {
      return result.cast<at::Tensor>();
    } catch (const py::cast_error&) {
      throw ModelError("the loss function returned " + std::string(py::str(py::type::of(result))) +
                       ", not a tensor");
    }
  };
}

// train_step or evaluate with a Python loss, the GIL released for the step (the loss takes it back).
template <StepOutput (DistributedModel::*step)(const ModelInputs&, const at::Tensor&, const OutputsLossFunction&, bool,
                                               const std::vector<bool>&, LossReduction)>
StepOutput with_python_loss(DistributedModel& model, const OptionalTensors& inputs,
                            const std::optional<at::Tensor>& targets, py::function loss, bool keep_outputs,
                            const std::vector<bool>& batched, LossReduction reduction) {
  const OutputsLossFunction function = python_loss(std::move(loss));
  const ModelInputs model_inputs = defined_or_not(inputs);
  py::gil_scoped_release released;
  return (model.*step)(model_inputs, targets.value_or(at::Tensor()), function, keep_outputs, batched, reduction);
}

// A torch.optim optimizer's checkpoint state, serialized by the package's Python (torch.save of its state_dict,
// and the LR scheduler's) during the save's pause; the writer thread only writes the bytes, never touching Python.
class PythonOptimizerState final : public OptimizerCheckpointState {
 public:
  PythonOptimizerState(py::function snapshot, py::function load)
      : snapshot_(held_under_gil(std::move(snapshot))), load_(held_under_gil(std::move(load))) {}

  std::function<std::string()> snapshot() override {
    auto bytes = std::make_shared<std::string>();
    {
      py::gil_scoped_acquire gil;
      try {
        *bytes = (*snapshot_)().cast<std::string>();
      } catch (const py::error_already_set& error) {
        if (error.matches(PyExc_KeyboardInterrupt)) rethrow_python_error(error);
        throw CheckpointError(std::string("saving the optimizer state: ") + error.what());
      }
    }
    return [bytes] { return *bytes; };
  }

  // The device is torch.optim's business: load_state_dict moves each state tensor to its parameter's.
  void load(const SavedOptimizerState& saved, c10::Device /*device*/) override {
    py::gil_scoped_acquire gil;
    try {
      // Python reads the shares one at a time, as the LibTorch optimizers' load does.
      const py::cpp_function read([&saved](int share) {
        const SavedOptimizerShare read = saved.read(share);
        return py::make_tuple(read.path, py::bytes(read.bytes), read.parameters);
      });
      (*load_)(saved.share_count, saved.first_share, saved.shares_to_read, read);
    } catch (const py::error_already_set& error) {
      if (error.matches(PyExc_KeyboardInterrupt)) rethrow_python_error(error);
      // The package's own CheckpointError already says what is wrong; another error keeps its type's name.
      const bool ours = error.matches(py::module_::import("smp._smp").attr("CheckpointError"));
      throw CheckpointError(ours ? std::string(py::str(error.value())) : std::string(error.what()));
    }
  }

  std::string format() const override { return "torch.optim"; }

 private:
  std::shared_ptr<py::object> snapshot_, load_;
};

}  // namespace

PYBIND11_MODULE(_smp, module) {
  module.doc() = "smp's engine for PyTorch models (use the smp package, not this module)";

  // Python classes for the errors each layer raises, so that callers can tell a bad config from a dead peer.
  py::register_exception<ConfigError>(module, "ConfigError", PyExc_ValueError);
  py::register_exception<ModelError>(module, "ModelError", PyExc_RuntimeError);
  py::register_exception<NonFiniteError>(module, "NonFiniteError", PyExc_ArithmeticError);
  py::register_exception<CheckpointError>(module, "CheckpointError", PyExc_RuntimeError);
  py::register_exception<comm::CommError>(module, "CommError", PyExc_RuntimeError);
  // Ctrl-C (smprun forwards SIGINT to every rank) ends each rank as KeyboardInterrupt, as in plain PyTorch: where
  // the interrupt stopped Python code the engine called (Interrupted), and where it is still pending because the
  // rank waited in C++ on a peer that the interrupt had stopped. Otherwise that peer's leaving surfaced as a
  // CommError, and Python, raising the pending interrupt while it printed that error, lost its stderr.
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      std::rethrow_exception(thrown);
    } catch (const Interrupted&) {
      PyErr_SetNone(PyExc_KeyboardInterrupt);
      return;
    } catch (...) {
    }
    // Runs the pending handlers: Python's default SIGINT handler raises KeyboardInterrupt, set as the error now.
    if (PyErr_CheckSignals() != 0) return;
    std::rethrow_exception(thrown);
  });

  py::class_<ScriptedModule, std::shared_ptr<ScriptedModule>>(module, "ScriptedModule");
  module.def("load_scripted", &load_scripted, py::arg("serialized"));
  py::class_<EagerModule, std::shared_ptr<EagerModule>>(module, "EagerModule");
  module.def(
      "wrap_eager",
      [](const py::object& module, const py::object& call) { return std::make_shared<EagerModule>(module, call); },
      py::arg("module"), py::arg("call") = py::none());

  py::class_<GraphModel>(module, "GraphModel")
      .def(py::init<std::vector<std::string>>(), py::arg("input_names"))
      .def("add", &add_node<ScriptedModule>, py::arg("name"), py::arg("module"), py::arg("inputs"),
           py::arg("parameter_prefix") = "", py::arg("names_from_root") = false, py::arg("profile_key") = "",
           py::return_value_policy::reference_internal)
      .def("add", &add_node<EagerModule>, py::arg("name"), py::arg("module"), py::arg("inputs"),
           py::arg("parameter_prefix") = "", py::arg("names_from_root") = false, py::arg("profile_key") = "",
           py::return_value_policy::reference_internal)
      .def("set_transient_buffers", &GraphModel::set_transient_buffers, py::arg("names"))
      .def("set_run_fuser", &set_run_fuser, py::arg("fuser"))
      .def("set_outputs", &GraphModel::set_outputs, py::arg("outputs"))
      .def_property_readonly("input_names", &GraphModel::input_names)
      .def_property_readonly("output_names", &GraphModel::output_names)
      .def("node_names",
           [](const GraphModel& graph) {
             std::vector<std::string> names;
             for (const auto& node : graph.nodes()) names.push_back(node.name);
             return names;
           })
      .def(
          "forward",
          [](const GraphModel& graph, const OptionalTensors& inputs) { return graph.forward(defined_or_not(inputs)); },
          py::arg("inputs"), py::call_guard<py::gil_scoped_release>());

  py::class_<Config>(module, "Config")
      .def_static("from_file", &Config::from_file, py::arg("path"))
      .def_static("from_json_text", &Config::from_json_text, py::arg("text"), py::arg("source"))
      .def_readonly("partitions", &Config::partitions)
      .def_readonly("microbatches", &Config::microbatches)
      .def_readonly("global_batch_size", &Config::global_batch_size)
      .def_readonly("seed", &Config::seed)
      .def_readonly("bf16", &Config::bf16)
      .def_readonly("fp16", &Config::fp16)
      .def_readonly("sequence_parallel", &Config::sequence_parallel)
      .def_readonly("expert_parallel_degree", &Config::expert_parallel_degree)
      .def_readonly("memory_limit_mb", &Config::memory_limit_mb)
      .def_readonly("checkpoint_dir", &Config::checkpoint_dir)
      .def_readonly("device_memory_mb", &Config::device_memory_mb)
      .def_readonly("source", &Config::source)
      .def_readonly("text", &Config::text)
      .def_readonly("trace_dir", &Config::trace_dir)
      .def_readonly("auto_keys", &Config::auto_keys)
      .def_readonly("virtual_stages", &Config::virtual_stages)
      .def_readonly("ddp", &Config::ddp)
      .def_readonly("shard_optimizer_state", &Config::shard_optimizer_state)
      .def_readonly("tensor_parallel_degree", &Config::tensor_parallel_degree)
      .def_readonly("checkpointed_stages", &Config::checkpointed_stages)
      .def_readonly("checkpointed_modules", &Config::checkpointed_modules)
      .def("schedule_name", &Config::schedule_name)
      .def_static("planned_keys", &Config::planned_keys)
      .def_readonly("partition_overrides", &Config::partition_overrides)
      .def("num_stages", &Config::num_stages)
      .def("check_sections", &Config::check_sections, py::arg("known"));

  py::class_<Runtime, std::shared_ptr<Runtime>>(module, "Runtime")
      .def_static("init", py::overload_cast<const Config&>(&Runtime::init), py::arg("config"),
                  py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Runtime::rank)
      .def_property_readonly("world_size", &Runtime::world_size)
      .def_property_readonly("pp_rank", &Runtime::pp_rank)
      .def_property_readonly("local_rank", [](const Runtime& runtime) { return runtime.launch().local_rank; })
      .def_property_readonly("local_world_size", [](const Runtime& runtime) { return runtime.launch().local_world_size; })
      .def_property_readonly("dp_rank", &Runtime::dp_rank)
      .def_property_readonly("tp_rank", &Runtime::tp_rank)
      .def_property_readonly("tensor_parallel_degree",
                             [](const Runtime& runtime) { return runtime.topology().tensor_parallel_degree(); })
      .def_property_readonly("data_parallel_degree",
                             [](const Runtime& runtime) { return runtime.topology().data_parallel_degree(); })
      .def_property_readonly("expert_parallel_degree",
                             [](const Runtime& runtime) { return runtime.topology().expert_parallel_degree(); })
      .def_property_readonly("ep_rank", &Runtime::ep_rank)
      .def_property_readonly("device", [](const Runtime& runtime) { return runtime.device().str(); })
      .def_property_readonly("config", &Runtime::config, py::return_value_policy::reference_internal)
      .def("replica_slice", &Runtime::replica_slice, py::arg("global_batch"), py::arg("fill_microbatches") = true)
      .def("_refuse_after_leaving", &Runtime::refuse_after_leaving, py::arg("caller"))
      .def(
          "_with_peers",
          [](Runtime& runtime, const std::string& what, const py::function& work) {
            py::object result;
            runtime.with_peers(what, [&] { result = work(); });
            return result;
          },
          py::arg("what"), py::arg("work"))
      .def("_adopt_layout", &Runtime::adopt_layout, py::arg("chosen"), py::call_guard<py::gil_scoped_release>())
      .def("_expect_planned_model", &Runtime::expect_planned_model)
      // The links and compute slowdown for planning this job (every rank calls it at once).
      .def(
          "_measured_planning_costs",
          [](Runtime& runtime) {
            PlanningCosts costs;
            {
              py::gil_scoped_release released;
              costs = measured_planning_costs(runtime);
            }
            py::dict measured;
            measured["latency_s"] = costs.latency_s;
            measured["bytes_per_s"] = costs.p2p_bytes_per_s;
            measured["shared_processors"] = costs.shared_processors;  // 0: each rank has its own
            // 0: not measured (no cores shared)
            measured["synchronization_s"] = costs.synchronization_s;
            measured["synchronized_bytes_per_s"] = costs.synchronized_bytes_per_s;
            return measured;
          })
      // Per rank, the speeds the config gives or measures (every rank calls it at once; measured once per job).
      .def(
          "_device_speeds", [](Runtime& runtime) { return device_speeds(runtime, "planned_layout/"); },
          py::call_guard<py::gil_scoped_release>())
      // Runtime::from_rank0 with a Python callable (called with the GIL held, on rank 0 only).
      .def(
          "_from_rank0",
          [](Runtime& runtime, const std::string& key, const py::function& make) {
            return runtime.from_rank0(key, [&] {
              try {
                return make().cast<std::string>();
              } catch (py::error_already_set& error) {
                // smp's own errors as their C++ kinds, which from_rank0 hands the other ranks; any other exception
                // keeps its traceback on rank 0 (the others raise ConfigError naming it).
                const auto smp_module = py::module_::import("smp._smp");
                const std::string what = py::str(error.value());
                if (error.matches(smp_module.attr("ModelError"))) throw ModelError(what);
                if (error.matches(smp_module.attr("CheckpointError"))) throw CheckpointError(what);
                if (error.matches(smp_module.attr("CommError"))) throw comm::CommError(what);
                throw;
              }
            });
          },
          py::arg("key"), py::arg("make"))
      // Sums a CPU tensor in place over every rank of the job (each calls it): for metrics, e.g. counts that only
      // the ranks running the last stage have. Returns it, so that `total = runtime.all_reduce_sum(total)` works too.
      .def(
          "all_reduce_sum",
          [](Runtime& runtime, const at::Tensor& tensor) {
            if (!tensor.device().is_cpu() || tensor.scalar_type() == at::kBool || tensor.is_complex()) {
              throw ConfigError("all_reduce_sum takes a real, non-bool CPU tensor, got " + tensor.toString() +
                                " on " + tensor.device().str());
            }
            // Always through a copy of our own, never the caller's tensor: Gloo's work object keeps what it reduced
            // and is destroyed later on a Gloo thread, and dropping a tensor that Python also holds takes the GIL
            // there. At interpreter exit that thread then died inside a destructor, aborting the process
            // ("terminate called without an active exception", 9 of 20 two-process runs that exit right after).
            // The copy is also dense, as the transports need (they sum data_ptr() over numel()).
            const at::Tensor owned = tensor.clone(at::MemoryFormat::Contiguous);
            runtime.refuse_after_leaving("all_reduce_sum");
            runtime.with_peers("all_reduce_sum", [&] { runtime.world().all_reduce_sum(owned); });
            tensor.copy_(owned);
            return tensor;
          },
          py::arg("tensor"), py::call_guard<py::gil_scoped_release>())
      .def("_use_replica_statistics", &Runtime::use_replica_statistics, py::call_guard<py::gil_scoped_release>())
      // Rows of `tensor` to the members of the expert-parallel group, for smp.ep's all_to_all (autograd is its).
      .def(
          "_ep_all_to_all",
          [](Runtime& runtime, const at::Tensor& tensor, const std::vector<int64_t>& output_rows,
             const std::vector<int64_t>& input_rows, bool counted) {
            return exchange_rows(tensor, output_rows, input_rows, runtime.expert_parallel(), counted);
          },
          py::arg("tensor"), py::arg("output_rows"), py::arg("input_rows"), py::arg("counted") = true,
          py::call_guard<py::gil_scoped_release>());

  py::class_<StepOutput>(module, "StepOutput")
      .def_readonly("loss", &StepOutput::loss)
      .def_readonly("skipped", &StepOutput::skipped)
      .def_readonly("seconds", &StepOutput::seconds)
      .def_readonly("gradient_buckets", &StepOutput::gradient_buckets)
      .def_readonly("buckets_overlapped", &StepOutput::buckets_overlapped)
      .def_readonly("forwards_overlapped", &StepOutput::forwards_overlapped)
      .def_property_readonly("all_outputs", [](const StepOutput& output) -> py::object {
        return output.all_outputs.empty() ? py::none() : py::cast(output.all_outputs);
      });

  py::enum_<LossReduction>(module, "LossReduction")
      .value("mean", LossReduction::kMean)
      .value("sum", LossReduction::kSum);
  py::class_<DistributedModel>(module, "DistributedModel")
      .def(py::init([](std::shared_ptr<Runtime> runtime, GraphModel model, const OptionalTensors& sample,
                       const py::object& materialize, bool resume) {
             DistributedModel::MaterializeNodes hook;
             if (!materialize.is_none()) {
               auto callable = held_under_gil(materialize);
               // Python makes the local nodes' tensors real; every eager node is then seen anew, so that a tensor
               // several nodes share (a tied weight) is one tensor in all of them again.
               hook = [callable](GraphModel& graph, const std::vector<int>& local_nodes) {
                 {
                   py::gil_scoped_acquire gil;
                   (*callable)(local_nodes);
                 }
                 for (std::size_t i = 0; i < graph.nodes().size(); ++i) {
                   const auto eager = std::dynamic_pointer_cast<EagerModule>(graph.nodes()[i].module);
                   if (!eager) continue;
                   auto module = eager->rebuilt();
                   GraphModel::Forward forward = [module](const std::vector<at::Tensor>& values) {
                     return module->forward(values);
                   };
                   graph.replace_module(static_cast<int>(i), module, std::move(forward));
                 }
               };
             }
             py::gil_scoped_release released;
             return std::make_unique<DistributedModel>(std::move(runtime), std::move(model), defined_or_not(sample),
                                                       hook, resume ? Resume::kAsConfigured : Resume::kNever);
           }),
           py::arg("runtime"), py::arg("model"), py::arg("sample"), py::arg("materialize") = py::none(),
           py::arg("resume") = true)
      .def("train_step", with_python_loss<&DistributedModel::train_step>, py::arg("inputs"), py::arg("targets"),
           py::arg("loss"), py::arg("keep_outputs") = false, py::arg("batched") = std::vector<bool>{},
           py::arg("reduction") = LossReduction::kMean)
      .def("evaluate", with_python_loss<&DistributedModel::evaluate>, py::arg("inputs"), py::arg("targets"),
           py::arg("loss"), py::arg("keep_outputs") = false, py::arg("batched") = std::vector<bool>{},
           py::arg("reduction") = LossReduction::kMean)
      .def("count_refused_call", &DistributedModel::count_refused_call, py::arg("train_step"))
      .def(
          "next_call_takes_share_of",
          [](DistributedModel& model, const OptionalTensors& inputs, const std::optional<at::Tensor>& targets,
             const std::vector<bool>& batched) {
            model.next_call_takes_share_of(defined_or_not(inputs), targets.value_or(at::Tensor()), batched);
          },
          py::arg("inputs"), py::arg("targets"), py::arg("batched"))
      .def("named_parameters",
           [](const DistributedModel& model) {
             py::dict parameters;
             for (const auto& [name, parameter] : model.named_parameters()) parameters[py::str(name)] = parameter;
             return parameters;
           })
      .def("named_buffers",
           [](const DistributedModel& model) {
             py::dict buffers;
             for (const auto& [name, buffer] : model.named_buffers()) buffers[py::str(name)] = buffer;
             return buffers;
           })
      .def("seed_random_stream", &DistributedModel::seed_random_stream, py::arg("seed"))
      .def("load_parameters", &DistributedModel::load_parameters, py::arg("path"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("stage", &DistributedModel::stage)
      .def_property_readonly("stages", &DistributedModel::stages)
      .def("calls_per_microbatch", &DistributedModel::calls_per_microbatch)
      .def_property_readonly("stage_of_module", [](const DistributedModel& model) { return model.plan().stage_of_module; })
      .def("partition_report", [](const DistributedModel& model) { return model.plan().report(); })
      .def_property_readonly("loss_scale", &DistributedModel::loss_scale)
      .def_property_readonly("last_step_skipped", &DistributedModel::last_step_skipped)
      .def_property_readonly("gradients_dropped", &DistributedModel::gradients_dropped)
      .def("forget_dropped_gradients", &DistributedModel::forget_dropped_gradients)
      .def("clip_grad_norm", &DistributedModel::clip_grad_norm, py::arg("max_norm"),
           py::call_guard<py::gil_scoped_release>())
      .def("zero_grad", &DistributedModel::zero_grad, py::arg("set_to_none") = true)
      .def_property_readonly("optimizer_state_shards", &DistributedModel::optimizer_state_shards)
      .def("updates_parameter", &DistributedModel::updates_parameter, py::arg("parameter"))

      .def("share_updated_parameters", &DistributedModel::share_updated_parameters,
           py::call_guard<py::gil_scoped_release>());

  module.def(
      "batched_inputs",
      [](const OptionalTensors& inputs, const std::optional<at::Tensor>& targets, const std::string& caller) {
        return DistributedModel::batched_inputs(defined_or_not(inputs), targets.value_or(at::Tensor()), caller.c_str());
      },
      py::arg("inputs"), py::arg("targets"), py::arg("caller") = "train_step");
  // Counts CPU tensor bytes while open (benchmarks: a step's memory beside the planner's prediction).
  py::class_<CpuTensorMeter>(module, "CpuTensorMeter")
      .def(py::init<>())
      .def_property_readonly("live_bytes", &CpuTensorMeter::live_bytes)
      .def_property_readonly("peak_bytes", &CpuTensorMeter::peak_bytes)
      .def("reset_peak", &CpuTensorMeter::reset_peak);
  module.def(
      "write_file_atomically",
      [](const std::string& path, const std::string& contents) { write_file_atomically(path, contents); },
      py::arg("path"), py::arg("contents"));
  // smp.plan: the graph profiled on the sample (alone, as rank 0 profiles in a job), then every layout predicted.
  py::class_<ModelProfile>(module, "ModelProfile")
      .def(py::init<>())
      .def_property_readonly("nodes", [](const ModelProfile& profile) { return profile.modules.size(); })
      .def_property_readonly("tp_collectives", [](const ModelProfile& profile) {
        std::int64_t collectives = 0;
        for (const auto& node : profile.modules) collectives += node.tp_forward_collectives + node.tp_backward_collectives;
        return collectives;
      })
      .def_property_readonly("modules", [](const ModelProfile& profile) {
        py::list nodes;
        for (const auto& node : profile.modules) {
          py::dict row;
          row["name"] = node.name;
          row["forward_s"] = node.forward_s;
          row["backward_s"] = node.backward_s;
          row["parameter_bytes"] = node.parameter_bytes;
          row["activation_bytes"] = node.activation_bytes;
          row["largest_parameter_bytes"] = node.largest_parameter_bytes;
          row["frozen_parameter_bytes"] = node.frozen_parameter_bytes;
          row["expert_parameter_bytes"] = node.expert_parameter_bytes;
          row["expert_token_bytes"] = node.expert_token_bytes;
          row["expert_compute_share"] = node.expert_compute_share;
          nodes.append(row);
        }
        return nodes;
      })
      .def_readwrite("least_microbatch", &ModelProfile::least_microbatch)
      .def_readwrite("most_microbatch", &ModelProfile::most_microbatch)
      .def("copy", [](const ModelProfile& profile) { return profile; })
      .def("mark_experts", &ModelProfile::mark_experts, py::arg("token_bytes"), py::arg("experts"),
           py::arg("split") = 1, py::arg("routed") = std::map<std::string, ExpertRouting>{},
           py::arg("experts_per_token") = 0);
  module.def("routing_imbalance", &routing_imbalance, py::arg("routing"), py::arg("ep"), py::arg("samples"));
  module.def(
      "profile_for_planning",
      [](const GraphModel& graph, const OptionalTensors& sample, const std::string& device) {
        py::gil_scoped_release released;
        return profile_for_planning(graph, defined_or_not(sample), c10::Device(device));
      },
      py::arg("graph"), py::arg("sample"), py::arg("device"));
  // The process's tensor-parallel group as a stand-in of `degree` ranks while the context lives (tp::ProfiledDegree).
  struct ProfiledDegreeScope {
    int degree;
    std::unique_ptr<tp::ProfiledDegree> held;
  };
  py::class_<ProfiledDegreeScope>(module, "ProfiledDegree")
      .def(py::init([](int degree) { return ProfiledDegreeScope{degree, nullptr}; }), py::arg("degree"))
      .def("__enter__", [](ProfiledDegreeScope& scope) { scope.held = std::make_unique<tp::ProfiledDegree>(scope.degree); })
      .def("__exit__", [](ProfiledDegreeScope& scope, const py::args&) { scope.held.reset(); });
  module.def(
      "plan_layouts",
      [](const std::map<int, ModelProfile>& by_degree, const Config& config, int world_size, int global_batch_size,
         double memory_limit_mb, double optimizer_moments, double latency_s, double bytes_per_s, double compute_scale,
         double optimizer_s_per_byte, const std::vector<double>& device_speeds, double shared_processors,
         bool optimizer_foreach, double synchronization_s, double synchronized_bytes_per_s, bool keep_fixed_keys) {
        // Overrides of the job's config (0 / negative / empty: the config's).
        Config base = config;
        if (!device_speeds.empty()) base.device_speeds = device_speeds;
        if (global_batch_size > 0) base.global_batch_size = global_batch_size;
        if (memory_limit_mb >= 0) base.memory_limit_mb = memory_limit_mb;
        if (bytes_per_s <= 0) bytes_per_s = base.link_bandwidth_gbps * 1e9;
        std::vector<LayoutPrediction> predictions;
        {
          py::gil_scoped_release released;
          PlanningCosts costs{latency_s, bytes_per_s, bytes_per_s, compute_scale, optimizer_s_per_byte,
                              shared_processors};
          costs.optimizer_foreach = optimizer_foreach;
          costs.synchronization_s = synchronization_s;
          costs.synchronized_bytes_per_s = synchronized_bytes_per_s;
          predictions = plan_layouts(by_degree, base, world_size, costs, optimizer_moments, keep_fixed_keys);
        }
        py::list layouts;
        for (const auto& prediction : predictions) {
          py::dict row;
          row["layout"] = prediction.layout.describe();
          row["config"] = prediction.config_json();
          row["step_ms"] = prediction.step_s * 1e3;
          row["pipeline_ms"] = prediction.pipeline_s * 1e3;
          row["gradient_sync_ms"] = prediction.gradient_sync_s * 1e3;
          row["optimizer_ms"] = prediction.optimizer_s * 1e3;
          row["bubble"] = prediction.bubble_fraction;
          row["memory_mib"] = prediction.memory_mib;
          row["stages"] = prediction.stages;
          row["rejected"] = prediction.rejected.empty() ? py::object(py::none()) : py::str(prediction.rejected);
          row["timeline_svg"] = prediction.timeline_svg.empty() ? py::object(py::none()) : py::str(prediction.timeline_svg);
          layouts.append(row);
        }
        // A job's own plan: its choice as the C++ job takes it (the adopted config's text), or why there is none.
        py::object choice = py::none();
        if (keep_fixed_keys) {
          try {
            choice = py::dict(py::arg("config") = choose_layout(predictions, config, world_size).second.text);
          } catch (const ConfigError& error) {
            choice = py::dict(py::arg("error") = std::string(error.what()));
          }
        }
        return py::make_tuple(layouts, layout_report(predictions), choice);
      },
      py::arg("by_degree"), py::arg("config"), py::arg("world_size"), py::arg("global_batch_size"), py::arg("memory_limit_mb"),
      py::arg("optimizer_moments"), py::arg("latency_s"), py::arg("bytes_per_s"), py::arg("compute_scale"),
      py::arg("optimizer_s_per_byte"), py::arg("device_speeds") = std::vector<double>{},
      py::arg("shared_processors") = 0.0, py::arg("optimizer_foreach") = false, py::arg("synchronization_s") = 0.0,
      py::arg("synchronized_bytes_per_s") = 0.0, py::arg("keep_fixed_keys") = false);
  // smp.tp.shard_of: the engine's cut, so that both languages shard (and checkpoints reassemble) alike.
  module.def(
      "tp_shard_of",
      [](const at::Tensor& whole, int64_t dim, int64_t blocks, int64_t rank, int64_t degree) {
        return tp::shard_of(whole, dim, rank, degree, blocks);
      },
      py::arg("whole"), py::arg("dim"), py::arg("blocks"), py::arg("rank"), py::arg("degree"));
  // smp.tp's collectives and layers: the engine's (tp.h), over the process's tensor-parallel group. Called under
  // torch.export too, whose tracing sees the operators they dispatch (the GIL is taken back where it needs it).
  const auto release = py::call_guard<py::gil_scoped_release>();
  module.def("tp_copy_to_shards", [](const at::Tensor& x) { return tp::copy_to_shards(x, tp::process_group()); },
             release);
  module.def("tp_reduce_from_shards",
             [](const at::Tensor& x) { return tp::reduce_from_shards(x, tp::process_group()); }, release);
  module.def("tp_gather_last_dim", [](const at::Tensor& x) { return tp::gather_last_dim(x, tp::process_group()); },
             release);
  module.def("tp_scatter_last_dim", [](const at::Tensor& x) { return tp::scatter_last_dim(x, tp::process_group()); },
             release);
  module.def("tp_scatter_sequence", [](const at::Tensor& x) { return tp::scatter_sequence(x, tp::process_group()); },
             release);
  module.def(
      "tp_gather_sequence",
      [](const at::Tensor& x, bool for_whole) { return tp::gather_sequence(x, tp::process_group(), for_whole); },
      py::arg("x"), py::arg("for_whole"), release);
  module.def("tp_reduce_scatter_sequence",
             [](const at::Tensor& x) { return tp::reduce_scatter_sequence(x, tp::process_group()); }, release);
  module.def(
      "tp_column_parallel_linear",
      [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool gather_output,
         bool input_gathered, bool transposed) {
        using Input = tp::ColumnParallelOptions::Input;
        return tp::column_parallel_linear(x, weight, bias.value_or(at::Tensor()), tp::process_group(),
                                          {input_gathered ? Input::already_gathered : Input::whole, gather_output,
                                           transposed});
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("gather_output"), py::arg("input_gathered"),
      py::arg("transposed"), release);
  module.def(
      "tp_row_parallel_linear",
      [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool input_is_parallel,
         bool sequence_parallel, bool transposed) {
        return tp::row_parallel_linear(x, weight, bias.value_or(at::Tensor()), tp::process_group(),
                                       {input_is_parallel, sequence_parallel, transposed});
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("input_is_parallel"), py::arg("sequence_parallel"),
      py::arg("transposed"), release);
  module.def(
      "tp_vocab_parallel_embedding",
      [](const at::Tensor& ids, const at::Tensor& weight, int64_t first_id, std::optional<int64_t> padding_idx) {
        return tp::vocab_parallel_embedding(ids, weight, first_id, tp::process_group(), padding_idx.value_or(-1));
      },
      py::arg("ids"), py::arg("weight"), py::arg("first_id"), py::arg("padding_idx"), release);
  module.def(
      "tp_vocab_parallel_cross_entropy",
      [](const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
        return tp::vocab_parallel_cross_entropy(logits, targets, tp::process_group(), ignore_index);
      },
      py::arg("logits"), py::arg("targets"), py::arg("ignore_index"), release);
  module.def("recomputing", &recomputing);
  // Whether the process runs without collectives (rank 0 profiling alone, WithoutCollectives).
  module.def("without_collectives", &without_collectives);
  module.def("current_program_call", &current_program_call);
  module.def("describe_program_call", &describe_program_call, py::arg("id"));
  module.def("export_checkpoint", &export_checkpoint, py::arg("checkpoint_directory"), py::arg("output_file"),
             py::call_guard<py::gil_scoped_release>());
  module.def("export_checkpoint_safetensors", &export_checkpoint_safetensors, py::arg("checkpoint_directory"),
             py::arg("output_directory"), py::arg("max_shard_bytes"), py::call_guard<py::gil_scoped_release>());
  module.def(
      "read_full_model",
      [](const std::string& file) {
        py::dict tensors;
        const FullModel model = read_full_model(file);
        for (const auto& entry : model.parameters) tensors[py::str(entry.key())] = entry.value();
        for (const auto& entry : model.buffers) tensors[py::str(entry.key())] = entry.value();
        return tensors;
      },
      py::arg("full_model_file"));
  module.def("module_seed", &module_seed, py::arg("seed"), py::arg("path"));
  module.def("collective_bytes", [] {
    const auto bytes = collective_bytes();
    return py::dict(py::arg("all_reduced") = bytes.all_reduced, py::arg("all_gathered") = bytes.all_gathered,
                    py::arg("reduce_scattered") = bytes.reduce_scattered,
                    py::arg("all_to_all_sent") = bytes.all_to_all_sent);
  });
  module.def(
      "latest_checkpoint",
      [](const std::string& root) -> py::object {
        const auto found = find_latest_checkpoint(root);
        return found ? py::object(py::str(found->directory)) : py::object(py::none());
      },
      py::arg("root"));

  module.def(
      "resumed_layout",
      [](const Config& given, int world_size) { return resumed_layout(given, world_size).value_or(""); },
      py::arg("given"), py::arg("world_size"));

  py::class_<Checkpointer>(module, "Checkpointer")
      .def(py::init([](DistributedModel& model, py::function snapshot, py::function load) {
             return std::make_unique<Checkpointer>(
                 model, std::make_unique<PythonOptimizerState>(std::move(snapshot), std::move(load)));
           }),
           py::arg("model"), py::arg("snapshot_optimizer"), py::arg("load_optimizer"), py::keep_alive<1, 2>())
      .def("resume", &Checkpointer::resume, py::call_guard<py::gil_scoped_release>())
      .def("due", &Checkpointer::due, py::arg("step"))
      .def("save", &Checkpointer::save, py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def("wait", &Checkpointer::wait, py::call_guard<py::gil_scoped_release>());
}

}  // namespace smp::python
