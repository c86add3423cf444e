#pragma once
// Where every rank sits: rank <-> (pp_rank, dp_rank, tp_rank) over three named axes, ordered by the placement
// strategy, and the groups along each axis. Expert parallelism divides the data axis: blocks of
// expert_parallel_degree consecutive replicas share out the experts (an expert-parallel group), and the replicas
// holding the same experts form an expert-data-parallel group.

#include <array>
#include <string>
#include <vector>

#include "smp/config.h"

namespace smp {

// The axes of parallelism, by SMP's placement letters: T (tensor), P (pipeline), D (data).
enum class Axis { tensor, pipeline, data };

struct Coordinates {
  int pp_rank = 0;  // pipeline stage index within the replica
  int dp_rank = 0;  // which data-parallel replica
  int tp_rank = 0;  // which shard of the tensor-parallel layers
  int& along(Axis axis) { return axis == Axis::pipeline ? pp_rank : axis == Axis::data ? dp_rank : tp_rank; }
  int along(Axis axis) const { return const_cast<Coordinates&>(*this).along(axis); }
};

class Topology {
 public:
  // Throws ConfigError when world_size does not fit the config (see Config::replicas_for_world).
  Topology(const Config& config, int world_size);

  int world_size() const { return world_size_; }
  int degree(Axis axis) const { return degrees_[static_cast<int>(axis)]; }
  int pipeline_degree() const { return degree(Axis::pipeline); }
  int data_parallel_degree() const { return degree(Axis::data); }
  int tensor_parallel_degree() const { return degree(Axis::tensor); }
  int expert_parallel_degree() const { return expert_parallel_degree_; }
  // Which share of the experts a replica holds: its place in its expert-parallel group.
  int ep_rank(const Coordinates& member) const { return member.dp_rank % expert_parallel_degree_; }
  // The placement as letters from the axis that varies slowest over consecutive ranks to the fastest: "DPT" for
  // SMP's "cluster" (a tensor-parallel group on consecutive ranks, then a replica's stages), "TPD" for "spread".
  const std::string& order() const { return order_; }

  int rank_of(Coordinates coordinates) const;
  Coordinates coordinates_of(int rank) const;
  // The ranks along `axis` through `member` (its other coordinates fixed), ordered by the coordinate on `axis`.
  std::vector<int> group(Axis axis, Coordinates member) const;
  // Ranks of one replica's pipeline (one tensor-parallel shard of it), ordered by pp_rank.
  std::vector<int> pipeline_group(int dp_rank, int tp_rank = 0) const { return group(Axis::pipeline, {0, dp_rank, tp_rank}); }
  // Ranks that hold the same stage (and shard) in every replica, ordered by dp_rank.
  std::vector<int> data_parallel_group(int pp_rank, int tp_rank = 0) const { return group(Axis::data, {pp_rank, 0, tp_rank}); }
  // Ranks that hold the shards of one stage of one replica, ordered by tp_rank.
  std::vector<int> tensor_parallel_group(int pp_rank, int dp_rank) const { return group(Axis::tensor, {pp_rank, dp_rank, 0}); }

  // The ranks that divide the experts among them, with `member` (its pp and tp coordinates, its block of
  // replicas), ordered by ep_rank.
  std::vector<int> expert_parallel_group(const Coordinates& member) const;
  // The ranks holding the same experts as `member` (the same ep_rank in every block), ordered by dp_rank: their
  // expert gradients are averaged as the data-parallel group averages the others.
  std::vector<int> expert_data_parallel_group(const Coordinates& member) const;

  std::string describe() const;  // the rank table, for the start-of-job log
  // Per pipeline rank, the least of `per_rank` (one value per rank) over the ranks at that position (its replicas
  // and shards): a stage goes as fast as its slowest holder, and fits the smallest.
  std::vector<double> least_per_pipeline_rank(const std::vector<double>& per_rank) const;

 private:
  int world_size_;
  std::array<int, 3> degrees_;  // by Axis
  int expert_parallel_degree_;
  std::string order_;
  std::array<int, 3> strides_;  // by Axis: rank = sum of coordinate x stride
};

}  // namespace smp
