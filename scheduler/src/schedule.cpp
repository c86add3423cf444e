// The CSV format that schedule.h points to here is described in csv.cpp.

#include "smp/scheduler/schedule.h"

#include <algorithm>
#include <string>

namespace smp::sched {

namespace {

struct KindName {
  ActionKind kind;
  const char* name;
};

constexpr KindName kKindNames[] = {
    {ActionKind::Forward, "F"},           {ActionKind::Backward, "B"},          {ActionKind::BackwardInput, "I"},
    {ActionKind::BackwardWeight, "W"},    {ActionKind::SendForward, "SEND_F"},  {ActionKind::RecvForward, "RECV_F"},
    {ActionKind::SendBackward, "SEND_B"}, {ActionKind::RecvBackward, "RECV_B"},
};

}  // namespace

const char* to_string(ActionKind kind) {
  for (const KindName& entry : kKindNames)
    if (entry.kind == kind) return entry.name;
  throw ScheduleError("unknown ActionKind value " + std::to_string(static_cast<int>(kind)));
}

ActionKind action_kind_from_string(const std::string& text) {
  for (const KindName& entry : kKindNames)
    if (text == entry.name) return entry.kind;
  throw ScheduleError("unknown action kind '" + text + "' (expected F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B)");
}

bool is_compute(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward:
    case ActionKind::Backward:
    case ActionKind::BackwardInput:
    case ActionKind::BackwardWeight:
      return true;
    case ActionKind::SendForward:
    case ActionKind::RecvForward:
    case ActionKind::SendBackward:
    case ActionKind::RecvBackward:
      return false;
  }
  throw ScheduleError("unknown ActionKind value " + std::to_string(static_cast<int>(kind)));
}

bool is_send(ActionKind kind) { return kind == ActionKind::SendForward || kind == ActionKind::SendBackward; }

std::string describe(const Action& action) {
  std::string text = to_string(action.kind);
  text += "(stage " + std::to_string(action.stage);
  switch (action.kind) {
    case ActionKind::SendForward:
    case ActionKind::SendBackward:
      text += " -> " + std::to_string(action.peer_stage);
      break;
    case ActionKind::RecvForward:
    case ActionKind::RecvBackward:
      text += " <- " + std::to_string(action.peer_stage);
      break;
    default:
      break;
  }
  return text + ", mb " + std::to_string(action.microbatch) + ")";
}

StageGraph StageGraph::chain(int num_stages) {
  if (num_stages < 1) throw ScheduleError("a stage chain needs at least 1 stage, got " + std::to_string(num_stages));
  StageGraph graph;
  graph.consumers.resize(static_cast<std::size_t>(num_stages));
  for (int stage = 0; stage + 1 < num_stages; ++stage) graph.consumers[stage] = {stage + 1};
  return graph;
}

std::vector<int> StageGraph::producers_of(int stage) const {
  if (stage < 0 || stage >= num_stages())
    throw ScheduleError("stage " + std::to_string(stage) + " is not in a graph of " + std::to_string(num_stages()) +
                        " stages");
  std::vector<int> producers;
  for (int candidate = 0; candidate < num_stages(); ++candidate) {
    const std::vector<int>& fed = consumers[candidate];
    if (std::find(fed.begin(), fed.end(), stage) != fed.end()) producers.push_back(candidate);
  }
  return producers;
}

Schedule forward_only(const Schedule& schedule) {
  Schedule forward = schedule;
  forward.name = schedule.name + "_forward";
  forward.forward_only = true;
  forward.split_backward = false;
  for (auto& actions : forward.ranks) {
    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [](const Action& action) {
                                   return action.kind != ActionKind::Forward &&
                                          action.kind != ActionKind::SendForward &&
                                          action.kind != ActionKind::RecvForward;
                                 }),
                  actions.end());
  }
  return forward;
}

std::vector<int> Schedule::stages_of_rank(int rank) const {
  std::vector<int> stages;
  for (int stage = 0; stage < static_cast<int>(stage_to_rank.size()); ++stage)
    if (stage_to_rank[stage] == rank) stages.push_back(stage);
  return stages;
}

}  // namespace smp::sched
