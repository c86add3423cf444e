#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "smp/partitioner/chain_split.h"
#include "smp/partitioner/graph_generators.h"
#include "smp/partitioner/graph_partition.h"

using namespace smp::part;
using Catch::Matchers::Contains;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kRelativeTolerance = 1e-9;

// Tensors of a few MiB cost a noticeable fraction of a millisecond-scale stage at 10 GB/s.
constexpr double kBandwidth = 10e9;

ModuleGraph chain(const std::vector<double>& compute_s, const std::vector<double>& memory_bytes,
                  const std::vector<double>& edge_bytes) {
  ModuleGraph graph;
  for (std::size_t i = 0; i < compute_s.size(); ++i) {
    graph.nodes.push_back({"layer_" + std::to_string(i), compute_s[i], memory_bytes[i], memory_bytes[i] / 4});
    if (i > 0) graph.edges.push_back({static_cast<int>(i) - 1, static_cast<int>(i), edge_bytes[i - 1]});
  }
  return graph;
}

ModuleGraph named_chain(const std::vector<std::string>& names) {
  ModuleGraph graph;
  for (std::size_t i = 0; i < names.size(); ++i) {
    graph.nodes.push_back({names[i], 1e-3, 10.0, 1.0});
    if (i > 0) graph.edges.push_back({static_cast<int>(i) - 1, static_cast<int>(i), 1.0});
  }
  return graph;
}

GraphPartitionOptions stages(int num_stages, double memory_weight = 0.2, double bandwidth = 0) {
  GraphPartitionOptions options;
  options.num_stages = num_stages;
  options.memory_weight = memory_weight;
  options.bandwidth_bytes_per_s = bandwidth;
  return options;
}

double max_of(const std::vector<double>& values) { return *std::max_element(values.begin(), values.end()); }

bool no_worse(double ours, double other) { return ours <= other * (1 + kRelativeTolerance); }

struct NamedGraph {
  std::string name;
  ModuleGraph graph;
};

std::vector<NamedGraph> every_generator() {
  return {{"uniform_chain(100)", uniform_chain(100)},  {"random_chain(100)", random_chain(100, 3)},
          {"transformer_chain(70)", transformer_chain(70)}, {"resnet_like(40)", resnet_like(40)},
          {"unet_like(30)", unet_like(30)},                {"random_dag(150)", random_dag(150, 5)}};
}

}  // namespace

TEST_CASE("evaluate counts each output once per consuming stage and normalizes by the graph's means") {
  // a feeds b and c; b feeds d.
  ModuleGraph graph;
  graph.nodes = {{"a", 1.0, 100, 0}, {"b", 2.0, 300, 0}, {"c", 1.0, 0, 0}, {"d", 4.0, 600, 0}};
  graph.edges = {{0, 1, 10}, {0, 2, 30}, {1, 3, 5}};
  GraphPartitionOptions options = stages(3, 0.25, 10.0);  // 10 bytes per second

  const GraphPartition together = evaluate(graph, {0, 1, 1, 2}, options);
  CHECK(together.stage_sent_bytes == std::vector<double>{30, 5, 0});  // a's output travels once, at its largest
  const GraphPartition apart = evaluate(graph, {0, 1, 2, 2}, options);
  CHECK(apart.stage_sent_bytes == std::vector<double>{40, 5, 0});  // once to each consuming stage
  CHECK(apart.stage_compute_s == std::vector<double>{1, 2, 5});
  CHECK(apart.stage_memory_bytes == std::vector<double>{100, 300, 600});

  // Means over the graph: compute 8 s / 3 stages, memory 1000 bytes / 3 stages.
  const double mean_time = 8.0 / 3, mean_memory = 1000.0 / 3;
  CHECK(apart.stage_cost[0] == Approx(0.75 * (1 + 40 / 10.0) / mean_time + 0.25 * 100 / mean_memory));
  CHECK(apart.stage_cost[2] == Approx(0.75 * 5 / mean_time + 0.25 * 600 / mean_memory));
  CHECK(apart.bottleneck == Approx(max_of(apart.stage_cost)));

  SECTION("a term whose total is zero drops out") {
    for (GraphNode& node : graph.nodes) node.memory_bytes = 0;
    const GraphPartition compute_only = evaluate(graph, {0, 1, 2, 2}, stages(3, 0.25));
    CHECK(compute_only.stage_cost[2] == Approx(0.75 * 5 / mean_time));
  }
  SECTION("a stage over the memory limit is infeasible") {
    options.memory_limit_bytes = 500;
    CHECK(evaluate(graph, {0, 1, 2, 2}, options).bottleneck == std::numeric_limits<double>::infinity());
  }
}

