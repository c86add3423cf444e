#pragma once
// Pipeline partition of a module DAG (residuals, skip connections, tied weights): nodes carry profiled costs,
// edges the tensors between them, and the search assigns every node a stage such that tensors only flow forward.
// Plain C++ (no LibTorch); METIS supplies a cut-aware node order.

#include <cstdint>
#include <string>
#include <vector>

#include "smp/partitioner/chain_split.h"  // PartitionError

namespace smp::part {

struct GraphNode {
  std::string name;
  double compute_s = 0;        // forward + backward time of one microbatch
  double memory_bytes = 0;     // what the node keeps on its device whatever the schedule: parameters, gradients,
                               // optimizer state
  double parameter_bytes = 0;  // the parameters alone; only the by-parameters baseline looks at it
  double activation_bytes = 0;  // what one microbatch's forward keeps for its backward; a stage holds
                                // activation_copies of it (see GraphPartitionOptions)
  double recompute_s = 0;       // the forward time that a recomputing stage (activation checkpointing) spends again
};

struct GraphEdge {
  int from = 0, to = 0;  // a tensor from node `from` to node `to`
  double bytes = 0;
};

// Nodes are listed in a topological order: every edge has from < to (PartitionError naming the edge otherwise).
struct ModuleGraph {
  std::vector<GraphNode> nodes;
  std::vector<GraphEdge> edges;
};

struct GraphPartitionOptions {
  int num_stages = 1;
  double memory_weight = 0.2;        // SMP's weight of memory balancing against compute balancing (0: compute only,
                                     // 1: memory only)
  double memory_limit_bytes = 0;     // per stage; 0 = none
  double bandwidth_bytes_per_s = 0;  // turns bytes sent into seconds; 0 = communication is free
  std::vector<int> pinned;           // empty, or one per node: -1 free, else the stage the node must be on
  // Per stage (empty: 1 each): how many microbatches' activations the stage holds at once. Under 1F1B the first
  // of p stages holds p and the last one; the same node costs more memory on an earlier stage.
  std::vector<double> activation_copies;
  std::vector<bool> recomputes;      // per stage (empty: none): its backward runs its forward again
  // Devices that differ. Per stage (empty: alike): the relative compute speed of the device the stage runs on (its
  // compute there takes compute_s / speed; sends are not sped up), and that device's memory limit in bytes (0:
  // memory_limit_bytes). A faster stage gets more of the model, in proportion.
  std::vector<double> stage_speeds;
  std::vector<double> stage_memory_limit_bytes;
  // Every stage gets a node with parameter_bytes > 0, when at least num_stages nodes have some: a rank without
  // parameters has nothing for its optimizer to step (torch.optim refuses an empty parameter list), and a slow
  // device would otherwise be handed a lone activation function. The searches alone honour it; pins or a memory
  // limit that leave a stage without parameters win over it (and so does a large DAG's heuristic that finds no
  // split with it). evaluate() does not judge it. Its price shows where the stages nearly
  // number the modules with parameters: in bench_partition's 252 cases two bottlenecks grew, ResNet-like graphs at
  // 10 GB/s of 11 nodes on 8 stages (1.18x) and of 98 nodes on 64 stages (1.71x).
  bool parameters_on_every_stage = true;
};

// The objective: the bottleneck, the largest per-stage cost, where with w = memory_weight and k = num_stages
//
//   time_s(stage)       = (compute_s(stage) [+ recompute_s(stage) if it recomputes]) / stage_speeds[stage]
//                         + sent_bytes(stage) / bandwidth
//   memory_bytes(stage) = memory_bytes of its nodes + activation_copies[stage] * activation_bytes of its nodes
//   cost(stage)         = (1 - w) * time_s(stage) / (total time / sum of speeds)
//                         + w * memory_bytes(stage) / (total memory / k)
//
// sent_bytes(stage) counts the tensors its nodes send to other stages: a node's output goes once to each stage
// that consumes it (the largest of its edges into that stage). The means are taken over the graph's totals (with
// the stages' mean activation copies and share of recomputing stages), not the partition's, so that every
// partition is measured on the same scale (a partition that sends more is charged
// for it, not normalized by it); a term whose total is 0 is dropped. A stage over memory_limit_bytes costs
// +infinity (infeasible); so does one over its own stage_memory_limit_bytes.
struct GraphPartition {
  std::vector<int> stage_of_node;  // stage(from) <= stage(to) for every edge; every stage non-empty
  std::vector<double> stage_compute_s;     // recomputation included, on the stage's device (its speed)
  std::vector<double> stage_memory_bytes;  // activation copies included
  std::vector<double> stage_sent_bytes;
  std::vector<double> stage_cost;  // the objective's per-stage cost (above)
  double bottleneck = 0;           // max stage_cost
};

// The one cost function: fills the per-stage sums and costs of `stage_of_node` under `options` (num_stages and
// the cost weights; pins are not checked). Throws PartitionError when a stage is out of range.
GraphPartition evaluate(const ModuleGraph& graph, const std::vector<int>& stage_of_node,
                        const GraphPartitionOptions& options);

// Minimum-bottleneck search. From a few topological orders (the given one; one that keeps METIS's cost-balanced,
// cut-minimizing parts together; on small graphs random ones), it takes the exact bottleneck-minimizing split of
// the order into contiguous segments (contiguous segments of a topological order always form an acyclic stage
// order), refines it by moving nodes across stage boundaries while the bottleneck drops, and repeats on the order
// of the refined stages while that helps. Exact on chains (a chain's sends are priced exactly), a heuristic on
// DAGs: the split estimates where an output's consumers will land. Deterministic: the same input gives the same
// partition on every rank. Honours pins, the memory limit and parameters_on_every_stage (dropped when the search
// finds no split with it); when no tried order yields a split within the limit,
// a graph of at most 12 nodes gets the exhaustive search's answer (exact), a larger one the error.
// Throws PartitionError, naming nodes by name, for: an edge that is not from < to, more stages than nodes, a pin out
// of range, pins against the edges (a node pinned to an earlier stage than a node it depends on), a node over the
// memory limit alone, and a memory limit or pins that no split meets.
GraphPartition partition_graph(const ModuleGraph& graph, const GraphPartitionOptions& options);

// Baselines, contiguous along the given order and blind to pins and the memory limit, evaluated with `evaluate`:
// equal node counts (the first stages take one extra node when the count does not divide) ...
GraphPartition partition_uniform(const ModuleGraph& graph, const GraphPartitionOptions& options);
// ... and DeepSpeed's "parameters" method: the split with the smallest largest parameter_bytes per stage.
GraphPartition partition_by_parameters(const ModuleGraph& graph, const GraphPartitionOptions& options);

// The optimum over every acyclic assignment (stage monotone along edges, every stage non-empty, pins, memory
// limit and parameters_on_every_stage honoured, the last dropped as partition_graph drops it), by branch and bound; the yardstick for small DAGs. Throws PartitionError above 16 nodes.
// `max_placements` bounds the work (node placements tried; 0: none): past it, PartitionError saying it gave up.
GraphPartition optimal_partition_exhaustive(const ModuleGraph& graph, const GraphPartitionOptions& options,
                                            std::uint64_t max_placements = 0);

// Throws PartitionError (naming nodes by name) unless every node is placed once on a stage in [0, num_stages),
// every edge goes to the same or a later stage, and no stage is empty.
void check_partition(const ModuleGraph& graph, const GraphPartition& partition, int num_stages);

}  // namespace smp::part
