#include "smp/scheduler/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "detail.h"

namespace smp::sched {

SimulationCosts SimulationCosts::uniform(int num_stages, const StageCosts& stage, const P2PCosts& p2p) {
  if (num_stages < 1) throw ScheduleError("simulation costs need at least 1 stage, got " + std::to_string(num_stages));
  return SimulationCosts{std::vector<StageCosts>(static_cast<std::size_t>(num_stages), stage), p2p};
}

namespace {

void check_costs(const SimulationCosts& costs, int num_stages) {
  const auto check = [](double value, const std::string& what) {
    if (!std::isfinite(value) || value < 0)
      throw ScheduleError("simulation costs: " + what + " must be finite and non-negative, got " +
                          std::to_string(value));
  };
  if (static_cast<int>(costs.stages.size()) != num_stages)
    throw ScheduleError("simulation costs: " + std::to_string(costs.stages.size()) + " stage entries for " +
                        std::to_string(num_stages) + " stages");
  for (std::size_t stage = 0; stage < costs.stages.size(); ++stage) {
    const StageCosts& cost = costs.stages[stage];
    const std::string which = "stage " + std::to_string(stage) + " ";
    check(cost.forward, which + "forward");
    check(cost.backward, which + "backward");
    check(cost.backward_input, which + "backward_input");
    check(cost.backward_weight, which + "backward_weight");
  }
  if (!costs.weight_pass_share.empty() && static_cast<int>(costs.weight_pass_share.size()) != num_stages)
    throw ScheduleError("simulation costs: " + std::to_string(costs.weight_pass_share.size()) +
                        " weight_pass_share entries for " + std::to_string(num_stages) + " stages");
  for (double share : costs.weight_pass_share) {
    if (!(share >= 0 && share <= 1))
      throw ScheduleError("simulation costs: weight_pass_share must be within [0, 1], got " + std::to_string(share));
  }
  if (!costs.activation_bytes.empty() || !costs.gradient_bytes.empty()) {
    if (static_cast<int>(costs.activation_bytes.size()) != num_stages ||
        static_cast<int>(costs.gradient_bytes.size()) != num_stages)
      throw ScheduleError("simulation costs: activation_bytes and gradient_bytes need one entry per stage (" +
                          std::to_string(num_stages) + "), got " + std::to_string(costs.activation_bytes.size()) +
                          " and " + std::to_string(costs.gradient_bytes.size()));
    for (std::size_t stage = 0; stage < costs.activation_bytes.size(); ++stage) {
      check(costs.activation_bytes[stage], "stage " + std::to_string(stage) + " activation_bytes");
      check(costs.gradient_bytes[stage], "stage " + std::to_string(stage) + " gradient_bytes");
    }
  }
  check(costs.processors, "processors");
  check(costs.p2p.latency_s, "latency_s");
  check(costs.p2p.bytes_per_transfer, "bytes_per_transfer");
  if (costs.p2p.bytes_per_transfer > 0 && !(costs.p2p.bandwidth_bytes_per_s > 0))
    throw ScheduleError("simulation costs: bandwidth_bytes_per_s must be positive when bytes_per_transfer is");
}

double compute_cost(const StageCosts& cost, ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward:
      return cost.forward;
    case ActionKind::Backward:
      return cost.backward;
    case ActionKind::BackwardInput:
      return cost.backward_input;
    case ActionKind::BackwardWeight:
      return cost.backward_weight;
    default:
      return 0.0;
  }
}

// What both simulations keep: messages' arrival times, each rank's place in its actions, and the result.
class SimulationState {
 protected:
  SimulationState(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs)
      : schedule_(schedule),
        costs_(costs),
        transfers_(graph, schedule.num_microbatches),
        implicit_transfers_(!detail::has_transfers(schedule)),
        arrival_(static_cast<std::size_t>(transfers_.num_messages()), kNotSent),
        next_action_(static_cast<std::size_t>(schedule.num_ranks), 0),
        clock_(static_cast<std::size_t>(schedule.num_ranks), 0.0),
        awaited_(static_cast<std::size_t>(schedule.num_ranks)),
        in_flight_(static_cast<std::size_t>(schedule.num_ranks), 0),
        activations_(static_cast<std::size_t>(schedule.num_ranks), 0.0),
        bytes_(static_cast<std::size_t>(schedule.num_ranks), 0.0),
        stage_gradients_(static_cast<std::size_t>(schedule.num_stages), false) {
    result_.busy_time.assign(static_cast<std::size_t>(schedule.num_ranks), 0.0);
    result_.peak_in_flight.assign(static_cast<std::size_t>(schedule.num_ranks), 0);
    result_.peak_activations.assign(static_cast<std::size_t>(schedule.num_ranks), 0.0);
    if (!costs.activation_bytes.empty()) result_.peak_step_bytes.assign(static_cast<std::size_t>(schedule.num_ranks), 0.0);
    result_.timings.resize(static_cast<std::size_t>(schedule.num_ranks));
    for (int rank = 0; rank < schedule.num_ranks; ++rank) result_.timings[rank].resize(schedule.ranks[rank].size());
  }

