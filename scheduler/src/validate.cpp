#include <algorithm>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "detail.h"
#include "smp/scheduler/simulator.h"

namespace smp::sched {

namespace detail {

namespace {

[[noreturn]] void reject(int rank, std::size_t index, const Action& action, const std::string& problem) {
  throw ScheduleError("rank " + std::to_string(rank) + ", action #" + std::to_string(index) + " " + describe(action) +
                      ": " + problem);
}

void check_shape(const Schedule& schedule, const StageGraph& graph) {
  const std::string name = "schedule '" + schedule.name + "'";
  if (schedule.num_ranks < 1) throw ScheduleError(name + " has no ranks");
  if (schedule.num_stages < 1) throw ScheduleError(name + " has no stages");
  if (schedule.num_microbatches < 1) throw ScheduleError(name + " has no microbatches");
  if (static_cast<int>(schedule.ranks.size()) != schedule.num_ranks)
    throw ScheduleError(name + " declares " + std::to_string(schedule.num_ranks) + " ranks but lists actions for " +
                        std::to_string(schedule.ranks.size()));
  if (static_cast<int>(schedule.stage_to_rank.size()) != schedule.num_stages)
    throw ScheduleError(name + " declares " + std::to_string(schedule.num_stages) + " stages but maps " +
                        std::to_string(schedule.stage_to_rank.size()) + " to ranks");
  for (int stage = 0; stage < schedule.num_stages; ++stage) {
    const int rank = schedule.stage_to_rank[stage];
    if (rank < 0 || rank >= schedule.num_ranks)
      throw ScheduleError(name + " maps stage " + std::to_string(stage) + " to unknown rank " + std::to_string(rank));
  }
  check_graph(graph);
  if (graph.num_stages() != schedule.num_stages)
    throw ScheduleError(name + " has " + std::to_string(schedule.num_stages) + " stages, its stage graph " +
                        std::to_string(graph.num_stages()));
}

// Position of every compute action in its rank's list (a stage lives on one rank, so that is enough), -1 where
// absent.
class ComputeIndex {
 public:
  ComputeIndex(int num_stages, int num_microbatches)
      : num_stages_(num_stages),
        num_microbatches_(num_microbatches),
        index_(4 * static_cast<std::size_t>(num_stages) * static_cast<std::size_t>(num_microbatches), -1) {}

  long long& operator()(ActionKind kind, int stage, int microbatch) {
    const std::size_t kind_slot = static_cast<std::size_t>(kind);
    return index_[(kind_slot * num_stages_ + stage) * num_microbatches_ + microbatch];
  }

