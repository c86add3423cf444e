// The interleaved and zero-bubble generators and the name-based factory: structure, validity, CSV. Their simulated
// bubbles and memory are in test_simulator.cpp.

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "scheduler_test_support.h"
#include "smp/scheduler/schedule.h"
#include "smp/scheduler/simulator.h"

using namespace smp::sched;
using namespace smp::sched::testing;
using Catch::Contains;

namespace {


// How often each compute action (kind, stage, microbatch) occurs in the schedule.
std::map<std::tuple<ActionKind, int, int>, int> compute_counts(const Schedule& schedule) {
  std::map<std::tuple<ActionKind, int, int>, int> counts;
  for (const std::vector<Action>& actions : schedule.ranks)
    for (const Action& action : actions) ++counts[{action.kind, action.stage, action.microbatch}];
  return counts;
}

// The same order with every B replaced by I and W back to back: a valid split-backward schedule of any layout.
Schedule split_each_backward(const Schedule& schedule) {
  Schedule split = schedule;
  split.split_backward = true;
  for (std::vector<Action>& actions : split.ranks) {
    std::vector<Action> replaced;
    for (const Action& action : actions) {
      if (action.kind != ActionKind::Backward) {
        replaced.push_back(action);
        continue;
      }
      replaced.push_back(I(action.stage, action.microbatch));
      replaced.push_back(W(action.stage, action.microbatch));
    }
    actions = replaced;
  }
  return split;
}

// Whether the schedule's layout has `virtual_stages` stages per rank: one, any number, or two (a V).
bool fits(const std::string& name, int virtual_stages) {
  const int per_rank = find_schedule_kind(name).stages_per_rank;
  return per_rank == 0 || per_rank == virtual_stages;
}
bool splits_backward(const std::string& name) { return find_schedule_kind(name).split_backward; }
bool takes_cap(const std::string& name) { return find_schedule_kind(name).takes_cap; }
// The rank of each stage: looped (stage % ranks), or down and back up a V.
int rank_of_stage(const std::string& name, int stage, int ranks) {
  if (find_schedule_kind(name).stages_per_rank == 2 && stage >= ranks) return 2 * ranks - 1 - stage;
  return stage % ranks;
}

}  // namespace

TEST_CASE("schedule_names lists every generator", "[generators][factory]") {
  CHECK(schedule_names() ==
        std::vector<std::string>{"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zb_v",
                                 "dualpipe_v"});
}

TEST_CASE("make_schedule builds what the named generator builds", "[generators][factory]") {
  CHECK(make_schedule("gpipe", 3, 5, 1, 0).ranks == make_gpipe(3, 5).ranks);
  CHECK(make_schedule("1f1b", 3, 5, 1, 2).ranks == make_1f1b(3, 5, 2).ranks);
  CHECK(make_schedule("interleaved_1f1b", 3, 5, 2, 0).ranks == make_interleaved_1f1b(3, 5, 2).ranks);
  CHECK(make_schedule("looped_bfs", 3, 5, 3, 0).ranks == make_looped_bfs(3, 5, 3).ranks);
  CHECK(make_schedule("zb_h1", 3, 5, 1, 0).ranks == make_zero_bubble_h1(3, 5).ranks);
  CHECK(make_schedule("zb_h2", 3, 5, 1, 4).ranks == make_zero_bubble_h2(3, 5, 4).ranks);
  CHECK(make_schedule("zb_v", 3, 5, 2, 0).ranks == make_zero_bubble_v(3, 5).ranks);
  CHECK(make_schedule("dualpipe_v", 3, 5, 2, 0).ranks == make_dualpipe_v(3, 5).ranks);
  for (const std::string& name : schedule_names()) CHECK(make_schedule(name, 2, 2, fits(name, 1) ? 1 : 2, 0).name == name);
}

