#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "smp/scheduler/schedule.h"

namespace smp::sched {

namespace {

// Stage s lives on rank s % num_ranks, so chunk c of rank r is stage c * num_ranks + r and a chain of stages visits
// every rank once per chunk. With one virtual stage per rank this is the layout of every non-interleaved schedule.
Schedule looped_layout(const char* name, int num_ranks, int num_microbatches, int virtual_stages = 1) {
  if (num_ranks < 1)
    throw ScheduleError(std::string(name) + ": need at least 1 rank, got " + std::to_string(num_ranks));
  if (num_microbatches < 1)
    throw ScheduleError(std::string(name) + ": need at least 1 microbatch, got " + std::to_string(num_microbatches));
  if (virtual_stages < 1)
    throw ScheduleError(std::string(name) + ": need at least 1 virtual stage per rank, got " +
                        std::to_string(virtual_stages));
  Schedule schedule;
  schedule.name = name;
  schedule.num_ranks = num_ranks;
  schedule.num_stages = num_ranks * virtual_stages;
  schedule.num_microbatches = num_microbatches;
  schedule.stage_to_rank.resize(static_cast<std::size_t>(schedule.num_stages));
  for (int stage = 0; stage < schedule.num_stages; ++stage) schedule.stage_to_rank[stage] = stage % num_ranks;
  schedule.ranks.resize(static_cast<std::size_t>(num_ranks));
  return schedule;
}

void check_max_active(const char* name, int max_active) {
  if (max_active < 0)
    throw ScheduleError(std::string(name) + ": max_active must be 0 (no cap) or positive, got " +
                        std::to_string(max_active));
}

// The forwards a rank runs ahead of its first backward: the one forward of each steady-state step comes on top,
// so a cap of max_active in flight leaves max_active - 1 (0 means no cap).
int warmup_within(int natural_warmup, int max_active) {
  return max_active > 0 ? std::min(natural_warmup, max_active - 1) : natural_warmup;
}

std::vector<Action> each_microbatch(ActionKind kind, int stage, int num_microbatches) {
  std::vector<Action> actions;
  actions.reserve(static_cast<std::size_t>(num_microbatches));
  for (int mb = 0; mb < num_microbatches; ++mb) actions.push_back({kind, stage, mb});
  return actions;
}

// The 1F1B order of one rank, given the order in which its forwards and its backwards must run: `warmup` forwards,
// then one forward and one backward at a time, then the backwards left.
std::vector<Action> one_forward_one_backward(const std::vector<Action>& forwards, const std::vector<Action>& backwards,
                                             int warmup) {
  const std::size_t ahead = std::min(static_cast<std::size_t>(warmup), forwards.size());
  std::vector<Action> order(forwards.begin(), forwards.begin() + static_cast<std::ptrdiff_t>(ahead));
  order.reserve(forwards.size() + backwards.size());
  auto backward = backwards.begin();
  for (auto forward = forwards.begin() + static_cast<std::ptrdiff_t>(ahead); forward != forwards.end(); ++forward) {
    order.push_back(*forward);
    order.push_back(*backward++);
  }
  order.insert(order.end(), backward, backwards.end());
  return order;
}

// How far a split-backward rank runs ahead: `warmup` forwards as in 1F1B, and the W of microbatch i right after the
// I of microbatch i + weight_lag.
struct SplitBackwardDepths {
  int warmup;
  int weight_lag;
};

// 1F1B over F and I, with each W deferred by its rank's weight lag. An I is all that the previous rank waits for, so
// running it as soon as its gradient is in lets gradients travel back at T_I per rank instead of T_B; the deferred
// Ws then fill the cooldown, in which 1F1B idles. Activations are held from F to W, so a lag adds to the warmup's
// activations, and a max_active cap trims the warmup first, then the lag.
template <typename DepthsOfRank>
Schedule split_backward_1f1b(const char* name, int num_ranks, int num_microbatches, int max_active,
                             DepthsOfRank depths_of_rank) {
  check_max_active(name, max_active);
  Schedule schedule = looped_layout(name, num_ranks, num_microbatches);
  schedule.split_backward = true;
  for (int rank = 0; rank < num_ranks; ++rank) {
    const SplitBackwardDepths natural = depths_of_rank(rank);
    const int warmup = warmup_within(natural.warmup, max_active);
    const int weight_lag = max_active > 0 ? std::min(natural.weight_lag, max_active - 1 - warmup) : natural.weight_lag;

    const std::vector<Action> forwards_and_inputs =
        one_forward_one_backward(each_microbatch(ActionKind::Forward, rank, num_microbatches),
                                 each_microbatch(ActionKind::BackwardInput, rank, num_microbatches), warmup);
    std::vector<Action>& actions = schedule.ranks[rank];
    actions.reserve(3 * static_cast<std::size_t>(num_microbatches));
    int inputs_done = 0;
    int weights_done = 0;
    for (const Action& action : forwards_and_inputs) {
      actions.push_back(action);
      if (action.kind != ActionKind::BackwardInput) continue;
      ++inputs_done;
      const int weights_due = inputs_done == num_microbatches ? num_microbatches : inputs_done - weight_lag;
      for (; weights_done < weights_due; ++weights_done)
        actions.push_back({ActionKind::BackwardWeight, rank, weights_done});
    }
  }
  return schedule;
}

// Stage s of 2 * num_ranks: rank s going down the V, rank 2 * num_ranks - 1 - s coming back up.
Schedule v_layout(const char* name, int num_ranks, int num_microbatches) {
  Schedule schedule = looped_layout(name, num_ranks, num_microbatches, 2);
  for (int stage = num_ranks; stage < 2 * num_ranks; ++stage) schedule.stage_to_rank[stage] = 2 * num_ranks - 1 - stage;
  schedule.split_backward = true;
  return schedule;
}

// Emits a rank's compute actions, numbering each stage's microbatches in order per kind, and leaves out those of
// microbatches the job does not have (a V is built for at least as many microbatches as it needs to fill; dropping
// every action of some microbatches removes nodes from an acyclic graph of waits, so it cannot deadlock).
class RankOrder {
 public:
  RankOrder(std::vector<Action>& actions, int num_microbatches) : actions_(actions), limit_(num_microbatches) {}
  int forwards(int stage) { return next_[{ActionKind::Forward, stage}]; }
  void forward(int stage) { emit(ActionKind::Forward, stage, next_[{ActionKind::Forward, stage}]++); }
  // I now, its W when weights() comes to it.
  void input(int stage) {
    const int mb = next_[{ActionKind::BackwardInput, stage}]++;
    emit(ActionKind::BackwardInput, stage, mb);
    pending_weights_.emplace_back(stage, mb);
  }
  // The W of the oldest I whose W is pending, if any.
  void oldest_weight() {
    if (pending_weights_.empty()) return;
    const auto [stage, mb] = pending_weights_.front();
    pending_weights_.erase(pending_weights_.begin());
    emit(ActionKind::BackwardWeight, stage, mb);
  }
  // The W of the oldest pending I of `stage`, and then all of that stage's left.
  void oldest_weight_of(int stage) {
    const auto found = std::find_if(pending_weights_.begin(), pending_weights_.end(),
                                    [&](const auto& pending) { return pending.first == stage; });
    if (found == pending_weights_.end()) return;
    const int mb = found->second;
    pending_weights_.erase(found);
    emit(ActionKind::BackwardWeight, stage, mb);
  }
  void remaining_weights_of(int stage) {
    while (std::any_of(pending_weights_.begin(), pending_weights_.end(),
                       [&](const auto& pending) { return pending.first == stage; })) {
      oldest_weight_of(stage);
    }
  }
  // A full backward: I and W back to back.
  void full_backward(int stage) {
    const int mb = next_[{ActionKind::BackwardInput, stage}]++;
    emit(ActionKind::BackwardInput, stage, mb);
    emit(ActionKind::BackwardWeight, stage, mb);
  }

