#pragma once
// Where every rank sits: rank <-> (pp_rank, dp_rank) under the placement strategy, and the groups built on it.

#include <string>
#include <vector>

#include "smp/config.h"

namespace smp {

struct Coordinates {
  int pp_rank = 0;  // pipeline stage index within the replica
  int dp_rank = 0;  // which data-parallel replica
};

class Topology {
 public:
  // Throws ConfigError when world_size does not fit the config (see Config::replicas_for_world).
  Topology(const Config& config, int world_size);

  int world_size() const { return world_size_; }
  int pipeline_degree() const { return pipeline_degree_; }
  int data_parallel_degree() const { return data_parallel_degree_; }
  // True when consecutive ranks hold the stages of one replica (SMP's "cluster"): pipeline neighbours then
  // share a host, where point-to-point traffic is cheapest.
  bool pipeline_innermost() const { return pipeline_innermost_; }

  int rank_of(Coordinates coordinates) const;
  Coordinates coordinates_of(int rank) const;
  // Ranks of one replica's pipeline, ordered by pp_rank.
  std::vector<int> pipeline_group(int dp_rank) const;
  // Ranks that hold the same stage in every replica, ordered by dp_rank.
  std::vector<int> data_parallel_group(int pp_rank) const;

  std::string describe() const;  // the rank table, for the start-of-job log

 private:
  int world_size_;
  int pipeline_degree_;
  int data_parallel_degree_;
  bool pipeline_innermost_;
};

}  // namespace smp
