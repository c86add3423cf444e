#include <catch2/catch.hpp>

#include <set>

#include "smp/topology.h"

using smp::Config;
using smp::Topology;

namespace {
Topology make(const std::string& placement, int partitions, int world, int tp = 1) {
  Config config;
  config.partitions = partitions;
  config.tensor_parallel_degree = tp;
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

TEST_CASE("topology: expert-parallel groups are blocks of consecutive replicas, their holders strided", "[topology]") {
  Config config;
  config.partitions = 2;
  config.ddp = true;
  config.expert_parallel_degree = 2;
  const Topology topology(config, 8);  // cluster: replica d holds ranks 2d, 2d + 1
  CHECK(topology.expert_parallel_degree() == 2);
  const auto at = [&](int rank) { return topology.coordinates_of(rank); };
  CHECK(topology.ep_rank(at(5)) == 0);  // replica 2
  CHECK(topology.expert_parallel_group(at(5)) == std::vector<int>{5, 7});
  CHECK(topology.expert_parallel_group(at(7)) == std::vector<int>{5, 7});
  CHECK(topology.expert_data_parallel_group(at(5)) == std::vector<int>{1, 5});
  CHECK(topology.expert_data_parallel_group(at(2)) == std::vector<int>{2, 6});
  config.expert_parallel_degree = 1;
  const Topology whole(config, 8);
  CHECK(whole.expert_parallel_group(at(5)) == std::vector<int>{5});
  CHECK(whole.expert_data_parallel_group(at(5)) == whole.data_parallel_group(1));
}

TEST_CASE("topology: a world that does not fit the config is rejected", "[topology]") {
  CHECK_THROWS_AS(make("cluster", 4, 6), smp::ConfigError);
}

TEST_CASE("topology: three axes in SMP's letter orders, the last letter varying fastest", "[topology]") {
  // SMP's table for 8 ranks, tp 2 x pp 2 x dp 2 under "DPT": rank = 4 dp + 2 pp + tp.
  const Topology cluster = make("cluster", 2, 8, 2);
  CHECK(cluster.order() == "DPT");
  CHECK(cluster.data_parallel_degree() == 2);
  CHECK(cluster.tensor_parallel_group(1, 0) == std::vector<int>{2, 3});
  CHECK(cluster.pipeline_group(1, 1) == std::vector<int>{5, 7});
  CHECK(cluster.data_parallel_group(0, 1) == std::vector<int>{1, 5});
  const auto six = cluster.coordinates_of(6);
  CHECK((six.dp_rank == 1 && six.pp_rank == 1 && six.tp_rank == 0));
  // "spread" is "TPD": replicas on consecutive ranks, tensor-parallel shards farthest apart.
  const Topology spread = make("spread", 2, 8, 2);
  CHECK(spread.tensor_parallel_group(0, 0) == std::vector<int>{0, 4});
  CHECK(spread.data_parallel_group(1, 0) == std::vector<int>{2, 3});
  // Two letters put T fastest.
  CHECK(make("PD", 2, 8, 2).tensor_parallel_group(1, 1) == std::vector<int>{6, 7});
  CHECK(make("PTD", 2, 8, 2).tensor_parallel_group(0, 0) == std::vector<int>{0, 2});
  // Every order is a bijection, and each axis's groups partition the world.
  for (const char* order : {"DPT", "DTP", "PDT", "PTD", "TDP", "TPD"}) {
    const Topology topology = make(order, 3, 12, 2);
    std::set<int> seen;
    for (int rank = 0; rank < 12; ++rank) {
      const auto c = topology.coordinates_of(rank);
      CHECK(topology.rank_of(c) == rank);
      seen.insert(c.tp_rank * 100 + c.pp_rank * 10 + c.dp_rank);
      for (smp::Axis axis : {smp::Axis::tensor, smp::Axis::pipeline, smp::Axis::data}) {
        const auto group = topology.group(axis, c);
        CHECK(group.at(static_cast<std::size_t>(c.along(axis))) == rank);
      }
    }
    CHECK(seen.size() == 12);
  }
  CHECK_THROWS_WITH(make("cluster", 2, 6, 2), Catch::Contains("is not a multiple of \"partitions\" x \"tensor_parallel_degree\" (2 x 2)"));
}