 private:
  void emit(ActionKind kind, int stage, int mb) {
    if (mb < limit_) actions_.push_back({kind, stage, mb});
  }
  std::vector<Action>& actions_;
  int limit_;
  std::map<std::pair<ActionKind, int>, int> next_;
  std::vector<std::pair<int, int>> pending_weights_;  // (stage, microbatch) of Is, oldest first
};

const std::vector<ScheduleKind> kKinds = {
    {"gpipe", "simple", 1, false, false, true,
     [](int num_ranks, int num_microbatches, int, int) { return make_gpipe(num_ranks, num_microbatches); }},
    {"1f1b", "interleaved", 1, false, true, true,
     [](int num_ranks, int num_microbatches, int, int max_active) {
       return make_1f1b(num_ranks, num_microbatches, max_active);
     }},
    {"interleaved_1f1b", "interleaved", 0, false, true, true, make_interleaved_1f1b},
    // Interleaved 1F1B's bubble with GPipe's memory: the planner, which weighs both, would never choose it.
    {"looped_bfs", "", 0, false, false, false,
     [](int num_ranks, int num_microbatches, int virtual_stages, int) {
       return make_looped_bfs(num_ranks, num_microbatches, virtual_stages);
     }},
    {"zb_h1", "zero_bubble", 1, true, true, true,
     [](int num_ranks, int num_microbatches, int, int max_active) {
       return make_zero_bubble_h1(num_ranks, num_microbatches, max_active);
     }},
    // More forwards ahead than ZB-H1 for a bubble the planner's V schedules already close.
    {"zb_h2", "zero_bubble_h2", 1, true, true, false,
     [](int num_ranks, int num_microbatches, int, int max_active) {
       return make_zero_bubble_h2(num_ranks, num_microbatches, max_active);
     }},
    {"zb_v", "", 2, true, false, true,
     [](int num_ranks, int num_microbatches, int, int) { return make_zero_bubble_v(num_ranks, num_microbatches); }},
    {"dualpipe_v", "", 2, true, false, true,
     [](int num_ranks, int num_microbatches, int, int) { return make_dualpipe_v(num_ranks, num_microbatches); }},
};

template <typename Keep>
std::string names_where(Keep keep) {
  std::string names;
  for (const ScheduleKind& kind : kKinds) {
    if (keep(kind)) names += (names.empty() ? "" : ", ") + std::string(kind.name);
  }
  return names;
}

std::string known_names() {
  return names_where([](const ScheduleKind&) { return true; });
}

}  // namespace

Schedule make_gpipe(int num_ranks, int num_microbatches) {
  Schedule schedule = looped_layout("gpipe", num_ranks, num_microbatches);
  for (int rank = 0; rank < num_ranks; ++rank) {
    std::vector<Action>& actions = schedule.ranks[rank];
    actions = each_microbatch(ActionKind::Forward, rank, num_microbatches);
    // Reverse order on every rank: the last stage starts with the microbatch whose activations are freshest,
    // and each earlier stage receives gradients in exactly the order it then consumes them.
    std::vector<Action> backwards = each_microbatch(ActionKind::Backward, rank, num_microbatches);
    actions.insert(actions.end(), backwards.rbegin(), backwards.rend());
  }
  return schedule;
}

Schedule make_1f1b(int num_ranks, int num_microbatches, int max_active) {
  check_max_active("1f1b", max_active);
  Schedule schedule = looped_layout("1f1b", num_ranks, num_microbatches);
  for (int rank = 0; rank < num_ranks; ++rank) {
    // Rank r must have num_ranks - r microbatches in flight before the first gradient can come back; fewer
    // warmup forwards (a cap) only trade bubble for memory. The steady state adds one more in flight.
    const int warmup = warmup_within(num_ranks - rank - 1, max_active);
    schedule.ranks[rank] = one_forward_one_backward(each_microbatch(ActionKind::Forward, rank, num_microbatches),
                                                    each_microbatch(ActionKind::Backward, rank, num_microbatches),
                                                    warmup);
  }
  return schedule;
}

Schedule make_interleaved_1f1b(int num_ranks, int num_microbatches, int virtual_stages, int max_active) {
  constexpr const char* name = "interleaved_1f1b";
  check_max_active(name, max_active);
  Schedule schedule = looped_layout(name, num_ranks, num_microbatches, virtual_stages);
  if (max_active > 0 && max_active < virtual_stages)
    throw ScheduleError(std::string(name) + ": max_active=" + std::to_string(max_active) + " is below virtual_stages=" +
                        std::to_string(virtual_stages) + ": every rank runs microbatch 0 forward through all its " +
                        std::to_string(virtual_stages) + " stages before its first backward");

  // Microbatches go through the chunks in groups: a group runs chunk 0, then chunk 1, and so on. A group of
  // num_ranks microbatches keeps rank 0 busy until the first of them comes back round from the last rank for the
  // next chunk. A rank holds all of a group on chunks 0..v-2 before its first backward, so a cap shrinks the groups.
  int group = num_ranks;
  if (max_active > 0 && virtual_stages > 1) group = std::min(group, (max_active - 1) / (virtual_stages - 1));
  // Megatron-LM's order needs whole groups: a short last group makes rank 0 wait for its wrap-around in the middle
  // of the steady state, where the order can deadlock. So the order is built for whole groups and the microbatches
  // beyond num_microbatches are then left out, which cannot deadlock: dropping every action of some microbatches
  // removes nodes from an acyclic graph of waits.
  const int padded_microbatches = (num_microbatches + group - 1) / group * group;
  const auto chunk_major = [&](bool reverse_chunks) {
    std::vector<std::pair<int, int>> order;  // (chunk, microbatch)
    order.reserve(static_cast<std::size_t>(padded_microbatches) * virtual_stages);
    for (int first = 0; first < padded_microbatches; first += group)
      for (int step = 0; step < virtual_stages; ++step)
        for (int mb = first; mb < first + group; ++mb)
          order.emplace_back(reverse_chunks ? virtual_stages - 1 - step : step, mb);
    return order;
  };
  // Megatron-LM's warmup: the first backward on rank r is for its last chunk, which needs v - 1 groups of forwards
  // first, plus p - r - 1 for each trip between rank r and the last rank that the first gradient waits on. Covering
  // the gradient's trip back as well costs memory, but keeps the steady state from stalling where microbatches were
  // left out or transfers take time. With one chunk Megatron-LM runs plain 1F1B, which covers only the forward trip,
  // and so does this: virtual_stages = 1 gives make_1f1b's order.
  const int trips_to_last_rank = virtual_stages > 1 ? 2 : 1;
  const std::vector<std::pair<int, int>> forward_order = chunk_major(false);
  const std::vector<std::pair<int, int>> backward_order = chunk_major(true);

  for (int rank = 0; rank < num_ranks; ++rank) {
    std::vector<Action> forwards, backwards;
    for (const auto& [chunk, mb] : forward_order)
      forwards.push_back({ActionKind::Forward, chunk * num_ranks + rank, mb});
    for (const auto& [chunk, mb] : backward_order)
      backwards.push_back({ActionKind::Backward, chunk * num_ranks + rank, mb});
    const int warmup = warmup_within(trips_to_last_rank * (num_ranks - rank - 1) + (virtual_stages - 1) * group,
                                     max_active);
    std::vector<Action>& actions = schedule.ranks[rank];
    actions = one_forward_one_backward(forwards, backwards, warmup);
    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [&](const Action& action) { return action.microbatch >= num_microbatches; }),
                  actions.end());
  }
  return schedule;
}