TEST_CASE("on chains partition_graph finds the exact chain split's bottleneck") {
  std::mt19937_64 random(11);
  std::uniform_real_distribution<double> compute(0.1e-3, 5e-3), memory(1 * kMiB, 500 * kMiB), bytes(1, 64 * kMiB);
  for (int trial = 0; trial < 60; ++trial) {
    const int num_stages = 1 + trial % 8;
    const int num_nodes = num_stages + static_cast<int>(random() % 40);
    std::vector<double> compute_s(num_nodes), memory_bytes(num_nodes), edge_bytes(num_nodes);
    for (int i = 0; i < num_nodes; ++i) compute_s[i] = compute(random), memory_bytes[i] = memory(random);
    for (double& b : edge_bytes) b = bytes(random);
    const ModuleGraph graph = chain(compute_s, memory_bytes, edge_bytes);
    INFO("trial " << trial << ": " << num_nodes << " nodes, " << num_stages << " stages");

    // Compute only: the bottleneck in seconds is the chain split's.
    const GraphPartition ours = partition_graph(graph, stages(num_stages, 0.0));
    CHECK_NOTHROW(check_partition(graph, ours, num_stages));
    CHECK(max_of(ours.stage_compute_s) ==
          Approx(split_chain_min_bottleneck(compute_s, num_stages).bottleneck).epsilon(kRelativeTolerance));

    // With memory balancing the objective is still additive along a chain.
    const double total_compute = std::accumulate(compute_s.begin(), compute_s.end(), 0.0);
    const double total_memory = std::accumulate(memory_bytes.begin(), memory_bytes.end(), 0.0);
    std::vector<double> blended(num_nodes);
    for (int i = 0; i < num_nodes; ++i) {
      blended[i] = num_stages * (0.8 * compute_s[i] / total_compute + 0.2 * memory_bytes[i] / total_memory);
    }
    CHECK(partition_graph(graph, stages(num_stages, 0.2)).bottleneck ==
          Approx(split_chain_min_bottleneck(blended, num_stages).bottleneck).epsilon(kRelativeTolerance));
  }
}

TEST_CASE("on long chains partition_graph matches the exact chain split") {
  const ModuleGraph graph = random_chain(400, 17);
  std::vector<double> compute_s;
  for (const GraphNode& node : graph.nodes) compute_s.push_back(node.compute_s);
  for (int num_stages : {2, 7, 32, 64}) {
    INFO(num_stages << " stages");
    CHECK(max_of(partition_graph(graph, stages(num_stages, 0.0)).stage_compute_s) ==
          Approx(split_chain_min_bottleneck(compute_s, num_stages).bottleneck).epsilon(kRelativeTolerance));
  }
}

TEST_CASE("more than 64 stages, and graphs without edges") {
  const ModuleGraph graph = random_chain(150, 23);
  std::vector<double> compute_s;
  for (const GraphNode& node : graph.nodes) compute_s.push_back(node.compute_s);
  for (int num_stages : {65, 100, 150}) {
    INFO(num_stages << " stages");
    const GraphPartition ours = partition_graph(graph, stages(num_stages, 0.0));
    REQUIRE_NOTHROW(check_partition(graph, ours, num_stages));
    CHECK(max_of(ours.stage_compute_s) ==
          Approx(split_chain_min_bottleneck(compute_s, num_stages).bottleneck).epsilon(kRelativeTolerance));
  }
  ModuleGraph independent = random_chain(40, 29);
  independent.edges.clear();
  for (int num_stages : {2, 7}) {
    const GraphPartitionOptions options = stages(num_stages, 0.2, kBandwidth);
    const GraphPartition ours = partition_graph(independent, options);
    REQUIRE_NOTHROW(check_partition(independent, ours, num_stages));
    CHECK(no_worse(ours.bottleneck, partition_uniform(independent, options).bottleneck));
  }
}

TEST_CASE("on chains with communication partition_graph is optimal") {
  // A chain has no fan-out, so the contiguous split prices every send exactly.
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    const ModuleGraph graph = random_chain(6 + static_cast<int>(seed % 7), seed);
    for (int num_stages = 2; num_stages <= 4; ++num_stages) {
      const GraphPartitionOptions options = stages(num_stages, 0.2, kBandwidth);
      INFO("seed " << seed << ", " << num_stages << " stages");
      CHECK(partition_graph(graph, options).bottleneck ==
            Approx(optimal_partition_exhaustive(graph, options).bottleneck).epsilon(kRelativeTolerance));
    }
  }
}

TEST_CASE("on small DAGs partition_graph is near the exhaustive optimum and never worse than the baselines") {
  double worst_ratio = 1, ratio_sum = 0;
  int cases = 0, within_two_percent = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const ModuleGraph graph = random_dag(6 + static_cast<int>(seed % 7), 1000 + seed);
    for (int num_stages = 2; num_stages <= 4; ++num_stages) {
      for (double bandwidth : {0.0, kBandwidth}) {
        const GraphPartitionOptions options = stages(num_stages, 0.2, bandwidth);
        INFO("seed " << seed << ", " << graph.nodes.size() << " nodes, " << num_stages << " stages, bandwidth "
                     << bandwidth);
        const GraphPartition ours = partition_graph(graph, options);
        const double optimum = optimal_partition_exhaustive(graph, options).bottleneck;
        REQUIRE_NOTHROW(check_partition(graph, ours, num_stages));
        const double ratio = ours.bottleneck / optimum;
        REQUIRE(ratio >= 1 - kRelativeTolerance);
        REQUIRE(ratio <= 1.10);
        CHECK(no_worse(ours.bottleneck, partition_uniform(graph, options).bottleneck));
        CHECK(no_worse(ours.bottleneck, partition_by_parameters(graph, options).bottleneck));
        worst_ratio = std::max(worst_ratio, ratio);
        ratio_sum += ratio;
        within_two_percent += ratio <= 1.02 ? 1 : 0;
        ++cases;
      }
    }
  }
  std::ostringstream report;
  report << "small DAGs: " << cases << " cases, ours / exhaustive optimum: mean " << ratio_sum / cases << ", worst "
         << worst_ratio << ", within 2%: " << within_two_percent;
  WARN(report.str());
}

