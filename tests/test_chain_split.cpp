#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <limits>
#include <random>

#include "smp/partitioner/chain_split.h"

using namespace smp::part;
using Catch::Matchers::Contains;

namespace {
// Every contiguous split, for checking the dynamic program on small chains.
double brute_force_bottleneck(const std::vector<double>& costs, int stages) {
  const int n = static_cast<int>(costs.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> cuts(stages - 1);
  std::function<void(int, int)> place = [&](int index, int first) {
    if (index == stages - 1) {
      double worst = 0, sum = 0;
      int begin = 0;
      for (int s = 0; s < stages; ++s) {
        const int end = s + 1 < stages ? cuts[s] : n;
        sum = 0;
        for (int i = begin; i < end; ++i) sum += costs[i];
        worst = std::max(worst, sum);
        begin = end;
      }
      best = std::min(best, worst);
      return;
    }
    for (int cut = first; cut <= n - (stages - 1 - index); ++cut) {
      cuts[index] = cut;
      place(index + 1, cut + 1);
    }
  };
  place(0, 1);
  return best;
}
}  // namespace

TEST_CASE("chain split: optimal on random chains", "[partition]") {
  std::mt19937 generator(42);
  std::uniform_real_distribution<double> cost(0.1, 10.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(generator() % 10);
    const int stages = 1 + static_cast<int>(generator() % n);
    std::vector<double> costs(n);
    for (auto& c : costs) c = cost(generator);
    const auto split = split_chain_min_bottleneck(costs, stages);
    REQUIRE(split.stage_of_node.size() == costs.size());
    CHECK(split.stage_of_node.front() == 0);
    CHECK(split.stage_of_node.back() == stages - 1);
    for (int i = 1; i < n; ++i) {
      const int step = split.stage_of_node[i] - split.stage_of_node[i - 1];
      CHECK((step == 0 || step == 1));
    }
    CHECK(split.bottleneck == Approx(brute_force_bottleneck(costs, stages)));
    CHECK(split.bottleneck <= split_chain_uniform(costs, stages).bottleneck + 1e-12);
  }
}

TEST_CASE("chain split: a heavy first module gets its own stage", "[partition]") {
  const auto split = split_chain_min_bottleneck({10, 1, 1, 1, 1, 1, 1}, 3);
  CHECK(split.stage_of_node == std::vector<int>{0, 1, 1, 1, 2, 2, 2});
  CHECK(split.bottleneck == 10);
}

TEST_CASE("chain split: pinned modules", "[partition]") {
  CHECK_THROWS_WITH(split_chain_min_bottleneck({1, 1, 1, 1}, 2, {-1, -1, -1, 0}), Contains("leave some stage empty"));
  CHECK(split_chain_min_bottleneck({5, 1, 1, 1}, 2, {0, 0, -1, -1}).stage_of_node == std::vector<int>{0, 0, 1, 1});
  CHECK_THROWS_WITH(split_chain_min_bottleneck({1, 1, 1}, 2, {1, 0, -1}), Contains("module 1 is pinned to stage 0 but comes after module 0"));
  CHECK_THROWS_WITH(split_chain_min_bottleneck({1, 1, 1}, 2, {-1, 7, -1}), Contains("outside [0, 1]"));
}

TEST_CASE("chain split: impossible requests", "[partition]") {
  CHECK_THROWS_WITH(split_chain_min_bottleneck({1, 1}, 3), Contains("cannot split 2 modules into 3 pipeline stages"));
  CHECK_THROWS_WITH(split_chain_min_bottleneck({1, -1}, 1), Contains("invalid cost"));
  CHECK_THROWS_AS(split_chain_min_bottleneck({1}, 0), PartitionError);
  const auto uniform = split_chain_uniform({1, 1, 1, 1, 1}, 2);
  CHECK(uniform.stage_of_node == std::vector<int>{0, 0, 0, 1, 1});
}
