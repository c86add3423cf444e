// The graph partition search (see graph_partition.h), its baselines and its exhaustive yardstick.

#include "smp/partitioner/graph_partition.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "graph_internals.h"

namespace smp::part {
namespace {

using detail::Adjacency;
using detail::CostModel;
using detail::LinearProblem;
using detail::StageBounds;

// The baselines check the graph and the stage count, and ignore pins and the memory limit.
void validate_for_baseline(const ModuleGraph& graph, int num_stages) {
  GraphPartitionOptions options;
  options.num_stages = num_stages;
  detail::validate(graph, Adjacency(graph), options);
}

// A topological order (Kahn's algorithm) choosing among the ready nodes, in this order of preference: those a pin
// forces earliest (smallest `latest` stage; so the pinned stages never decrease along the order), the group of
// the previous node (a run of one group lets the contiguous split cut around it), the smaller group rank, the
// smaller tie_break (a permutation of the nodes).
std::vector<int> topological_order(const Adjacency& adjacency, const StageBounds& bounds,
                                   const std::vector<int>& group_rank, const std::vector<int>& tie_break) {
  const int num_nodes = static_cast<int>(adjacency.out.size());
  using Key = std::tuple<int, int, int, int>;
  auto by_pins = [&](int node) {
    return Key{bounds.latest[node], bounds.earliest[node], group_rank[node], tie_break[node]};
  };
  auto by_group = [&](int node) {
    return Key{group_rank[node], bounds.latest[node], bounds.earliest[node], tie_break[node]};
  };
  std::vector<int> node_of_tie(num_nodes);
  for (int node = 0; node < num_nodes; ++node) node_of_tie[tie_break[node]] = node;
  std::set<Key> ready_by_pins, ready_by_group;
  std::vector<int> waiting_for(num_nodes);
  for (int node = 0; node < num_nodes; ++node) {
    waiting_for[node] = static_cast<int>(adjacency.predecessors[node].size());
    if (waiting_for[node] == 0) ready_by_pins.insert(by_pins(node)), ready_by_group.insert(by_group(node));
  }
  std::vector<int> order;
  order.reserve(num_nodes);
  int current_group = -1;
  while (!ready_by_pins.empty()) {
    int chosen = node_of_tie[std::get<3>(*ready_by_pins.begin())];
    const auto same_group = ready_by_group.lower_bound(Key{current_group, INT_MIN, INT_MIN, INT_MIN});
    if (same_group != ready_by_group.end() && std::get<0>(*same_group) == current_group &&
        std::get<1>(*same_group) == bounds.latest[chosen]) {
      chosen = node_of_tie[std::get<3>(*same_group)];
    }
    ready_by_pins.erase(by_pins(chosen));
    ready_by_group.erase(by_group(chosen));
    order.push_back(chosen);
    current_group = group_rank[chosen];
    for (int successor : adjacency.successors[chosen]) {
      if (--waiting_for[successor] == 0) {
        ready_by_pins.insert(by_pins(successor)), ready_by_group.insert(by_group(successor));
      }
    }
  }
  return order;
}

// Ranks METIS's parts by the mean position of their nodes in the given order, so that the order visits them
// roughly front to back.
std::vector<int> part_rank_of_node(const std::vector<int>& part) {
  const int num_nodes = static_cast<int>(part.size());
  const int num_parts = *std::max_element(part.begin(), part.end()) + 1;
  std::vector<double> position_sum(num_parts, 0.0), count(num_parts, 0.0);
  for (int node = 0; node < num_nodes; ++node) position_sum[part[node]] += node, count[part[node]] += 1;
  std::vector<int> parts_by_position(num_parts);
  std::iota(parts_by_position.begin(), parts_by_position.end(), 0);
  auto mean_position = [&](int p) { return count[p] > 0 ? position_sum[p] / count[p] : 0.0; };
  std::stable_sort(parts_by_position.begin(), parts_by_position.end(),
                   [&](int a, int b) { return mean_position(a) < mean_position(b); });
  std::vector<int> rank_of_part(num_parts);
  for (int rank = 0; rank < num_parts; ++rank) rank_of_part[parts_by_position[rank]] = rank;
  std::vector<int> rank_of_node(num_nodes);
  for (int node = 0; node < num_nodes; ++node) rank_of_node[node] = rank_of_part[part[node]];
  return rank_of_node;
}

// The orders the search starts from: the given one; one that keeps METIS's parts (balanced by cost, few bytes
// cut) together; and on small graphs random topological orders, which reach assignments that the first two
// cannot (on graphs of a thousand nodes and more they never won in our measurements, so their number falls with
// the size and reaches zero there).
std::vector<std::vector<int>> starting_orders(const ModuleGraph& graph, const Adjacency& adjacency,
                                              const CostModel& costs, const StageBounds& bounds, int num_stages) {
  constexpr int kRandomOrderNodes = 2048, kMaxRandomOrders = 32;
  constexpr std::uint64_t kSeed = 0x5eed;  // fixed: the same graph always gets the same partition
  const int num_nodes = static_cast<int>(graph.nodes.size());
  const std::vector<int> one_group(num_nodes, 0);
  std::vector<int> identity(num_nodes);
  std::iota(identity.begin(), identity.end(), 0);

  std::vector<std::vector<int>> orders{topological_order(adjacency, bounds, one_group, identity)};
  auto add = [&](std::vector<int> order) {
    if (std::find(orders.begin(), orders.end(), order) == orders.end()) orders.push_back(std::move(order));
  };
  if (num_stages > 1) {
    const std::vector<int> parts = detail::metis_parts(graph, costs, num_stages);
    if (!parts.empty()) add(topological_order(adjacency, bounds, part_rank_of_node(parts), identity));
    std::mt19937_64 random(kSeed);
    std::vector<int> priority = identity;
    const int random_orders = std::min(kMaxRandomOrders, kRandomOrderNodes / num_nodes);
    for (int i = 0; i < random_orders; ++i) {
      std::shuffle(priority.begin(), priority.end(), random);
      add(topological_order(adjacency, bounds, one_group, priority));
    }
  }
  return orders;
}

// The contiguous split cannot know in how many later stages an output's consumers will land. It assumes one (the
// output is sent once, at its largest edge) unless an earlier assignment is given (`sends_like`): then it charges
// once per stage that held some of the consumers there, so that the next split sees the fan-out the previous one
// paid for, and what keeping those consumers apart would save.
LinearProblem linear_problem(const ModuleGraph& graph, const Adjacency& adjacency, const CostModel& costs,
                             const GraphPartitionOptions& options, const std::vector<int>& order,
                             const std::vector<int>& sends_like) {
  const int num_nodes = static_cast<int>(order.size());
  std::vector<int> position_of(num_nodes);
  for (int position = 0; position < num_nodes; ++position) position_of[order[position]] = position;
  LinearProblem problem;
  problem.memory_limits = costs.split_memory_limits;
  problem.activation_copies = costs.activation_copies;
  problem.recomputes = costs.recomputes;
  problem.compute_factors = costs.compute_factors;
  std::vector<std::tuple<int, int, double>> consumers;  // (group, position, bytes)
  for (int position = 0; position < num_nodes; ++position) {
    const int node = order[position];
    consumers.clear();
    for (const detail::OutEdge& edge : adjacency.out[node]) {
      consumers.emplace_back(sends_like.empty() ? 0 : sends_like[edge.to], position_of[edge.to], edge.bytes);
    }
    std::sort(consumers.begin(), consumers.end());
    for (std::size_t i = 0; i < consumers.size();) {
      LinearProblem::Send send{position, -1, 0.0};
      const int group = std::get<0>(consumers[i]);
      for (; i < consumers.size() && std::get<0>(consumers[i]) == group; ++i) {
        send.last_consumer = std::max(send.last_consumer, std::get<1>(consumers[i]));
        send.cost = std::max(send.cost, costs.per_sent_byte * std::get<2>(consumers[i]));
      }
      problem.sends.push_back(send);
    }
    const GraphNode& info = graph.nodes[node];
    problem.node_cost.push_back(costs.per_memory_byte * info.memory_bytes);
    problem.compute_cost.push_back(costs.per_compute_s * info.compute_s);
    problem.activation_cost.push_back(costs.per_memory_byte * info.activation_bytes);
    problem.recompute_cost.push_back(costs.per_compute_s * info.recompute_s);
    problem.memory_bytes.push_back(info.memory_bytes);
    problem.activation_bytes.push_back(info.activation_bytes);
    if (!options.pinned.empty()) problem.pinned.push_back(options.pinned[node]);
    if (costs.needs_parameters) problem.holds_parameters.push_back(info.parameter_bytes > 0 ? 1 : 0);
  }
  return problem;
}

std::vector<int> stage_of_node_from(const std::vector<int>& order, const std::vector<int>& stage_of_position) {
  std::vector<int> stage_of_node(order.size());
  for (std::size_t position = 0; position < order.size(); ++position) {
    stage_of_node[order[position]] = stage_of_position[position];
  }
  return stage_of_node;
}

std::string memory_limits_text(const GraphPartitionOptions& options) {
  if (options.stage_memory_limit_bytes.empty()) {
    return "the memory limit of " + detail::readable_bytes(options.memory_limit_bytes);
  }
  std::string text = "its memory limit (";
  for (std::size_t stage = 0; stage < options.stage_memory_limit_bytes.size(); ++stage) {
    const double own = options.stage_memory_limit_bytes[stage];
    text += (stage ? ", " : "") + detail::readable_bytes(own > 0 ? own : options.memory_limit_bytes);
  }
  return text + " by stage)";
}

[[noreturn]] void throw_no_split(const ModuleGraph& graph, const GraphPartitionOptions& options,
                                 LinearProblem problem) {
  if (std::any_of(problem.memory_limits.begin(), problem.memory_limits.end(),
                  [](double limit) { return limit < detail::kInfinity; })) {
    problem.memory_limits.assign(problem.memory_limits.size(), detail::kInfinity);
    if (detail::split_min_bottleneck(problem, options.num_stages)) {
      const double fewest_copies =
          *std::min_element(problem.activation_copies.begin(), problem.activation_copies.end());
      double total_bytes = 0;
      for (const GraphNode& node : graph.nodes) total_bytes += node.memory_bytes + fewest_copies * node.activation_bytes;
      // Exact on chains and on small graphs; on larger DAGs the search may miss a split that exists, so it says
      // what it found.
      throw PartitionError("found no split of the " + std::to_string(graph.nodes.size()) + " modules into " +
                           std::to_string(options.num_stages) + (options.num_stages == 1 ? " stage" : " stages") +
                           " that keeps every stage within " +
                           memory_limits_text(options) + " (the modules need " +
                           detail::readable_bytes(total_bytes) + " in all, with the fewest activation copies)");
    }
  }
  throw PartitionError("the pinned modules leave no way to give each of the " + std::to_string(options.num_stages) +
                       " stages at least one module");
}

// The best partition the search finds, or nothing when no tried order gives a split that meets the rules.
std::optional<GraphPartition> search_partition(const ModuleGraph& graph, const Adjacency& adjacency,
                                               const StageBounds& bounds, const CostModel& costs,
                                               const GraphPartitionOptions& options) {
  const int num_stages = options.num_stages;

  const std::vector<std::vector<int>> orders = starting_orders(graph, adjacency, costs, bounds, num_stages);

  // Each order: its contiguous split, refined; then, while that lowers the bottleneck, the same again on the
  // order that lists the refined stages one after another (the split can shift whole runs of nodes across a
  // boundary, which single moves cannot) and with the outputs priced by their fan-out in the refined stages.
  // Rounds rarely go past four; the cap bounds the time.
  constexpr int kMaxRoundsPerOrder = 8;
  std::optional<GraphPartition> best;
  for (std::vector<int> order : orders) {
    std::optional<GraphPartition> best_from_order;
    for (int round = 0; round < kMaxRoundsPerOrder; ++round) {
      const auto split = detail::split_min_bottleneck(
          linear_problem(graph, adjacency, costs, options, order,
                         best_from_order ? best_from_order->stage_of_node : std::vector<int>{}),
          num_stages);
      if (!split) break;
      GraphPartition candidate = evaluate(
          graph, detail::refine_bottleneck(graph, adjacency, costs, options, stage_of_node_from(order, *split)),
          options);
      if (!std::isfinite(candidate.bottleneck)) break;  // over the limit after all: not a split to return
      if (best_from_order && candidate.bottleneck >= best_from_order->bottleneck * (1 - 1e-12)) break;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return candidate.stage_of_node[a] < candidate.stage_of_node[b];
      });
      best_from_order = std::move(candidate);
    }
    if (best_from_order && (!best || best_from_order->bottleneck < best->bottleneck)) best = std::move(best_from_order);
  }
  if (!best) {
    // A tight limit can leave splits that no contiguous cut of the tried orders reaches. On small graphs the
    // exhaustive search settles it: it finds one, or proves there is none (within a bounded effort: about a
    // second at worst).
    constexpr int kExhaustiveFallbackNodes = 12;
    constexpr std::uint64_t kExhaustiveFallbackPlacements = 20'000'000;
    if (static_cast<int>(graph.nodes.size()) <= kExhaustiveFallbackNodes) {
      try {
        return optimal_partition_exhaustive(graph, options, kExhaustiveFallbackPlacements);
      } catch (const PartitionError&) {
        // None exists, or the search gave up.
      }
    }
  }
  return best;
}

}  // namespace

