#pragma once
// A TorchScript module (scripted or traced in Python, saved with torch.jit.save, loaded in C++ with
// torch::jit::load) as an smp::GraphModel, cut between its submodule calls at the depth balance needs:
//
//   torch::jit::Module scripted = torch::jit::load("model.pt");
//   smp::GraphModel model = smp::graph_from_torchscript(scripted, config.num_stages());
//   smp::DistributedModel distributed(runtime, model, sample);
//
// The forward's submodule calls are the units; a call holding more than a quarter of a stage's share of the
// parameters is inlined, so that its own submodule calls become units (a transformer block's attention and MLP),
// until none is left to cut. Each value one unit makes and another reads is a node, running the forward's
// operations that lead to it from its inputs; values that depend on no parameter (masks, positions) are computed
// again where they are read. Parameters keep their paths in the module ("layers.3.linear.weight"), the tensors
// the TorchScript module holds, so that it is trained in place. The forward's inputs are the model's inputs, named
// as in its signature; a tuple it returns gives several outputs.

#include <torch/csrc/jit/api/module.h>

#include "smp/graph_model.h"

namespace smp {

// Throws ModelError for what cannot be cut (a forward that returns something other than tensors or a tuple of
// them).
GraphModel graph_from_torchscript(const torch::jit::Module& module, int stages);

}  // namespace smp
