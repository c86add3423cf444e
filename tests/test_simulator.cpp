// The discrete-event simulator: timings, bubble, activation memory, deadlock reports.

#include <algorithm>
#include <catch2/catch.hpp>
#include <numeric>
#include <vector>

#include "smp/scheduler/schedule.h"
#include "smp/scheduler/simulator.h"

using namespace smp::sched;
using Catch::Contains;
using Catch::WithinAbs;

namespace {

constexpr double kTolerance = 1e-9;

// T_F = 1, T_B = 2, free transfers: the textbook setting in which both GPipe and 1F1B need (m + p - 1) * 3.
SimulationCosts textbook_costs(int num_stages) {
  StageCosts stage;
  stage.forward = 1.0;
  stage.backward = 2.0;
  return SimulationCosts::uniform(num_stages, stage);
}

}  // namespace

TEST_CASE("GPipe and 1F1B match the analytic bubble (p - 1) / (m + p - 1)", "[simulator]") {
  for (int ranks : {1, 2, 3, 4, 8}) {
    for (int microbatches : {1, 2, 3, 4, 7, 16}) {
      const StageGraph graph = StageGraph::chain(ranks);
      for (const Schedule& schedule : {make_gpipe(ranks, microbatches), make_1f1b(ranks, microbatches)}) {
        INFO(schedule.name << " ranks=" << ranks << " microbatches=" << microbatches);
        const double expected_bubble = double(ranks - 1) / (microbatches + ranks - 1);
        const double expected_makespan = (microbatches + ranks - 1) * 3.0;
        // A compute-only schedule is simulated as its lowering would be.
        for (const Schedule& variant : {schedule, lower_communication(schedule, graph)}) {
          const SimulationResult result = simulate(variant, graph, textbook_costs(ranks));
          CHECK_THAT(result.makespan, WithinAbs(expected_makespan, kTolerance));
          CHECK_THAT(result.bubble_fraction, WithinAbs(expected_bubble, kTolerance));
          for (double busy : result.busy_time) CHECK_THAT(busy, WithinAbs(3.0 * microbatches, kTolerance));
        }
      }
    }
  }
}

TEST_CASE("peak activations in flight", "[simulator]") {
  for (int ranks : {1, 2, 4, 5}) {
    for (int microbatches : {1, 2, 3, 8}) {
      const StageGraph graph = StageGraph::chain(ranks);
      const SimulationCosts costs = textbook_costs(ranks);
      INFO("ranks=" << ranks << " microbatches=" << microbatches);
      const SimulationResult gpipe = simulate(make_gpipe(ranks, microbatches), graph, costs);
      const SimulationResult one_f_one_b = simulate(make_1f1b(ranks, microbatches), graph, costs);
      const SimulationResult capped = simulate(make_1f1b(ranks, microbatches, 2), graph, costs);
      for (int rank = 0; rank < ranks; ++rank) {
        INFO("rank " << rank);
        CHECK(gpipe.peak_in_flight[rank] == microbatches);
        CHECK(one_f_one_b.peak_in_flight[rank] == std::min(ranks - rank, microbatches));
        CHECK(capped.peak_in_flight[rank] == std::min({ranks - rank, microbatches, 2}));
      }
    }
  }
}

TEST_CASE("max_active=1 serialises the pipeline", "[simulator]") {
  const SimulationResult result = simulate(make_1f1b(4, 5, 1), StageGraph::chain(4), textbook_costs(4));
  CHECK_THAT(result.makespan, WithinAbs(5 * 4 * 3.0, kTolerance));
  CHECK_THAT(result.bubble_fraction, WithinAbs(0.75, kTolerance));
}

