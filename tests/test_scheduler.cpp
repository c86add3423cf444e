// Generators, lowering, validation and the CSV format of smp::sched. Simulator timings: test_simulator.cpp.

#include <algorithm>
#include <catch2/catch.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "scheduler_test_support.h"
#include "smp/scheduler/schedule.h"

using namespace smp::sched;
using namespace smp::sched::testing;
using Catch::Contains;

namespace {

Action send_f(int stage, int to, int mb) { return {ActionKind::SendForward, stage, mb, to}; }
Action recv_f(int stage, int from, int mb) { return {ActionKind::RecvForward, stage, mb, from}; }
Action send_b(int stage, int to, int mb) { return {ActionKind::SendBackward, stage, mb, to}; }
Action recv_b(int stage, int from, int mb) { return {ActionKind::RecvBackward, stage, mb, from}; }

std::vector<Action>::iterator find_action(Schedule& schedule, int rank, const Action& action) {
  std::vector<Action>& actions = schedule.ranks[rank];
  const auto found = std::find(actions.begin(), actions.end(), action);
  REQUIRE(found != actions.end());
  return found;
}

void swap_actions(Schedule& schedule, int rank, const Action& first, const Action& second) {
  std::iter_swap(find_action(schedule, rank, first), find_action(schedule, rank, second));
}

void erase_action(Schedule& schedule, int rank, const Action& action) {
  schedule.ranks[rank].erase(find_action(schedule, rank, action));
}

// Split-backward pipeline of 2 ranks, 2 microbatches, written by hand so that the checks below pin every action.
Schedule split_backward_schedule() {
  Schedule schedule;
  schedule.name = "split";
  schedule.num_ranks = 2;
  schedule.num_stages = 2;
  schedule.num_microbatches = 2;
  schedule.split_backward = true;
  schedule.stage_to_rank = {0, 1};
  schedule.ranks = {{F(0, 0), F(0, 1), I(0, 0), I(0, 1), W(0, 0), W(0, 1)},
                    {F(1, 0), I(1, 0), F(1, 1), I(1, 1), W(1, 0), W(1, 1)}};
  return schedule;
}

}  // namespace

TEST_CASE("action kinds round-trip through their names", "[schedule]") {
  const std::vector<std::pair<ActionKind, std::string>> kinds = {
      {ActionKind::Forward, "F"},           {ActionKind::Backward, "B"},         {ActionKind::BackwardInput, "I"},
      {ActionKind::BackwardWeight, "W"},    {ActionKind::SendForward, "SEND_F"}, {ActionKind::RecvForward, "RECV_F"},
      {ActionKind::SendBackward, "SEND_B"}, {ActionKind::RecvBackward, "RECV_B"}};
  for (const auto& [kind, name] : kinds) {
    CHECK(to_string(kind) == name);
    CHECK(action_kind_from_string(name) == kind);
    CHECK(is_compute(kind) == (name.size() == 1));
  }
  REQUIRE_THROWS_WITH(action_kind_from_string("SEND"), Contains("unknown action kind 'SEND'"));
  REQUIRE_THROWS_AS(action_kind_from_string("f"), ScheduleError);
}

TEST_CASE("describe names kind, stages and microbatch", "[schedule]") {
  CHECK(describe(F(2, 3)) == "F(stage 2, mb 3)");
  CHECK(describe(W(0, 7)) == "W(stage 0, mb 7)");
  CHECK(describe(send_f(1, 2, 0)) == "SEND_F(stage 1 -> 2, mb 0)");
  CHECK(describe(recv_b(1, 2, 4)) == "RECV_B(stage 1 <- 2, mb 4)");
}