TEST_CASE("make_schedule rejects what it cannot build", "[generators][factory]") {
  REQUIRE_THROWS_WITH(make_schedule("zb_h3", 4, 8, 1, 0),
                      Contains("unknown schedule 'zb_h3'") &&
                          Contains("gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zb_h2"));
  REQUIRE_THROWS_AS(make_schedule("", 4, 8, 1, 0), ScheduleError);
  for (const char* name : {"gpipe", "1f1b", "zb_h1", "zb_h2"}) {
    INFO(name);
    REQUIRE_THROWS_WITH(make_schedule(name, 4, 8, 2, 0),
                        Contains(std::string(name) + " runs one stage per rank") &&
                            Contains("virtual_stages must be 1, got 2"));
    REQUIRE_THROWS_WITH(make_schedule(name, 4, 8, 0, 0), Contains("virtual_stages must be 1, got 0"));
  }
  REQUIRE_THROWS_WITH(make_schedule("gpipe", 4, 8, 1, 2), Contains("gpipe") && Contains("max_active=2"));
  REQUIRE_THROWS_WITH(make_schedule("interleaved_1f1b", 4, 8, 0, 0), Contains("at least 1 virtual stage"));
  REQUIRE_THROWS_WITH(make_schedule("looped_bfs", 4, 8, 0, 0), Contains("at least 1 virtual stage"));
  REQUIRE_THROWS_WITH(make_schedule("looped_bfs", 4, 8, 2, 4), Contains("looped_bfs") && Contains("max_active=4"));
  for (const char* name : {"zb_v", "dualpipe_v"}) {
    INFO(name);
    REQUIRE_THROWS_WITH(make_schedule(name, 4, 8, 1, 0), Contains("virtual_stages must be 2, got 1"));
    REQUIRE_THROWS_WITH(make_schedule(name, 4, 8, 2, 3), Contains("max_active=3 cannot apply"));
  }
}

TEST_CASE("the new generators reject impossible arguments", "[generators]") {
  REQUIRE_THROWS_WITH(make_interleaved_1f1b(0, 4, 2), Contains("rank"));
  REQUIRE_THROWS_WITH(make_interleaved_1f1b(4, 0, 2), Contains("microbatch"));
  REQUIRE_THROWS_WITH(make_interleaved_1f1b(4, 4, 2, -1), Contains("max_active"));
  REQUIRE_THROWS_WITH(make_interleaved_1f1b(4, 4, 3, 2),
                      Contains("max_active=2 is below virtual_stages=3") && Contains("before its first backward"));
  for (const auto make : {make_zero_bubble_h1, make_zero_bubble_h2}) {
    REQUIRE_THROWS_WITH(make(0, 4, 0), Contains("rank"));
    REQUIRE_THROWS_WITH(make(4, 0, 0), Contains("microbatch"));
    REQUIRE_THROWS_WITH(make(4, 4, -1), Contains("max_active"));
  }
}

TEST_CASE("every named schedule over the grid validates, lowers and simulates", "[generators][validate]") {
  for (const std::string& name : schedule_names()) {
    for (int ranks : {1, 2, 3, 4, 8}) {
      for (int microbatches : {1, 2, 3, 5, 8, 16}) {
        for (int virtual_stages : {1, 2, 3}) {
          if (!fits(name, virtual_stages)) continue;
          for (int max_active : {0, 2}) {
            INFO(name << " ranks=" << ranks << " microbatches=" << microbatches << " virtual_stages=" << virtual_stages
                      << " max_active=" << max_active);
            if ((!takes_cap(name) && max_active != 0) || (max_active != 0 && max_active < virtual_stages)) {
              REQUIRE_THROWS_AS(make_schedule(name, ranks, microbatches, virtual_stages, max_active), ScheduleError);
              continue;
            }
            const Schedule schedule = make_schedule(name, ranks, microbatches, virtual_stages, max_active);
            const int stages = ranks * virtual_stages;
            REQUIRE(schedule.num_ranks == ranks);
            REQUIRE(schedule.num_stages == stages);
            REQUIRE(schedule.num_microbatches == microbatches);
            REQUIRE(schedule.split_backward == splits_backward(name));
            for (int stage = 0; stage < stages; ++stage) CHECK(schedule.stage_to_rank[stage] == rank_of_stage(name, stage, ranks));

            const auto counts = compute_counts(schedule);
            std::vector<ActionKind> passes = {ActionKind::Forward, ActionKind::Backward};
            if (schedule.split_backward)
              passes = {ActionKind::Forward, ActionKind::BackwardInput, ActionKind::BackwardWeight};
            CHECK(counts.size() == passes.size() * stages * microbatches);
            for (int stage = 0; stage < stages; ++stage)
              for (int mb = 0; mb < microbatches; ++mb)
                for (ActionKind kind : passes) {
                  const auto found = counts.find({kind, stage, mb});
                  REQUIRE(found != counts.end());
                  CHECK(found->second == 1);
                }

            const StageGraph graph = StageGraph::chain(stages);
            REQUIRE_NOTHROW(validate(schedule, graph));
            const Schedule lowered = lower_communication(schedule, graph);
            REQUIRE_NOTHROW(validate(lowered, graph));
            const SimulationResult result = simulate(lowered, graph, SimulationCosts::uniform(stages));
            if (max_active > 0)
              for (int peak : result.peak_in_flight) CHECK(peak <= max_active);

            // Its evaluation step: every F once with its transfers, nothing else, and it runs to the end.
            const Schedule evaluation = forward_only(lowered);
            REQUIRE_NOTHROW(validate(evaluation, graph));
            int forwards = 0;
            for (const auto& [action, count] : compute_counts(evaluation)) {
              if (std::get<0>(action) != ActionKind::Forward) continue;
              ++forwards;
              CHECK(count == 1);
            }
            CHECK(forwards == stages * microbatches);
            for (const auto& actions : evaluation.ranks)
              for (const Action& action : actions)
                CHECK((action.kind == ActionKind::Forward || action.kind == ActionKind::SendForward ||
                       action.kind == ActionKind::RecvForward));
            const SimulationResult forward_result = simulate(evaluation, graph, SimulationCosts::uniform(stages));
            for (int peak : forward_result.peak_in_flight) CHECK(peak == 0);
            CHECK(forward_result.makespan <= result.makespan);
          }
        }
      }
    }
  }
}

