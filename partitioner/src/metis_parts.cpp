// METIS as a source of node orders: its parts balance the node costs while cutting few bytes, which a contiguous
// split of the original topological order cannot see on a DAG with parallel branches.

#include <metis.h>

#include <algorithm>
#include <cmath>

#include "graph_internals.h"

namespace smp::part::detail {
namespace {

// METIS takes 32-bit integer weights whose sums must not overflow: node weights are scaled to about 1e7 in all,
// edge weights to about 5e8 in all, each at least 1 (a zero weight would let METIS ignore a node or an edge).
constexpr double kTotalNodeWeight = 1e7;
constexpr double kTotalEdgeWeight = 5e8;
constexpr real_t kAllowedImbalance = 1.05;  // the contiguous split rebalances afterwards, so 5% costs nothing

idx_t scaled_weight(double value, double scale) {
  return static_cast<idx_t>(std::max<long long>(1, std::llround(value * scale)));
}

}  // namespace

std::vector<int> metis_parts(const ModuleGraph& graph, const CostModel& costs, int num_parts) {
  const int num_nodes = static_cast<int>(graph.nodes.size());
  // METIS wants a symmetric graph without parallel edges: merge both directions, summing their bytes.
  std::vector<std::vector<std::pair<int, double>>> neighbors(num_nodes);
  double total_bytes = 0;
  for (const GraphEdge& edge : graph.edges) {
    neighbors[edge.from].emplace_back(edge.to, edge.bytes);
    neighbors[edge.to].emplace_back(edge.from, edge.bytes);
    total_bytes += edge.bytes;
  }
  const bool bytes_matter = costs.per_sent_byte > 0 && total_bytes > 0;
  const double edge_scale = bytes_matter ? kTotalEdgeWeight / (2 * total_bytes) : 0.0;

  std::vector<idx_t> offsets{0}, adjacent, edge_weights;
  for (auto& list : neighbors) {
    std::sort(list.begin(), list.end());
    for (std::size_t i = 0; i < list.size();) {
      const int neighbor = list[i].first;
      double bytes = 0;
      for (; i < list.size() && list[i].first == neighbor; ++i) bytes += list[i].second;
      adjacent.push_back(neighbor);
      edge_weights.push_back(scaled_weight(bytes, edge_scale));
    }
    offsets.push_back(static_cast<idx_t>(adjacent.size()));
  }

  double total_node_cost = 0;
  for (const GraphNode& node : graph.nodes) total_node_cost += costs.mean_node_cost(node);
  const double node_scale = total_node_cost > 0 ? kTotalNodeWeight / total_node_cost : 0.0;
  std::vector<idx_t> node_weights(num_nodes);
  for (int node = 0; node < num_nodes; ++node) {
    node_weights[node] = scaled_weight(costs.mean_node_cost(graph.nodes[node]), node_scale);
  }

  idx_t vertex_count = num_nodes, constraints = 1, parts = num_parts, edge_cut = 0;
  real_t imbalance = kAllowedImbalance;
  idx_t options[METIS_NOPTIONS];
  METIS_SetDefaultOptions(options);
  options[METIS_OPTION_SEED] = 1;  // reproducible partitions
  std::vector<idx_t> part(num_nodes, 0);
  // METIS's manual: recursive bisection is the better choice for a few parts, k-way beyond about 8.
  auto* method = num_parts <= 8 ? METIS_PartGraphRecursive : METIS_PartGraphKway;
  const int status = method(&vertex_count, &constraints, offsets.data(), adjacent.data(), node_weights.data(),
                            nullptr, edge_weights.data(), &parts, nullptr, &imbalance, options, &edge_cut,
                            part.data());
  if (status != METIS_OK) return {};
  return std::vector<int>(part.begin(), part.end());
}

}  // namespace smp::part::detail