  static constexpr double kNotSent = -1.0;

  double transfer_time(const Action& transfer) const {
    if (schedule_.stage_to_rank[transfer.stage] == schedule_.stage_to_rank[transfer.peer_stage]) return 0.0;
    const P2PCosts& p2p = costs_.p2p;
    return p2p.latency_s + (p2p.bytes_per_transfer > 0 ? p2p.bytes_per_transfer / p2p.bandwidth_bytes_per_s : 0.0);
  }

  // The messages `action` waits for, visited as visit(const Action& receive, int message).
  template <typename Visit>
  void for_each_receive(const Action& action, Visit&& visit) const {
    if (action.kind == ActionKind::RecvForward || action.kind == ActionKind::RecvBackward)
      visit(action, transfers_.message_of(action));
    else if (implicit_transfers_)
      transfers_.for_each_receive(action, visit);
  }

  // `rank`'s action `index` ran from `start` to `end`: its messages leave, and a compute action counts.
  template <typename OnSent>
  void finish(int rank, std::size_t index, double start, double end, OnSent&& on_sent) {
    const Action& action = schedule_.ranks[rank][index];
    result_.timings[rank][index] = {start, end};
    clock_[rank] = end;
    const auto send = [&](const Action& transfer, int message) {
      arrival_[message] = end + transfer_time(transfer);
      on_sent(message);
    };
    if (is_send(action.kind))
      send(action, transfers_.message_of(action));
    else if (implicit_transfers_)
      transfers_.for_each_send(action, send);
    if (is_compute(action.kind)) {
      result_.busy_time[rank] += end - start;
      track_activations(rank, action);
    }
  }

  SimulationResult result() {
    throw_if_stuck();
    result_.makespan = *std::max_element(clock_.begin(), clock_.end());
    const double busy = std::accumulate(result_.busy_time.begin(), result_.busy_time.end(), 0.0);
    if (result_.makespan > 0) result_.bubble_fraction = 1.0 - busy / (schedule_.num_ranks * result_.makespan);
    return std::move(result_);
  }

  const Schedule& schedule_;
  const SimulationCosts& costs_;
  const detail::TransferMap transfers_;
  const bool implicit_transfers_;  // compute-only: each compute action does its own receives and sends
  std::vector<double> arrival_;    // per message
  std::vector<std::size_t> next_action_;
  std::vector<double> clock_;    // per rank: when its last action ended
  std::vector<Action> awaited_;  // per rank: the receive it is parked on

 private:
  void track_activations(int rank, const Action& action) {
    int& held = in_flight_[rank];
    double& activations = activations_[rank];
    if (schedule_.forward_only) return;  // an evaluation step keeps nothing for a backward
    const double share = costs_.weight_pass_share.empty() ? 1.0 : costs_.weight_pass_share.at(action.stage);
    switch (action.kind) {
      case ActionKind::Forward:
        ++held;
        activations += 1.0;
        result_.peak_in_flight[rank] = std::max(result_.peak_in_flight[rank], held);
        result_.peak_activations[rank] = std::max(result_.peak_activations[rank], activations);
        break;
      case ActionKind::Backward:
        --held;
        activations -= 1.0;
        break;
      case ActionKind::BackwardInput:
        activations -= 1.0 - share;
        break;
      case ActionKind::BackwardWeight:
        --held;
        activations -= share;
        break;
      default:
        break;
    }
    if (!result_.peak_step_bytes.empty()) track_bytes(rank, action, share);
  }