TEST_CASE("receives_in_send_order pairs every receive with the peer's sends, in order", "[generators][lowering]") {
  int out_of_order = 0;
  for (const std::string& name : schedule_names()) {
    for (int ranks : {2, 3, 4, 8}) {
      for (int microbatches : {1, 2, 3, 5, 8, 16}) {
        for (int virtual_stages : {1, 2, 3}) {
          if (!fits(name, virtual_stages)) continue;
          const Schedule compute_only = make_schedule(name, ranks, microbatches, virtual_stages, 0);
          const int stages = ranks * virtual_stages;
          // A chain, and skip connections over one stage as residual models have.
          StageGraph skips = StageGraph::chain(stages);
          for (int stage = 0; stage + 2 < stages; ++stage) skips.consumers[stage].push_back(stage + 2);
          for (const StageGraph& graph : {StageGraph::chain(stages), skips}) {
            INFO(name << " ranks=" << ranks << " microbatches=" << microbatches << " virtual_stages=" << virtual_stages
                      << " skips=" << (graph.consumers[0].size() > 1));
            const Schedule schedule = lower_communication(compute_only, graph);
            for (int rank = 0; rank < ranks; ++rank) {
              const auto order = receives_in_send_order(schedule, rank);
              for (const auto& [peer, receives] : order) {
                std::vector<Action> sends;
                for (const Action& action : schedule.ranks[peer])
                  if (smp::sched::is_send(action.kind) &&
                      schedule.stage_to_rank[action.peer_stage] == rank)
                    sends.push_back(action);
                REQUIRE(sends.size() == receives.size());
                for (std::size_t i = 0; i < sends.size(); ++i) {
                  const Action& receive = schedule.ranks[rank][receives[i]];
                  CHECK(receive.kind == (sends[i].kind == ActionKind::SendForward ? ActionKind::RecvForward
                                                                                  : ActionKind::RecvBackward));
                  CHECK(receive.stage == sends[i].peer_stage);
                  CHECK(receive.peer_stage == sends[i].stage);
                  CHECK(receive.microbatch == sends[i].microbatch);
                }
                out_of_order += !std::is_sorted(receives.begin(), receives.end());
              }
            }
          }
        }
      }
    }
  }
  // Interleaved 1F1B with skips on 3 ranks receives some messages in another order than they are sent: the case
  // the executor's receive-ahead exists for.
  CHECK(out_of_order > 0);
}

TEST_CASE("receives_in_send_order names a send nobody receives", "[validate]") {
  Schedule lowered = lower_communication(make_gpipe(2, 2), StageGraph::chain(2));
  auto& receiver = lowered.ranks[1];
  receiver.erase(std::find_if(receiver.begin(), receiver.end(),
                              [](const Action& action) { return action.kind == ActionKind::RecvForward; }));
  REQUIRE_THROWS_WITH(receives_in_send_order(lowered, 1), Contains("never receives"));
}

