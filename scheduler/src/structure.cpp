// A schedule's structure checked rank by rank, without running it: every action once, on a stage its rank holds and
// a microbatch in range; each microbatch's passes in order; every transfer with both ends, each received before it is
// used. Both validate(), which adds a simulation to find deadlocks, and simulate() run it first.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "detail.h"

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

}  // namespace smp::sched
