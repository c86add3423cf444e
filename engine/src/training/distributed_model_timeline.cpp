// A traced step's record: every rank's timeline gathered on rank 0, beside a simulation of the same schedule with
// the costs this step measured, so that the measured bubble has a yardstick.
#include "smp/distributed_model.h"

#include <cstdio>
#include <filesystem>
#include <map>

#include "smp/log.h"
#include "smp/timeline.h"
#include "smp/scheduler/simulator.h"

namespace smp {

void DistributedModel::write_timeline(const std::vector<TimelineEvent>& events) {
  RankTimeline mine{runtime_->rank(), runtime_->pp_rank(), runtime_->dp_rank(), events, runtime_->tp_rank()};
  const std::string key = exchange_ + "timeline/" + std::to_string(step_) + "/";
  runtime_->publish(key + std::to_string(runtime_->rank()), mine.to_json());
  if (runtime_->rank() != 0) return;
  std::vector<RankTimeline> ranks;
  for (int rank = 0; rank < runtime_->world_size(); ++rank) {
    ranks.push_back(RankTimeline::from_json(runtime_->fetch(key + std::to_string(rank))));
  }

  // Simulate the same schedule with the durations this step measured (replica 0), to compare bubbles.
  const auto& schedule = executor_->schedule();
  std::map<std::string, std::vector<std::pair<double, int>>> totals;  // kind -> per stage (sum, count)
  for (const auto& rank : ranks) {
    if (rank.dp_rank != 0) continue;
    for (const auto& event : rank.events) {
      auto& per_stage = totals[event.kind];
      per_stage.resize(static_cast<std::size_t>(schedule.num_stages));
      per_stage[event.stage].first += (event.end_us - event.start_us) * 1e-6;
      per_stage[event.stage].second += 1;
    }
  }
  auto mean = [&](const char* kind, int stage) {
    const auto found = totals.find(kind);
    if (found == totals.end() || found->second[stage].second == 0) return 0.0;
    return found->second[stage].first / found->second[stage].second;
  };
  // The simulator's sends take no time, but posting one costs the sender (the header, a contiguous copy):
  // charge it to the compute that the send follows.
  sched::SimulationCosts costs;
  for (int stage = 0; stage < schedule.num_stages; ++stage) {
    const double send_forward = mean("SEND_F", stage), send_backward = mean("SEND_B", stage);
    costs.stages.push_back({mean("F", stage) + send_forward, mean("B", stage) + send_backward,
                            mean("I", stage) + send_backward, mean("W", stage)});
  }
  const auto measured = summarize(ranks, 0);
  costs.p2p.latency_s = measured.transfer_latency_us * 1e-6;
  const auto simulated = sched::simulate(schedule, graph_, costs);

  const std::string& dir = runtime_->config().trace_dir;
  std::filesystem::create_directories(dir);
  const std::string stem = dir + "/step" + std::to_string(step_);
  write_file_atomically(stem + "_trace.json", to_chrome_trace(ranks));
  char title[256];
  std::snprintf(title, sizeof title, "%s, %d stages on %d ranks, %d microbatches, step %lld: bubble %.3f measured, %.3f simulated",
                schedule.name.c_str(), schedule.num_stages, schedule.num_ranks, schedule.num_microbatches, step_,
                measured.bubble_fraction, simulated.bubble_fraction);
  write_file_atomically(stem + "_pipeline.svg", to_svg(ranks, title));
  char line[512];
  std::snprintf(line, sizeof line,
                "timeline of step %lld: bubble %.3f measured (makespan %.2f ms), %.3f simulated (makespan %.2f ms); "
                "receive waits %.2f ms over replica 0; transfer latency %.3f ms; wrote %s_trace.json and "
                "%s_pipeline.svg",
                step_, measured.bubble_fraction, measured.makespan_us / 1e3, simulated.bubble_fraction,
                simulated.makespan * 1e3, measured.receive_wait_us / 1e3, measured.transfer_latency_us / 1e3,
                stem.c_str(), stem.c_str());
  log::info(line);
}

}  // namespace smp