TEST_CASE("interleaved 1F1B action lists", "[generators]") {
  SECTION("p=2, m=4, v=2: rank r owns stages r and r + 2, microbatches go round in groups of 2") {
    const Schedule schedule = make_interleaved_1f1b(2, 4, 2);
    CHECK(schedule.name == "interleaved_1f1b");
    CHECK(schedule.stage_to_rank == std::vector<int>{0, 1, 0, 1});
    // Rank 0 warms up with 2 (p - 1) + (v - 1) p = 4 forwards, rank 1 with (v - 1) p = 2.
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(2, 0), F(2, 1), F(0, 2), B(2, 0), F(0, 3),
                                                   B(2, 1), F(2, 2), B(0, 0), F(2, 3), B(0, 1), B(2, 2), B(2, 3),
                                                   B(0, 2), B(0, 3)});
    CHECK(schedule.ranks[1] == std::vector<Action>{F(1, 0), F(1, 1), F(3, 0), B(3, 0), F(3, 1), B(3, 1), F(1, 2),
                                                   B(1, 0), F(1, 3), B(1, 1), F(3, 2), B(3, 2), F(3, 3), B(3, 3),
                                                   B(1, 2), B(1, 3)});
  }
  SECTION("m not a multiple of p: the order for the next multiple, without the extra microbatches") {
    const Schedule schedule = make_interleaved_1f1b(2, 3, 2);
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(2, 0), F(2, 1), F(0, 2), B(2, 0), B(2, 1),
                                                   F(2, 2), B(0, 0), B(0, 1), B(2, 2), B(0, 2)});
    CHECK(schedule.ranks[1] == std::vector<Action>{F(1, 0), F(1, 1), F(3, 0), B(3, 0), F(3, 1), B(3, 1), F(1, 2),
                                                   B(1, 0), B(1, 1), F(3, 2), B(3, 2), B(1, 2)});
  }
  SECTION("a cap shrinks the groups: p=2, v=2, max_active=2 sends microbatches round one at a time") {
    const Schedule schedule = make_interleaved_1f1b(2, 2, 2, 2);
    for (int rank = 0; rank < 2; ++rank)
      CHECK(schedule.ranks[rank] == std::vector<Action>{F(rank, 0), F(rank + 2, 0), B(rank + 2, 0), F(rank, 1),
                                                        B(rank, 0), F(rank + 2, 1), B(rank + 2, 1), B(rank, 1)});
  }
  SECTION("one virtual stage is 1F1B") {
    for (int ranks : {1, 2, 4, 5})
      for (int microbatches : {1, 3, 4, 9})
        for (int max_active : {0, 1, 2}) {
          INFO("ranks=" << ranks << " microbatches=" << microbatches << " max_active=" << max_active);
          CHECK(make_interleaved_1f1b(ranks, microbatches, 1, max_active).ranks ==
                make_1f1b(ranks, microbatches, max_active).ranks);
        }
  }
}

TEST_CASE("breadth-first looped action lists", "[generators]") {
  SECTION("p=2, m=3, v=2: every microbatch through one chunk before the next, backwards chunk by chunk in reverse") {
    const Schedule schedule = make_looped_bfs(2, 3, 2);
    CHECK(schedule.name == "looped_bfs");
    CHECK(schedule.stage_to_rank == std::vector<int>{0, 1, 0, 1});
    CHECK_FALSE(schedule.split_backward);
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(0, 2), F(2, 0), F(2, 1), F(2, 2),
                                                   B(2, 2), B(2, 1), B(2, 0), B(0, 2), B(0, 1), B(0, 0)});
    CHECK(schedule.ranks[1] == std::vector<Action>{F(1, 0), F(1, 1), F(1, 2), F(3, 0), F(3, 1), F(3, 2),
                                                   B(3, 2), B(3, 1), B(3, 0), B(1, 2), B(1, 1), B(1, 0)});
  }
  SECTION("one stage per rank is GPipe") {
    for (int ranks : {1, 2, 4})
      for (int microbatches : {1, 3, 8}) CHECK(make_looped_bfs(ranks, microbatches, 1).ranks == make_gpipe(ranks, microbatches).ranks);
  }
  SECTION("impossible arguments") {
    REQUIRE_THROWS_WITH(make_looped_bfs(0, 4, 2), Contains("rank"));
    REQUIRE_THROWS_WITH(make_looped_bfs(4, 0, 2), Contains("microbatch"));
    REQUIRE_THROWS_WITH(make_looped_bfs(4, 4, 0), Contains("virtual stage"));
  }
}

