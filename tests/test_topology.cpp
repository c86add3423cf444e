#include <catch2/catch.hpp>

#include <set>

#include "smp/topology.h"

using smp::Config;
using smp::Topology;

namespace {
Topology make(const std::string& placement, int partitions, int world) {
  Config config;
  config.partitions = partitions;
  config.ddp = true;
  config.placement_strategy = placement;
  return Topology(config, world);
}
}  // namespace

TEST_CASE("topology: cluster keeps a replica's stages on consecutive ranks", "[topology]") {
  const Topology topology = make("cluster", 4, 8);
  CHECK(topology.data_parallel_degree() == 2);
  CHECK(topology.pipeline_group(0) == std::vector<int>{0, 1, 2, 3});
  CHECK(topology.pipeline_group(1) == std::vector<int>{4, 5, 6, 7});
  CHECK(topology.data_parallel_group(2) == std::vector<int>{2, 6});
  CHECK(topology.coordinates_of(6).pp_rank == 2);
  CHECK(topology.coordinates_of(6).dp_rank == 1);
  CHECK(make("DP", 4, 8).pipeline_group(1) == topology.pipeline_group(1));
  CHECK(make("DPT", 4, 8).pipeline_group(1) == topology.pipeline_group(1));
}

TEST_CASE("topology: spread keeps a stage's replicas on consecutive ranks", "[topology]") {
  const Topology topology = make("spread", 4, 8);
  CHECK(topology.pipeline_group(0) == std::vector<int>{0, 2, 4, 6});
  CHECK(topology.pipeline_group(1) == std::vector<int>{1, 3, 5, 7});
  CHECK(topology.data_parallel_group(3) == std::vector<int>{6, 7});
  CHECK(make("PD", 4, 8).pipeline_group(1) == topology.pipeline_group(1));
  CHECK(make("TPD", 4, 8).pipeline_group(1) == topology.pipeline_group(1));
}

TEST_CASE("topology: rank <-> coordinates is a bijection", "[topology]") {
  for (const char* placement : {"cluster", "spread"}) {
    for (int partitions : {1, 2, 3, 4}) {
      for (int replicas : {1, 2, 3}) {
        const Topology topology = make(placement, partitions, partitions * replicas);
        std::set<int> seen;
        for (int rank = 0; rank < partitions * replicas; ++rank) {
          const auto c = topology.coordinates_of(rank);
          CHECK(topology.rank_of(c) == rank);
          CHECK(c.pp_rank < partitions);
          CHECK(c.dp_rank < replicas);
          seen.insert(c.pp_rank * 100 + c.dp_rank);
        }
        CHECK(static_cast<int>(seen.size()) == partitions * replicas);
      }
    }
  }
}

TEST_CASE("topology: a world that does not fit the config is rejected", "[topology]") {
  CHECK_THROWS_AS(make("cluster", 4, 6), smp::ConfigError);
}
