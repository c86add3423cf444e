#pragma once
// Pieces shared by the graph partition search, its baselines and its yardstick; not installed.

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "smp/partitioner/graph_partition.h"

namespace smp::part::detail {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// "'name'" for messages (or "#index" for a nameless node).
std::string node_label(const ModuleGraph& graph, int node);
// An amount of memory as a person reads it in an error: whole bytes below a MiB, else MiB with one decimal.
std::string readable_bytes(double bytes);

struct OutEdge {
  int to = 0;
  double bytes = 0;
};

struct Adjacency {
  explicit Adjacency(const ModuleGraph& graph);
  std::vector<std::vector<OutEdge>> out;  // parallel edges kept: they may carry different tensors
  std::vector<std::vector<int>> predecessors, successors;  // distinct nodes
};

// What a stage gathers from its nodes; its cost and memory follow from these and from which stage it is.
struct StageTotals {
  double compute_s = 0, recompute_s = 0, memory_bytes = 0, activation_bytes = 0, sent_bytes = 0;
  int parameter_nodes = 0;  // a count, not a sum of bytes: bytes added and taken away need not come back to 0

  void add(const GraphNode& node, double sign = 1.0) {
    if (node.parameter_bytes > 0) parameter_nodes += sign > 0 ? 1 : -1;
    compute_s += sign * node.compute_s;
    recompute_s += sign * node.recompute_s;
    memory_bytes += sign * node.memory_bytes;
    activation_bytes += sign * node.activation_bytes;
  }
  StageTotals& operator+=(const StageTotals& other) {
    parameter_nodes += other.parameter_nodes;
    compute_s += other.compute_s, recompute_s += other.recompute_s, memory_bytes += other.memory_bytes;
    activation_bytes += other.activation_bytes, sent_bytes += other.sent_bytes;
    return *this;
  }
  StageTotals operator+(const StageTotals& other) const { return StageTotals(*this) += other; }
};

// The coefficients of the objective documented in graph_partition.h, and the per-stage factors.
struct CostModel {
  CostModel(const ModuleGraph& graph, const GraphPartitionOptions& options);
  double stage_compute_s(int stage, const StageTotals& totals) const {
    return compute_factors[stage] * (totals.compute_s + (recomputes[stage] ? totals.recompute_s : 0.0));
  }
  double stage_memory_bytes(int stage, const StageTotals& totals) const {
    return totals.memory_bytes + activation_copies[stage] * totals.activation_bytes;
  }
  double stage_cost(int stage, const StageTotals& totals) const {
    if (needs_parameters && totals.parameter_nodes == 0) return kInfinity;
    return growing_stage_cost(stage, totals);
  }
  // The cost without the parameter rule, which only grows as nodes join a stage (compute, memory, and sends, which
  // only add): a bound for partial stages.
  double growing_stage_cost(int stage, const StageTotals& totals) const {
    const double memory_bytes = stage_memory_bytes(stage, totals);
    if (memory_bytes > memory_limits[stage]) return kInfinity;
    return per_compute_s * stage_compute_s(stage, totals) + per_memory_byte * memory_bytes +
           per_sent_byte * totals.sent_bytes;
  }
  // A node's compute and memory terms under the stages' mean factors, for orders that do not know its stage.
  double mean_node_cost(const GraphNode& node) const {
    return per_compute_s * (node.compute_s + mean_recomputes * node.recompute_s) +
           per_memory_byte * (node.memory_bytes + mean_activation_copies * node.activation_bytes);
  }
  double per_compute_s = 0, per_memory_byte = 0, per_sent_byte = 0;
  // The limit with a little slack: sums taken in different orders (the split's sliding window, a stage's totals
  // times its copies) differ in their last bits, and a stage exactly at the limit must be feasible to every part
  // of the search. The split gets less slack than the judge, so that whatever it accepts the judge accepts too.
  std::vector<double> memory_limits;        // per stage, for stage_cost: the limit plus 1e-9 of it
  std::vector<double> split_memory_limits;  // per stage, for the contiguous split: the limit plus 1e-10 of it
  std::vector<double> activation_copies;  // per stage, filled in (1 each when the options give none)
  std::vector<char> recomputes;           // per stage, 0 or 1
  std::vector<double> compute_factors;    // per stage: 1 / its device's speed
  double mean_activation_copies = 1, mean_recomputes = 0;
  bool needs_parameters = false;  // parameters_on_every_stage, and enough nodes with parameters for it
};

// A producer's sent bytes: its output goes once to each other stage that consumes it, at the size of its largest
// edge into that stage. Keeps scratch space so that the hot loops (refinement, exhaustive search) do not allocate.
class SentBytes {
 public:
  explicit SentBytes(int num_stages) : largest_(num_stages, 0.0), stamp_(num_stages, 0) {}
  double of_producer(const Adjacency& adjacency, const std::vector<int>& stage_of_node, int node);