TEST_CASE("zero-bubble action lists", "[generators]") {
  SECTION("ZB-H1, p=3, m=4: 1F1B's warmup, W of microbatch i right after I of microbatch i + rank") {
    const Schedule schedule = make_zero_bubble_h1(3, 4);
    CHECK(schedule.name == "zb_h1");
    CHECK(schedule.split_backward);
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(0, 2), I(0, 0), W(0, 0), F(0, 3), I(0, 1),
                                                   W(0, 1), I(0, 2), W(0, 2), I(0, 3), W(0, 3)});
    CHECK(schedule.ranks[1] == std::vector<Action>{F(1, 0), F(1, 1), I(1, 0), F(1, 2), I(1, 1), W(1, 0), F(1, 3),
                                                   I(1, 2), W(1, 1), I(1, 3), W(1, 2), W(1, 3)});
    CHECK(schedule.ranks[2] == std::vector<Action>{F(2, 0), I(2, 0), F(2, 1), I(2, 1), F(2, 2), I(2, 2), W(2, 0),
                                                   F(2, 3), I(2, 3), W(2, 1), W(2, 2), W(2, 3)});
  }
  SECTION("ZB-H2, p=2, m=4: twice the warmup and twice the lag") {
    const Schedule schedule = make_zero_bubble_h2(2, 4);
    CHECK(schedule.name == "zb_h2");
    CHECK(schedule.ranks[0] == std::vector<Action>{F(0, 0), F(0, 1), F(0, 2), I(0, 0), W(0, 0), F(0, 3), I(0, 1),
                                                   W(0, 1), I(0, 2), W(0, 2), I(0, 3), W(0, 3)});
    CHECK(schedule.ranks[1] == std::vector<Action>{F(1, 0), I(1, 0), F(1, 1), I(1, 1), F(1, 2), I(1, 2), W(1, 0),
                                                   F(1, 3), I(1, 3), W(1, 1), W(1, 2), W(1, 3)});
  }
  SECTION("max_active=2 trims the warmup first, then the lag") {
    const Schedule schedule = make_zero_bubble_h1(3, 3, 2);
    CHECK(schedule.ranks[0] ==
          std::vector<Action>{F(0, 0), F(0, 1), I(0, 0), W(0, 0), F(0, 2), I(0, 1), W(0, 1), I(0, 2), W(0, 2)});
    CHECK(schedule.ranks[2] ==
          std::vector<Action>{F(2, 0), I(2, 0), F(2, 1), I(2, 1), W(2, 0), F(2, 2), I(2, 2), W(2, 1), W(2, 2)});
  }
  SECTION("max_active=1 runs F, I, W for one microbatch at a time") {
    for (const Schedule& schedule : {make_zero_bubble_h1(3, 2, 1), make_zero_bubble_h2(3, 2, 1)})
      for (int rank = 0; rank < 3; ++rank)
        CHECK(schedule.ranks[rank] ==
              std::vector<Action>{F(rank, 0), I(rank, 0), W(rank, 0), F(rank, 1), I(rank, 1), W(rank, 1)});
  }
}

TEST_CASE("malformed split-backward schedules are rejected, naming the action", "[validate]") {
  // An interleaved order with each B split, so stages share ranks and the chain wraps round.
  const StageGraph graph = StageGraph::chain(6);
  Schedule split = split_each_backward(make_interleaved_1f1b(3, 4, 2));
  REQUIRE_NOTHROW(validate(split, graph));
  REQUIRE_NOTHROW(validate(lower_communication(split, graph), graph));

  SECTION("W before its I") {
    std::vector<Action>& actions = split.ranks[1];
    const auto input = std::find(actions.begin(), actions.end(), I(4, 2));
    REQUIRE(input != actions.end());
    std::iter_swap(input, input + 1);
    REQUIRE_THROWS_WITH(validate(split, graph),
                        Contains("rank 1, action #") &&
                            Contains(describe(W(4, 2)) + ": weight gradient before its input gradient"));
  }
  SECTION("I without W") {
    std::vector<Action>& actions = split.ranks[0];
    actions.erase(std::find(actions.begin(), actions.end(), W(3, 1)));
    REQUIRE_THROWS_WITH(validate(split, graph), Contains("rank 0: missing " + describe(W(3, 1))));
  }
  SECTION("ZB-H1 with a W moved ahead of its I") {
    Schedule zb = make_zero_bubble_h1(4, 8);
    std::vector<Action>& actions = zb.ranks[2];
    const auto weight = std::find(actions.begin(), actions.end(), W(2, 3));
    REQUIRE(weight != actions.end());
    std::rotate(actions.begin(), weight, weight + 1);
    REQUIRE_THROWS_WITH(validate(zb, StageGraph::chain(4)),
                        Contains("rank 2, action #0 " + describe(W(2, 3)) +
                                 ": weight gradient before its input gradient"));
  }
}

