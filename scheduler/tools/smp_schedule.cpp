// smp_schedule: generate, dump, load and simulate pipeline schedules without running a model.
//   smp_schedule --schedule 1f1b --ranks 4 --microbatches 8 [--virtual-stages V] [--active A] [--csv OUT]
//   smp_schedule --load FILE.csv
// Prints the simulated makespan, bubble fraction and peak in-flight activations per rank, with the textbook
// bubble formula where one exists. Costs per microbatch and stage: --forward, --backward, --backward-input,
// --backward-weight (seconds; defaults 1, 2, 1, 1), --latency (seconds per transfer).

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "smp/scheduler/schedule.h"
#include "smp/scheduler/simulator.h"

namespace {

using namespace smp::sched;

void print_usage(std::FILE* to) {
  std::fprintf(to, "usage: smp_schedule --schedule NAME --ranks P --microbatches M [--virtual-stages V] [--active A] "
                   "[--csv OUT] [--forward T] [--backward T] [--backward-input T] [--backward-weight T] [--latency S]\n"
                   "       smp_schedule --load FILE.csv\n"
                   "Simulates the schedule (makespan, bubble, peak in-flight activations per rank); --csv writes its "
                   "action list, which --load and the config's \"schedule_file\" read. --virtual-stages: stages per rank, "
                   "by default 2 for the V schedules and those that take any number (interleaved_1f1b, looped_bfs), else 1.\nschedules:");
  for (const auto& kind : schedule_kinds()) {
    std::fprintf(to, " %s", kind.name);
    if (*kind.config_alias) std::fprintf(to, " (config \"%s\")", kind.config_alias);
  }
  std::fprintf(to, "\n");
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "smp_schedule: %s\n", message.c_str());
  print_usage(stderr);
  std::exit(2);
}

double number(const std::string& flag, const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(value >= 0)) usage_error(flag + " expects a non-negative number, got " + text);
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name, csv_out, load;
  int ranks = -1, microbatches = -1, virtual_stages = 0, active = 0;  // -1, 0: not given
  StageCosts stage_costs;
  P2PCosts p2p;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      print_usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) usage_error(flag + " needs a value");
    const char* value = argv[++i];
    if (flag == "--schedule") name = value;
    else if (flag == "--ranks") ranks = static_cast<int>(number(flag, value));
    else if (flag == "--microbatches") microbatches = static_cast<int>(number(flag, value));
    else if (flag == "--virtual-stages") virtual_stages = static_cast<int>(number(flag, value));
    else if (flag == "--active") active = static_cast<int>(number(flag, value));
    else if (flag == "--csv") csv_out = value;
    else if (flag == "--load") load = value;
    else if (flag == "--forward") stage_costs.forward = number(flag, value);
    else if (flag == "--backward") stage_costs.backward = number(flag, value);
    else if (flag == "--backward-input") stage_costs.backward_input = number(flag, value);
    else if (flag == "--backward-weight") stage_costs.backward_weight = number(flag, value);
    else if (flag == "--latency") p2p.latency_s = number(flag, value);
    else usage_error("unknown flag " + flag);
  }
  try {
    Schedule schedule;
    if (!load.empty()) {
      std::ifstream in(load);
      if (!in) usage_error("cannot open " + load);
      schedule = read_csv(in);
    } else {
      if (name.empty() || ranks == -1 || microbatches == -1) usage_error("--schedule, --ranks and --microbatches are required");
      if (ranks < 1 || microbatches < 1) usage_error("--ranks and --microbatches must be at least 1");
      // The config's names ("interleaved", "simple") too, as the engine reads them. Untold, a V takes its 2 stages
      // per rank, as the config's "pipeline" does, and interleaved 1F1B 2 (with 1 it is 1F1B).
      if (virtual_stages == 0) {
        const int per_rank = find_schedule_kind(name).stages_per_rank;
        virtual_stages = per_rank == 0 ? 2 : per_rank;
      }
      schedule = make_schedule(find_schedule_kind(name, virtual_stages).name, ranks, microbatches, virtual_stages, active);
    }
    const auto graph = StageGraph::chain(schedule.num_stages);
    bool lowered = false;
    for (const auto& actions : schedule.ranks) {
      for (const auto& action : actions) lowered |= !is_compute(action.kind);
    }
    if (!lowered) schedule = lower_communication(schedule, graph);
    validate(schedule, graph);
    if (!csv_out.empty()) {
      std::ofstream out(csv_out);
      write_csv(schedule, out);
      if (!out) usage_error("cannot write " + csv_out);
    }
    // Stage costs are per stage; with v stages per rank each is 1/v of the rank's work.
    const int per_rank = schedule.num_stages / schedule.num_ranks;
    StageCosts scaled{stage_costs.forward / per_rank, stage_costs.backward / per_rank,
                      stage_costs.backward_input / per_rank, stage_costs.backward_weight / per_rank};
    const auto result = simulate(schedule, graph, SimulationCosts::uniform(schedule.num_stages, scaled, p2p));
    std::printf("schedule %s: %d ranks, %d stages, %d microbatches\n", schedule.name.c_str(), schedule.num_ranks,
                schedule.num_stages, schedule.num_microbatches);
    std::printf("makespan %.6g, bubble fraction %.6f\n", result.makespan, result.bubble_fraction);
    const double p = schedule.num_ranks, m = schedule.num_microbatches, v = per_rank;
    // The textbook bubble of a looped schedule without split backward: (p-1)/(v*m+p-1), which GPipe and 1F1B meet
    // (v = 1) and interleaving meets when its microbatches fill whole rounds of p.
    // A loaded file's schedule may be of no kind the registry knows (a hand-written one): no formula then.
    const ScheduleKind* kind = nullptr;
    for (const auto& known : schedule_kinds()) {
      if (schedule.name == known.name) kind = &known;
    }
    const bool looped = kind && kind->stages_per_rank != 2 && !kind->split_backward;
    if (looped && (per_rank == 1 || schedule.num_microbatches % schedule.num_ranks == 0)) {
      std::printf("formula (p-1)/(v*m+p-1) = %.6f\n", (p - 1) / (v * m + p - 1));
    }
    std::printf("peak in-flight (stage, microbatch) pairs per rank:");
    for (int peak : result.peak_in_flight) std::printf(" %d", peak);
    if (per_rank > 1) {
      // With v stages per rank each pair holds a stage's activations, 1/v of the rank's for a microbatch.
      std::printf(" (in whole microbatches of the rank's activations:");
      for (int peak : result.peak_in_flight) std::printf(" %.3g", peak / v);
      std::printf(")");
    }
    std::printf("\n");
  } catch (const ScheduleError& error) {
    std::fprintf(stderr, "smp_schedule: %s\n", error.what());
    return 1;
  }
  return 0;
}