TEST_CASE("stage graphs", "[schedule]") {
  const StageGraph chain = StageGraph::chain(4);
  REQUIRE(chain.num_stages() == 4);
  CHECK(chain.consumers == std::vector<std::vector<int>>{{1}, {2}, {3}, {}});
  CHECK(chain.producers_of(0).empty());
  CHECK(chain.producers_of(3) == std::vector<int>{2});
  CHECK(StageGraph::chain(1).consumers == std::vector<std::vector<int>>{{}});

  const StageGraph diamond{{{1, 2}, {3}, {3}, {}}};
  CHECK(diamond.producers_of(3) == std::vector<int>{1, 2});
  CHECK(diamond.producers_of(2) == std::vector<int>{0});

  REQUIRE_THROWS_AS(StageGraph::chain(0), ScheduleError);
  REQUIRE_THROWS_WITH(chain.producers_of(4), Contains("stage 4"));
}

TEST_CASE("stages_of_rank follows stage_to_rank", "[schedule]") {
  CHECK(make_gpipe(3, 2).stages_of_rank(1) == std::vector<int>{1});
  Schedule looped;
  looped.stage_to_rank = {0, 1, 0, 1};
  CHECK(looped.stages_of_rank(0) == std::vector<int>{0, 2});
  CHECK(looped.stages_of_rank(1) == std::vector<int>{1, 3});
  CHECK(looped.stages_of_rank(2).empty());
}

TEST_CASE("generators reject impossible arguments", "[generators]") {
  REQUIRE_THROWS_WITH(make_gpipe(0, 4), Contains("rank"));
  REQUIRE_THROWS_WITH(make_gpipe(4, 0), Contains("microbatch"));
  REQUIRE_THROWS_WITH(make_1f1b(0, 4), Contains("rank"));
  REQUIRE_THROWS_WITH(make_1f1b(4, 0), Contains("microbatch"));
  REQUIRE_THROWS_WITH(make_1f1b(4, 4, -1), Contains("max_active"));
}

TEST_CASE("generated schedules validate before and after lowering", "[generators][validate]") {
  for (int ranks : {1, 2, 3, 4, 7, 8}) {
    for (int microbatches : {1, 2, 3, 4, 5, 8, 13}) {
      const StageGraph graph = StageGraph::chain(ranks);
      std::vector<Schedule> schedules = {make_gpipe(ranks, microbatches)};
      for (int max_active : {0, 1, 2, 3, 100}) schedules.push_back(make_1f1b(ranks, microbatches, max_active));
      for (const Schedule& schedule : schedules) {
        INFO(schedule.name << " ranks=" << ranks << " microbatches=" << microbatches);
        REQUIRE(schedule.num_ranks == ranks);
        REQUIRE(schedule.num_stages == ranks);
        REQUIRE(schedule.num_microbatches == microbatches);
        REQUIRE_FALSE(schedule.split_backward);
        for (int rank = 0; rank < ranks; ++rank) {
          CHECK(schedule.stage_to_rank[rank] == rank);
          CHECK(schedule.ranks[rank].size() == 2u * microbatches);
        }
        REQUIRE_NOTHROW(validate(schedule, graph));

        const Schedule lowered = lower_communication(schedule, graph);
        REQUIRE_NOTHROW(validate(lowered, graph));
        // F and B on an inner stage each gain one receive and one send; end stages have one neighbour.
        std::size_t transfers = 0;
        for (const std::vector<Action>& actions : lowered.ranks)
          transfers +=
              std::count_if(actions.begin(), actions.end(), [](const Action& a) { return !is_compute(a.kind); });
        CHECK(transfers == 4u * (ranks - 1) * microbatches);
      }
    }
  }
}