TEST_CASE("every generator and stage count gives an acyclic partition with non-empty stages") {
  for (const NamedGraph& generated : every_generator()) {
    const int num_nodes = static_cast<int>(generated.graph.nodes.size());
    for (int num_stages = 2; num_stages <= std::min(64, num_nodes); ++num_stages) {
      for (double bandwidth : {0.0, kBandwidth}) {
        INFO(generated.name << ", " << num_stages << " stages, bandwidth " << bandwidth);
        const GraphPartitionOptions options = stages(num_stages, 0.2, bandwidth);
        const GraphPartition ours = partition_graph(generated.graph, options);
        REQUIRE_NOTHROW(check_partition(generated.graph, ours, num_stages));
        REQUIRE(ours.stage_cost.size() == static_cast<std::size_t>(num_stages));
        REQUIRE(ours.bottleneck == Approx(evaluate(generated.graph, ours.stage_of_node, options).bottleneck));
        CHECK_NOTHROW(check_partition(generated.graph, partition_uniform(generated.graph, options), num_stages));
        CHECK_NOTHROW(
            check_partition(generated.graph, partition_by_parameters(generated.graph, options), num_stages));
      }
    }
  }
}

TEST_CASE("on larger graphs partition_graph is never worse than the baselines") {
  const std::vector<NamedGraph> graphs = {{"transformer_chain(500)", transformer_chain(500)},
                                          {"resnet_like(300)", resnet_like(300)},
                                          {"unet_like(250)", unet_like(250)},
                                          {"random_dag(800)", random_dag(800, 9)}};
  for (const NamedGraph& generated : graphs) {
    for (int num_stages : {2, 8, 32, 64}) {
      for (double bandwidth : {0.0, kBandwidth}) {
        INFO(generated.name << ", " << num_stages << " stages, bandwidth " << bandwidth);
        const GraphPartitionOptions options = stages(num_stages, 0.2, bandwidth);
        const double ours = partition_graph(generated.graph, options).bottleneck;
        CHECK(no_worse(ours, partition_uniform(generated.graph, options).bottleneck));
        CHECK(no_worse(ours, partition_by_parameters(generated.graph, options).bottleneck));
      }
    }
  }
}

TEST_CASE("pinned nodes stay on their stages") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    const ModuleGraph graph = random_dag(60, seed);
    const int num_stages = 2 + static_cast<int>(seed % 5);
    GraphPartitionOptions options = stages(num_stages, 0.2, kBandwidth);
    // Pins taken from a valid assignment (contiguous along the topological order) are consistent with the edges.
    const std::vector<int> valid = partition_uniform(graph, options).stage_of_node;
    options.pinned.assign(graph.nodes.size(), -1);
    std::mt19937_64 random(seed);
    for (std::size_t node = 0; node < graph.nodes.size(); ++node) {
      if (random() % 5 == 0) options.pinned[node] = valid[node];
    }
    INFO("seed " << seed);
    const GraphPartition ours = partition_graph(graph, options);
    REQUIRE_NOTHROW(check_partition(graph, ours, num_stages));
    for (std::size_t node = 0; node < graph.nodes.size(); ++node) {
      if (options.pinned[node] >= 0) CHECK(ours.stage_of_node[node] == options.pinned[node]);
    }
  }
}

TEST_CASE("pins on unrelated nodes that the given order lists backwards are still honoured") {
  // Two independent branches; the later-listed branch is pinned to the first stage.
  ModuleGraph graph;
  graph.nodes = {{"left_a", 1, 1, 0}, {"left_b", 1, 1, 0}, {"right_a", 1, 1, 0}, {"right_b", 1, 1, 0}};
  graph.edges = {{0, 1, 1}, {2, 3, 1}};
  GraphPartitionOptions options = stages(2);
  options.pinned = {1, -1, 0, -1};
  const GraphPartition ours = partition_graph(graph, options);
  REQUIRE_NOTHROW(check_partition(graph, ours, 2));
  CHECK(ours.stage_of_node[0] == 1);
  CHECK(ours.stage_of_node[2] == 0);
}

