// The discrete-event simulator: timings, bubble, activation memory, deadlock reports.

#include <algorithm>
#include <catch2/catch.hpp>
#include <numeric>
#include <string>
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

// A schedule written out action by action: `stage_to_rank` gives the ranks and stages, `ranks` each rank's actions.
Schedule by_hand(const std::string& name, std::vector<int> stage_to_rank, int microbatches,
                 std::vector<std::vector<Action>> ranks, bool split_backward = false) {
  Schedule schedule;
  schedule.name = name;
  schedule.num_ranks = static_cast<int>(ranks.size());
  schedule.num_stages = static_cast<int>(stage_to_rank.size());
  schedule.num_microbatches = microbatches;
  schedule.split_backward = split_backward;
  schedule.stage_to_rank = std::move(stage_to_rank);
  schedule.ranks = std::move(ranks);
  return schedule;
}

Action act(ActionKind kind, int stage, int microbatch) { return Action{kind, stage, microbatch}; }

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
      // A byte a microbatch's activations, a thousand each stage's gradients: beside the gradients, the bytes above
      // a thousand are the microbatches held.
      SimulationCosts costs = textbook_costs(ranks);
      costs.activation_bytes.assign(static_cast<std::size_t>(ranks), 1.0);
      costs.gradient_bytes.assign(static_cast<std::size_t>(ranks), 1000.0);
      INFO("ranks=" << ranks << " microbatches=" << microbatches);
      const SimulationResult gpipe = simulate(make_gpipe(ranks, microbatches), graph, costs);
      const SimulationResult one_f_one_b = simulate(make_1f1b(ranks, microbatches), graph, costs);
      const SimulationResult capped = simulate(make_1f1b(ranks, microbatches, 2), graph, costs);
      for (int rank = 0; rank < ranks; ++rank) {
        INFO("rank " << rank);
        CHECK(gpipe.peak_in_flight[rank] == microbatches);
        CHECK(one_f_one_b.peak_in_flight[rank] == std::min(ranks - rank, microbatches));
        CHECK(capped.peak_in_flight[rank] == std::min({ranks - rank, microbatches, 2}));
        // Beside the gradients (from the end of the first backward): GPipe has no forward left, so one microbatch
        // fewer; 1F1B forwards again where microbatches remain after its warm-up, and holds its peak.
        CHECK(gpipe.peak_step_bytes[rank] == 1000.0 + (microbatches - 1));
        for (const auto& [result, peak] : {std::pair{&one_f_one_b, std::min(ranks - rank, microbatches)},
                                           std::pair{&capped, std::min({ranks - rank, microbatches, 2})}}) {
          CHECK(result->peak_step_bytes[rank] == 1000.0 + (microbatches > peak ? peak : peak - 1));
        }
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
  std::vector<Action> actions;
  for (int mb = 0; mb < 3; ++mb) {
    actions.push_back(act(ActionKind::Forward, 0, mb));
    actions.push_back(act(ActionKind::Forward, 1, mb));
  }
  for (int mb = 0; mb < 3; ++mb) {
    actions.push_back(act(ActionKind::Backward, 1, mb));
    actions.push_back(act(ActionKind::Backward, 0, mb));
  }
  const Schedule schedule = by_hand("local", {0, 0}, 3, {actions});
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

TEST_CASE("bytes held through the step: activations until their backward, each stage's gradients from its first",
          "[simulator]") {
  // One rank holding both stages of a chain, 2 microbatches: F00 F10 B10 F01 F11 B11 B00 B01.
  constexpr ActionKind F = ActionKind::Forward, B = ActionKind::Backward;
  const Schedule schedule = by_hand("two stages on one rank", {0, 0}, 2,
                                    {{act(F, 0, 0), act(F, 1, 0), act(B, 1, 0), act(F, 0, 1), act(F, 1, 1),
                                      act(B, 1, 1), act(B, 0, 0), act(B, 0, 1)}});
  SimulationCosts costs = SimulationCosts::uniform(2);
  // Stage 0: 10 bytes of activations a microbatch and 100 of gradients; stage 1: 1 and 3. Held after each action:
  // 10, 11, 13 (stage 1's gradients), 23, 24, 23, 113 (stage 0's), 103. Counting all gradients from the rank's
  // first backward would peak at 124, after F11.
  costs.activation_bytes = {10.0, 1.0};
  costs.gradient_bytes = {100.0, 3.0};
  const SimulationResult result = simulate(schedule, StageGraph::chain(2), costs);
  REQUIRE(result.peak_step_bytes.size() == 1);
  CHECK_THAT(result.peak_step_bytes[0], WithinAbs(113.0, kTolerance));
  // Not asked for: not counted.
  CHECK(simulate(schedule, StageGraph::chain(2), SimulationCosts::uniform(2)).peak_step_bytes.empty());
  costs.gradient_bytes = {100.0};
  CHECK_THROWS_WITH(simulate(schedule, StageGraph::chain(2), costs),
                    Catch::Matchers::Contains("activation_bytes and gradient_bytes need one entry per stage"));
}

TEST_CASE("split backward: activations are freed by W, not I", "[simulator]") {
  constexpr ActionKind F = ActionKind::Forward, I = ActionKind::BackwardInput, W = ActionKind::BackwardWeight;
  const Schedule schedule =
      by_hand("split", {0, 1}, 2,
              {{act(F, 0, 0), act(F, 0, 1), act(I, 0, 0), act(I, 0, 1), act(W, 0, 0), act(W, 0, 1)},
               {act(F, 1, 0), act(I, 1, 0), act(F, 1, 1), act(I, 1, 1), act(W, 1, 0), act(W, 1, 1)}},
              /*split_backward=*/true);
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
  CHECK(result.peak_activations == std::vector<double>{2.0, 2.0});
  CHECK_THAT(result.timings[0][2].start, WithinAbs(3.0, kTolerance));
  CHECK_THAT(result.timings[0][3].start, WithinAbs(5.0, kTolerance));

  // When I frees all but a quarter of a microbatch's activations (what W reads), rank 1 holds at most F1's whole
  // and I0's quarter; rank 0 keeps everything to W (its share 1: a first stage's W is its whole backward).
  SimulationCosts freed = SimulationCosts::uniform(2, unit);
  freed.weight_pass_share = {1.0, 0.25};
  const SimulationResult held = simulate(schedule, graph, freed);
  CHECK(held.peak_in_flight == std::vector<int>{2, 2});
  CHECK_THAT(held.peak_activations[0], WithinAbs(2.0, kTolerance));
  CHECK_THAT(held.peak_activations[1], WithinAbs(1.25, kTolerance));
  // The gradients come with W: after W0 rank 0 still holds microbatch 1 whole, rank 1 the quarter its W reads
  // (a byte a microbatch, a thousand of gradients).
  SimulationCosts with_gradients = freed;
  with_gradients.activation_bytes = {1.0, 1.0};
  with_gradients.gradient_bytes = {1000.0, 1000.0};
  const SimulationResult beside = simulate(schedule, graph, with_gradients);
  CHECK_THAT(beside.peak_step_bytes[0], WithinAbs(1001.0, kTolerance));
  CHECK_THAT(beside.peak_step_bytes[1], WithinAbs(1000.25, kTolerance));
  // In bytes (activations 4 a microbatch, gradients 2): rank 1 holds F1's 4 and I0's quarter, 5, before its
  // gradients; after W0, I1's quarter and the gradients, 3.
  freed.activation_bytes = {4.0, 4.0};
  freed.gradient_bytes = {2.0, 2.0};
  const SimulationResult in_bytes = simulate(schedule, graph, freed);
  CHECK_THAT(in_bytes.peak_step_bytes[0], WithinAbs(8.0, kTolerance));
  CHECK_THAT(in_bytes.peak_step_bytes[1], WithinAbs(5.0, kTolerance));
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

namespace {

// Every generator's schedule for these sizes (two stages per rank where a generator takes several).
std::vector<Schedule> every_generator(int ranks, int microbatches) {
  std::vector<Schedule> schedules;
  for (const ScheduleKind& kind : schedule_kinds()) {
    const int virtual_stages = kind.stages_per_rank == 1 ? 1 : 2;
    schedules.push_back(kind.make(ranks, microbatches, virtual_stages, 0));
  }
  return schedules;
}

}  // namespace

TEST_CASE("shared processors: as many as ranks change nothing, one does all the work back to back",
          "[simulator][shared]") {
  for (int ranks : {2, 3, 4}) {
    for (int microbatches : {1, 4, 8}) {
      for (const Schedule& generated : every_generator(ranks, microbatches)) {
        INFO(generated.name << " ranks=" << ranks << " microbatches=" << microbatches);
        const StageGraph graph = StageGraph::chain(generated.num_stages);
        const Schedule lowered = lower_communication(generated, graph);
        SimulationCosts costs = SimulationCosts::uniform(generated.num_stages, StageCosts{1.0, 2.0, 1.25, 0.75});
        const SimulationResult own = simulate(lowered, graph, costs);
        costs.processors = ranks;
        const SimulationResult enough = simulate(lowered, graph, costs);
        CHECK_THAT(enough.makespan, WithinAbs(own.makespan, kTolerance));
        for (std::size_t rank = 0; rank < own.timings.size(); ++rank) {
          for (std::size_t index = 0; index < own.timings[rank].size(); ++index) {
            CHECK_THAT(enough.timings[rank][index].start, WithinAbs(own.timings[rank][index].start, kTolerance));
            CHECK_THAT(enough.timings[rank][index].end, WithinAbs(own.timings[rank][index].end, kTolerance));
          }
        }
        CHECK(enough.peak_in_flight == own.peak_in_flight);
        // One processor is never idle while a rank can compute, and free transfers leave it nothing to wait for.
        costs.processors = 1.0;
        double work = 0.0;
        for (double busy : own.busy_time) work += busy;
        CHECK_THAT(simulate(lowered, graph, costs).makespan, WithinAbs(work, 1e-6));
      }
    }
  }
}

TEST_CASE("shared processors: a pipeline's fill and drain run at full speed, its steady state shares",
          "[simulator][shared]") {
  // GPipe, 2 ranks, 2 microbatches, F = 1, B = 2, on 1 processor: F0 alone (1), then F1 on rank 0 beside F0 on
  // rank 1 at half speed each (ending at 3), F1 on rank 1 alone (4), B1 on rank 1 alone (6), B1 on rank 0 beside B0
  // on rank 1 (ending at 10), B0 on rank 0 alone (12): 12, the total work. On 1.5 processors, the two shared
  // stretches run at 0.75: the shared F's end at 1 + 4/3, F1 alone at 10/3, B1 alone at 16/3, the shared B's at
  // 16/3 + 8/3 = 8, then B0 alone: 10.
  const StageGraph graph = StageGraph::chain(2);
  SimulationCosts costs = textbook_costs(2);
  costs.processors = 1.0;
  CHECK_THAT(simulate(make_gpipe(2, 2), graph, costs).makespan, WithinAbs(12.0, kTolerance));
  costs.processors = 1.5;
  CHECK_THAT(simulate(make_gpipe(2, 2), graph, costs).makespan, WithinAbs(10.0, kTolerance));
  CHECK(simulate(make_gpipe(2, 2), graph, textbook_costs(2)).makespan == 9.0);
}

TEST_CASE("shared processors: a deadlock is still named", "[simulator][shared]") {
  const StageGraph graph = StageGraph::chain(3);
  Schedule lowered = lower_communication(make_gpipe(3, 1), graph);
  std::swap(lowered.ranks[0][1], lowered.ranks[0][2]);
  SimulationCosts costs = textbook_costs(3);
  costs.processors = 2.0;
  REQUIRE_THROWS_WITH(simulate(lowered, graph, costs),
                      Contains("deadlocks") && Contains("rank 0 waits at action #1 RECV_B(stage 0 <- 1, mb 0)"));
}

TEST_CASE("simulate rejects costs that do not fit", "[simulator]") {
  const StageGraph graph = StageGraph::chain(2);
  const Schedule schedule = make_gpipe(2, 2);
  REQUIRE_THROWS_WITH(simulate(schedule, graph, SimulationCosts::uniform(3)), Contains("3 stage entries for 2 stages"));
  SimulationCosts negative = SimulationCosts::uniform(2);
  negative.stages[1].backward = -1.0;
  REQUIRE_THROWS_WITH(simulate(schedule, graph, negative), Contains("stage 1 backward"));
  SimulationCosts no_processors = SimulationCosts::uniform(2);
  no_processors.processors = -1.0;
  REQUIRE_THROWS_WITH(simulate(schedule, graph, no_processors), Contains("processors"));
  SimulationCosts shares = SimulationCosts::uniform(2);
  shares.weight_pass_share = {1.0};
  REQUIRE_THROWS_WITH(simulate(schedule, graph, shares), Contains("1 weight_pass_share entries for 2 stages"));
  shares.weight_pass_share = {1.0, 1.5};
  REQUIRE_THROWS_WITH(simulate(schedule, graph, shares), Contains("weight_pass_share must be within [0, 1]"));
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

namespace {

// Split-backward costs; 1F1B sees T_B = T_I + T_W.
SimulationCosts split_costs(int num_stages, double forward, double backward_input, double backward_weight,
                            double latency_s = 0.0) {
  StageCosts stage;
  stage.forward = forward;
  stage.backward_input = backward_input;
  stage.backward_weight = backward_weight;
  stage.backward = backward_input + backward_weight;
  P2PCosts p2p;
  p2p.latency_s = latency_s;
  return SimulationCosts::uniform(num_stages, stage, p2p);
}

// T_F = 1, T_B = 2 per rank, split evenly over its virtual stages, so every rank does the work it does in 1F1B.
SimulationCosts chunked_textbook_costs(int num_ranks, int virtual_stages) {
  StageCosts stage;
  stage.forward = 1.0 / virtual_stages;
  stage.backward = 2.0 / virtual_stages;
  return SimulationCosts::uniform(num_ranks * virtual_stages, stage);
}

// Idle time per rank: the step minus the rank's own work, the same for every rank when the work is.
double bubble_time(const SimulationResult& result) { return result.makespan - result.busy_time.front(); }

}  // namespace

TEST_CASE("interleaved 1F1B matches the analytic bubble (p - 1) / (v m + p - 1)", "[simulator][interleaved]") {
  for (int ranks : {1, 2, 3, 4, 8}) {
    for (int microbatches_per_rank : {1, 2, 4}) {
      for (int virtual_stages : {1, 2, 3, 4}) {
        const int microbatches = ranks * microbatches_per_rank;
        INFO("ranks=" << ranks << " microbatches=" << microbatches << " virtual_stages=" << virtual_stages);
        const Schedule schedule = make_interleaved_1f1b(ranks, microbatches, virtual_stages);
        const SimulationResult result = simulate(schedule, StageGraph::chain(ranks * virtual_stages),
                                                 chunked_textbook_costs(ranks, virtual_stages));
        const double slots = virtual_stages * microbatches + ranks - 1;
        CHECK_THAT(result.makespan, WithinAbs(slots * 3.0 / virtual_stages, kTolerance));
        CHECK_THAT(result.bubble_fraction, WithinAbs((ranks - 1) / slots, kTolerance));
        for (double busy : result.busy_time) CHECK_THAT(busy, WithinAbs(3.0 * microbatches, kTolerance));
      }
    }
  }
}

TEST_CASE("interleaved 1F1B at p=4: a smaller bubble than 1F1B for the same work per rank",
          "[simulator][interleaved]") {
  const SimulationResult one_f_one_b = simulate(make_1f1b(4, 8), StageGraph::chain(4), textbook_costs(4));
  const SimulationResult interleaved =
      simulate(make_interleaved_1f1b(4, 8, 2), StageGraph::chain(8), chunked_textbook_costs(4, 2));
  CHECK_THAT(one_f_one_b.makespan, WithinAbs(33.0, kTolerance));
  CHECK_THAT(interleaved.makespan, WithinAbs(28.5, kTolerance));  // (2 * 8 + 3) * 3 / 2
  CHECK_THAT(interleaved.bubble_fraction, WithinAbs(3.0 / 19.0, kTolerance));
  CHECK(interleaved.bubble_fraction < one_f_one_b.bubble_fraction);
  // Megatron-LM's warmup of 2 (p - r - 1) + (v - 1) p forwards, plus the one of the steady state, in (stage,
  // microbatch) pairs of half a rank's layers each.
  CHECK(interleaved.peak_in_flight == std::vector<int>{11, 9, 7, 5});

  const SimulationResult deep =
      simulate(make_interleaved_1f1b(4, 16, 4), StageGraph::chain(16), chunked_textbook_costs(4, 4));
  CHECK_THAT(deep.bubble_fraction, WithinAbs(3.0 / 67.0, kTolerance));
}

TEST_CASE("interleaved 1F1B is never worse than 1F1B, for any number of microbatches", "[simulator][interleaved]") {
  for (int ranks : {2, 3, 4, 8}) {
    for (int microbatches = 1; microbatches <= 17; ++microbatches) {
      const SimulationResult one_f_one_b =
          simulate(make_1f1b(ranks, microbatches), StageGraph::chain(ranks), textbook_costs(ranks));
      for (int virtual_stages : {2, 3}) {
        INFO("ranks=" << ranks << " microbatches=" << microbatches << " virtual_stages=" << virtual_stages);
        const SimulationResult interleaved =
            simulate(make_interleaved_1f1b(ranks, microbatches, virtual_stages),
                     StageGraph::chain(ranks * virtual_stages), chunked_textbook_costs(ranks, virtual_stages));
        CHECK(interleaved.makespan <= one_f_one_b.makespan + kTolerance);
      }
    }
  }
}

TEST_CASE("interleaved 1F1B under a cap holds at most max_active pairs", "[simulator][interleaved]") {
  for (int max_active : {2, 3, 4, 5, 8}) {
    for (int microbatches : {1, 3, 8}) {
      INFO("max_active=" << max_active << " microbatches=" << microbatches);
      const SimulationResult result = simulate(make_interleaved_1f1b(4, microbatches, 2, max_active),
                                               StageGraph::chain(8), chunked_textbook_costs(4, 2));
      CHECK(*std::max_element(result.peak_in_flight.begin(), result.peak_in_flight.end()) <= max_active);
    }
  }
}

TEST_CASE("breadth-first looped: interleaved 1F1B's bubble at GPipe's memory", "[simulator][looped_bfs]") {
  for (int p : {2, 4, 8}) {
    for (int v : {1, 2, 4}) {
      for (int m : {p, 2 * p, 4 * p}) {
        INFO("p=" << p << " v=" << v << " m=" << m);
        const int stages = p * v;
        const StageGraph graph = StageGraph::chain(stages);
        // A rank's work is F = 1, B = 2 whatever v is: each of its stages costs 1/v of that.
        const SimulationCosts costs = SimulationCosts::uniform(stages, StageCosts{1.0 / v, 2.0 / v, 0.5 / v, 0.5 / v});
        const SimulationResult bfs = simulate(make_looped_bfs(p, m, v), graph, costs);
        const SimulationResult interleaved = simulate(make_interleaved_1f1b(p, m, v), graph, costs);
        // Lamy-Poirier's looped schedules: the same (p - 1) / (v m + p - 1) as interleaved 1F1B once m >= p.
        CHECK_THAT(bfs.bubble_fraction, WithinAbs((p - 1.0) / (v * m + p - 1.0), kTolerance));
        CHECK_THAT(bfs.makespan, WithinAbs(interleaved.makespan, kTolerance));
        // ... but every rank holds every (stage, microbatch) before its first backward: m whole microbatches.
        for (int peak : bfs.peak_in_flight) CHECK(peak == v * m);
        for (std::size_t rank = 0; rank < bfs.peak_in_flight.size(); ++rank)
          CHECK(interleaved.peak_in_flight[rank] <= bfs.peak_in_flight[rank]);
      }
    }
  }
}

TEST_CASE("ZB-H1 cuts the 1F1B bubble to a third at the same peak memory", "[simulator][zero_bubble]") {
  SECTION("p=4, m=8, T_F = T_I = T_W = 1") {
    const StageGraph graph = StageGraph::chain(4);
    const SimulationCosts costs = split_costs(4, 1.0, 1.0, 1.0);
    const SimulationResult one_f_one_b = simulate(make_1f1b(4, 8), graph, costs);
    const SimulationResult zb = simulate(make_zero_bubble_h1(4, 8), graph, costs);
    CHECK_THAT(one_f_one_b.makespan, WithinAbs(33.0, kTolerance));  // (m + p - 1) * 3
    CHECK_THAT(zb.makespan, WithinAbs(27.0, kTolerance));           // 3 m + (p - 1)
    CHECK_THAT(bubble_time(zb), WithinAbs(bubble_time(one_f_one_b) / 3.0, kTolerance));
    CHECK_THAT(zb.bubble_fraction, WithinAbs(3.0 / 27.0, kTolerance));
  }
  SECTION("the paper's bubble (p - 1)(T_F + T_I - T_W), m >= p") {
    struct Costs {
      double forward, input, weight;
    };
    for (const Costs& cost : {Costs{1.0, 1.0, 1.0}, Costs{1.0, 1.5, 0.5}, Costs{1.0, 2.0, 1.0}}) {
      for (int ranks : {2, 3, 4, 8}) {
        for (int microbatches : {ranks, 2 * ranks, 32}) {
          INFO("T_F=" << cost.forward << " T_I=" << cost.input << " T_W=" << cost.weight << " ranks=" << ranks
                      << " microbatches=" << microbatches);
          const SimulationCosts costs = split_costs(ranks, cost.forward, cost.input, cost.weight);
          const StageGraph graph = StageGraph::chain(ranks);
          const SimulationResult one_f_one_b = simulate(make_1f1b(ranks, microbatches), graph, costs);
          const SimulationResult zb = simulate(make_zero_bubble_h1(ranks, microbatches), graph, costs);
          const double step = cost.forward + cost.input + cost.weight;
          CHECK_THAT(one_f_one_b.makespan, WithinAbs((microbatches + ranks - 1) * step, kTolerance));
          const double paper_bubble = (ranks - 1) * (cost.forward + cost.input - cost.weight);
          CHECK_THAT(zb.makespan, WithinAbs(microbatches * step + paper_bubble, kTolerance));
        }
      }
    }
  }
  SECTION("no rank holds more than 1F1B's rank 0") {
    // Activations count from F to W. Deferring W, every rank holds p, as rank 0 does in 1F1B and as in the paper's
    // Figure 3, where 1F1B's rank r holds p - r. Holding only p - r would cost the bubble: with unit costs a last
    // rank that holds one microbatch must run F, I, W in turn from time p - 1, so its I of the last microbatch ends
    // at 3 m + p - 2 at the earliest, and rank 0's W of that microbatch at 3 m + 2 p - 2, not 3 m + p - 1.
    for (int ranks : {1, 2, 4, 5}) {
      for (int microbatches : {1, 2, 3, 8}) {
        INFO("ranks=" << ranks << " microbatches=" << microbatches);
        const StageGraph graph = StageGraph::chain(ranks);
        const SimulationCosts costs = split_costs(ranks, 1.0, 1.0, 1.0);
        const SimulationResult one_f_one_b = simulate(make_1f1b(ranks, microbatches), graph, costs);
        const SimulationResult zb = simulate(make_zero_bubble_h1(ranks, microbatches), graph, costs);
        CHECK(zb.peak_in_flight == std::vector<int>(ranks, std::min(ranks, microbatches)));
        CHECK(*std::max_element(zb.peak_in_flight.begin(), zb.peak_in_flight.end()) ==
              *std::max_element(one_f_one_b.peak_in_flight.begin(), one_f_one_b.peak_in_flight.end()));
      }
    }
  }
}

TEST_CASE("ZB-H2 leaves no bubble inside any rank's step", "[simulator][zero_bubble]") {
  SECTION("m >= 2p - 1: the step is as short as the last rank's work allows") {
    struct Costs {
      double forward, input, weight, latency;
    };
    for (const Costs& cost : {Costs{1.0, 1.0, 1.0, 0.0}, Costs{1.0, 1.2, 0.8, 0.0}, Costs{1.0, 1.0, 1.0, 0.5}}) {
      const bool equal_costs = cost.forward == cost.input && cost.input == cost.weight && cost.latency == 0.0;
      for (int ranks : {1, 2, 3, 4, 8}) {
        for (int microbatches : {2 * ranks - 1, 2 * ranks, 16, 32}) {
          if (microbatches < 2 * ranks - 1) continue;
          INFO("T_F=" << cost.forward << " T_I=" << cost.input << " T_W=" << cost.weight << " latency="
                      << cost.latency << " ranks=" << ranks << " microbatches=" << microbatches);
          const SimulationResult zb = simulate(make_zero_bubble_h2(ranks, microbatches), StageGraph::chain(ranks),
                                               split_costs(ranks, cost.forward, cost.input, cost.weight, cost.latency));
          const double hop = cost.forward + cost.latency;
          const double work = microbatches * (cost.forward + cost.input + cost.weight);
          // Every rank starts as soon as its first input can be there, and the last one never waits after that.
          // What remains is the skew between the ranks' starts, which only the paper's optimizer-step
          // post-validation (not modelled here) removes.
          for (int rank = 0; rank < ranks; ++rank)
            CHECK_THAT(zb.timings[rank].front().start, WithinAbs(rank * hop, kTolerance));
          CHECK_THAT(zb.makespan, WithinAbs((ranks - 1) * hop + work, kTolerance));
          // With equal costs no rank waits at all once it has started.
          if (equal_costs)
            for (int rank = 0; rank < ranks; ++rank)
              CHECK_THAT(zb.timings[rank].back().end, WithinAbs(rank * hop + work, kTolerance));
        }
      }
    }
  }
  SECTION("p=4, m=16, T_F = T_I = T_W = 1") {
    const StageGraph graph = StageGraph::chain(4);
    const SimulationCosts costs = split_costs(4, 1.0, 1.0, 1.0);
    const SimulationResult one_f_one_b = simulate(make_1f1b(4, 16), graph, costs);
    const SimulationResult h1 = simulate(make_zero_bubble_h1(4, 16), graph, costs);
    const SimulationResult h2 = simulate(make_zero_bubble_h2(4, 16), graph, costs);
    // The last rank cannot start before 3 T_F, so 3 / 51 is the least bubble any schedule has here. With equal
    // costs ZB-H1 reaches it too; ZB-H2 pulls ahead where W is cheaper than F + I, or where transfers take time.
    CHECK_THAT(h2.makespan, WithinAbs(51.0, kTolerance));
    CHECK_THAT(h2.bubble_fraction, WithinAbs(3.0 / 51.0, kTolerance));
    CHECK_THAT(h1.makespan, WithinAbs(51.0, kTolerance));
    CHECK_THAT(one_f_one_b.makespan, WithinAbs(57.0, kTolerance));
    CHECK(h2.peak_in_flight == std::vector<int>{7, 7, 7, 7});  // 2 p - 1
    CHECK(*std::min_element(h2.peak_in_flight.begin(), h2.peak_in_flight.end()) >
          *std::max_element(one_f_one_b.peak_in_flight.begin(), one_f_one_b.peak_in_flight.end()));
  }
  SECTION("where W is cheap or transfers are slow, ZB-H2 beats ZB-H1") {
    const StageGraph graph = StageGraph::chain(4);
    const SimulationCosts cheap_weight = split_costs(4, 1.0, 1.2, 0.8);
    CHECK_THAT(simulate(make_zero_bubble_h1(4, 16), graph, cheap_weight).makespan, WithinAbs(52.2, kTolerance));
    CHECK_THAT(simulate(make_zero_bubble_h2(4, 16), graph, cheap_weight).makespan, WithinAbs(51.0, kTolerance));
    const SimulationCosts slow_links = split_costs(4, 1.0, 1.0, 1.0, 1.0);
    CHECK_THAT(simulate(make_zero_bubble_h1(4, 16), graph, slow_links).makespan, WithinAbs(71.0, kTolerance));
    CHECK_THAT(simulate(make_zero_bubble_h2(4, 16), graph, slow_links).makespan, WithinAbs(54.0, kTolerance));
  }
  SECTION("peak in flight is 2 p - 1, or m") {
    for (int ranks : {1, 2, 4, 5}) {
      for (int microbatches : {1, 2, 3, 8, 16}) {
        INFO("ranks=" << ranks << " microbatches=" << microbatches);
        const SimulationResult zb = simulate(make_zero_bubble_h2(ranks, microbatches), StageGraph::chain(ranks),
                                             split_costs(ranks, 1.0, 1.0, 1.0));
        CHECK(zb.peak_in_flight == std::vector<int>(ranks, std::min(2 * ranks - 1, microbatches)));
      }
    }
  }
}

TEST_CASE("zero-bubble schedules under a cap hold at most max_active", "[simulator][zero_bubble]") {
  for (int max_active : {1, 2, 3, 5}) {
    for (const Schedule& schedule : {make_zero_bubble_h1(5, 8, max_active), make_zero_bubble_h2(5, 8, max_active)}) {
      INFO(schedule.name << " max_active=" << max_active);
      const SimulationResult result = simulate(schedule, StageGraph::chain(5), split_costs(5, 1.0, 1.0, 1.0));
      for (int peak : result.peak_in_flight) CHECK(peak == max_active);
    }
  }
}

TEST_CASE("simulating interleaved 1F1B at p=128, m=1024, v=4", "[simulator][large]") {
  const int ranks = 128;
  const int microbatches = 1024;
  const int virtual_stages = 4;
  const StageGraph graph = StageGraph::chain(ranks * virtual_stages);
  const Schedule lowered = lower_communication(make_interleaved_1f1b(ranks, microbatches, virtual_stages), graph);
  const SimulationResult result = simulate(lowered, graph, chunked_textbook_costs(ranks, virtual_stages));
  CHECK_THAT(result.makespan,
             WithinAbs((virtual_stages * microbatches + ranks - 1) * 3.0 / virtual_stages, kTolerance));
  CHECK(result.timings[0].size() == lowered.ranks[0].size());
}