TEST_CASE("1F1B action lists", "[generators]") {
  SECTION("p=4, m=8: rank 0 warms up with 3 forwards, rank 3 alternates from the start") {
    const Schedule schedule = make_1f1b(4, 8);
    CHECK(schedule.name == "1f1b");
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(0, 2), F(0, 3), B(0, 0), F(0, 4), B(0, 1),
                                                   F(0, 5), B(0, 2), F(0, 6), B(0, 3), F(0, 7), B(0, 4), B(0, 5),
                                                   B(0, 6), B(0, 7)});
    CHECK(schedule.ranks[2] == std::vector<Action>{F(2, 0), F(2, 1), B(2, 0), F(2, 2), B(2, 1), F(2, 3), B(2, 2),
                                                   F(2, 4), B(2, 3), F(2, 5), B(2, 4), F(2, 6), B(2, 5), F(2, 7),
                                                   B(2, 6), B(2, 7)});
    CHECK(schedule.ranks[3] == std::vector<Action>{F(3, 0), B(3, 0), F(3, 1), B(3, 1), F(3, 2), B(3, 2), F(3, 3),
                                                   B(3, 3), F(3, 4), B(3, 4), F(3, 5), B(3, 5), F(3, 6), B(3, 6),
                                                   F(3, 7), B(3, 7)});
  }
  SECTION("fewer microbatches than ranks: warmup stops at m") {
    const Schedule schedule = make_1f1b(4, 2);
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), B(0, 0), B(0, 1)});
    CHECK(schedule.ranks[2] == std::vector<Action>{F(2, 0), F(2, 1), B(2, 0), B(2, 1)});
    CHECK(schedule.ranks[3] == std::vector<Action>{F(3, 0), B(3, 0), F(3, 1), B(3, 1)});
  }
  SECTION("max_active=1 degenerates to F, B, F, B") {
    const Schedule schedule = make_1f1b(4, 3, 1);
    for (int rank = 0; rank < 4; ++rank)
      CHECK(schedule.ranks[rank] ==
            std::vector<Action>{F(rank, 0), B(rank, 0), F(rank, 1), B(rank, 1), F(rank, 2), B(rank, 2)});
  }
  SECTION("max_active=2 leaves one forward of warmup") {
    const Schedule schedule = make_1f1b(4, 4, 2);
    CHECK(schedule.ranks[0] ==
          std::vector<Action>{F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), F(0, 3), B(0, 2), B(0, 3)});
    CHECK(schedule.ranks[3] ==
          std::vector<Action>{F(3, 0), B(3, 0), F(3, 1), B(3, 1), F(3, 2), B(3, 2), F(3, 3), B(3, 3)});
  }
  SECTION("a single rank") {
    CHECK(make_1f1b(1, 2).ranks[0] == std::vector<Action>{F(0, 0), B(0, 0), F(0, 1), B(0, 1)});
  }
}

TEST_CASE("GPipe runs all forwards, then backwards in reverse", "[generators]") {
  const Schedule schedule = make_gpipe(2, 3);
  CHECK(schedule.name == "gpipe");
  CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(0, 2), B(0, 2), B(0, 1), B(0, 0)});
  CHECK(schedule.ranks[1] == std::vector<Action>{F(1, 0), F(1, 1), F(1, 2), B(1, 2), B(1, 1), B(1, 0)});
}

