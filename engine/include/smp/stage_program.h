#pragma once
// What one stage computes per microbatch, as a list of calls: a node alone, or a run of consecutive nodes in one call
// where the model fuses them (GraphModel::set_run_fuser). Activation-checkpointed nodes stay alone, since backward
// recomputes each of them on its own.

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/graph_model.h"

namespace smp {

struct NodeRun {
  std::vector<int> nodes;           // consecutive on the stage, in model order
  std::vector<std::string> inputs;  // a fused run's: what it reads from outside itself, in first-read order
  GraphModel::RunForward forward;   // empty: one node, computed alone
};

// `nodes` (one stage's, in model order) as runs: each maximal sequence of two or more nodes not in `alone` that the
// model fuses is one run, every other node a run of its own.
std::vector<NodeRun> plan_node_runs(const GraphModel& model, const std::vector<int>& nodes,
                                    const std::vector<bool>& alone);

// Computes the runs into `values`, which holds the model inputs and the tensors the stage received; `compute_alone`
// computes one node from its inputs. A failure is a ModelError naming `where` ("step 3, stage 1"), the module or the
// fused run's first and last, and the shapes of what it read.
void compute_runs(const GraphModel& model, const std::vector<NodeRun>& runs, std::map<std::string, at::Tensor>& values,
                  const std::function<at::Tensor(int node, const std::vector<at::Tensor>&)>& compute_alone,
                  const std::function<std::string()>& where);

}  // namespace smp