namespace {

bool every_stage_has_parameters(const ModuleGraph& graph, const GraphPartition& partition, int num_stages) {
  std::vector<int> with_parameters(num_stages, 0);
  for (std::size_t node = 0; node < graph.nodes.size(); ++node) {
    if (graph.nodes[node].parameter_bytes > 0) ++with_parameters[partition.stage_of_node[node]];
  }
  return std::count(with_parameters.begin(), with_parameters.end(), 0) == 0;
}

// Linear layers (with parameters) each followed by a cheap activation (without).
ModuleGraph linear_relu_chain(int pairs) {
  ModuleGraph graph;
  for (int i = 0; i < 2 * pairs; ++i) {
    const bool linear = i % 2 == 0;
    graph.nodes.push_back({(linear ? "linear_" : "relu_") + std::to_string(i / 2), linear ? 1e-3 : 1e-4,
                           linear ? 4 * kMiB : 0.0, linear ? kMiB : 0.0, kMiB});
    if (i > 0) graph.edges.push_back({i - 1, i, kMiB});
  }
  return graph;
}

}  // namespace

TEST_CASE("every stage gets parameters when enough modules have them") {
  SECTION("a device five times slower is not handed a lone activation") {
    const ModuleGraph graph = linear_relu_chain(2);
    GraphPartitionOptions options = stages(2, 0.0);
    options.stage_speeds = {1.0, 0.2};
    options.parameters_on_every_stage = false;
    CHECK(partition_graph(graph, options).stage_of_node == std::vector<int>{0, 0, 0, 1});
    options.parameters_on_every_stage = true;
    const GraphPartition split = partition_graph(graph, options);
    CHECK(split.stage_of_node == std::vector<int>{0, 0, 1, 1});
    CHECK(split.bottleneck == Approx(optimal_partition_exhaustive(graph, options).bottleneck));
  }
  SECTION("on DAGs with parameter-free modules the search keeps the rule and stays near the exhaustive optimum") {
    // A heuristic on DAGs: single moves cannot trade a stage's only parameters for another's, so a few cases stay
    // in a worse local minimum than without the rule (over 1,084 such cases: mean 1.0013 against 1.0007, three
    // above 1.10, the worst 1.29, which one case reaches without the rule too).
    double worst_ratio = 1, ratio_sum = 0;
    int cases = 0;
    for (std::uint64_t seed = 1; seed <= 30; ++seed) {
      ModuleGraph graph = random_dag(8 + static_cast<int>(seed % 5), 2000 + seed);
      std::mt19937_64 random(seed);
      for (GraphNode& node : graph.nodes) {
        if (random() % 2 == 0) node.parameter_bytes = 0, node.memory_bytes = 0;
      }
      const auto with_parameters = std::count_if(graph.nodes.begin(), graph.nodes.end(),
                                                 [](const GraphNode& node) { return node.parameter_bytes > 0; });
      for (int num_stages = 2; num_stages <= std::min<int>(4, static_cast<int>(with_parameters)); ++num_stages) {
        for (bool speeds_differ : {false, true}) {  // one cost class, and the per-stage search
          GraphPartitionOptions options = stages(num_stages, 0.2, kBandwidth);
          if (speeds_differ) options.stage_speeds.assign(num_stages, 1.0), options.stage_speeds.back() = 0.25;
          INFO("seed " << seed << ", " << graph.nodes.size() << " nodes, " << num_stages << " stages, speeds differ "
                       << speeds_differ);
          const GraphPartition ours = partition_graph(graph, options);
          REQUIRE_NOTHROW(check_partition(graph, ours, num_stages));
          REQUIRE(every_stage_has_parameters(graph, ours, num_stages));
          const GraphPartition optimum = optimal_partition_exhaustive(graph, options);
          REQUIRE(every_stage_has_parameters(graph, optimum, num_stages));
          const double ratio = ours.bottleneck / optimum.bottleneck;
          REQUIRE(ratio >= 1 - kRelativeTolerance);
          REQUIRE(ratio <= 1.25);
          worst_ratio = std::max(worst_ratio, ratio);
          ratio_sum += ratio, ++cases;
        }
      }
    }
    CHECK(ratio_sum / cases <= 1.01);
    WARN("DAGs with parameter-free modules: " << cases << " cases, ours / optimum: mean " << ratio_sum / cases
                                              << ", worst " << worst_ratio);
  }
  SECTION("many stages on a long graph") {
    const ModuleGraph graph = linear_relu_chain(100);
    for (int num_stages : {2, 7, 64, 100}) {
      GraphPartitionOptions options = stages(num_stages, 0.2, kBandwidth);
      INFO(num_stages << " stages");
      CHECK(every_stage_has_parameters(graph, partition_graph(graph, options), num_stages));
      options.stage_speeds.assign(num_stages, 1.0);
      options.stage_speeds.front() = 0.1;
      CHECK(every_stage_has_parameters(graph, partition_graph(graph, options), num_stages));
    }
  }
  SECTION("pins that leave a stage without parameters win over the rule") {
    const ModuleGraph graph = linear_relu_chain(2);
    GraphPartitionOptions options = stages(2);
    options.pinned = {-1, -1, 0, 1};
    CHECK(partition_graph(graph, options).stage_of_node == std::vector<int>{0, 0, 0, 1});
    CHECK(optimal_partition_exhaustive(graph, options).stage_of_node == std::vector<int>{0, 0, 0, 1});
  }
  SECTION("fewer modules with parameters than stages: the rule is off") {
    ModuleGraph graph = linear_relu_chain(2);
    graph.nodes[2].parameter_bytes = graph.nodes[2].memory_bytes = 0;
    REQUIRE_NOTHROW(check_partition(graph, partition_graph(graph, stages(3)), 3));
  }
  SECTION("evaluate prices a stage without parameters like any other") {
    const ModuleGraph graph = linear_relu_chain(2);
    CHECK(std::isfinite(evaluate(graph, {0, 0, 0, 1}, stages(2)).bottleneck));
  }
}