TEST_CASE("action timings with latency and bandwidth", "[simulator]") {
  const StageGraph graph = StageGraph::chain(2);
  const Schedule lowered = lower_communication(make_gpipe(2, 1), graph);
  P2PCosts p2p;
  p2p.latency_s = 0.5;
  p2p.bytes_per_transfer = 100.0;
  p2p.bandwidth_bytes_per_s = 200.0;  // 0.5 + 100 / 200 = 1.0 per transfer
  const SimulationResult result = simulate(lowered, graph, SimulationCosts::uniform(2, StageCosts{}, p2p));

  // Rank 0: F, SEND_F, RECV_B, B.   Rank 1: RECV_F, F, B, SEND_B.
  const auto timing = [&](int rank, std::size_t index) {
    const ActionTiming t = result.timings[rank][index];
    return std::vector<double>{t.start, t.end};
  };
  REQUIRE(result.timings[0].size() == 4);
  REQUIRE(result.timings[1].size() == 4);
  CHECK(timing(0, 0) == std::vector<double>{0, 1});
  CHECK(timing(0, 1) == std::vector<double>{1, 1});
  CHECK(timing(1, 0) == std::vector<double>{0, 2});
  CHECK(timing(1, 1) == std::vector<double>{2, 3});
  CHECK(timing(1, 2) == std::vector<double>{3, 5});
  CHECK(timing(1, 3) == std::vector<double>{5, 5});
  CHECK(timing(0, 2) == std::vector<double>{1, 6});
  CHECK(timing(0, 3) == std::vector<double>{6, 8});
  CHECK_THAT(result.makespan, WithinAbs(8.0, kTolerance));
  CHECK(result.busy_time == std::vector<double>{3.0, 3.0});
  CHECK_THAT(result.bubble_fraction, WithinAbs(1.0 - 6.0 / 16.0, kTolerance));

  // The compute-only schedule pays the same transfers, and its F on rank 1 starts when the input lands.
  const SimulationResult implicit = simulate(make_gpipe(2, 1), graph, SimulationCosts::uniform(2, StageCosts{}, p2p));
  CHECK_THAT(implicit.makespan, WithinAbs(8.0, kTolerance));
  CHECK_THAT(implicit.timings[1][0].start, WithinAbs(2.0, kTolerance));
}

TEST_CASE("stages on one rank hand over for free", "[simulator]") {
  // Two stages, both on rank 0, as a looped schedule would place them.
  Schedule schedule;
  schedule.name = "local";
  schedule.num_ranks = 1;
  schedule.num_stages = 2;
  schedule.num_microbatches = 3;
  schedule.stage_to_rank = {0, 0};
  schedule.ranks.resize(1);
  for (int mb = 0; mb < 3; ++mb) {
    schedule.ranks[0].push_back({ActionKind::Forward, 0, mb});
    schedule.ranks[0].push_back({ActionKind::Forward, 1, mb});
  }
  for (int mb = 0; mb < 3; ++mb) {
    schedule.ranks[0].push_back({ActionKind::Backward, 1, mb});
    schedule.ranks[0].push_back({ActionKind::Backward, 0, mb});
  }
  const StageGraph graph = StageGraph::chain(2);
  P2PCosts slow_network;
  slow_network.latency_s = 10.0;
  const SimulationResult result =
      simulate(lower_communication(schedule, graph), graph, SimulationCosts::uniform(2, StageCosts{}, slow_network));
  CHECK_THAT(result.makespan, WithinAbs(3 * (1.0 + 1.0 + 2.0 + 2.0), kTolerance));
  CHECK_THAT(result.bubble_fraction, WithinAbs(0.0, kTolerance));
  CHECK(result.peak_in_flight == std::vector<int>{6});  // (stage, microbatch) pairs, not microbatches
}

TEST_CASE("per-stage costs: the slowest stage sets the pace", "[simulator]") {
  const StageGraph graph = StageGraph::chain(3);
  SimulationCosts costs = SimulationCosts::uniform(3);
  costs.stages[1].forward = 2.0;
  costs.stages[1].backward = 4.0;
  const int microbatches = 6;
  const SimulationResult result = simulate(make_gpipe(3, microbatches), graph, costs);
  // Forwards: stage 0 delivers every 1, stage 1 finishes its last at 1 + 6 * 2 = 13, stage 2 at 14. Backwards:
  // stage 2 runs 14..26, stage 1 is the bottleneck from its first gradient at 16 to 16 + 6 * 4 = 40, stage 0
  // then runs its last backward 40..42.
  CHECK_THAT(result.makespan, WithinAbs(42.0, kTolerance));
  CHECK(result.busy_time == std::vector<double>{18.0, 36.0, 18.0});
}