TEST_CASE("sends_delivered_by_receive lists each send under the first receive that follows its delivery",
          "[lowering]") {
  // The other end of a transfer: SEND_F(s -> t, mb) is RECV_F(t <- s, mb).
  auto other_end = [](const Action& action) {
    const ActionKind kinds[] = {ActionKind::SendForward, ActionKind::RecvForward, ActionKind::SendBackward,
                                ActionKind::RecvBackward};
    ActionKind kind = action.kind;
    for (int i = 0; i < 4; ++i) {
      if (kinds[i] == action.kind) kind = kinds[i ^ 1];
    }
    return Action{kind, action.peer_stage, action.microbatch, action.stage};
  };
  auto is_receive = [](const Action& action) {
    return action.kind == ActionKind::RecvForward || action.kind == ActionKind::RecvBackward;
  };
  // The reference, by search: which actions of `rank` come after (rank `from`, action `index`) in the executors'
  // order, where each rank runs its list in order and every message's send precedes its receive.
  auto followers_on = [&](const Schedule& schedule, int from, std::size_t index, int rank) {
    std::set<std::pair<int, std::size_t>> seen{{from, index}};
    std::vector<std::pair<int, std::size_t>> frontier{{from, index}};
    std::set<std::size_t> on_rank;
    while (!frontier.empty()) {
      const auto [r, i] = frontier.back();
      frontier.pop_back();
      if (r == rank) on_rank.insert(i);
      const auto& actions = schedule.ranks[r];
      std::vector<std::pair<int, std::size_t>> after;
      if (i + 1 < actions.size()) after.emplace_back(r, i + 1);
      if (smp::sched::is_send(actions[i].kind) && schedule.stage_to_rank[actions[i].peer_stage] != r) {
        const int peer = schedule.stage_to_rank[actions[i].peer_stage];
        const auto& theirs = schedule.ranks[peer];
        after.emplace_back(peer, std::find(theirs.begin(), theirs.end(), other_end(actions[i])) - theirs.begin());
      }
      for (const auto& next : after) {
        if (seen.insert(next).second) frontier.push_back(next);
      }
    }
    return on_rank;
  };
  for (const std::string& name : schedule_names()) {
    for (int ranks : {2, 3, 4}) {
      for (int microbatches : {1, 4, 8}) {
        for (int virtual_stages : {1, 2}) {
          if (!fits(name, virtual_stages)) continue;
          const int stages = ranks * virtual_stages;
          // A chain, and skips over one stage (two receivers per send, and local transfers with virtual stages);
          // in flight as the schedule likes, and capped at 2.
          StageGraph skips = StageGraph::chain(stages);
          for (int stage = 0; stage + 2 < stages; ++stage) skips.consumers[stage].push_back(stage + 2);
          std::vector<Schedule> schedules;
          for (const StageGraph& graph : {StageGraph::chain(stages), skips}) {
            for (int cap : {0, 2}) {
              if (cap != 0 && !takes_cap(name)) continue;  // GPipe and the Vs bound what they hold themselves
              const Schedule training =
                  lower_communication(make_schedule(name, ranks, microbatches, virtual_stages, cap), graph);
              schedules.push_back(training);
              schedules.push_back(forward_only(training));
            }
          }
          for (const Schedule& schedule : schedules) {
            INFO(name << " ranks=" << ranks << " microbatches=" << microbatches << " virtual_stages="
                      << virtual_stages << (schedule.forward_only ? " forward only" : ""));
            std::size_t listed = 0;
            for (int rank = 0; rank < ranks; ++rank) {
              const auto& mine = schedule.ranks[rank];
              std::map<std::size_t, std::size_t> listed_under;  // send -> receive
              for (const auto& [receive, sends] : sends_delivered_by_receive(schedule, rank)) {
                for (std::size_t send : sends) {
                  CHECK(listed_under.emplace(send, receive).second);
                  ++listed;
                }
              }
              for (std::size_t send = 0; send < mine.size(); ++send) {
                if (!smp::sched::is_send(mine[send].kind) || schedule.stage_to_rank[mine[send].peer_stage] == rank) continue;
                const int peer = schedule.stage_to_rank[mine[send].peer_stage];
                const auto& theirs = schedule.ranks[peer];
                const std::size_t taken =
                    std::find(theirs.begin(), theirs.end(), other_end(mine[send])) - theirs.begin();
                // The first remote receive of ours after the send that the peer's taking precedes.
                std::size_t expected = mine.size();
                for (std::size_t later : followers_on(schedule, peer, taken, rank)) {
                  if (later > send && later < expected && is_receive(mine[later]) &&
                      schedule.stage_to_rank[mine[later].peer_stage] != rank) {
                    expected = later;
                  }
                }
                INFO("rank " << rank << " send " << send);
                if (expected == mine.size()) {
                  CHECK(listed_under.count(send) == 0);
                } else {
                  REQUIRE(listed_under.count(send) == 1);
                  CHECK(listed_under.at(send) == expected);
                }
              }
            }
            // With several microbatches, some send is proven by a later receive (in an evaluation, only when
            // messages come back round: virtual stages).
            if (microbatches > 1 && (!schedule.forward_only || virtual_stages > 1)) CHECK(listed > 0);
          }
        }
      }
    }
  }
  auto position = [](const std::vector<Action>& actions, const Action& wanted) {
    const auto found = std::find(actions.begin(), actions.end(), wanted);
    REQUIRE(found != actions.end());
    return static_cast<std::size_t>(found - actions.begin());
  };
  // 1F1B on two ranks: rank 0's first gradient proves its first forward's send delivered.
  const StageGraph graph = StageGraph::chain(2);
  const Schedule one_f_one_b = lower_communication(make_1f1b(2, 4), graph);
  const auto delivered = sends_delivered_by_receive(one_f_one_b, 0);
  const auto& rank0 = one_f_one_b.ranks[0];
  const std::size_t first_gradient = position(rank0, Action{ActionKind::RecvBackward, 0, 0, 1});
  REQUIRE(delivered.count(first_gradient) == 1);
  CHECK(delivered.at(first_gradient) == std::vector<std::size_t>{position(rank0, Action{ActionKind::SendForward, 0, 0, 1})});
}