TEST_CASE("the memory limit holds and costs balance") {
  const ModuleGraph graph = transformer_chain(30);
  std::vector<double> memory_bytes;
  for (const GraphNode& node : graph.nodes) memory_bytes.push_back(node.memory_bytes + node.activation_bytes);
  const int num_stages = 4;
  GraphPartitionOptions options = stages(num_stages, 0.0);
  const GraphPartition unconstrained = partition_graph(graph, options);
  const double smallest_possible = split_chain_min_bottleneck(memory_bytes, num_stages).bottleneck;
  REQUIRE(max_of(unconstrained.stage_memory_bytes) > smallest_possible * 1.01);  // the limit below binds

  options.memory_limit_bytes = (max_of(unconstrained.stage_memory_bytes) + smallest_possible) / 2;
  const GraphPartition limited = partition_graph(graph, options);
  REQUIRE_NOTHROW(check_partition(graph, limited, num_stages));
  CHECK(max_of(limited.stage_memory_bytes) <= options.memory_limit_bytes);
  CHECK(limited.bottleneck >= unconstrained.bottleneck * (1 - kRelativeTolerance));
  CHECK(std::isfinite(limited.bottleneck));
}

// Under 1F1B on p ranks, stage s holds the activations of p - s microbatches at once.
std::vector<double> one_f_one_b_copies(int num_stages) {
  std::vector<double> copies;
  for (int stage = 0; stage < num_stages; ++stage) copies.push_back(num_stages - stage);
  return copies;
}

ModuleGraph equal_layers(int num_nodes, double activation_bytes) {
  ModuleGraph graph;
  for (int i = 0; i < num_nodes; ++i) {
    GraphNode node;
    node.name = "layer_" + std::to_string(i);
    node.compute_s = 3e-3;
    node.recompute_s = 1e-3;
    node.memory_bytes = 4 * kMiB;
    node.parameter_bytes = kMiB;
    node.activation_bytes = activation_bytes;
    graph.nodes.push_back(node);
    if (i > 0) graph.edges.push_back({i - 1, i, kMiB});
  }
  return graph;
}

std::vector<int> layers_per_stage(const GraphPartition& partition, int num_stages) {
  std::vector<int> count(num_stages, 0);
  for (int stage : partition.stage_of_node) ++count[stage];
  return count;
}

TEST_CASE("per-stage activation copies and recomputation enter each stage's memory and time") {
  ModuleGraph graph = equal_layers(4, 10 * kMiB);
  GraphPartitionOptions options = stages(2, 0.5);
  options.activation_copies = {3, 1};
  options.recomputes = {false, true};
  const GraphPartition split = evaluate(graph, {0, 0, 1, 1}, options);
  CHECK(split.stage_memory_bytes == std::vector<double>{2 * (4 + 3 * 10) * kMiB, 2 * (4 + 10) * kMiB});
  CHECK(split.stage_compute_s[0] == Approx(6e-3));
  CHECK(split.stage_compute_s[1] == Approx(8e-3));  // its forward again

  SECTION("the factors must fit the stages") {
    options.activation_copies = {1, 2, 3};
    CHECK_THROWS_WITH(evaluate(graph, {0, 0, 1, 1}, options), Contains("one entry per stage"));
    CHECK_THROWS_WITH(partition_graph(graph, options), Contains("one entry per stage"));
    options.activation_copies = {1, -1};
    CHECK_THROWS_WITH(partition_graph(graph, options), Contains("activation_copies of stage 1"));
  }
}