TEST_CASE("split backward: activations are freed by W, not I", "[simulator]") {
  Schedule schedule;
  schedule.name = "split";
  schedule.num_ranks = 2;
  schedule.num_stages = 2;
  schedule.num_microbatches = 2;
  schedule.split_backward = true;
  schedule.stage_to_rank = {0, 1};
  const auto act = [](ActionKind kind, int stage, int mb) { return Action{kind, stage, mb}; };
  constexpr ActionKind F = ActionKind::Forward, I = ActionKind::BackwardInput, W = ActionKind::BackwardWeight;
  schedule.ranks = {{act(F, 0, 0), act(F, 0, 1), act(I, 0, 0), act(I, 0, 1), act(W, 0, 0), act(W, 0, 1)},
                    {act(F, 1, 0), act(I, 1, 0), act(F, 1, 1), act(I, 1, 1), act(W, 1, 0), act(W, 1, 1)}};
  const StageGraph graph = StageGraph::chain(2);
  StageCosts unit;
  unit.forward = unit.backward_input = unit.backward_weight = 1.0;
  unit.backward = 100.0;  // unused by a split schedule
  const SimulationResult result = simulate(schedule, graph, SimulationCosts::uniform(2, unit));
  // Rank 1: F0 1..2, I0 2..3, F1 3..4, I1 4..5, W0 5..6, W1 6..7.
  // Rank 0: F0 0..1, F1 1..2, I0 3..4 (after rank 1's I0), I1 5..6, W0 6..7, W1 7..8.
  CHECK_THAT(result.makespan, WithinAbs(8.0, kTolerance));
  CHECK(result.busy_time == std::vector<double>{6.0, 6.0});
  CHECK(result.peak_in_flight == std::vector<int>{2, 2});
  CHECK_THAT(result.timings[0][2].start, WithinAbs(3.0, kTolerance));
  CHECK_THAT(result.timings[0][3].start, WithinAbs(5.0, kTolerance));
}

TEST_CASE("a deadlock names every stuck rank and what it waits for", "[simulator]") {
  const StageGraph graph = StageGraph::chain(3);
  Schedule lowered = lower_communication(make_gpipe(3, 1), graph);
  // Rank 0 waits for the gradient before it sends the activation, so nothing moves anywhere.
  std::swap(lowered.ranks[0][1], lowered.ranks[0][2]);
  REQUIRE_THROWS_WITH(simulate(lowered, graph, textbook_costs(3)),
                      Contains("schedule 'gpipe' deadlocks: ") &&
                          Contains("rank 0 waits at action #1 RECV_B(stage 0 <- 1, mb 0) for "
                                   "SEND_B(stage 1 -> 0, mb 0) from rank 1") &&
                          Contains("rank 1 waits at action #0 RECV_F(stage 1 <- 0, mb 0) for "
                                   "SEND_F(stage 0 -> 1, mb 0) from rank 0") &&
                          Contains("rank 2 waits at action #0 RECV_F(stage 2 <- 1, mb 0) for "
                                   "SEND_F(stage 1 -> 2, mb 0) from rank 1"));
}

TEST_CASE("simulate rejects costs that do not fit", "[simulator]") {
  const StageGraph graph = StageGraph::chain(2);
  const Schedule schedule = make_gpipe(2, 2);
  REQUIRE_THROWS_WITH(simulate(schedule, graph, SimulationCosts::uniform(3)), Contains("3 stage entries for 2 stages"));
  SimulationCosts negative = SimulationCosts::uniform(2);
  negative.stages[1].backward = -1.0;
  REQUIRE_THROWS_WITH(simulate(schedule, graph, negative), Contains("stage 1 backward"));
  P2PCosts no_bandwidth;
  no_bandwidth.bytes_per_transfer = 1024.0;
  REQUIRE_THROWS_WITH(simulate(schedule, graph, SimulationCosts::uniform(2, StageCosts{}, no_bandwidth)),
                      Contains("bandwidth_bytes_per_s"));
  Schedule broken = schedule;
  broken.ranks[1].pop_back();
  REQUIRE_THROWS_WITH(simulate(broken, graph, SimulationCosts::uniform(2)), Contains("missing B(stage 1, mb 0)"));
}

TEST_CASE("simulating p=128, m=1024", "[simulator][large]") {
  const int ranks = 128;
  const int microbatches = 1024;
  const StageGraph graph = StageGraph::chain(ranks);
  const Schedule lowered = lower_communication(make_1f1b(ranks, microbatches), graph);
  const SimulationResult result = simulate(lowered, graph, textbook_costs(ranks));
  CHECK_THAT(result.makespan, WithinAbs((microbatches + ranks - 1) * 3.0, kTolerance));
  CHECK(result.peak_in_flight.front() == ranks);
  CHECK(result.peak_in_flight.back() == 1);
  REQUIRE(result.timings.size() == static_cast<std::size_t>(ranks));
  CHECK(result.timings[0].size() == lowered.ranks[0].size());
}
