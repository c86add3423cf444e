// The objective, input validation and the partition checks of the graph partitioner.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "graph_internals.h"

namespace smp::part {
namespace detail {
namespace {

bool valid_amount(double value) { return std::isfinite(value) && value >= 0; }

std::string stage_text(int stage) { return "stage " + std::to_string(stage); }

}  // namespace

std::string node_label(const ModuleGraph& graph, int node) {
  const std::string& name = graph.nodes[node].name;
  return name.empty() ? "#" + std::to_string(node) : "'" + name + "'";
}

std::string readable_bytes(double bytes) {
  char text[64];
  if (bytes < 1024.0 * 1024.0) std::snprintf(text, sizeof text, "%.0f bytes", bytes);
  else std::snprintf(text, sizeof text, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return text;
}

Adjacency::Adjacency(const ModuleGraph& graph)
    : out(graph.nodes.size()), predecessors(graph.nodes.size()), successors(graph.nodes.size()) {
  const int num_nodes = static_cast<int>(graph.nodes.size());
  for (std::size_t e = 0; e < graph.edges.size(); ++e) {
    const GraphEdge& edge = graph.edges[e];
    const std::string which = "edge " + std::to_string(e);
    if (edge.from < 0 || edge.to < 0 || edge.from >= num_nodes || edge.to >= num_nodes) {
      throw PartitionError(which + " (" + std::to_string(edge.from) + " -> " + std::to_string(edge.to) +
                           ") names a node outside [0, " + std::to_string(num_nodes - 1) + "]");
    }
    if (edge.from >= edge.to) {
      throw PartitionError(which + " from " + node_label(graph, edge.from) + " to " + node_label(graph, edge.to) +
                           " points backwards: list the nodes in a topological order (every edge from < to)");
    }
    if (!valid_amount(edge.bytes)) {
      throw PartitionError(which + " from " + node_label(graph, edge.from) + " to " + node_label(graph, edge.to) +
                           " has invalid bytes " + std::to_string(edge.bytes));
    }
    out[edge.from].push_back({edge.to, edge.bytes});
    predecessors[edge.to].push_back(edge.from);
    successors[edge.from].push_back(edge.to);
  }
  for (auto* lists : {&predecessors, &successors}) {
    for (std::vector<int>& nodes : *lists) {
      std::sort(nodes.begin(), nodes.end());
      nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    }
  }
}

CostModel::CostModel(const ModuleGraph& graph, const GraphPartitionOptions& options)
    : activation_copies(options.activation_copies.empty() ? std::vector<double>(options.num_stages, 1.0)
                                                          : options.activation_copies),
      recomputes(std::max(options.num_stages, 0), 0),
      compute_factors(std::max(options.num_stages, 0), 1.0) {
  // evaluate() builds a cost model without validate(): the per-stage factors must fit before they are indexed.
  const std::size_t stages_given = recomputes.size();
  auto sized = [&](std::size_t size) { return size == 0 || size == stages_given; };
  if (activation_copies.size() != stages_given || !sized(options.recomputes.size()) ||
      !sized(options.stage_speeds.size()) || !sized(options.stage_memory_limit_bytes.size())) {
    throw PartitionError("activation_copies, recomputes, stage_speeds and stage_memory_limit_bytes need one entry "
                         "per stage (" + std::to_string(options.num_stages) + ") or none, got " +
                         std::to_string(options.activation_copies.size()) + ", " +
                         std::to_string(options.recomputes.size()) + ", " +
                         std::to_string(options.stage_speeds.size()) + " and " +
                         std::to_string(options.stage_memory_limit_bytes.size()));
  }
  for (std::size_t stage = 0; stage < options.stage_speeds.size(); ++stage) {
    const double speed = options.stage_speeds[stage];
    if (!(std::isfinite(speed) && speed > 0)) {
      throw PartitionError("stage_speeds of " + stage_text(static_cast<int>(stage)) +
                           " must be finite and positive, got " + std::to_string(speed));
    }
    compute_factors[stage] = 1.0 / speed;
  }
  for (std::size_t stage = 0; stage < options.stage_memory_limit_bytes.size(); ++stage) {
    if (!valid_amount(options.stage_memory_limit_bytes[stage])) {
      throw PartitionError("stage_memory_limit_bytes of " + stage_text(static_cast<int>(stage)) +
                           " must be finite and non-negative, got " +
                           std::to_string(options.stage_memory_limit_bytes[stage]));
    }
  }
  for (std::size_t stage = 0; stage < activation_copies.size(); ++stage) {
    if (!valid_amount(activation_copies[stage])) {
      throw PartitionError("activation_copies of " + stage_text(static_cast<int>(stage)) +
                           " must be finite and non-negative, got " + std::to_string(activation_copies[stage]));
    }
  }
  for (std::size_t stage = 0; stage < options.recomputes.size() && stage < recomputes.size(); ++stage) {
    recomputes[stage] = options.recomputes[stage] ? 1 : 0;
  }
  if (options.num_stages > 0) {
    double copies = 0, recomputing = 0;
    for (int stage = 0; stage < options.num_stages; ++stage) {
      copies += activation_copies[stage];
      recomputing += recomputes[stage];
    }
    mean_activation_copies = copies / options.num_stages;
    mean_recomputes = recomputing / options.num_stages;
  }
  double total_compute_s = 0, total_memory_bytes = 0;
  for (const GraphNode& node : graph.nodes) {
    total_compute_s += node.compute_s + mean_recomputes * node.recompute_s;
    total_memory_bytes += node.memory_bytes + mean_activation_copies * node.activation_bytes;
  }
  // The time term's scale: a stage's share of the whole when every stage's time is equal, total / sum of speeds.
  double speeds = 0;
  for (double factor : compute_factors) speeds += 1.0 / factor;
  const double stages = options.num_stages, w = options.memory_weight;
  if (total_compute_s > 0) per_compute_s = (1 - w) * speeds / total_compute_s;
  if (options.bandwidth_bytes_per_s > 0) per_sent_byte = per_compute_s / options.bandwidth_bytes_per_s;
  if (total_memory_bytes > 0) per_memory_byte = w * stages / total_memory_bytes;
  if (options.parameters_on_every_stage) {
    const auto with_parameters = std::count_if(graph.nodes.begin(), graph.nodes.end(),
                                               [](const GraphNode& node) { return node.parameter_bytes > 0; });
    needs_parameters = options.num_stages > 1 && with_parameters >= options.num_stages;
  }
  memory_limits.assign(compute_factors.size(), kInfinity);
  split_memory_limits.assign(compute_factors.size(), kInfinity);
  for (std::size_t stage = 0; stage < memory_limits.size(); ++stage) {
    const double own = stage < options.stage_memory_limit_bytes.size() ? options.stage_memory_limit_bytes[stage] : 0.0;
    const double limit = own > 0 ? own : options.memory_limit_bytes;
    if (limit > 0) memory_limits[stage] = limit * (1 + 1e-9), split_memory_limits[stage] = limit * (1 + 1e-10);
  }
}

double SentBytes::of_producer(const Adjacency& adjacency, const std::vector<int>& stage_of_node, int node) {
  if (++epoch_ == 0) {  // wrapped: old stamps could read as current
    std::fill(stamp_.begin(), stamp_.end(), 0u);
    epoch_ = 1;
  }
  const int own_stage = stage_of_node[node];
  double total = 0;
  for (const OutEdge& edge : adjacency.out[node]) {
    const int stage = stage_of_node[edge.to];
    if (stage == own_stage) continue;
    if (stamp_[stage] != epoch_) {
      stamp_[stage] = epoch_;
      largest_[stage] = edge.bytes;
      total += edge.bytes;
    } else if (edge.bytes > largest_[stage]) {
      total += edge.bytes - largest_[stage];
      largest_[stage] = edge.bytes;
    }
  }
  return total;
}

StageMeter::StageMeter(const ModuleGraph& graph, const Adjacency& adjacency, const CostModel& costs, int num_stages)
    : totals(num_stages), cost(num_stages), graph_(graph), adjacency_(adjacency), costs_(costs),
      sent_bytes_of_(num_stages) {}

double StageMeter::bottleneck(const std::vector<int>& stage_of_node) {
  std::fill(totals.begin(), totals.end(), StageTotals{});
  for (std::size_t node = 0; node < graph_.nodes.size(); ++node) {
    StageTotals& stage = totals[stage_of_node[node]];
    stage.add(graph_.nodes[node]);
    stage.sent_bytes += sent_bytes_of_.of_producer(adjacency_, stage_of_node, static_cast<int>(node));
  }
  double worst = 0;
  for (std::size_t stage = 0; stage < cost.size(); ++stage) {
    cost[stage] = costs_.stage_cost(static_cast<int>(stage), totals[stage]);
    worst = std::max(worst, cost[stage]);
  }
  return worst;
}

StageBounds validate(const ModuleGraph& graph, const Adjacency& adjacency, const GraphPartitionOptions& options) {
  const int num_nodes = static_cast<int>(graph.nodes.size()), num_stages = options.num_stages;
  if (num_stages < 1) throw PartitionError("cannot split a graph into " + std::to_string(num_stages) + " stages");
  if (num_nodes < num_stages) {
    throw PartitionError("cannot split " + std::to_string(num_nodes) + " modules into " + std::to_string(num_stages) +
                         " pipeline stages: every stage needs at least one module");
  }
  for (int node = 0; node < num_nodes; ++node) {
    const GraphNode& info = graph.nodes[node];
    if (!valid_amount(info.compute_s) || !valid_amount(info.memory_bytes) || !valid_amount(info.parameter_bytes) ||
        !valid_amount(info.activation_bytes) || !valid_amount(info.recompute_s)) {
      throw PartitionError("module " + node_label(graph, node) + " has a negative or non-finite cost");
    }
  }
  if (!(options.memory_weight >= 0 && options.memory_weight <= 1)) {
    throw PartitionError("memory_weight must be in [0, 1], got " + std::to_string(options.memory_weight));
  }
  if (!valid_amount(options.bandwidth_bytes_per_s) || !valid_amount(options.memory_limit_bytes)) {
    throw PartitionError("bandwidth_bytes_per_s and memory_limit_bytes must be finite and non-negative");
  }

  const std::vector<int>& pinned = options.pinned;
  if (!pinned.empty() && static_cast<int>(pinned.size()) != num_nodes) {
    throw PartitionError("pinned stages given for " + std::to_string(pinned.size()) + " nodes, expected " +
                         std::to_string(num_nodes));
  }
  auto pin_of = [&](int node) { return pinned.empty() ? -1 : pinned[node]; };
  for (int node = 0; node < num_nodes; ++node) {
    if (pin_of(node) < -1 || pin_of(node) >= num_stages) {
      throw PartitionError("module " + node_label(graph, node) + " is pinned to " + stage_text(pin_of(node)) +
                           ", outside [0, " + std::to_string(num_stages - 1) + "]");
    }
  }

  const CostModel costs(graph, options);  // checks the per-stage factors
  auto limit_of = [&](int stage) {  // 0: none
    const auto& own = options.stage_memory_limit_bytes;
    return own.empty() || own[stage] == 0 ? options.memory_limit_bytes : own[stage];
  };
  for (int node = 0; node < num_nodes; ++node) {
    // A node fits if it fits alone on some stage; the message names the stage it comes closest on.
    double closest_need = 0, closest_limit = 0;
    bool fits = false;
    for (int stage = 0; stage < num_stages && !fits; ++stage) {
      const double limit = limit_of(stage);
      const double need = graph.nodes[node].memory_bytes + costs.activation_copies[stage] * graph.nodes[node].activation_bytes;
      fits = limit == 0 || need <= limit;
      if (stage == 0 || need - limit < closest_need - closest_limit) closest_need = need, closest_limit = limit;
    }
    if (!fits) {
      std::string need = readable_bytes(closest_need), limit = readable_bytes(closest_limit);
      if (need == limit) {  // rounded alike ("1.0 MiB, over ... 1.0 MiB"): in bytes, which differ
        need = std::to_string(static_cast<long long>(closest_need)) + " bytes";
        limit = std::to_string(static_cast<long long>(closest_limit)) + " bytes";
      }
      throw PartitionError("module " + node_label(graph, node) + " alone needs " + need +
                           ", over the per-stage memory limit of " + limit);
    }
  }

  StageBounds bounds{std::vector<int>(num_nodes, 0), std::vector<int>(num_nodes, num_stages - 1)};
  std::vector<int> earliest_because_of(num_nodes, -1);  // the pinned ancestor that sets `earliest`
  for (int node = 0; node < num_nodes; ++node) {
    for (int predecessor : adjacency.predecessors[node]) {
      if (bounds.earliest[predecessor] > bounds.earliest[node]) {
        bounds.earliest[node] = bounds.earliest[predecessor];
        earliest_because_of[node] = earliest_because_of[predecessor];
      }
    }
    const int pin = pin_of(node);
    if (pin < 0) continue;
    if (bounds.earliest[node] > pin) {
      const int ancestor = earliest_because_of[node];
      throw PartitionError("module " + node_label(graph, node) + " is pinned to " + stage_text(pin) +
                           " but depends on module " + node_label(graph, ancestor) + " pinned to " +
                           stage_text(pin_of(ancestor)) + ": tensors only flow to the same or later stages");
    }
    bounds.earliest[node] = pin;
    earliest_because_of[node] = node;
  }
  for (int node = num_nodes - 1; node >= 0; --node) {
    for (int successor : adjacency.successors[node]) {
      bounds.latest[node] = std::min(bounds.latest[node], bounds.latest[successor]);
    }
    if (pin_of(node) >= 0) bounds.latest[node] = pin_of(node);
  }
  return bounds;
}

}  // namespace detail

GraphPartition evaluate(const ModuleGraph& graph, const std::vector<int>& stage_of_node,
                        const GraphPartitionOptions& options) {
  const int num_stages = options.num_stages;
  if (num_stages < 1) throw PartitionError("cannot evaluate a partition into " + std::to_string(num_stages) + " stages");
  if (stage_of_node.size() != graph.nodes.size()) {
    throw PartitionError("the partition places " + std::to_string(stage_of_node.size()) + " nodes, the graph has " +
                         std::to_string(graph.nodes.size()));
  }
  for (std::size_t node = 0; node < stage_of_node.size(); ++node) {
    if (stage_of_node[node] < 0 || stage_of_node[node] >= num_stages) {
      throw PartitionError("module " + detail::node_label(graph, static_cast<int>(node)) + " is on " +
                           detail::stage_text(stage_of_node[node]) + ", outside [0, " +
                           std::to_string(num_stages - 1) + "]");
    }
  }
  const detail::Adjacency adjacency(graph);
  GraphPartitionOptions judged = options;
  judged.parameters_on_every_stage = false;  // a rule of the search, not a cost: a given partition's costs stay finite
  const detail::CostModel costs(graph, judged);
  detail::StageMeter meter(graph, adjacency, costs, num_stages);
  GraphPartition partition;
  partition.bottleneck = meter.bottleneck(stage_of_node);
  partition.stage_of_node = stage_of_node;
  for (int stage = 0; stage < num_stages; ++stage) {
    const detail::StageTotals& totals = meter.totals[stage];
    partition.stage_compute_s.push_back(costs.stage_compute_s(stage, totals));
    partition.stage_memory_bytes.push_back(costs.stage_memory_bytes(stage, totals));
    partition.stage_sent_bytes.push_back(totals.sent_bytes);
  }
  partition.stage_cost = std::move(meter.cost);
  return partition;
}

void check_partition(const ModuleGraph& graph, const GraphPartition& partition, int num_stages) {
  const std::vector<int>& stage_of_node = partition.stage_of_node;
  if (stage_of_node.size() != graph.nodes.size()) {
    throw PartitionError("the partition places " + std::to_string(stage_of_node.size()) + " nodes, the graph has " +
                         std::to_string(graph.nodes.size()));
  }
  std::vector<int> nodes_on_stage(std::max(num_stages, 0), 0);
  for (std::size_t node = 0; node < stage_of_node.size(); ++node) {
    const int stage = stage_of_node[node];
    if (stage < 0 || stage >= num_stages) {
      throw PartitionError("module " + detail::node_label(graph, static_cast<int>(node)) + " is on " +
                           detail::stage_text(stage) + ", outside [0, " + std::to_string(num_stages - 1) + "]");
    }
    ++nodes_on_stage[stage];
  }
  const detail::Adjacency checked_edges(graph);  // throws before a malformed edge could index stage_of_node
  for (const GraphEdge& edge : graph.edges) {
    if (stage_of_node[edge.from] > stage_of_node[edge.to]) {
      throw PartitionError("module " + detail::node_label(graph, edge.to) + " on " +
                           detail::stage_text(stage_of_node[edge.to]) + " consumes module " +
                           detail::node_label(graph, edge.from) + " on later " +
                           detail::stage_text(stage_of_node[edge.from]) + ": the stages form a cycle");
    }
  }
  for (int stage = 0; stage < num_stages; ++stage) {
    if (nodes_on_stage[stage] == 0) throw PartitionError(detail::stage_text(stage) + " has no module");
  }
}

}  // namespace smp::part