 private:
  std::vector<double> largest_;
  std::vector<unsigned> stamp_;
  unsigned epoch_ = 0;
};

// Per-stage totals and costs of an assignment: the single implementation of the objective (`evaluate` and the
// exhaustive search both read it). Keeps its buffers so that measuring many assignments does not allocate.
class StageMeter {
 public:
  StageMeter(const ModuleGraph& graph, const Adjacency& adjacency, const CostModel& costs, int num_stages);
  double bottleneck(const std::vector<int>& stage_of_node);  // fills the totals and costs below
  std::vector<StageTotals> totals;
  std::vector<double> cost;

 private:
  const ModuleGraph& graph_;
  const Adjacency& adjacency_;
  const CostModel& costs_;
  SentBytes sent_bytes_of_;
};

// Per node, the stages it may take given the pins: at least the largest pin among its ancestors (itself
// included), at most the smallest among its descendants.
struct StageBounds {
  std::vector<int> earliest, latest;
};

// Checks the graph, the stage count, the per-stage factors and the pins (range, and order along edges: the
// message names both nodes), and that no node alone exceeds the memory limit on every stage. Returns the pins'
// stage bounds.
StageBounds validate(const ModuleGraph& graph, const Adjacency& adjacency, const GraphPartitionOptions& options);

// One topological order of the graph laid out as positions, for the contiguous split. A segment that becomes
// stage t costs, per position, node_cost + activation_copies[t] * activation_cost + compute_factors[t] *
// (compute_cost + recomputes[t] * recompute_cost), plus its sends; its memory is memory_bytes +
// activation_copies[t] * activation_bytes, within memory_limits[t].
struct LinearProblem {
  // A producer's segment pays `cost` for sending an output as long as one of its consumers (in this group) lies
  // beyond the segment, that is while the segment ends at or before `last_consumer`.
  struct Send {
    int producer, last_consumer;
    double cost;
  };
  std::vector<double> node_cost;        // the memory term of the node at each position (any cost alike on every stage)
  std::vector<double> compute_cost;     // per position (empty: none): its compute term on a device of speed 1
  std::vector<double> activation_cost;  // per position (empty: none): the memory term of one activation copy
  std::vector<double> recompute_cost;   // per position (empty: none): the compute term of its recomputation
  std::vector<Send> sends;
  std::vector<double> memory_bytes;      // for the memory limit
  std::vector<double> activation_bytes;  // per position (empty: none)
  std::vector<double> memory_limits;      // per stage (empty: none)
  std::vector<double> activation_copies;  // per stage (empty: 1 each)
  std::vector<char> recomputes;           // per stage (empty: none)
  std::vector<double> compute_factors;    // per stage (empty: 1 each)
  std::vector<int> pinned;           // -1 or the required stage; never decreasing along the positions
  std::vector<char> holds_parameters;  // per position (empty: no rule): every segment must hold one that does
};

// The split into `num_stages` non-empty contiguous segments with the smallest bottleneck, where a segment costs
// its nodes' costs plus its sends; the stage of each position, or nothing when the pins and the memory limit admit
// no split.
std::optional<std::vector<int>> split_min_bottleneck(const LinearProblem& problem, int num_stages);

// Moves single nodes, or all the consumers of one output that share a stage, across stage boundaries (keeping
// edges forward, stages non-empty, pins and the memory limit) while the bottleneck drops; returns the improved
// assignment.
std::vector<int> refine_bottleneck(const ModuleGraph& graph, const Adjacency& adjacency, const CostModel& costs,
                                   const GraphPartitionOptions& options, std::vector<int> stage_of_node);

// METIS's split of the undirected graph into `num_parts` parts balanced by node cost with the fewest bytes cut;
// empty when METIS fails.
std::vector<int> metis_parts(const ModuleGraph& graph, const CostModel& costs, int num_parts);

}  // namespace smp::part::detail