Schedule make_looped_bfs(int num_ranks, int num_microbatches, int virtual_stages) {
  Schedule schedule = looped_layout("looped_bfs", num_ranks, num_microbatches, virtual_stages);
  for (int rank = 0; rank < num_ranks; ++rank) {
    std::vector<Action>& actions = schedule.ranks[rank];
    // Every wait is for a (chunk, microbatch, rank) that comes earlier in that order (forwards) or later (backwards)
    // than the waiting action, so no order of ranks can deadlock, whatever num_microbatches is.
    for (int chunk = 0; chunk < virtual_stages; ++chunk) {
      const std::vector<Action> forwards = each_microbatch(ActionKind::Forward, chunk * num_ranks + rank, num_microbatches);
      actions.insert(actions.end(), forwards.begin(), forwards.end());
    }
    for (int chunk = virtual_stages - 1; chunk >= 0; --chunk) {
      const std::vector<Action> backwards =
          each_microbatch(ActionKind::Backward, chunk * num_ranks + rank, num_microbatches);
      actions.insert(actions.end(), backwards.rbegin(), backwards.rend());
    }
  }
  return schedule;
}

Schedule make_zero_bubble_h1(int num_ranks, int num_microbatches, int max_active) {
  return split_backward_1f1b("zb_h1", num_ranks, num_microbatches, max_active, [&](int rank) {
    return SplitBackwardDepths{num_ranks - rank - 1, rank};
  });
}