GraphPartition partition_graph(const ModuleGraph& graph, const GraphPartitionOptions& options) {
  const Adjacency adjacency(graph);
  const StageBounds bounds = detail::validate(graph, adjacency, options);
  const CostModel costs(graph, options);
  if (auto found = search_partition(graph, adjacency, bounds, costs, options)) return std::move(*found);
  // Pins or a memory limit that leave some stage without parameters win over that rule.
  GraphPartitionOptions without_rule = options;
  without_rule.parameters_on_every_stage = false;
  const CostModel plain_costs(graph, without_rule);
  if (costs.needs_parameters) {
    if (auto found = search_partition(graph, adjacency, bounds, plain_costs, without_rule)) return std::move(*found);
  }
  throw_no_split(graph, without_rule,
                 linear_problem(graph, adjacency, plain_costs, without_rule,
                                starting_orders(graph, adjacency, plain_costs, bounds, 1).front(), {}));
}

GraphPartition partition_uniform(const ModuleGraph& graph, const GraphPartitionOptions& options) {
  validate_for_baseline(graph, options.num_stages);
  const std::vector<double> unit_costs(graph.nodes.size(), 1.0);
  return evaluate(graph, split_chain_uniform(unit_costs, options.num_stages).stage_of_node, options);
}

GraphPartition partition_by_parameters(const ModuleGraph& graph, const GraphPartitionOptions& options) {
  validate_for_baseline(graph, options.num_stages);
  LinearProblem problem;
  for (const GraphNode& node : graph.nodes) {
    problem.node_cost.push_back(node.parameter_bytes);
    problem.memory_bytes.push_back(0.0);
  }
  // Without pins or a memory limit every split into non-empty segments is feasible.
  return evaluate(graph, *detail::split_min_bottleneck(problem, options.num_stages), options);
}

