#include "smp/topology.h"

#include <sstream>

namespace smp {

Topology::Topology(const Config& config, int world_size)
    : world_size_(world_size),
      pipeline_degree_(config.partitions),
      data_parallel_degree_(config.replicas_for_world(world_size)) {
  const std::string& strategy = config.placement_strategy;
  if (strategy == "cluster") {
    pipeline_innermost_ = true;
  } else if (strategy == "spread") {
    pipeline_innermost_ = false;
  } else {
    // A letter order such as "DP" or "DPT": P after D means the pipeline index varies faster.
    pipeline_innermost_ = strategy.find('P') > strategy.find('D');
  }
}

int Topology::rank_of(Coordinates c) const {
  return pipeline_innermost_ ? c.dp_rank * pipeline_degree_ + c.pp_rank : c.pp_rank * data_parallel_degree_ + c.dp_rank;
}

Coordinates Topology::coordinates_of(int rank) const {
  if (pipeline_innermost_) return {rank % pipeline_degree_, rank / pipeline_degree_};
  return {rank / data_parallel_degree_, rank % data_parallel_degree_};
}

std::vector<int> Topology::pipeline_group(int dp_rank) const {
  std::vector<int> ranks;
  for (int pp = 0; pp < pipeline_degree_; ++pp) ranks.push_back(rank_of({pp, dp_rank}));
  return ranks;
}

std::vector<int> Topology::data_parallel_group(int pp_rank) const {
  std::vector<int> ranks;
  for (int dp = 0; dp < data_parallel_degree_; ++dp) ranks.push_back(rank_of({pp_rank, dp}));
  return ranks;
}

std::string Topology::describe() const {
  std::ostringstream text;
  text << "world " << world_size_ << " = " << pipeline_degree_ << " pipeline stages x " << data_parallel_degree_
       << " data-parallel replicas (" << (pipeline_innermost_ ? "cluster" : "spread") << " placement)";
  for (int dp = 0; dp < data_parallel_degree_; ++dp) {
    text << "; replica " << dp << ": ranks";
    for (int rank : pipeline_group(dp)) text << ' ' << rank;
  }
  return text.str();
}

}  // namespace smp