Schedule make_zero_bubble_h2(int num_ranks, int num_microbatches, int max_active) {
  return split_backward_1f1b("zb_h2", num_ranks, num_microbatches, max_active, [&](int rank) {
    return SplitBackwardDepths{2 * (num_ranks - rank - 1), 2 * rank};
  });
}

Schedule make_zero_bubble_v(int num_ranks, int num_microbatches) {
  Schedule schedule = v_layout("zb_v", num_ranks, num_microbatches);
  const int p = num_ranks;
  const int n = std::max(2 * p - 1, num_microbatches);
  for (int r = 0; r < p; ++r) {
    const int down = r, up = 2 * p - 1 - r;
    RankOrder order(schedule.ranks[r], num_microbatches);
    // Warm-up: enough forwards down the V that the first microbatch reaches the bottom and comes back up to this
    // rank; then each forward up the V is followed at once by its backward, I then W.
    for (int i = 0; i < 2 * (p - r) - 1; ++i) order.forward(down);
    for (int i = 0; i < r; ++i) order.forward(up), order.forward(down);
    for (int i = 0; i < p - r; ++i) order.forward(up), order.input(up), order.oldest_weight();
    // Steady state: a forward down, the backward of the oldest microbatch down, one forward and backward up.
    while (order.forwards(up) < order.forwards(down) || order.forwards(down) < n) {
      if (order.forwards(down) < n) order.forward(down);
      order.input(down), order.oldest_weight();
      order.forward(up), order.input(up), order.oldest_weight();
    }
    // Cool-down: the input gradients go first, to the ranks waiting for them; the Ws fill the tail, the last
    // ranks' first (nearer the V's tip, the gradients reach them later).
    for (int i = 0; i < r; ++i) order.input(down), order.input(up);
    for (int i = 0; i < p - r; ++i) order.input(down), order.oldest_weight_of(down);
    order.remaining_weights_of(up);
    order.remaining_weights_of(down);
  }
  return schedule;
}