TEST_CASE("lowering wraps each compute action in its transfers", "[lowering]") {
  SECTION("chain: the end stages have no producer or no consumer") {
    const Schedule lowered = lower_communication(make_gpipe(3, 1), StageGraph::chain(3));
    CHECK(lowered.ranks[0] == std::vector<Action>{F(0, 0), send_f(0, 1, 0), recv_b(0, 1, 0), B(0, 0)});
    CHECK(lowered.ranks[1] ==
          std::vector<Action>{recv_f(1, 0, 0), F(1, 0), send_f(1, 2, 0), recv_b(1, 2, 0), B(1, 0), send_b(1, 0, 0)});
    CHECK(lowered.ranks[2] == std::vector<Action>{recv_f(2, 1, 0), F(2, 0), B(2, 0), send_b(2, 1, 0)});
    CHECK(lowered.name == "gpipe");
    CHECK(lowered.stage_to_rank == std::vector<int>{0, 1, 2});
  }
  SECTION("diamond graph with two stages per rank, split backward") {
    // Stage 0 feeds 1 and 2, both feed 3. Rank 0 owns stages 0 and 3, rank 1 owns 1 and 2.
    const StageGraph diamond{{{1, 2}, {3}, {3}, {}}};
    Schedule schedule;
    schedule.name = "diamond";
    schedule.num_ranks = 2;
    schedule.num_stages = 4;
    schedule.num_microbatches = 1;
    schedule.split_backward = true;
    schedule.stage_to_rank = {0, 1, 1, 0};
    schedule.ranks = {{F(0, 0), F(3, 0), I(3, 0), W(3, 0), I(0, 0), W(0, 0)},
                      {F(1, 0), F(2, 0), I(2, 0), I(1, 0), W(1, 0), W(2, 0)}};
    REQUIRE_NOTHROW(validate(schedule, diamond));

    const Schedule lowered = lower_communication(schedule, diamond);
    CHECK(lowered.ranks[0] == std::vector<Action>{F(0, 0), send_f(0, 1, 0), send_f(0, 2, 0), recv_f(3, 1, 0),
                                                  recv_f(3, 2, 0), F(3, 0), I(3, 0), send_b(3, 1, 0), send_b(3, 2, 0),
                                                  W(3, 0), recv_b(0, 1, 0), recv_b(0, 2, 0), I(0, 0), W(0, 0)});
    CHECK(lowered.ranks[1] == std::vector<Action>{recv_f(1, 0, 0), F(1, 0), send_f(1, 3, 0), recv_f(2, 0, 0), F(2, 0),
                                                  send_f(2, 3, 0), recv_b(2, 3, 0), I(2, 0), send_b(2, 0, 0),
                                                  recv_b(1, 3, 0), I(1, 0), send_b(1, 0, 0), W(1, 0), W(2, 0)});
    REQUIRE_NOTHROW(validate(lowered, diamond));
  }
  SECTION("errors") {
    REQUIRE_THROWS_WITH(lower_communication(make_gpipe(3, 2), StageGraph::chain(4)),
                        Contains("stage graph has 4 stages") && Contains("has 3"));
    const Schedule lowered = lower_communication(make_gpipe(2, 1), StageGraph::chain(2));
    REQUIRE_THROWS_WITH(lower_communication(lowered, StageGraph::chain(2)),
                        Contains(describe(send_f(0, 1, 0))) && Contains("already has transfers"));
    REQUIRE_THROWS_WITH(lower_communication(make_gpipe(2, 1), StageGraph{{{1}, {0}}}),
                        Contains("consumers must be later stages"));
  }
}

TEST_CASE("overlapped pairs: a forward and the backward of another microbatch after it", "[overlap]") {
  SECTION("DualPipeV's pairs; the forward's sends and those after them held") {
    const Schedule lowered = lower_communication(make_dualpipe_v(2, 4), StageGraph::chain(4));
    const auto& actions = lowered.ranks[0];
    const auto at = [&](const Action& wanted) {
      return static_cast<std::size_t>(std::find(actions.begin(), actions.end(), wanted) - actions.begin());
    };
    const auto pairs = overlapped_pairs(lowered, 0);
    std::vector<Action> forwards;
    for (const auto& [first, window] : pairs) forwards.push_back(actions[first]);
    // F(3, 1) is followed by another forward and F(3, 0) by its own backward: not pairs.
    CHECK(forwards == std::vector<Action>{F(0, 3), F(3, 2), F(3, 3)});
    const auto& with_sends = pairs.at(at(F(0, 3)));
    CHECK(actions[with_sends.last] == W(3, 1));
    CHECK(with_sends.held == std::vector<std::size_t>{at(send_f(0, 1, 3)), at(send_b(3, 2, 1))});
    const auto& with_receive = pairs.at(at(F(3, 2)));
    CHECK(actions[with_receive.last] == W(0, 0));
    CHECK(with_receive.held.empty());
    // Rank 1's forward of stage 1 sends to its own stage 2: held, it does not stop the receive of the gradient
    // from rank 0 for the backward beside it.
    const auto& middle = lowered.ranks[1];
    const auto middle_pairs = overlapped_pairs(lowered, 1);
    const auto local_send = std::find(middle.begin(), middle.end(), send_f(1, 2, 2)) - middle.begin();
    const auto pair = middle_pairs.find(static_cast<std::size_t>(local_send - 1));
    REQUIRE(pair != middle_pairs.end());
    CHECK(middle[pair->second.last] == W(2, 0));
    CHECK(pair->second.held.front() == static_cast<std::size_t>(local_send));
  }
  SECTION("a receive after a held send ends the window") {
    Schedule schedule = lower_communication(make_1f1b(2, 4), StageGraph::chain(2));
    for (int rank = 0; rank < 2; ++rank) CHECK(overlapped_pairs(schedule, rank).empty());
    schedule.ranks[0] = {F(0, 1), send_f(0, 1, 1), recv_b(0, 1, 0), B(0, 0)};
    CHECK(overlapped_pairs(schedule, 0).empty());
    schedule.ranks[0] = {F(0, 1), recv_b(0, 1, 0), send_f(0, 1, 1), B(0, 0), send_b(0, 1, 0), recv_b(0, 1, 1)};
    const auto pairs = overlapped_pairs(schedule, 0);
    REQUIRE(pairs.size() == 1);
    CHECK(pairs.at(0).last == 3);
    CHECK(pairs.at(0).held == std::vector<std::size_t>{2});
  }
  SECTION("evaluation has no backward to pair with") {
    Schedule schedule = lower_communication(make_dualpipe_v(2, 4), StageGraph::chain(4));
    schedule.forward_only = true;
    CHECK(overlapped_pairs(schedule, 0).empty());
  }
}