TEST_CASE("a stage exactly at the memory limit is feasible to the split and to evaluate alike") {
  // Fractional amounts whose sums round differently in the split's sliding window and in a stage's totals.
  ModuleGraph graph;
  const double nodes[3][3] = {{0.25, 8 * 0.1, 6 * 0.1}, {0.64, 7 * 0.1, 4 * 0.1}, {0.94, 3 * 0.1, 8 * 0.1}};
  for (int i = 0; i < 3; ++i) {
    GraphNode node;
    node.name = "n" + std::to_string(i);
    node.compute_s = nodes[i][0];
    node.memory_bytes = nodes[i][1];
    node.activation_bytes = nodes[i][2];
    graph.nodes.push_back(node);
    if (i > 0) graph.edges.push_back({i - 1, i, 1.0});
  }
  GraphPartitionOptions options = stages(2, 0.3);
  options.activation_copies = {0.1, 2 * 0.1};
  options.memory_limit_bytes = 1.24;
  const GraphPartition optimum = optimal_partition_exhaustive(graph, options);
  const GraphPartition ours = partition_graph(graph, options);
  CHECK(std::isfinite(ours.bottleneck));
  CHECK(ours.bottleneck == Approx(optimum.bottleneck).epsilon(kRelativeTolerance));

  SECTION("bad per-stage values are refused by every entry point") {
    options.activation_copies = {-5, 1};
    CHECK_THROWS_WITH(evaluate(graph, {0, 1, 1}, options), Contains("activation_copies of stage 0"));
    options.activation_copies = {std::numeric_limits<double>::quiet_NaN(), 1};
    CHECK_THROWS_AS(partition_uniform(graph, options), PartitionError);
    CHECK_THROWS_AS(partition_by_parameters(graph, options), PartitionError);
  }
}

TEST_CASE("stages that hold more microbatches get fewer layers") {
  const int num_stages = 4;
  const ModuleGraph graph = equal_layers(20, 16 * kMiB);
  SECTION("memory balancing under 1F1B") {
    GraphPartitionOptions options = stages(num_stages, 1.0);
    options.activation_copies = one_f_one_b_copies(num_stages);
    const std::vector<int> layers = layers_per_stage(partition_graph(graph, options), num_stages);
    INFO("layers per stage: " << layers[0] << " " << layers[1] << " " << layers[2] << " " << layers[3]);
    CHECK(std::is_sorted(layers.begin(), layers.end()));
    CHECK(layers.front() < layers.back());
  }
  SECTION("a memory limit that only the per-stage counts can meet") {
    // 20 layers of 4 MiB state and 16 MiB activations: the first stage holds 4 copies (68 MiB a layer), the last
    // one (20 MiB a layer). Counting 4 copies everywhere, 20 layers need 1360 MiB: more than 4 x 300 MiB.
    GraphPartitionOptions options = stages(num_stages, 0.0);
    options.memory_limit_bytes = 300 * kMiB;
    options.activation_copies = std::vector<double>(num_stages, 4.0);
    CHECK_THROWS_WITH(partition_graph(graph, options), Contains("memory limit"));
    options.activation_copies = one_f_one_b_copies(num_stages);
    const GraphPartition split = partition_graph(graph, options);
    REQUIRE_NOTHROW(check_partition(graph, split, num_stages));
    CHECK(max_of(split.stage_memory_bytes) <= options.memory_limit_bytes);
  }
  SECTION("recomputation makes a stage slower") {
    GraphPartitionOptions options = stages(num_stages, 0.0);
    options.recomputes = {true, false, false, false};
    const std::vector<int> layers = layers_per_stage(partition_graph(graph, options), num_stages);
    CHECK(layers[0] < layers[1]);
  }
}

TEST_CASE("devices that differ: a faster stage gets more layers, a smaller one fewer") {
  const ModuleGraph graph = equal_layers(24, 16 * kMiB);
  SECTION("layers in proportion to the speeds") {
    GraphPartitionOptions options = stages(3, 0.0);
    options.stage_speeds = {1.0, 2.0, 1.0};
    const GraphPartition split = partition_graph(graph, options);
    CHECK(layers_per_stage(split, 3) == std::vector<int>{6, 12, 6});
    // On its own device every stage takes the same time.
    CHECK(split.stage_compute_s[0] == Approx(split.stage_compute_s[1]));
    CHECK(split.stage_compute_s[1] == Approx(split.stage_compute_s[2]));
  }
  SECTION("a device with less memory holds fewer layers, the others take the rest") {
    GraphPartitionOptions options = stages(2, 0.0);
    const double layer_bytes = graph.nodes[0].memory_bytes + graph.nodes[0].activation_bytes;
    options.stage_memory_limit_bytes = {8.5 * layer_bytes, 0.0};  // the second: no limit
    const GraphPartition split = partition_graph(graph, options);
    CHECK(layers_per_stage(split, 2) == std::vector<int>{8, 16});
    CHECK(split.stage_memory_bytes[0] <= options.stage_memory_limit_bytes[0]);
  }
  SECTION("bad speeds and per-stage lists of the wrong length are named") {
    GraphPartitionOptions options = stages(2, 0.0);
    options.stage_speeds = {1.0, 0.0};
    CHECK_THROWS_WITH(partition_graph(graph, options), Contains("stage_speeds of stage 1 must be finite and positive"));
    options.stage_speeds = {1.0, 1.0, 1.0};
    CHECK_THROWS_WITH(partition_graph(graph, options), Contains("one entry per stage (2) or none"));
  }
}

