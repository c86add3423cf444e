#include "smp/stage_program.h"

#include <algorithm>
#include <exception>

#include <c10/util/StringUtil.h>

#include "smp/comm/communicator.h"
#include "smp/errors.h"

namespace smp {

namespace {

// The names a run reads that no node of it makes, in the order the nodes first read them.
std::vector<std::string> outside_inputs(const GraphModel& model, const std::vector<int>& run) {
  std::vector<std::string> inputs;
  std::vector<std::string> made;
  for (int index : run) {
    for (const auto& input : model.nodes()[index].inputs) {
      if (std::find(made.begin(), made.end(), input) == made.end() &&
          std::find(inputs.begin(), inputs.end(), input) == inputs.end()) {
        inputs.push_back(input);
      }
    }
    made.push_back(model.nodes()[index].name);
  }
  return inputs;
}

std::string shapes_of(const std::vector<at::Tensor>& tensors) {
  std::string shapes;
  for (const auto& tensor : tensors) {
    shapes += (shapes.empty() ? "" : ", ") + (tensor.defined() ? c10::str(tensor.sizes()) : std::string("None"));
  }
  return shapes;
}

}  // namespace

std::vector<NodeRun> plan_node_runs(const GraphModel& model, const std::vector<int>& nodes,
                                    const std::vector<bool>& alone) {
  std::vector<NodeRun> runs;
  std::vector<int> pending;  // consecutive nodes that may be fused
  const auto flush = [&] {
    if (pending.size() >= 2 && model.run_fuser()) {
      auto inputs = outside_inputs(model, pending);
      if (auto forward = model.run_fuser()(pending, inputs)) {
        runs.push_back({pending, std::move(inputs), std::move(forward)});
        pending.clear();
        return;
      }
    }
    for (int node : pending) runs.push_back({{node}, {}, {}});
    pending.clear();
  };
  for (int node : nodes) {
    if (alone[static_cast<std::size_t>(node)]) {
      flush();
      runs.push_back({{node}, {}, {}});
    } else {
      pending.push_back(node);
    }
  }
  flush();
  return runs;
}

void compute_runs(const GraphModel& model, const std::vector<NodeRun>& runs, std::map<std::string, at::Tensor>& values,
                  const std::function<at::Tensor(int node, const std::vector<at::Tensor>&)>& compute_alone,
                  const std::function<std::string()>& where) {
  const auto& nodes = model.nodes();
  std::vector<at::Tensor> arguments;
  for (const auto& run : runs) {
    arguments.clear();
    const auto& reads = run.forward ? run.inputs : nodes[run.nodes.front()].inputs;
    for (const auto& input : reads) arguments.push_back(values.at(input));
    try {
      if (!run.forward) {
        values[nodes[run.nodes.front()].name] = compute_alone(run.nodes.front(), arguments);
        continue;
      }
      auto computed = run.forward(arguments);
      if (computed.size() != run.nodes.size()) {
        throw ModelError("the fused run returned " + std::to_string(computed.size()) + " tensors for " +
                         std::to_string(run.nodes.size()) + " nodes");
      }
      for (std::size_t i = 0; i < computed.size(); ++i) values[nodes[run.nodes[i]].name] = std::move(computed[i]);
    } catch (const Interrupted&) {
      throw;
    } catch (const std::exception& error) {  // LibTorch's, TorchScript's interpreter's, or Python's
      // A model that does not fit its data fails inside LibTorch; say where, without the C++ backtrace.
      const std::string module = run.nodes.size() == 1
                                     ? "module \"" + nodes[run.nodes.front()].name + "\""
                                     : "modules \"" + nodes[run.nodes.front()].name + "\" to \"" +
                                           nodes[run.nodes.back()].name + "\" (run as one)";
      throw ModelError(where() + ", " + module + " (input " + shapes_of(arguments) + "): " +
                       comm::brief_message(error));
    }
  }
}

}  // namespace smp