TEST_CASE("validate rejects malformed compute-only schedules", "[validate]") {
  const StageGraph graph = StageGraph::chain(3);
  Schedule schedule = make_1f1b(3, 4);

  SECTION("backward before its forward") {
    swap_actions(schedule, 1, F(1, 2), B(1, 2));
    REQUIRE_THROWS_WITH(validate(schedule, graph),
                        Contains("rank 1, action #") && Contains(describe(B(1, 2)) + ": backward before its forward"));
  }
  SECTION("duplicate forward") {
    schedule.ranks[2].push_back(F(2, 1));
    REQUIRE_THROWS_WITH(validate(schedule, graph),
                        Contains("rank 2, action #8 " + describe(F(2, 1)) + ": duplicate of action #2"));
  }
  SECTION("missing backward") {
    erase_action(schedule, 1, B(1, 3));
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains("rank 1: missing " + describe(B(1, 3))));
  }
  SECTION("action on a stage another rank owns") {
    *find_action(schedule, 1, F(1, 0)) = F(2, 0);
    REQUIRE_THROWS_WITH(validate(schedule, graph),
                        Contains("rank 1, action #0 " + describe(F(2, 0)) + ": stage 2 belongs to rank 2"));
  }
  SECTION("unknown stage, microbatch out of range, stray peer") {
    schedule.ranks[0][1] = F(5, 1);
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains(describe(F(5, 1)) + ": unknown stage"));
    schedule.ranks[0][1] = F(0, 4);
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains(describe(F(0, 4)) + ": microbatch out of range"));
    schedule.ranks[0][1] = Action{ActionKind::Forward, 0, 1, 1};
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains("take no peer stage"));
  }
  SECTION("I and W without split_backward, B with it") {
    *find_action(schedule, 0, B(0, 0)) = I(0, 0);
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains(describe(I(0, 0)) + ": I and W need split_backward"));
    Schedule split = split_backward_schedule();
    split.ranks[1][1] = B(1, 0);
    REQUIRE_THROWS_WITH(validate(split, StageGraph::chain(2)), Contains(describe(B(1, 0)) + ": B in a split-backward"));
  }
  SECTION("weight gradient before its input gradient") {
    Schedule split = split_backward_schedule();
    REQUIRE_NOTHROW(validate(split, StageGraph::chain(2)));
    swap_actions(split, 0, I(0, 1), W(0, 1));
    REQUIRE_THROWS_WITH(validate(split, StageGraph::chain(2)),
                        Contains("rank 0, action #3 " + describe(W(0, 1)) +
                                 ": weight gradient before its input gradient (at action #5)"));
  }
  SECTION("inconsistent shape") {
    REQUIRE_THROWS_WITH(validate(schedule, StageGraph::chain(4)), Contains("stage graph"));
    schedule.stage_to_rank[2] = 3;
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains("maps stage 2 to unknown rank 3"));
    schedule.ranks.pop_back();
    REQUIRE_THROWS_WITH(validate(schedule, graph), Contains("declares 3 ranks but lists actions for 2"));
  }
  SECTION("an order that deadlocks") {
    // Rank 1 wants microbatch 1 first, but rank 0 sends it only after backward of microbatch 0, which needs
    // rank 1's backward of microbatch 0, which rank 1 runs after forward of microbatch 1.
    Schedule two = make_1f1b(2, 2, 1);
    two.ranks[1] = {F(1, 1), F(1, 0), B(1, 0), B(1, 1)};
    REQUIRE_THROWS_WITH(
        validate(two, StageGraph::chain(2)),
        Contains("deadlocks") &&
            Contains("rank 1 waits at action #0 " + describe(F(1, 1)) + " for " + describe(F(0, 1)) + " from rank 0") &&
            Contains("rank 0 waits at action #1 " + describe(B(0, 0)) + " for " + describe(B(1, 0)) + " from rank 1"));
  }
}