  void track_bytes(int rank, const Action& action, double share) {
    const auto stage = static_cast<std::size_t>(action.stage);
    const double activations = costs_.activation_bytes.at(stage);
    double& held = bytes_[rank];
    const auto gradients_arrive = [&] {
      if (stage_gradients_[stage]) return;
      stage_gradients_[stage] = true;
      held += costs_.gradient_bytes.at(stage);
    };
    switch (action.kind) {
      case ActionKind::Forward:
        held += activations;
        break;
      case ActionKind::Backward:
        held -= activations;
        gradients_arrive();
        break;
      case ActionKind::BackwardInput:
        held -= activations * (1.0 - share);
        break;
      case ActionKind::BackwardWeight:
        held -= activations * share;
        gradients_arrive();
        break;
      default:
        break;
    }
    result_.peak_step_bytes[rank] = std::max(result_.peak_step_bytes[rank], held);
  }

  // What produces the message a receive waits for: its SEND, or in a compute-only schedule the compute action
  // that ships it, since that is what the reader of such a schedule can find in it.
  Action awaited_sender(const Action& receive) const {
    const Action send = detail::matching_transfer(receive);
    if (!implicit_transfers_) return send;
    if (send.kind == ActionKind::SendForward) return {ActionKind::Forward, send.stage, send.microbatch};
    return {schedule_.split_backward ? ActionKind::BackwardInput : ActionKind::Backward, send.stage, send.microbatch};
  }

  void throw_if_stuck() const {
    std::string stuck;
    for (int rank = 0; rank < schedule_.num_ranks; ++rank) {
      const std::size_t next = next_action_[rank];
      if (next == schedule_.ranks[rank].size()) continue;
      const Action sender = awaited_sender(awaited_[rank]);
      stuck += (stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(rank) + " waits at action #" +
               std::to_string(next) + " " + describe(schedule_.ranks[rank][next]) + " for " + describe(sender) +
               " from rank " + std::to_string(schedule_.stage_to_rank[sender.stage]);
    }
    if (!stuck.empty()) throw ScheduleError("schedule '" + schedule_.name + "' deadlocks: " + stuck);
  }

  std::vector<int> in_flight_;
  std::vector<double> activations_;
  std::vector<double> bytes_;           // per rank: activation and gradient bytes held (peak_step_bytes)
  std::vector<bool> stage_gradients_;  // per stage: its gradients exist
  SimulationResult result_;
};

// Ranks with devices of their own never contend, and links are not shared, so each rank's timeline depends only on
// its own order and on when its messages arrive. That makes the step a dataflow problem: run each rank as far as it
// can go, park it on the first message that has not been sent yet, and wake it when that message is sent. Every
// action is visited once (plus once per wake-up), and the order in which ranks are advanced does not change any time.
class Simulation : SimulationState {
 public:
  Simulation(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs)
      : SimulationState(schedule, graph, costs),
        waiting_rank_(static_cast<std::size_t>(transfers_.num_messages()), -1) {}

  SimulationResult run() {
    std::vector<int> runnable(static_cast<std::size_t>(schedule_.num_ranks));
    std::iota(runnable.begin(), runnable.end(), 0);
    while (!runnable.empty()) {
      const int rank = runnable.back();
      runnable.pop_back();
      advance(rank, runnable);
    }
    return result();
  }

 private:
  // Runs `rank` until it finishes or reaches a message that has not been sent yet.
  void advance(int rank, std::vector<int>& runnable) {
    const std::vector<Action>& actions = schedule_.ranks[rank];
    std::size_t& next = next_action_[rank];
    for (; next < actions.size(); ++next) {
      const Action& action = actions[next];
      double inputs_ready = clock_[rank];
      bool blocked = false;
      for_each_receive(action, [&](const Action& receive, int message) {
        if (blocked) return;
        if (arrival_[message] == kNotSent) {
          blocked = true;
          waiting_rank_[message] = rank;
          awaited_[rank] = receive;
        } else {
          inputs_ready = std::max(inputs_ready, arrival_[message]);
        }
      });
      if (blocked) return;
      const bool compute = is_compute(action.kind);
      // A RECV spans the wait; a compute action starts once its inputs are there.
      const double start = compute ? inputs_ready : clock_[rank];
      finish(rank, next, start, inputs_ready + compute_cost(costs_.stages[action.stage], action.kind),
             [&](int message) {
               if (waiting_rank_[message] >= 0) {
                 runnable.push_back(waiting_rank_[message]);
                 waiting_rank_[message] = -1;
               }
             });
    }
  }