TEST_CASE("with per-stage factors partition_graph stays exact on chains and near the optimum on DAGs") {
  std::mt19937_64 random(5);
  int dag_cases = 0, dag_within_two_percent = 0, dag_limit_misses = 0;
  double worst_dag_ratio = 1, dag_ratio_sum = 0;
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    for (bool is_chain : {true, false}) {
      const ModuleGraph graph = is_chain ? random_chain(6 + static_cast<int>(seed % 7), seed)
                                         : random_dag(6 + static_cast<int>(seed % 7), 2000 + seed);
      for (int num_stages = 2; num_stages <= 4; ++num_stages) {
        GraphPartitionOptions options = stages(num_stages, 0.4, kBandwidth);
        options.activation_copies.clear();
        for (int stage = 0; stage < num_stages; ++stage) {
          options.activation_copies.push_back(static_cast<double>(1 + random() % 4));
          options.recomputes.push_back(random() % 3 == 0);
          // Devices that differ, on half the cases: speeds from 0.5 to 2.
          if (seed % 2 == 0) options.stage_speeds.push_back(0.5 * static_cast<double>(1 + random() % 4));
        }
        if (seed % 3 == 0) {  // a pin the edges allow: the node at position i on stage i * k / n
          const int node = static_cast<int>(random() % graph.nodes.size());
          options.pinned.assign(graph.nodes.size(), -1);
          options.pinned[node] = static_cast<int>(node * num_stages / graph.nodes.size());
        }
        if (seed % 5 == 0) {  // a memory limit that binds: 90% of the largest stage of an unlimited optimum
          const GraphPartition unlimited = optimal_partition_exhaustive(graph, options);
          options.memory_limit_bytes = 0.9 * max_of(unlimited.stage_memory_bytes);
          if (seed % 2 == 0) {  // and one device with more memory than the others
            options.stage_memory_limit_bytes.assign(num_stages, 0.0);
            options.stage_memory_limit_bytes[random() % num_stages] = 1.5 * options.memory_limit_bytes;
          }
        }
        INFO("seed " << seed << (is_chain ? ", chain, " : ", DAG, ") << num_stages << " stages");
        double optimum;
        try {
          optimum = optimal_partition_exhaustive(graph, options).bottleneck;
        } catch (const PartitionError&) {
          CHECK_THROWS_AS(partition_graph(graph, options), PartitionError);
          continue;
        }
        // A split exists: the search must find one (exact on chains; on these small DAGs, when its orders miss
        // one under a tight limit, the exhaustive fallback finds it).
        GraphPartition ours;
        try {
          ours = partition_graph(graph, options);
        } catch (const PartitionError& error) {
          FAIL_CHECK("no split found although the optimum exists: " << error.what());
          ++dag_limit_misses;
          continue;
        }
        REQUIRE_NOTHROW(check_partition(graph, ours, num_stages));
        if (is_chain) {
          CHECK(ours.bottleneck == Approx(optimum).epsilon(kRelativeTolerance));
        } else {
          CHECK(ours.bottleneck >= optimum * (1 - kRelativeTolerance));
          // A heuristic on DAGs: the best assignment may need several nodes to trade stages at once (seen: 1.13
          // once in these 90 cases, with a mean of 1.0015).
          CHECK(ours.bottleneck <= optimum * 1.15);
          worst_dag_ratio = std::max(worst_dag_ratio, ours.bottleneck / optimum);
          dag_ratio_sum += ours.bottleneck / optimum;
          dag_within_two_percent += ours.bottleneck <= optimum * 1.02 ? 1 : 0;
          ++dag_cases;
        }
      }
    }
  }
  WARN("small DAGs with per-stage factors: " << dag_cases << " cases, ours / optimum: mean "
                                             << dag_ratio_sum / dag_cases << ", worst " << worst_dag_ratio
                                             << ", within 2%: " << dag_within_two_percent
                                             << "; limits met by a split that the search missed: " << dag_limit_misses);
  CHECK(dag_limit_misses == 0);
}

TEST_CASE("with a finite bandwidth the partition avoids cutting heavy tensors") {
  SECTION("a heavy edge in the middle of a chain") {
    ModuleGraph graph = named_chain({"n0", "n1", "n2", "n3", "n4", "n5"});
    graph.edges[2].bytes = 4e9;  // n2 -> n3, where the balanced cut would be
    const GraphPartition free_sends = partition_graph(graph, stages(2, 0.0));
    REQUIRE(free_sends.stage_of_node[2] != free_sends.stage_of_node[3]);
    const GraphPartition ours = partition_graph(graph, stages(2, 0.0, kBandwidth));
    CHECK(ours.stage_of_node[2] == ours.stage_of_node[3]);
    CHECK(ours.stage_sent_bytes[0] < 1e9);
  }
  SECTION("a heavy skip connection") {
    // n0 -> x -> conv1 -> conv2 -> add -> n5 with a heavy skip x -> add: every cut between x and add crosses it.
    ModuleGraph graph = named_chain({"n0", "x", "conv1", "conv2", "add", "n5"});
    graph.edges.push_back({1, 4, 4e9});
    const GraphPartition free_sends = partition_graph(graph, stages(2, 0.0));
    REQUIRE(free_sends.stage_of_node[1] != free_sends.stage_of_node[4]);
    const GraphPartition ours = partition_graph(graph, stages(2, 0.0, kBandwidth));
    REQUIRE_NOTHROW(check_partition(graph, ours, 2));
    CHECK(ours.stage_of_node[1] == ours.stage_of_node[4]);
  }
}

