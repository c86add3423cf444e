#pragma once
// Internal to smp_scheduler: the bookkeeping that lowering, validation and simulation share.

#include <vector>

#include "smp/scheduler/schedule.h"
#include "smp/scheduler/simulator.h"

namespace smp::sched::detail {

// Rejects consumer lists that point outside the graph, at an earlier stage, or twice at the same stage;
// everything below indexes by these lists without further checks.
void check_graph(const StageGraph& graph);

// Everything validate() checks except deadlock, which needs the simulator (which in turn relies on this).
void check_structure(const Schedule& schedule, const StageGraph& graph);

// simulate() for a schedule that already passed check_structure(); validate() uses it to find deadlocks.
SimulationResult simulate_checked(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs);

bool has_transfers(const Schedule& schedule);

// The other end of a transfer: SEND_F(stage 1 -> 2, mb 0) <-> RECV_F(stage 2 <- 1, mb 0).
Action matching_transfer(const Action& transfer);

// Every message crosses one graph edge in one direction for one microbatch. Numbering messages densely lets
// validation and simulation use flat arrays rather than hash maps, which keeps p=128, m=1024 fast.
class TransferMap {
 public:
  TransferMap(const StageGraph& graph, int num_microbatches);  // graph must have passed check_graph

  int num_messages() const { return num_edges_ * 2 * num_microbatches_; }

  // The message a SEND_*/RECV_* action carries, or -1 when its peer_stage is not at the other end of a graph
  // edge in the direction its kind implies. stage and microbatch must be in range.
  int message_of(const Action& transfer) const;

  // The receives a compute action needs before it runs, and the sends that ship its results, as
  // lower_communication() places them; visit(const Action& transfer, int message). W moves no data.
  template <typename Visit>
  void for_each_receive(const Action& compute, Visit&& visit) const {
    if (compute.kind == ActionKind::Forward) {
      for (const Edge& edge : incoming_[compute.stage])
        visit(Action{ActionKind::RecvForward, compute.stage, compute.microbatch, edge.peer},
              message(false, edge.id, compute.microbatch));
    } else if (is_backward_pass(compute.kind)) {
      for (const Edge& edge : outgoing_[compute.stage])
        visit(Action{ActionKind::RecvBackward, compute.stage, compute.microbatch, edge.peer},
              message(true, edge.id, compute.microbatch));
    }
  }
  template <typename Visit>
  void for_each_send(const Action& compute, Visit&& visit) const {
    if (compute.kind == ActionKind::Forward) {
      for (const Edge& edge : outgoing_[compute.stage])
        visit(Action{ActionKind::SendForward, compute.stage, compute.microbatch, edge.peer},
              message(false, edge.id, compute.microbatch));
    } else if (is_backward_pass(compute.kind)) {
      for (const Edge& edge : incoming_[compute.stage])
        visit(Action{ActionKind::SendBackward, compute.stage, compute.microbatch, edge.peer},
              message(true, edge.id, compute.microbatch));
    }
  }

 private:
  struct Edge {
    int peer;  // the stage at the other end
    int id;
  };

  // B and I both produce the input gradients that travel to the producers.
  static bool is_backward_pass(ActionKind kind) {
    return kind == ActionKind::Backward || kind == ActionKind::BackwardInput;
  }
  int message(bool backward, int edge, int microbatch) const {
    return (edge * 2 + (backward ? 1 : 0)) * num_microbatches_ + microbatch;
  }
  static int find_edge(const std::vector<Edge>& edges, int peer);

  std::vector<std::vector<Edge>> incoming_;  // per stage: its producers
  std::vector<std::vector<Edge>> outgoing_;  // per stage: its consumers
  int num_edges_ = 0;
  int num_microbatches_ = 0;
};

}  // namespace smp::sched::detail
