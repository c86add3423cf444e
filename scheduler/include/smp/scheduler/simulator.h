#pragma once
// Discrete-event model of one training step under a schedule: predicts makespan, bubble and activation memory
// before anything runs, and proves (or refutes) that an order of actions cannot deadlock.
//
// Each rank runs its actions in order. A compute action takes its stage's cost. A SEND takes no time on the
// sender and its message arrives at the receiver latency_s + bytes_per_transfer / bandwidth_bytes_per_s later
// (instantly between two stages of the same rank: the engine hands those over by a local copy). A RECV
// blocks until its message has arrived. Links are not modelled as shared, so no transfer delays another.
//
// A compute-only schedule (no SEND/RECV at all) is simulated as if lower_communication() had been applied.

#include <vector>

#include "smp/scheduler/schedule.h"

namespace smp::sched {

struct StageCosts {  // seconds per microbatch
  double forward = 1.0;
  double backward = 2.0;         // B
  double backward_input = 1.0;   // I
  double backward_weight = 1.0;  // W
};

struct P2PCosts {
  double latency_s = 0.0;
  double bytes_per_transfer = 0.0;
  double bandwidth_bytes_per_s = 0.0;  // must be positive when bytes_per_transfer is
};

struct SimulationCosts {
  std::vector<StageCosts> stages;  // one entry per stage
  P2PCosts p2p;
  // Processors the ranks share; 0: each rank has its own. More ranks than cores on one host (or several ranks on
  // one GPU) each compute at min(1, processors / ranks computing at that moment) of their own speed, as a fair
  // scheduler divides them: a pipeline's fill and drain, with few ranks busy, run faster than its steady state.
  double processors = 0.0;
  // Per stage (empty: 1 each): the share of a microbatch's activations that it still holds from its I until its W
  // (the zero-bubble input pass frees what the weight pass does not read). Only SimulationResult::peak_activations
  // reads it.
  std::vector<double> weight_pass_share;
  // Per stage (both empty: not counted): the bytes a microbatch's activations hold on it from its F until its B (or
  // W, less what I frees), and the bytes of its gradients, which appear when its first B (or W) ends and stay.
  // SimulationResult::peak_step_bytes sums them per rank.
  std::vector<double> activation_bytes;
  std::vector<double> gradient_bytes;

  // Every stage costs the same.
  static SimulationCosts uniform(int num_stages, const StageCosts& stage = {}, const P2PCosts& p2p = {});
};

struct ActionTiming {
  double start = 0.0;  // a RECV starts when the rank reaches it and ends when its message is there
  double end = 0.0;
};

struct SimulationResult {
  double makespan = 0.0;          // when the last rank finishes its last action
  std::vector<double> busy_time;  // per rank: time spent in compute actions
  double bubble_fraction = 0.0;   // 1 - sum(busy_time) / (num_ranks * makespan); 0 when makespan is 0
  // Per rank: the most (stage, microbatch) pairs whose activations it held at once, i.e. whose F had run and
  // whose B (or W) had not. Two stages of one rank holding the same microbatch count twice.
  std::vector<int> peak_in_flight;
  // Per rank: the most microbatches' activations it held at once, a microbatch between its I and its W counting
  // as its stage's weight_pass_share of one (peak_in_flight counts it whole).
  std::vector<double> peak_activations;
  // Per rank, where SimulationCosts gives activation and gradient bytes: the most of both it held at once, stage by
  // stage. A step starts without gradients (freed between steps, as zero_grad does by default), and each stage's
  // appear when its first B (or W) ends, so a rank that runs no forward after its first backward (every rank under
  // GPipe) never holds its peak of activations and its gradients at once. Taken between actions: a backward's own
  // mix of new gradients and activations not yet freed is not seen. Empty otherwise.
  std::vector<double> peak_step_bytes;
  std::vector<std::vector<ActionTiming>> timings;  // [rank][action index], the shape of Schedule::ranks
};

// Throws ScheduleError for a schedule validate() would reject (a deadlock names, for each stuck rank, the action
// it waits on and the transfer it waits for) and for costs that do not fit the schedule.
// O(number of actions): a step of p=128 ranks and m=1024 microbatches takes milliseconds.
SimulationResult simulate(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs);

}  // namespace smp::sched
