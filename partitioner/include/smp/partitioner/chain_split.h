#pragma once
// Contiguous split of a chain of nodes into pipeline stages. Plain C++ (no LibTorch): costs in, stages out.

#include <stdexcept>
#include <vector>

namespace smp::part {

class PartitionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ChainSplit {
  std::vector<int> stage_of_node;   // non-decreasing, every stage non-empty
  std::vector<double> stage_costs;  // sum of node costs per stage
  double bottleneck = 0.0;          // the slowest stage's cost, which bounds pipeline throughput
};

// Exact minimum-bottleneck split of `node_costs` into exactly `num_stages` non-empty contiguous stages. Among
// optimal splits it returns the one with the smallest sum of squared stage costs (the rest balanced too).
// `fixed_stage` (empty, or one entry per node: -1 = free, else the stage the node must be on) pins nodes.
// Throws PartitionError when there are fewer nodes than stages, a cost is negative or not finite, or the pins
// admit no contiguous split (the message names the nodes by index).
ChainSplit split_chain_min_bottleneck(const std::vector<double>& node_costs, int num_stages,
                                      const std::vector<int>& fixed_stage = {});

// Splits by node count alone (the first stages take one extra node when the count does not divide).
ChainSplit split_chain_uniform(const std::vector<double>& node_costs, int num_stages);

}  // namespace smp::part
