#include "smp/topology.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <utility>

namespace smp {

namespace {

Axis axis_of(char letter) { return letter == 'T' ? Axis::tensor : letter == 'P' ? Axis::pipeline : Axis::data; }

// SMP's names and letter orders as three letters, slowest first; an order without T puts it fastest, so that a
// tensor-parallel group shares a host.
std::string three_letters(const std::string& strategy) {
  if (strategy == "cluster") return "DPT";
  if (strategy == "spread") return "TPD";
  return strategy.find('T') == std::string::npos ? strategy + "T" : strategy;
}

}  // namespace

Topology::Topology(const Config& config, int world_size)
    : world_size_(world_size),
      degrees_{config.tensor_parallel_degree, config.partitions, config.replicas_for_world(world_size)},
      expert_parallel_degree_(config.expert_parallel_degree),
      order_(three_letters(config.placement_strategy)) {
  int stride = 1;
  for (auto letter = order_.rbegin(); letter != order_.rend(); ++letter) {
    strides_[static_cast<int>(axis_of(*letter))] = stride;
    stride *= degree(axis_of(*letter));
  }
  const std::pair<const char*, const std::vector<double>*> per_rank_keys[] = {
      {"device_speeds", &config.device_speeds},
      {"device_memory_mb", &config.device_memory_mb},
      {"emulated_slowdown", &config.emulated_slowdown}};
  for (const auto& [key, values] : per_rank_keys) {
    if (!values->empty() && static_cast<int>(values->size()) != world_size) {
      throw ConfigError(config.source + ": key \"" + key + "\": has " + std::to_string(values->size()) +
                        " entries, one per rank, but the job has " + std::to_string(world_size) + " ranks");
    }
  }
}

std::vector<double> Topology::least_per_pipeline_rank(const std::vector<double>& per_rank) const {
  std::vector<double> least(static_cast<std::size_t>(pipeline_degree()), std::numeric_limits<double>::infinity());
  for (int rank = 0; rank < world_size_ && rank < static_cast<int>(per_rank.size()); ++rank) {
    double& slot = least[static_cast<std::size_t>(coordinates_of(rank).pp_rank)];
    slot = std::min(slot, per_rank[static_cast<std::size_t>(rank)]);
  }
  return least;
}

int Topology::rank_of(Coordinates c) const {
  int rank = 0;
  for (Axis axis : {Axis::tensor, Axis::pipeline, Axis::data}) rank += c.along(axis) * strides_[static_cast<int>(axis)];
  return rank;
}

Coordinates Topology::coordinates_of(int rank) const {
  Coordinates c;
  for (Axis axis : {Axis::tensor, Axis::pipeline, Axis::data}) {
    c.along(axis) = rank / strides_[static_cast<int>(axis)] % degree(axis);
  }
  return c;
}

std::vector<int> Topology::group(Axis axis, Coordinates member) const {
  std::vector<int> ranks;
  for (int index = 0; index < degree(axis); ++index) {
    member.along(axis) = index;
    ranks.push_back(rank_of(member));
  }
  return ranks;
}

std::vector<int> Topology::expert_parallel_group(const Coordinates& member) const {
  Coordinates each = member;
  const int first = member.dp_rank - ep_rank(member);
  std::vector<int> ranks;
  for (int index = 0; index < expert_parallel_degree_; ++index) {
    each.dp_rank = first + index;
    ranks.push_back(rank_of(each));
  }
  return ranks;
}

std::vector<int> Topology::expert_data_parallel_group(const Coordinates& member) const {
  Coordinates each = member;
  std::vector<int> ranks;
  for (int dp = ep_rank(member); dp < data_parallel_degree(); dp += expert_parallel_degree_) {
    each.dp_rank = dp;
    ranks.push_back(rank_of(each));
  }
  return ranks;
}

std::string Topology::describe() const {
  std::ostringstream text;
  text << "world " << world_size_ << " = " << pipeline_degree() << " pipeline stages x " << data_parallel_degree()
       << " data-parallel replicas";
  if (tensor_parallel_degree() > 1) text << " x " << tensor_parallel_degree() << " tensor-parallel shards";
  if (expert_parallel_degree_ > 1) {
    text << ", the experts divided over blocks of " << expert_parallel_degree_ << " replicas";
  }
  text << " (" << (order_ == "DPT" ? "cluster" : order_ == "TPD" ? "spread" : order_) << " placement)";
  for (int dp = 0; dp < data_parallel_degree(); ++dp) {
    text << "; replica " << dp << ": ranks";
    if (tensor_parallel_degree() == 1) {
      for (int rank : pipeline_group(dp)) text << ' ' << rank;
      continue;
    }
    for (int pp = 0; pp < pipeline_degree(); ++pp) {
      text << (pp == 0 ? " " : " | ");
      const auto shards = tensor_parallel_group(pp, dp);
      for (std::size_t i = 0; i < shards.size(); ++i) text << (i ? "," : "") << shards[i];
    }
  }
  return text.str();
}

}  // namespace smp