GraphPartition optimal_partition_exhaustive(const ModuleGraph& graph, const GraphPartitionOptions& options,
                                            std::uint64_t max_placements) {
  constexpr int kMaxNodes = 16;
  const Adjacency adjacency(graph);
  const StageBounds bounds = detail::validate(graph, adjacency, options);
  const int num_nodes = static_cast<int>(graph.nodes.size()), num_stages = options.num_stages;
  if (num_nodes > kMaxNodes) {
    throw PartitionError("the exhaustive search takes at most " + std::to_string(kMaxNodes) + " nodes, got " +
                         std::to_string(num_nodes));
  }
  const CostModel costs(graph, options);
  detail::StageMeter meter(graph, adjacency, costs, num_stages);

  // Nodes are placed in their topological order, each no earlier than its predecessors and within its pin
  // bounds. A stage's compute and memory terms only grow as nodes join it (sends only add), so a stage whose
  // partial cost already reaches the best bottleneck prunes the branch (the parameter rule is judged on complete
  // assignments: a stage may yet gain its parameters).
  std::vector<int> stage_of_node(num_nodes), best_stage_of_node;
  std::vector<detail::StageTotals> totals(num_stages);
  std::vector<int> nodes_on_stage(num_stages, 0);
  int empty_stages = num_stages;
  double best = detail::kInfinity;
  std::uint64_t placements = 0;
  std::function<void(int)> place = [&](int node) {
    if (max_placements > 0 && ++placements > max_placements) {
      throw PartitionError("the exhaustive search gave up after " + std::to_string(max_placements) + " placements");
    }
    if (node == num_nodes) {
      if (empty_stages > 0) return;
      const double bottleneck = meter.bottleneck(stage_of_node);
      if (bottleneck < best) best = bottleneck, best_stage_of_node = stage_of_node;
      return;
    }
    int earliest = bounds.earliest[node];
    for (int predecessor : adjacency.predecessors[node]) earliest = std::max(earliest, stage_of_node[predecessor]);
    const int nodes_left_after = num_nodes - node - 1;
    for (int stage = earliest; stage <= bounds.latest[node]; ++stage) {
      if (empty_stages - (nodes_on_stage[stage] == 0 ? 1 : 0) > nodes_left_after) continue;
      stage_of_node[node] = stage;
      totals[stage].add(graph.nodes[node]);
      if (nodes_on_stage[stage]++ == 0) --empty_stages;
      if (costs.growing_stage_cost(stage, totals[stage]) < best) place(node + 1);
      if (--nodes_on_stage[stage] == 0) ++empty_stages;
      totals[stage].add(graph.nodes[node], -1.0);
    }
  };
  place(0);
  if (best_stage_of_node.empty() && costs.needs_parameters) {
    // As in partition_graph: pins or a memory limit that leave some stage without parameters win over the rule.
    GraphPartitionOptions without_rule = options;
    without_rule.parameters_on_every_stage = false;
    return optimal_partition_exhaustive(graph, without_rule, max_placements);
  }
  if (best_stage_of_node.empty()) {
    throw PartitionError("no acyclic split into " + std::to_string(num_stages) +
                         " non-empty stages meets the pins and the memory limit");
  }
  return evaluate(graph, best_stage_of_node, options);
}

}  // namespace smp::part
