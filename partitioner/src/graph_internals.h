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

struct OutEdge {
  int to = 0;
  double bytes = 0;
};

struct Adjacency {
  explicit Adjacency(const ModuleGraph& graph);
  std::vector<std::vector<OutEdge>> out;  // parallel edges kept: they may carry different tensors
  std::vector<std::vector<int>> predecessors, successors;  // distinct nodes
};

// The coefficients of the objective documented in graph_partition.h.
struct CostModel {
  CostModel(const ModuleGraph& graph, const GraphPartitionOptions& options);
  double node_cost(const GraphNode& node) const {
    return per_compute_s * node.compute_s + per_memory_byte * node.memory_bytes;
  }
  double stage_cost(double compute_s, double memory_bytes, double sent_bytes) const {
    if (memory_bytes > memory_limit_bytes) return kInfinity;
    return per_compute_s * compute_s + per_memory_byte * memory_bytes + per_sent_byte * sent_bytes;
  }
  double per_compute_s = 0, per_memory_byte = 0, per_sent_byte = 0;
  double memory_limit_bytes = kInfinity;
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
  double bottleneck(const std::vector<int>& stage_of_node);  // fills the totals below
  std::vector<double> compute_s, memory_bytes, sent_bytes, cost;

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

// Checks the graph, the stage count and the pins (range, and order along edges: the message names both nodes),
// and that no node alone exceeds the memory limit. Returns the pins' stage bounds.
StageBounds validate(const ModuleGraph& graph, const Adjacency& adjacency, const GraphPartitionOptions& options);

// One topological order of the graph laid out as positions, for the contiguous split.
struct LinearProblem {
  // A producer's segment pays `cost` for sending an output as long as one of its consumers (in this group) lies
  // beyond the segment, that is while the segment ends at or before `last_consumer`.
  struct Send {
    int producer, last_consumer;
    double cost;
  };
  std::vector<double> node_cost;     // the compute and memory terms of the node at each position
  std::vector<Send> sends;
  std::vector<double> memory_bytes;  // for the memory limit
  double memory_limit_bytes = kInfinity;
  std::vector<int> pinned;           // -1 or the required stage; never decreasing along the positions
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