TEST_CASE("validate rejects malformed lowered schedules", "[validate]") {
  const StageGraph graph = StageGraph::chain(3);
  Schedule lowered = lower_communication(make_1f1b(3, 4), graph);

  SECTION("backward before its forward") {
    swap_actions(lowered, 2, F(2, 1), B(2, 1));
    REQUIRE_THROWS_WITH(validate(lowered, graph), Contains(describe(B(2, 1)) + ": backward before its forward"));
  }
  SECTION("a dropped send leaves its receive unmatched") {
    erase_action(lowered, 0, send_f(0, 1, 2));
    REQUIRE_THROWS_WITH(validate(lowered, graph),
                        Contains("rank 1, action #") && Contains(describe(recv_f(1, 0, 2)) + ": no matching " +
                                                                 describe(send_f(0, 1, 2)) + " on rank 0"));
  }
  SECTION("a dropped receive starves the compute that needs it") {
    erase_action(lowered, 1, recv_b(1, 2, 3));
    REQUIRE_THROWS_WITH(validate(lowered, graph),
                        Contains(describe(B(1, 3)) + ": missing " + describe(recv_b(1, 2, 3)) + " before it"));
  }
  SECTION("a dropped receive leaves its send unmatched") {
    // Rank 1 is checked before rank 2, so the orphaned send is what gets reported.
    erase_action(lowered, 2, recv_f(2, 1, 0));
    REQUIRE_THROWS_WITH(validate(lowered, graph),
                        Contains("rank 1, action #") && Contains(describe(send_f(1, 2, 0)) + ": no matching " +
                                                                 describe(recv_f(2, 1, 0)) + " on rank 2"));
  }
  SECTION("duplicate forward") {
    lowered.ranks[0].push_back(F(0, 3));
    REQUIRE_THROWS_WITH(validate(lowered, graph), Contains(describe(F(0, 3)) + ": duplicate of action #"));
  }
  SECTION("duplicate send") {
    lowered.ranks[0].push_back(send_f(0, 1, 3));
    REQUIRE_THROWS_WITH(validate(lowered, graph), Contains(describe(send_f(0, 1, 3)) + ": duplicate of action #"));
  }
  SECTION("a transfer to a stage that is not a neighbour") {
    *find_action(lowered, 0, send_f(0, 1, 0)) = send_f(0, 2, 0);
    REQUIRE_THROWS_WITH(validate(lowered, graph),
                        Contains(describe(send_f(0, 2, 0)) + ": stage 2 is not a consumer of stage 0"));
  }
  SECTION("a receive after the compute that needs it") {
    swap_actions(lowered, 1, recv_f(1, 0, 1), F(1, 1));
    REQUIRE_THROWS_WITH(validate(lowered, graph),
                        Contains(describe(F(1, 1)) + ": " + describe(recv_f(1, 0, 1)) + " comes after it"));
  }
  SECTION("a send before the compute that produces it") {
    swap_actions(lowered, 0, F(0, 2), send_f(0, 1, 2));
    REQUIRE_THROWS_WITH(validate(lowered, graph),
                        Contains(describe(send_f(0, 1, 2)) + ": sent before the forward that produces it"));
  }
  SECTION("receiving a gradient before sending the activation deadlocks") {
    Schedule two = lower_communication(make_gpipe(2, 1), StageGraph::chain(2));
    swap_actions(two, 0, send_f(0, 1, 0), recv_b(0, 1, 0));
    REQUIRE_THROWS_WITH(validate(two, StageGraph::chain(2)),
                        Contains("deadlocks") &&
                            Contains("rank 0 waits at action #1 " + describe(recv_b(0, 1, 0)) + " for " +
                                     describe(send_b(1, 0, 0)) + " from rank 1") &&
                            Contains("rank 1 waits at action #0 " + describe(recv_f(1, 0, 0)) + " for " +
                                     describe(send_f(0, 1, 0)) + " from rank 0"));
  }
}

