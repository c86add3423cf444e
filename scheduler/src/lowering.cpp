#include <string>

#include "detail.h"

namespace smp::sched {

Schedule lower_communication(const Schedule& compute_only, const StageGraph& graph) {
  detail::check_graph(graph);
  if (graph.num_stages() != compute_only.num_stages)
    throw ScheduleError("lower_communication: stage graph has " + std::to_string(graph.num_stages()) +
                        " stages, schedule '" + compute_only.name + "' has " + std::to_string(compute_only.num_stages));
  if (compute_only.num_microbatches < 1)
    throw ScheduleError("lower_communication: schedule '" + compute_only.name + "' has no microbatches");

  const detail::TransferMap transfers(graph, compute_only.num_microbatches);
  Schedule lowered = compute_only;
  for (std::size_t rank = 0; rank < compute_only.ranks.size(); ++rank) {
    std::vector<Action>& out = lowered.ranks[rank];
    out.clear();
    const std::vector<Action>& actions = compute_only.ranks[rank];
    for (std::size_t index = 0; index < actions.size(); ++index) {
      const Action& action = actions[index];
      const auto reject = [&](const char* problem) {
        throw ScheduleError("lower_communication: rank " + std::to_string(rank) + ", action #" + std::to_string(index) +
                            " " + describe(action) + ": " + problem);
      };
      if (!is_compute(action.kind)) reject("the schedule already has transfers");
      if (action.stage < 0 || action.stage >= compute_only.num_stages) reject("unknown stage");
      if (action.microbatch < 0 || action.microbatch >= compute_only.num_microbatches)
        reject("microbatch out of range");

      const auto append = [&out](const Action& transfer, int /*message*/) { out.push_back(transfer); };
      transfers.for_each_receive(action, append);
      out.push_back(action);
      transfers.for_each_send(action, append);
    }
  }
  return lowered;
}

}  // namespace smp::sched
