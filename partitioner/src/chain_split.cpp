#include "smp/partitioner/chain_split.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace smp::part {
namespace {

void check_inputs(const std::vector<double>& node_costs, int num_stages) {
  const int num_nodes = static_cast<int>(node_costs.size());
  if (num_stages < 1) throw PartitionError("cannot split a chain into " + std::to_string(num_stages) + " stages");
  if (num_nodes < num_stages) {
    std::ostringstream message;
    message << "cannot split " << num_nodes << " modules into " << num_stages
            << " pipeline stages: every stage needs at least one module (lower `partitions` or split the model "
               "into more modules)";
    throw PartitionError(message.str());
  }
  for (int i = 0; i < num_nodes; ++i) {
    if (!std::isfinite(node_costs[i]) || node_costs[i] < 0) {
      throw PartitionError("module " + std::to_string(i) + " has an invalid cost " + std::to_string(node_costs[i]));
    }
  }
}

ChainSplit finish(const std::vector<double>& node_costs, std::vector<int> stage_of_node, int num_stages) {
  ChainSplit split;
  split.stage_costs.assign(num_stages, 0.0);
  for (std::size_t i = 0; i < node_costs.size(); ++i) split.stage_costs[stage_of_node[i]] += node_costs[i];
  split.bottleneck = *std::max_element(split.stage_costs.begin(), split.stage_costs.end());
  split.stage_of_node = std::move(stage_of_node);
  return split;
}

}  // namespace

ChainSplit split_chain_min_bottleneck(const std::vector<double>& node_costs, int num_stages,
                                      const std::vector<int>& fixed_stage) {
  check_inputs(node_costs, num_stages);
  const int n = static_cast<int>(node_costs.size());
  if (!fixed_stage.empty() && static_cast<int>(fixed_stage.size()) != n) {
    throw PartitionError("pinned stages given for " + std::to_string(fixed_stage.size()) + " nodes, expected " +
                         std::to_string(n));
  }
  int last_pin = -1, last_pin_node = -1;
  for (int node = 0; node < static_cast<int>(fixed_stage.size()); ++node) {
    const int pin = fixed_stage[node];
    if (pin < -1 || pin >= num_stages) {
      throw PartitionError("module " + std::to_string(node) + " is pinned to stage " + std::to_string(pin) +
                           ", outside [0, " + std::to_string(num_stages - 1) + "]");
    }
    if (pin < 0) continue;
    if (pin < last_pin) {
      throw PartitionError("module " + std::to_string(node) + " is pinned to stage " + std::to_string(pin) +
                           " but comes after module " + std::to_string(last_pin_node) + " pinned to stage " +
                           std::to_string(last_pin) + "; a chain's stages must follow its order");
    }
    last_pin = pin, last_pin_node = node;
  }
  // segment_allowed(stage, i, j): no node in [i, j) is pinned to another stage.
  std::vector<std::vector<int>> pinned_elsewhere_prefix(num_stages, std::vector<int>(n + 1, 0));
  for (int stage = 0; stage < num_stages; ++stage) {
    for (int node = 0; node < n; ++node) {
      const bool elsewhere = !fixed_stage.empty() && fixed_stage[node] >= 0 && fixed_stage[node] != stage;
      pinned_elsewhere_prefix[stage][node + 1] = pinned_elsewhere_prefix[stage][node] + (elsewhere ? 1 : 0);
    }
  }
  auto segment_allowed = [&](int stage, int i, int j) {
    return pinned_elsewhere_prefix[stage][j] == pinned_elsewhere_prefix[stage][i];
  };
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + node_costs[i];

  // best[k][j]: the smallest bottleneck of the first j nodes in k stages, ties broken by the smallest sum of
  // squared stage costs (the non-bottleneck stages come out balanced too, which shortens the pipeline's fill).
  // O(k n^2), ample for the module counts of a Sequential; the graph partitioner handles large graphs.
  constexpr double kInfeasible = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, kInfeasible));
  std::vector<std::vector<double>> squares(num_stages + 1, std::vector<double>(n + 1, kInfeasible));
  std::vector<std::vector<int>> cut(num_stages + 1, std::vector<int>(n + 1, -1));
  const double tolerance = 1e-12 * std::max(1.0, prefix[n]);
  best[0][0] = 0.0;
  squares[0][0] = 0.0;
  for (int k = 1; k <= num_stages; ++k) {
    for (int j = k; j <= n - (num_stages - k); ++j) {
      for (int i = k - 1; i < j; ++i) {
        if (best[k - 1][i] == kInfeasible || !segment_allowed(k - 1, i, j)) continue;
        const double segment = prefix[j] - prefix[i];
        const double candidate = std::max(best[k - 1][i], segment);
        const double candidate_squares = squares[k - 1][i] + segment * segment;
        const bool better = candidate < best[k][j] - tolerance ||
                            (candidate <= best[k][j] + tolerance && candidate_squares < squares[k][j] - tolerance * tolerance);
        if (better) {
          best[k][j] = candidate;
          squares[k][j] = candidate_squares;
          cut[k][j] = i;
        }
      }
    }
  }
  if (best[num_stages][n] == kInfeasible) {
    throw PartitionError("the pinned modules leave some stage empty: every one of the " + std::to_string(num_stages) +
                         " stages needs at least one module between the pins");
  }
  std::vector<int> stage_of_node(n);
  for (int k = num_stages, j = n; k >= 1; --k) {
    const int i = cut[k][j];
    for (int node = i; node < j; ++node) stage_of_node[node] = k - 1;
    j = i;
  }
  return finish(node_costs, std::move(stage_of_node), num_stages);
}

ChainSplit split_chain_uniform(const std::vector<double>& node_costs, int num_stages) {
  check_inputs(node_costs, num_stages);
  const int n = static_cast<int>(node_costs.size());
  std::vector<int> stage_of_node(n);
  const int base = n / num_stages, extra = n % num_stages;
  for (int stage = 0, node = 0; stage < num_stages; ++stage) {
    const int count = base + (stage < extra ? 1 : 0);
    for (int c = 0; c < count; ++c) stage_of_node[node++] = stage;
  }
  return finish(node_costs, std::move(stage_of_node), num_stages);
}

}  // namespace smp::part