  std::vector<int> waiting_rank_;  // per message: the rank parked on it, -1 if none
};

// Ranks sharing processors: how fast one computes depends on how many compute beside it, so the step runs in time
// order. Between two events (a compute action ending, a message arriving) the set of computing ranks is fixed and each
// progresses at min(1, processors / that many); O(actions x ranks).
class SharedSimulation : SimulationState {
 public:
  SharedSimulation(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs)
      : SimulationState(schedule, graph, costs),
        remaining_(static_cast<std::size_t>(schedule.num_ranks), kIdle),
        started_(static_cast<std::size_t>(schedule.num_ranks), 0.0) {}

  SimulationResult run() {
    double now = 0.0;
    for (;;) {
      // Until nothing moves: a message sent now may free a rank that was looked at before its sender.
      for (bool moved = true; moved;) {
        moved = false;
        for (int rank = 0; rank < schedule_.num_ranks; ++rank) moved |= start_what_can(rank, now);
      }
      int computing = 0;
      for (double work : remaining_) computing += work != kIdle;
      double next = std::numeric_limits<double>::infinity();
      const double rate = computing > 0 ? std::min(1.0, costs_.processors / computing) : 0.0;
      for (double work : remaining_) {
        if (work != kIdle) next = std::min(next, now + work / rate);
      }
      for (int rank = 0; rank < schedule_.num_ranks; ++rank) {  // a message on its way to a waiting rank
        if (remaining_[rank] != kIdle || next_action_[rank] == schedule_.ranks[rank].size()) continue;
        for_each_receive(schedule_.ranks[rank][next_action_[rank]], [&](const Action&, int message) {
          if (arrival_[message] > now) next = std::min(next, arrival_[message]);
        });
      }
      if (!std::isfinite(next)) break;  // every rank is done, or waits for a message nobody will send
      for (int rank = 0; rank < schedule_.num_ranks; ++rank) {
        if (remaining_[rank] == kIdle) continue;
        remaining_[rank] -= (next - now) * rate;
        // The ranks that end now: those the step was computed for, less what rounding left.
        if (remaining_[rank] <= 1e-12 * std::max(1.0, next)) {
          remaining_[rank] = kIdle;
          finish(rank, next_action_[rank]++, started_[rank], next, [](int) {});
        }
      }
      now = next;
    }
    return result();
  }

 private:
  static constexpr double kIdle = -1.0;  // remaining_: the rank is not computing

  // Runs `rank`'s actions that take no processor time, up to a compute action it starts or a message that is not
  // there; whether it did anything.
  bool start_what_can(int rank, double now) {
    const std::vector<Action>& actions = schedule_.ranks[rank];
    std::size_t& next = next_action_[rank];
    const std::size_t first = next;
    const bool was_computing = remaining_[rank] != kIdle;
    while (remaining_[rank] == kIdle && next < actions.size()) {
      const Action& action = actions[next];
      bool ready = true;
      for_each_receive(action, [&](const Action& receive, int message) {
        if (ready && (arrival_[message] == kNotSent || arrival_[message] > now)) {
          ready = false;
          awaited_[rank] = receive;
        }
      });
      if (!ready) break;
      const double work = compute_cost(costs_.stages[action.stage], action.kind);
      if (is_compute(action.kind) && work > 0) {
        remaining_[rank] = work;
        started_[rank] = now;
        break;
      }
      // A RECV spans the wait since the rank's previous action ended.
      finish(rank, next, is_compute(action.kind) ? now : clock_[rank], now, [](int) {});
      ++next;
    }
    return next != first || was_computing != (remaining_[rank] != kIdle);
  }

  std::vector<double> remaining_;  // per rank: work left in the compute action it runs, kIdle if none
  std::vector<double> started_;    // per rank: when that action started
};

}  // namespace

namespace detail {

SimulationResult simulate_checked(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs) {
  if (costs.processors > 0) return SharedSimulation(schedule, graph, costs).run();
  return Simulation(schedule, graph, costs).run();
}

}  // namespace detail

SimulationResult simulate(const Schedule& schedule, const StageGraph& graph, const SimulationCosts& costs) {
  detail::check_structure(schedule, graph);
  check_costs(costs, schedule.num_stages);
  return detail::simulate_checked(schedule, graph, costs);
}

}  // namespace smp::sched