 private:
  static_assert(static_cast<int>(ActionKind::Forward) == 0 && static_cast<int>(ActionKind::Backward) == 1 &&
                    static_cast<int>(ActionKind::BackwardInput) == 2 &&
                    static_cast<int>(ActionKind::BackwardWeight) == 3,
                "compute kinds index the table directly");
  std::size_t num_stages_;
  std::size_t num_microbatches_;
  std::vector<long long> index_;
};

bool is_send(ActionKind kind) { return kind == ActionKind::SendForward || kind == ActionKind::SendBackward; }

}  // namespace

void check_structure(const Schedule& schedule, const StageGraph& graph) {
  check_shape(schedule, graph);
  const int num_stages = schedule.num_stages;
  const int num_microbatches = schedule.num_microbatches;
  const bool split = schedule.split_backward;
  const bool lowered = has_transfers(schedule);
  const TransferMap transfers(graph, num_microbatches);
  const ActionKind gradient_pass = split ? ActionKind::BackwardInput : ActionKind::Backward;

  ComputeIndex compute_index(num_stages, num_microbatches);
  std::vector<long long> send_index(static_cast<std::size_t>(transfers.num_messages()), -1);
  std::vector<long long> recv_index(static_cast<std::size_t>(transfers.num_messages()), -1);

  // Each action on its own, recording where it is for the cross-checks below.
  for (int rank = 0; rank < schedule.num_ranks; ++rank) {
    const std::vector<Action>& actions = schedule.ranks[rank];
    for (std::size_t index = 0; index < actions.size(); ++index) {
      const Action& action = actions[index];
      if (action.stage < 0 || action.stage >= num_stages)
        reject(rank, index, action, "unknown stage (the schedule has " + std::to_string(num_stages) + ")");
      const int owner = schedule.stage_to_rank[action.stage];
      if (owner != rank)
        reject(rank, index, action,
               "stage " + std::to_string(action.stage) + " belongs to rank " + std::to_string(owner));
      if (action.microbatch < 0 || action.microbatch >= num_microbatches)
        reject(rank, index, action,
               "microbatch out of range (the schedule has " + std::to_string(num_microbatches) + ")");

      long long* slot = nullptr;
      if (is_compute(action.kind)) {
        if (action.peer_stage != -1) reject(rank, index, action, "compute actions take no peer stage (use -1)");
        if (schedule.forward_only && action.kind != ActionKind::Forward)
          reject(rank, index, action, "backward in a forward-only schedule");
        if (split && action.kind == ActionKind::Backward)
          reject(rank, index, action, "B in a split-backward schedule (use I and W)");
        if (!split && (action.kind == ActionKind::BackwardInput || action.kind == ActionKind::BackwardWeight))
          reject(rank, index, action, "I and W need split_backward");
        slot = &compute_index(action.kind, action.stage, action.microbatch);
      } else {
        if (schedule.forward_only && action.kind != ActionKind::SendForward && action.kind != ActionKind::RecvForward)
          reject(rank, index, action, "gradient transfer in a forward-only schedule");
        const int message = transfers.message_of(action);
        if (message < 0) {
          const bool peer_consumes = action.kind == ActionKind::SendForward || action.kind == ActionKind::RecvBackward;
          reject(rank, index, action,
                 "stage " + std::to_string(action.peer_stage) + " is not " +
                     (peer_consumes ? "a consumer" : "a producer") + " of stage " + std::to_string(action.stage) +
                     " in the stage graph");
        }
        slot = &(is_send(action.kind) ? send_index : recv_index)[message];
      }
      if (*slot >= 0) reject(rank, index, action, "duplicate of action #" + std::to_string(*slot));
      *slot = static_cast<long long>(index);
    }
  }

  // Every stage runs every microbatch through forward and backward (forward alone when forward_only) exactly once.
  for (int stage = 0; stage < num_stages; ++stage) {
    for (int microbatch = 0; microbatch < num_microbatches; ++microbatch) {
      for (ActionKind kind : {ActionKind::Forward, gradient_pass, ActionKind::BackwardWeight}) {
        if (kind == ActionKind::BackwardWeight && !split) continue;
        if (kind != ActionKind::Forward && schedule.forward_only) continue;
        if (compute_index(kind, stage, microbatch) < 0)
          throw ScheduleError("rank " + std::to_string(schedule.stage_to_rank[stage]) + ": missing " +
                              describe(Action{kind, stage, microbatch}));
      }
    }
  }

  // Orders within a rank, and the two ends of every transfer.
  for (int rank = 0; rank < schedule.num_ranks; ++rank) {
    const std::vector<Action>& actions = schedule.ranks[rank];
    for (std::size_t index = 0; index < actions.size(); ++index) {
      const Action& action = actions[index];
      const auto position = static_cast<long long>(index);
      const auto must_follow = [&](ActionKind kind, const char* problem) {
        const long long earlier = compute_index(kind, action.stage, action.microbatch);
        if (earlier > position)
          reject(rank, index, action, std::string(problem) + " (at action #" + std::to_string(earlier) + ")");
      };
      switch (action.kind) {
        case ActionKind::Backward:
        case ActionKind::BackwardInput:
          must_follow(ActionKind::Forward, "backward before its forward");
          break;
        case ActionKind::BackwardWeight:
          must_follow(ActionKind::BackwardInput, "weight gradient before its input gradient");
          break;
        case ActionKind::SendForward:
          must_follow(ActionKind::Forward, "sent before the forward that produces it");
          break;
        case ActionKind::SendBackward:
          must_follow(gradient_pass, "sent before the backward that produces it");
          break;
        default:
          break;
      }
      if (!lowered) continue;

      if (is_compute(action.kind)) {
        transfers.for_each_receive(action, [&](const Action& receive, int message) {
          const long long at = recv_index[message];
          if (at < 0) reject(rank, index, action, "missing " + describe(receive) + " before it");
          if (at > position)
            reject(rank, index, action, describe(receive) + " comes after it (at action #" + std::to_string(at) + ")");
        });
      } else {
        const int message = transfers.message_of(action);
        if ((is_send(action.kind) ? recv_index : send_index)[message] < 0) {
          const Action other_end = matching_transfer(action);
          reject(rank, index, action,
                 "no matching " + describe(other_end) + " on rank " +
                     std::to_string(schedule.stage_to_rank[other_end.stage]));
        }
      }
    }
  }
}

}  // namespace detail

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
        const bool receiving = remote(r, action) && !detail::is_send(action.kind);
        if (receiving) {
          const Key sent_as = key_of(detail::matching_transfer(action));
          const auto message = in_flight.find(sent_as);
          if (message == in_flight.end()) break;  // its sender has not got there yet
          for (int q = 0; q < ranks; ++q) now[q] = std::max(now[q], message->second[q]);
          in_flight.erase(message);
          if (schedule.stage_to_rank.at(action.peer_stage) == rank) taken_at[sent_as] = static_cast<long long>(at);
        }
        now[r] = static_cast<long long>(at);
        if (remote(r, action) && detail::is_send(action.kind)) in_flight[key_of(action)] = now;
        if (receiving && r == rank) my_receives.emplace_back(at, now);
      }
    }
  }
  // A schedule that deadlocks stops the clocks early: its sends stay unproven (validate() reports it).
  // Each send is listed once, under the first receive of this rank (in its order) that certifies it.
  const auto& mine = schedule.ranks.at(static_cast<std::size_t>(rank));
  std::map<std::size_t, std::vector<std::size_t>> delivered;
  for (std::size_t send = 0; send < mine.size(); ++send) {
    if (!remote(rank, mine[send]) || !detail::is_send(mine[send].kind)) continue;
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
