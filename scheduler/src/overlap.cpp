// Which forwards run at once with the backward after them (config "overlap_forward_backward"): DualPipe's pairs.
#include <utility>

#include "smp/scheduler/schedule.h"

namespace smp::sched {

std::map<std::size_t, OverlapWindow> overlapped_pairs(const Schedule& schedule, int rank) {
  const std::vector<Action>& actions = schedule.ranks.at(static_cast<std::size_t>(rank));
  std::map<std::size_t, OverlapWindow> pairs;
  if (schedule.forward_only) return pairs;
  const auto key = [](const Action& action) { return std::make_pair(action.stage, action.microbatch); };
  for (std::size_t first = 0; first < actions.size(); ++first) {
    if (actions[first].kind != ActionKind::Forward) continue;
    const auto forward = key(actions[first]);
    OverlapWindow window;
    bool held_for_others = false;  // a held send to another rank
    bool backward_seen = false;
    std::pair<int, int> backward{-1, -1};
    for (std::size_t next = first + 1; next < actions.size(); ++next) {
      const Action& action = actions[next];
      if (is_compute(action.kind)) {
        // Only the backward of one other (stage, microbatch): nothing it needs can be the forward in flight (its
        // own forward ran already, and that needed this one's, were they the same microbatch's neighbours).
        if (action.kind == ActionKind::Forward || key(action) == forward) break;
        if (backward_seen && key(action) != backward) break;
        backward_seen = true;
        backward = key(action);
        window.last = next;
        continue;
      }
      const bool send = is_send(action.kind);
      if (key(action) == forward && !send) break;  // a receive for the forward: it ran without it
      const bool local = schedule.stage_to_rank.at(static_cast<std::size_t>(action.peer_stage)) == rank;
      if (send && (key(action) == forward || !window.held.empty())) {
        // The forward's outputs exist once it is done, and sends keep their order (in-order transports).
        window.held.push_back(next);
        held_for_others = held_for_others || !local;
      } else if (!send && (held_for_others || (local && !window.held.empty()))) {
        // A receive may not wait while a send to another rank is held: its sender may be waiting for that send
        // first. A send to this rank's other stage only delays this rank, unless the receive is its message.
        break;
      }
    }
    if (!backward_seen) continue;
    // Held sends after the backward's last action are not the window's: they run in their place after it.
    while (!window.held.empty() && window.held.back() > window.last) window.held.pop_back();
    pairs.emplace(first, std::move(window));
  }
  return pairs;
}

}  // namespace smp::sched