TEST_CASE("CSV round trip", "[csv]") {
  const StageGraph graph = StageGraph::chain(3);
  for (const Schedule& original : {lower_communication(make_1f1b(3, 5, 2), graph), make_gpipe(3, 2),
                                    forward_only(lower_communication(make_1f1b(3, 5, 2), graph))}) {
    check_csv_round_trip(original, graph);
  }
  const Schedule split = split_backward_schedule();
  std::stringstream csv;
  write_csv(split, csv);
  const Schedule read = read_csv(csv);
  CHECK(read.split_backward);
  CHECK(read.ranks == split.ranks);
}

TEST_CASE("CSV layout", "[csv]") {
  std::stringstream csv;
  write_csv(make_gpipe(2, 1), csv);
  CHECK(csv.str() ==
        "# smp schedule name=gpipe ranks=2 stages=2 microbatches=1 split_backward=0 stage_to_rank=0;1\n"
        "rank,action,stage,microbatch,peer_stage\n"
        "0,F,0,0,-1\n"
        "0,B,0,0,-1\n"
        "1,F,1,0,-1\n"
        "1,B,1,0,-1\n");
}

TEST_CASE("CSV errors name the line", "[csv]") {
  const std::string metadata =
      "# smp schedule name=x ranks=2 stages=2 microbatches=1 split_backward=0 stage_to_rank=0;1\n";
  const std::string columns = "rank,action,stage,microbatch,peer_stage\n";
  const auto read = [](const std::string& text) {
    std::istringstream in(text);
    return read_csv(in);
  };
  REQUIRE_THROWS_WITH(read(metadata + columns + "0,F,0,0,-1\n1,FWD,1,0,-1\n"),
                      Contains("line 4") && Contains("unknown action kind 'FWD'"));
  REQUIRE_THROWS_WITH(read(metadata + columns + "0,F,0,0\n"), Contains("line 3") && Contains("expected 5 fields"));
  REQUIRE_THROWS_WITH(read(metadata + columns + "0,F,0,0,-1\n\n2,F,1,0,-1\n"),
                      Contains("line 5") && Contains("rank 2 out of range"));
  REQUIRE_THROWS_WITH(read(metadata + columns + "0,F,zero,0,-1\n"),
                      Contains("line 3") && Contains("stage 'zero' is not an integer"));
  REQUIRE_THROWS_WITH(read(metadata + "rank,kind\n"), Contains("line 2") && Contains("column line"));
  REQUIRE_THROWS_WITH(read(columns), Contains("line 1") && Contains("metadata"));
  REQUIRE_THROWS_WITH(read(""), Contains("empty input"));
  REQUIRE_THROWS_WITH(
      read("# smp schedule name=x ranks=2 stages=2 microbatches=1 split_backward=0 stage_to_rank=0\n" + columns),
      Contains("line 1") && Contains("stage_to_rank lists 1 ranks for 2 stages"));
  REQUIRE_THROWS_WITH(read("# smp schedule name=x ranks=2 stages=2 split_backward=0 stage_to_rank=0;1\n" + columns),
                      Contains("line 1") && Contains("microbatches="));

  Schedule spaced = make_gpipe(2, 1);
  spaced.name = "my schedule";
  std::ostringstream out;
  REQUIRE_THROWS_WITH(write_csv(spaced, out), Contains("whitespace"));
}