Schedule make_dualpipe_v(int num_ranks, int num_microbatches) {
  Schedule schedule = v_layout("dualpipe_v", num_ranks, num_microbatches);
  const int p = num_ranks;
  const int m = std::max(2 * p, num_microbatches);
  for (int r = 0; r < p; ++r) {
    const int down = r, up = 2 * p - 1 - r;
    RankOrder order(schedule.ranks[r], num_microbatches);
    for (int i = 0; i < 2 * (p - r - 1); ++i) order.forward(down);
    for (int i = 0; i < r + 1; ++i) order.forward(down), order.forward(up);
    for (int i = 0; i < p - r - 1; ++i) order.input(up), order.oldest_weight(), order.forward(up);
    // The pairs DualPipe overlaps: a forward of one stage and a full backward of the other.
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      order.forward(down), order.full_backward(up);
      order.forward(up), order.full_backward(down);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      order.full_backward(up);
      order.forward(up), order.full_backward(down);
    }
    // Cool-down: full backwards until half-way, then input gradients alone, their Ws filling the tail.
    bool inputs_only = false;
    const auto backward = [&](int stage) { inputs_only ? order.input(stage) : order.full_backward(stage); };
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) inputs_only = true;
      backward(up);
      if (i == (r + 1) / 2 && r % 2 == 0) inputs_only = true;
      backward(down);
    }
    for (int i = 0; i < p - r - 1; ++i) order.oldest_weight(), backward(down);
    for (int i = 0; i < r + 1; ++i) order.oldest_weight();
    order.remaining_weights_of(up);
    order.remaining_weights_of(down);
  }
  return schedule;
}

const std::vector<ScheduleKind>& schedule_kinds() { return kKinds; }

const ScheduleKind& find_schedule_kind(const std::string& name, int virtual_stages) {
  for (const ScheduleKind& kind : kKinds) {
    if (name == kind.name) return kind;
  }
  // A config alias: the kind whose layout fits virtual_stages exactly, else one that takes any number, else the
  // first (whose caller then says virtual_stages does not fit it).
  const ScheduleKind* found = nullptr;
  const auto rank = [&](const ScheduleKind& kind) {
    return kind.stages_per_rank == virtual_stages ? 2 : kind.stages_per_rank == 0 ? 1 : 0;
  };
  for (const ScheduleKind& kind : kKinds) {
    if (name == kind.config_alias && (!found || rank(kind) > rank(*found))) found = &kind;
  }
  if (found) return *found;
  throw ScheduleError("unknown schedule '" + name + "' (expected one of " + known_names() + ")");
}

Schedule make_schedule(const std::string& name, int num_ranks, int num_microbatches, int virtual_stages,
                       int max_active) {
  const ScheduleKind* kind = nullptr;
  for (const ScheduleKind& candidate : kKinds) {
    if (name == candidate.name) kind = &candidate;
  }
  if (!kind) throw ScheduleError("unknown schedule '" + name + "' (expected one of " + known_names() + ")");
  if (kind->stages_per_rank == 1 && virtual_stages != 1)
    throw ScheduleError(name + " runs one stage per rank, so virtual_stages must be 1, got " +
                        std::to_string(virtual_stages) + "; " + names_where([](const ScheduleKind& other) {
                          return other.stages_per_rank == 0;
                        }) + " run several");
  if (!kind->takes_cap && max_active != 0)
    throw ScheduleError(name + " takes no cap on what a rank holds (its own order decides it), so max_active=" +
                        std::to_string(max_active) + " cannot apply; use 0, or one of " +
                        names_where([](const ScheduleKind& other) { return other.takes_cap; }) +
                        " to cap activations");
  if (kind->stages_per_rank == 2 && virtual_stages != 2)
    throw ScheduleError(name + " runs two stages per rank (a V), so virtual_stages must be 2, got " +
                        std::to_string(virtual_stages));
  return kind->make(num_ranks, num_microbatches, virtual_stages, max_active);
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const ScheduleKind& kind : kKinds) names.emplace_back(kind.name);
  return names;
}

}  // namespace smp::sched