TEST_CASE("a forward-only schedule admits no backward", "[validate]") {
  const StageGraph graph = StageGraph::chain(4);
  const Schedule training = lower_communication(make_1f1b(4, 4), graph);
  Schedule evaluation = forward_only(training);
  REQUIRE_NOTHROW(validate(evaluation, graph));
  SECTION("a B") {
    evaluation.ranks[3].push_back(Action{ActionKind::Backward, 3, 0});
    REQUIRE_THROWS_WITH(validate(evaluation, graph), Contains("rank 3, action #") &&
                                                         Contains("backward in a forward-only schedule"));
  }
  SECTION("a gradient transfer") {
    evaluation.ranks[0].push_back(Action{ActionKind::RecvBackward, 0, 0, 1});
    REQUIRE_THROWS_WITH(validate(evaluation, graph), Contains("gradient transfer in a forward-only schedule"));
  }
  SECTION("a missing forward") {
    auto& actions = evaluation.ranks[2];
    actions.erase(std::find(actions.begin(), actions.end(), Action{ActionKind::Forward, 2, 1}));
    REQUIRE_THROWS_WITH(validate(evaluation, graph), Contains("missing " + describe(Action{ActionKind::Forward, 2, 1})));
  }
}

TEST_CASE("CSV round trip of every named schedule", "[csv]") {
  for (const std::string& name : schedule_names()) {
    const int virtual_stages = fits(name, 3) ? 3 : fits(name, 1) ? 1 : 2;
    const Schedule compute_only = make_schedule(name, 3, 5, virtual_stages, 0);
    const StageGraph graph = StageGraph::chain(compute_only.num_stages);
    for (const Schedule& original : {compute_only, lower_communication(compute_only, graph)}) {
      INFO(name);
      check_csv_round_trip(original, graph);
    }
  }
}