TEST_CASE("errors name the modules involved") {
  SECTION("more stages than modules") {
    CHECK_THROWS_WITH(partition_graph(named_chain({"a", "b", "c"}), stages(4)),
                      Contains("cannot split 3 modules into 4"));
  }
  SECTION("an edge against the order") {
    ModuleGraph graph = named_chain({"a", "b", "c"});
    graph.edges.push_back({2, 1, 1.0});
    CHECK_THROWS_WITH(partition_graph(graph, stages(2)), Contains("'c'") && Contains("'b'"));
  }
  SECTION("pins against the edges, along a path") {
    GraphPartitionOptions options = stages(2);
    options.pinned = {1, -1, 0};
    CHECK_THROWS_WITH(partition_graph(named_chain({"embed", "mid", "head"}), options),
                      Contains("'head'") && Contains("'embed'"));
    CHECK_THROWS_WITH(optimal_partition_exhaustive(named_chain({"embed", "mid", "head"}), options),
                      Contains("'head'") && Contains("'embed'"));
  }
  SECTION("a pin out of range") {
    GraphPartitionOptions options = stages(2);
    options.pinned = {-1, 2, -1};
    CHECK_THROWS_WITH(partition_graph(named_chain({"a", "b", "c"}), options), Contains("'b'") && Contains("outside"));
  }
  SECTION("a module over the memory limit alone") {
    ModuleGraph graph = named_chain({"a", "big", "c"});
    graph.nodes[1].memory_bytes = 100;
    GraphPartitionOptions options = stages(2);
    options.memory_limit_bytes = 50;
    CHECK_THROWS_WITH(partition_graph(graph, options), Contains("'big'") && Contains("memory limit"));
    // Sizes that round alike in MiB are said in bytes.
    graph.nodes[1].memory_bytes = 1.04 * 1024 * 1024;
    options.memory_limit_bytes = 1.0 * 1024 * 1024;
    CHECK_THROWS_WITH(partition_graph(graph, options),
                      Contains("alone needs 1090519 bytes, over the per-stage memory limit of 1048576 bytes"));
  }
  SECTION("a memory limit that no split meets") {
    GraphPartitionOptions options = stages(2);
    options.memory_limit_bytes = 15;  // four modules of 10 bytes on two stages
    CHECK_THROWS_WITH(partition_graph(named_chain({"a", "b", "c", "d"}), options), Contains("memory limit"));
  }
  SECTION("the exhaustive search refuses large graphs, and gives up past its budget") {
    CHECK_THROWS_AS(optimal_partition_exhaustive(uniform_chain(17), stages(2)), PartitionError);
    CHECK_THROWS_WITH(optimal_partition_exhaustive(uniform_chain(12), stages(4), 10), Contains("gave up after 10"));
    CHECK_NOTHROW(optimal_partition_exhaustive(uniform_chain(12), stages(4), 1'000'000));
  }
}

TEST_CASE("check_partition rejects cycles, empty stages and misplaced nodes") {
  const ModuleGraph graph = named_chain({"a", "b", "c"});
  GraphPartition partition;
  partition.stage_of_node = {0, 1, 0};
  CHECK_THROWS_WITH(check_partition(graph, partition, 2), Contains("'c'") && Contains("'b'"));
  partition.stage_of_node = {0, 0, 0};
  CHECK_THROWS_WITH(check_partition(graph, partition, 2), Contains("stage 1 has no module"));
  partition.stage_of_node = {0, 1};
  CHECK_THROWS_AS(check_partition(graph, partition, 2), PartitionError);
  partition.stage_of_node = {0, 1, 2};
  CHECK_THROWS_WITH(check_partition(graph, partition, 2), Contains("'c'") && Contains("outside"));
  partition.stage_of_node = {0, 0, 1};
  CHECK_NOTHROW(check_partition(graph, partition, 2));
}

TEST_CASE("the baselines split the given order") {
  const ModuleGraph graph = transformer_chain(10);  // embedding, 10 blocks, head
  const GraphPartition uniform = partition_uniform(graph, stages(4));
  CHECK(uniform.stage_of_node == std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3});
  // By parameters: the embedding and head tables outweigh about two blocks each.
  const GraphPartition by_parameters = partition_by_parameters(graph, stages(4));
  REQUIRE_NOTHROW(check_partition(graph, by_parameters, 4));
  std::vector<double> parameter_bytes;
  for (const GraphNode& node : graph.nodes) parameter_bytes.push_back(node.parameter_bytes);
  std::vector<double> per_stage(4, 0.0);
  for (std::size_t node = 0; node < graph.nodes.size(); ++node) {
    per_stage[by_parameters.stage_of_node[node]] += parameter_bytes[node];
  }
  CHECK(max_of(per_stage) == Approx(split_chain_min_bottleneck(parameter_bytes, 4).bottleneck));
}
