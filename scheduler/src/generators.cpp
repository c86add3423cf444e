#include <algorithm>
#include <string>

#include "smp/scheduler/schedule.h"

namespace smp::sched {

namespace {

// One stage per rank, stage s on rank s: the layout of every non-interleaved schedule.
Schedule one_stage_per_rank(const char* name, int num_ranks, int num_microbatches) {
  if (num_ranks < 1)
    throw ScheduleError(std::string(name) + ": need at least 1 rank, got " + std::to_string(num_ranks));
  if (num_microbatches < 1)
    throw ScheduleError(std::string(name) + ": need at least 1 microbatch, got " + std::to_string(num_microbatches));
  Schedule schedule;
  schedule.name = name;
  schedule.num_ranks = num_ranks;
  schedule.num_stages = num_ranks;
  schedule.num_microbatches = num_microbatches;
  schedule.stage_to_rank.resize(static_cast<std::size_t>(num_ranks));
  for (int stage = 0; stage < num_ranks; ++stage) schedule.stage_to_rank[stage] = stage;
  schedule.ranks.resize(static_cast<std::size_t>(num_ranks));
  return schedule;
}

Action forward(int stage, int microbatch) { return {ActionKind::Forward, stage, microbatch}; }
Action backward(int stage, int microbatch) { return {ActionKind::Backward, stage, microbatch}; }

}  // namespace

Schedule make_gpipe(int num_ranks, int num_microbatches) {
  Schedule schedule = one_stage_per_rank("gpipe", num_ranks, num_microbatches);
  for (int rank = 0; rank < num_ranks; ++rank) {
    std::vector<Action>& actions = schedule.ranks[rank];
    actions.reserve(2 * static_cast<std::size_t>(num_microbatches));
    for (int mb = 0; mb < num_microbatches; ++mb) actions.push_back(forward(rank, mb));
    // Reverse order on every rank: the last stage starts with the microbatch whose activations are freshest,
    // and each earlier stage receives gradients in exactly the order it then consumes them.
    for (int mb = num_microbatches - 1; mb >= 0; --mb) actions.push_back(backward(rank, mb));
  }
  return schedule;
}

Schedule make_1f1b(int num_ranks, int num_microbatches, int max_active) {
  if (max_active < 0)
    throw ScheduleError("1f1b: max_active must be 0 (no cap) or positive, got " + std::to_string(max_active));
  Schedule schedule = one_stage_per_rank("1f1b", num_ranks, num_microbatches);
  for (int rank = 0; rank < num_ranks; ++rank) {
    // Rank r must have num_ranks - r microbatches in flight before the first gradient can come back; fewer
    // warmup forwards (a cap) only trade bubble for memory. The steady state adds one more in flight.
    int warmup = std::min(num_ranks - rank - 1, num_microbatches);
    if (max_active > 0) warmup = std::min(warmup, max_active - 1);

    std::vector<Action>& actions = schedule.ranks[rank];
    actions.reserve(2 * static_cast<std::size_t>(num_microbatches));
    for (int mb = 0; mb < warmup; ++mb) actions.push_back(forward(rank, mb));
    for (int mb = 0; mb + warmup < num_microbatches; ++mb) {
      actions.push_back(forward(rank, mb + warmup));
      actions.push_back(backward(rank, mb));
    }
    for (int mb = num_microbatches - warmup; mb < num_microbatches; ++mb) actions.push_back(backward(rank, mb));
  }
  return schedule;
}

}  // namespace smp::sched
