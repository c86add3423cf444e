#include <algorithm>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "detail.h"
#include "smp/scheduler/simulator.h"

namespace smp::sched {

void validate(const Schedule& schedule, const StageGraph& graph) {
  detail::check_structure(schedule, graph);
  // Only whether every rank gets to its end matters here, so any positive costs do.
  detail::simulate_checked(schedule, graph, SimulationCosts::uniform(schedule.num_stages));
}

std::map<int, std::vector<std::size_t>> receives_in_send_order(const Schedule& schedule, int rank) {
  // A transfer as both ends name it: SEND_F(s -> t, mb) is RECV_F(t <- s, mb).
  using Transfer = std::tuple<bool, int, int, int>;  // forward, from stage, to stage, microbatch
  std::map<Transfer, std::size_t> receive_index;
  const auto& mine = schedule.ranks.at(static_cast<std::size_t>(rank));
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const Action& action = mine[i];
    if (action.kind != ActionKind::RecvForward && action.kind != ActionKind::RecvBackward) continue;
    if (schedule.stage_to_rank.at(action.peer_stage) == rank) continue;  // stays in the process
    receive_index[{action.kind == ActionKind::RecvForward, action.peer_stage, action.stage, action.microbatch}] = i;
  }
  std::map<int, std::vector<std::size_t>> order;
  for (int peer = 0; peer < schedule.num_ranks; ++peer) {
    if (peer == rank) continue;
    for (const Action& action : schedule.ranks[peer]) {
      if (action.kind != ActionKind::SendForward && action.kind != ActionKind::SendBackward) continue;
      if (schedule.stage_to_rank.at(action.peer_stage) != rank) continue;
      const auto found = receive_index.find(
          {action.kind == ActionKind::SendForward, action.stage, action.peer_stage, action.microbatch});
      if (found == receive_index.end()) {
        throw ScheduleError("rank " + std::to_string(peer) + " does " + describe(action) + " but rank " +
                            std::to_string(rank) + " never receives it");
      }
      order[peer].push_back(found->second);
      receive_index.erase(found);
    }
  }
  if (!receive_index.empty()) {
    const auto& [transfer, index] = *receive_index.begin();
    throw ScheduleError("rank " + std::to_string(rank) + " does " + describe(mine[index]) + " but no rank sends it");
  }
  return order;
}

std::map<std::size_t, std::vector<std::size_t>> sends_delivered_by_receive(const Schedule& schedule, int rank) {
  const int ranks = schedule.num_ranks;
  auto remote = [&](int on, const Action& action) {
    return action.peer_stage >= 0 && schedule.stage_to_rank.at(action.peer_stage) != on;
  };
  using Key = std::tuple<ActionKind, int, int, int>;
  auto key_of = [](const Action& action) { return Key{action.kind, action.stage, action.microbatch, action.peer_stage}; };
  // Vector clocks over the order the executors impose: each rank runs its list in order (a receive completes before
  // the rank's next action), and a message is sent before it is received. After an event, clock[q] is the last
  // action of rank q that completed before it. A receive of ours whose clock has reached the peer's receive of one
  // of our sends proves that send delivered, also when the proof came round through other ranks: in an interleaved
  // evaluation nothing comes back from rank 1, but rank p-1's messages to rank 0 follow what rank 1 took.
  std::vector<std::vector<long long>> clock(static_cast<std::size_t>(ranks), std::vector<long long>(ranks, -1));
  std::vector<std::size_t> next(static_cast<std::size_t>(ranks), 0);
  std::map<Key, std::vector<long long>> in_flight;           // a message sent, not yet received -> its send's clock
  std::vector<std::pair<std::size_t, std::vector<long long>>> my_receives;  // (index, clock), in our order
  std::map<Key, long long> taken_at;                          // our message (its send's key) -> where the peer takes it
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < ranks; ++r) {
      const auto& actions = schedule.ranks[static_cast<std::size_t>(r)];
      auto& now = clock[static_cast<std::size_t>(r)];
      for (auto& at = next[static_cast<std::size_t>(r)]; at < actions.size(); ++at, progressed = true) {
        const Action& action = actions[at];
        const bool receiving = remote(r, action) && !is_send(action.kind);
        if (receiving) {
          const Key sent_as = key_of(detail::matching_transfer(action));
          const auto message = in_flight.find(sent_as);
          if (message == in_flight.end()) break;  // its sender has not got there yet
          for (int q = 0; q < ranks; ++q) now[q] = std::max(now[q], message->second[q]);
          in_flight.erase(message);
          if (schedule.stage_to_rank.at(action.peer_stage) == rank) taken_at[sent_as] = static_cast<long long>(at);
        }
        now[r] = static_cast<long long>(at);
        if (remote(r, action) && is_send(action.kind)) in_flight[key_of(action)] = now;
        if (receiving && r == rank) my_receives.emplace_back(at, now);
      }
    }
  }
  // A schedule that deadlocks stops the clocks early: its sends stay unproven (validate() reports it).
  // Each send is listed once, under the first receive of this rank (in its order) that certifies it.
  const auto& mine = schedule.ranks.at(static_cast<std::size_t>(rank));
  std::map<std::size_t, std::vector<std::size_t>> delivered;
  for (std::size_t send = 0; send < mine.size(); ++send) {
    if (!remote(rank, mine[send]) || !is_send(mine[send].kind)) continue;
    const auto taken = taken_at.find(key_of(mine[send]));
    if (taken == taken_at.end()) continue;
    const int peer = schedule.stage_to_rank.at(mine[send].peer_stage);
    // Our clocks only grow along our list, so the first receive after the send that has seen the peer take it is
    // found by bisection.
    const auto after_send = std::partition_point(my_receives.begin(), my_receives.end(),
                                                 [&](const auto& receive) { return receive.first <= send; });
    const auto proof = std::partition_point(after_send, my_receives.end(), [&](const auto& receive) {
      return receive.second[static_cast<std::size_t>(peer)] < taken->second;
    });
    if (proof != my_receives.end()) delivered[proof->first].push_back(send);
  }
  return delivered;
}

}  // namespace smp::sched
