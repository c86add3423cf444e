#pragma once
// Backward split into I (input gradients) and W (weight gradients) for the zero-bubble schedules, so that W does
// only the weight work: I runs the graph to the stage's inputs without computing weight gradients and records what
// flows into every node that computes one (a "weight node": e.g. a matmul's backward, whose weight edge leads to
// parameters only); W then runs just those nodes, for their weight outputs, from what I recorded.
// When some weight node is not on I's path (its stage input needs no gradient), W falls back to one backward pass
// from the stage's outputs to its parameters: the same result, without the saving.

#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace smp {

class WeightPass {
 public:
  // Runs I: returns the gradients of `roots` (seeded with `root_grads`) with respect to `inputs` (zeros where none
  // flows) and the W still to run for `parameters`. The graph is kept for W.
  static std::pair<std::vector<at::Tensor>, WeightPass> run_input_pass(const std::vector<at::Tensor>& roots,
                                                                       const std::vector<at::Tensor>& root_grads,
                                                                       const std::vector<at::Tensor>& inputs,
                                                                       const std::vector<at::Tensor>& parameters);
  WeightPass();
  ~WeightPass();
  WeightPass(WeightPass&&) noexcept;
  WeightPass& operator=(WeightPass&&) noexcept;

  // Runs W once: each parameter's gradient accumulates exactly once (as one backward pass would add it).
  void run();
  bool pending() const;
  // True when W will run only the weight nodes (not the fallback backward pass): for tests and benchmarks.
  bool runs_weight_nodes_only() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace smp
