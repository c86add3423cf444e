#include "training/planned_layout.h"

#include <algorithm>
#include <filesystem>
#include <thread>

#include "smp/collectives.h"
#include "smp/layout_plan.h"
#include "smp/log.h"
#include "smp/stage_plan.h"
#include "smp/timeline.h"

namespace smp {

namespace {

// Rank 0's choice: the chosen config's document.
std::string plan_on_rank0(Runtime& runtime, const GraphModel& model, const ModelInputs& sample) {
  const Config& config = runtime.config();
  const int world = runtime.world_size();
  // Cut as finely as the most stages considered (two per rank), and profiled alone (no peers take part).
  const GraphModel fine = model.expanded_to(static_cast<std::size_t>(2 * world));
  const int batch = !sample.empty() && sample.front().defined() && sample.front().dim() > 0
                        ? static_cast<int>(sample.front().size(0))
                        : 1;
  ModelProfile profile;
  {
    const WithoutCollectives alone;
    profile = {profile_graph(fine, sample, 3), batch, {}, 0};
  }
  PlanningCosts costs;
  costs.p2p_bytes_per_s = costs.all_reduce_bytes_per_s = config.link_bandwidth_gbps * 1e9;
  if (runtime.device().is_cpu()) {
    // Ranks sharing this host's cores compute that much slower than the profile measured alone.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    costs.compute_scale = std::max(1.0, static_cast<double>(runtime.launch().local_world_size) / cores);
  }
  const auto predictions = plan_layouts(profile, config, world, costs);
  log::info("layouts planned for the \"auto\" keys of " + config.source + ":\n" + layout_report(predictions));
  auto [prediction, chosen] = choose_layout(predictions, config, world);
  log::info("planned layout " + prediction.layout.describe());
  // The C++ plan has no optimizer term: its step is what train_step takes.
  runtime.note_planned_step({prediction.layout.describe(), prediction.step_s});
  if (!config.trace_dir.empty()) {
    std::filesystem::create_directories(config.trace_dir);
    const std::string path = config.trace_dir + "/planned_layout.svg";
    write_file_atomically(path, layout_timeline_svg(profile, config, world, prediction.layout, costs));
    log::info("wrote the planned layout's simulated step to " + path);
  }
  return chosen.text;
}

}  // namespace

std::shared_ptr<Runtime> with_planned_layout(std::shared_ptr<Runtime> runtime, const GraphModel& model,
                                             const ModelInputs& sample) {
  const Config& config = runtime->config();
  if (config.auto_keys.empty()) return runtime;
  const std::string text =
      runtime->from_rank0("planned_layout", [&] { return plan_on_rank0(*runtime, model, sample); });
  runtime->adopt_layout(Config::from_json_text(text, config.source));
  return runtime;
}

}  // namespace smp
