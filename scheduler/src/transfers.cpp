#include <algorithm>
#include <string>

#include "detail.h"

namespace smp::sched::detail {

void check_graph(const StageGraph& graph) {
  const int num_stages = graph.num_stages();
  if (num_stages < 1) throw ScheduleError("stage graph has no stages");
  for (int stage = 0; stage < num_stages; ++stage) {
    const std::vector<int>& consumers = graph.consumers[stage];
    for (std::size_t i = 0; i < consumers.size(); ++i) {
      const int consumer = consumers[i];
      const std::string where =
          "stage graph: stage " + std::to_string(stage) + " lists consumer " + std::to_string(consumer);
      if (consumer < 0 || consumer >= num_stages)
        throw ScheduleError(where + ", but the graph has " + std::to_string(num_stages) + " stages");
      if (consumer <= stage) throw ScheduleError(where + ", but consumers must be later stages");
      if (std::find(consumers.begin(), consumers.begin() + static_cast<std::ptrdiff_t>(i), consumer) !=
          consumers.begin() + static_cast<std::ptrdiff_t>(i))
        throw ScheduleError(where + " twice");
    }
  }
}

bool has_transfers(const Schedule& schedule) {
  for (const std::vector<Action>& actions : schedule.ranks)
    for (const Action& action : actions)
      if (!is_compute(action.kind)) return true;
  return false;
}

Action matching_transfer(const Action& transfer) {
  switch (transfer.kind) {
    case ActionKind::SendForward:
      return {ActionKind::RecvForward, transfer.peer_stage, transfer.microbatch, transfer.stage};
    case ActionKind::RecvForward:
      return {ActionKind::SendForward, transfer.peer_stage, transfer.microbatch, transfer.stage};
    case ActionKind::SendBackward:
      return {ActionKind::RecvBackward, transfer.peer_stage, transfer.microbatch, transfer.stage};
    case ActionKind::RecvBackward:
      return {ActionKind::SendBackward, transfer.peer_stage, transfer.microbatch, transfer.stage};
    default:
      throw ScheduleError(describe(transfer) + " is not a transfer");
  }
}

TransferMap::TransferMap(const StageGraph& graph, int num_microbatches)
    : incoming_(static_cast<std::size_t>(graph.num_stages())),
      outgoing_(static_cast<std::size_t>(graph.num_stages())),
      num_microbatches_(num_microbatches) {
  for (int stage = 0; stage < graph.num_stages(); ++stage) {
    for (int consumer : graph.consumers[stage]) {
      outgoing_[stage].push_back({consumer, num_edges_});
      incoming_[consumer].push_back({stage, num_edges_});
      ++num_edges_;
    }
  }
}

int TransferMap::find_edge(const std::vector<Edge>& edges, int peer) {
  for (const Edge& edge : edges)
    if (edge.peer == peer) return edge.id;
  return -1;
}

int TransferMap::message_of(const Action& transfer) const {
  int edge = -1;
  bool backward = false;
  switch (transfer.kind) {
    case ActionKind::SendForward:
      edge = find_edge(outgoing_[transfer.stage], transfer.peer_stage);
      break;
    case ActionKind::RecvForward:
      edge = find_edge(incoming_[transfer.stage], transfer.peer_stage);
      break;
    case ActionKind::SendBackward:
      edge = find_edge(incoming_[transfer.stage], transfer.peer_stage);
      backward = true;
      break;
    case ActionKind::RecvBackward:
      edge = find_edge(outgoing_[transfer.stage], transfer.peer_stage);
      backward = true;
      break;
    default:
      throw ScheduleError(describe(transfer) + " is not a transfer");
  }
  return edge < 0 ? -1 : message(backward, edge, transfer.microbatch);
}

}  // namespace smp::sched::detail
