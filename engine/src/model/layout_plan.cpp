// Every layout of a world (tp x pp x dp, schedule, microbatches, virtual stages, recompute, ZeRO-1) cut as a job
// would cut it and predicted: its step by the schedule simulator on the profiled costs, each rank's peak memory.
#include "smp/layout_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "smp/graph_model.h"
#include "smp/scheduler/simulator.h"
#include "smp/timeline.h"

namespace smp {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr int kMostSamples = 1 << 30;

struct ScheduleChoice {
  const char* name;  // a generator's, which the config takes too
  int virtual_stages;
};
// The registry's planned kinds: those of one stage per rank first, then the V schedules and interleaving at two
// stages per rank.
std::vector<ScheduleChoice> planned_schedules() {
  std::vector<ScheduleChoice> choices;
  for (const bool one_per_rank : {true, false}) {
    for (const auto& kind : sched::schedule_kinds()) {
      if (kind.planned && (kind.stages_per_rank == 1) == one_per_rank) {
        choices.push_back({kind.name, one_per_rank ? 1 : 2});
      }
    }
  }
  return choices;
}

Config config_of(const Layout& layout, const Config& base) {
  Config config = base;
  config.tensor_parallel_degree = 1;  // a tensor-parallel group is one rank of the pipelines and replicas planned
  // The experts' share of parameters is the profile's (divide_experts); the degree tells the partition search over
  // how many replicas their optimizer state is sharded (replicas / ep hold the same experts).
  config.expert_parallel_degree = layout.experts;
  config.partitions = layout.partitions;
  config.virtual_stages = layout.virtual_stages;
  config.microbatches = layout.microbatches;
  config.pipeline = layout.pipeline;
  config.ddp = layout.replicas > 1;
  config.shard_optimizer_state = layout.shard_optimizer_state;
  config.active_microbatches = 0;
  config.schedule_file.clear();
  config.checkpointed_stages.clear();
  config.checkpointed_modules.clear();
  if (layout.recompute) {
    for (int stage = 0; stage < config.num_stages(); ++stage) config.checkpointed_stages.push_back(stage);
  }
  return config;
}

// The ranks and costs a layout's pipelines and replicas see: with tensor parallelism each of world_size / tp
// "ranks" is a group of tp ranks computing at once, so the processors a host's ranks share count in groups too.
PlanningCosts per_tensor_parallel_group(PlanningCosts costs, int tp) {
  if (tp <= 1) return costs;
  costs.shared_processors /= tp;
  if (costs.ranks_per_node > 0) costs.ranks_per_node = std::max(1, costs.ranks_per_node / tp);
  return costs;
}

// An exchange between ranks that each computed up to it (tensor-parallel collectives, experts' exchanges) over a
// group of n: n - 1 round trips (the synchronization measured after computing where ranks share cores, at least two
// latencies) and (n - 1) / n of `bytes` at the lower of the link's and the synchronized bandwidth.
double synchronized_s(double round_trips, double bytes, int n, double link_bytes_per_s, const PlanningCosts& costs) {
  const double round_trip = std::max(2.0 * costs.latency_s, costs.synchronization_s);
  const double bytes_per_s = costs.synchronized_bytes_per_s > 0
                                 ? std::min(link_bytes_per_s, costs.synchronized_bytes_per_s)
                                 : link_bytes_per_s;
  return round_trips * (n - 1) * round_trip + bytes * (n - 1) / n / bytes_per_s;
}

// A tensor-parallel group's collectives as rings (ModuleProfile's tp_* counts and ring bytes) on the all-reduce link.
double tensor_parallel_s(std::int64_t collectives, std::int64_t ring_bytes, int tp, const PlanningCosts& costs) {
  if (tp <= 1 || collectives == 0) return 0.0;
  return synchronized_s(static_cast<double>(collectives), static_cast<double>(ring_bytes), tp,
                        costs.all_reduce_bytes_per_s, costs);
}

// One exchange among an expert-parallel group of `ep` that carries `bytes` from each rank, a message to each peer, on
// the point-to-point link (an experts layer's ranks reach it computing alike).
double expert_exchange_s(std::int64_t bytes, int ep, const PlanningCosts& costs) {
  if (ep <= 1) return 0.0;
  return synchronized_s(1.0, static_cast<double>(bytes), ep, costs.p2p_bytes_per_s, costs);
}

// The profile as each rank of an expert-parallel group of `ep` runs it: its experts whole (a profile whose experts
// are split over `split` tensor-parallel ranks made whole again: their parameters, compute and activations times
// `split`, their outputs' sums over the group gone; an approximation where a node holds more than the experts: its
// other compute and activations are scaled too, and its other collectives dropped),
// then 1 / ep of their parameters, and the exchanges around them (ExpertsAcrossRanks: forward, the counts, the rows
// out and the results back; backward, the two gradients), which the partition search then balances like compute; a
// backward's exchanges carry input gradients, so the input pass's too. Each rank computes its experts on as many
// rows as it sends when routing is even; where the routing was counted, the busiest rank of an exchange of
// `samples_per_exchange` computes, holds and receives its rows (routing_imbalance), on the experts' share of the
// node's compute.
void divide_experts(std::vector<ModuleProfile>& modules, int ep, int split, int samples_per_exchange,
                    const PlanningCosts& costs) {
  if (ep <= 1) return;
  for (auto& module : modules) {
    if (module.expert_parameter_bytes == 0 && module.expert_token_bytes == 0) continue;
    const std::int64_t frozen_dense = module.frozen_parameter_bytes - module.frozen_expert_parameter_bytes;
    if (split > 1 && module.expert_parameter_bytes > 0) {
      module.frozen_expert_parameter_bytes *= split;
      module.parameter_bytes += (split - 1) * module.expert_parameter_bytes;
      module.expert_parameter_bytes *= split;
      module.activation_bytes *= split;
      if (module.weight_pass_bytes > 0) module.weight_pass_bytes *= split;
      for (double* seconds :
           {&module.forward_s, &module.backward_s, &module.backward_input_s, &module.backward_weight_s}) {
        *seconds *= split;
      }
      module.tp_forward_collectives = module.tp_backward_collectives = 0;
      module.tp_forward_ring_bytes = module.tp_backward_ring_bytes = 0;
    }
    const std::int64_t kept = module.expert_parameter_bytes / ep;
    module.parameter_bytes -= module.expert_parameter_bytes - kept;
    module.expert_parameter_bytes = kept;
    module.frozen_expert_parameter_bytes /= ep;  // frozen experts are divided with the others
    module.frozen_parameter_bytes = frozen_dense + module.frozen_expert_parameter_bytes;
    if (module.largest_expert_parameter_bytes > 0) {
      module.largest_expert_parameter_bytes = module.largest_expert_parameter_bytes * split / ep;
      module.largest_parameter_bytes =
          std::max(module.largest_other_parameter_bytes, module.largest_expert_parameter_bytes);
    }
    // Routing as counted on the sample: every layer's exchanges wait for its busiest rank, which computes and holds
    // that many more rows (a node holding several layers: their mean).
    double busiest = 1.0;
    if (!module.expert_routing.empty()) {
      double sum = 0.0;
      for (const auto& routed : module.expert_routing) sum += routing_imbalance(routed, ep, samples_per_exchange);
      busiest = sum / static_cast<double>(module.expert_routing.size());
    }
    const double scale = 1.0 + (busiest - 1.0) * module.expert_compute_share;
    for (double* seconds : {&module.forward_s, &module.backward_s, &module.backward_input_s, &module.backward_weight_s}) {
      *seconds *= scale;
    }
    module.activation_bytes = static_cast<std::int64_t>(static_cast<double>(module.activation_bytes) * scale);
    if (module.weight_pass_bytes > 0) {
      module.weight_pass_bytes = static_cast<std::int64_t>(static_cast<double>(module.weight_pass_bytes) * scale);
    }
    if (module.expert_token_bytes == 0) continue;  // the layer's exchanges are its first node's (mark_experts)
    const double rows =
        expert_exchange_s(static_cast<std::int64_t>(static_cast<double>(module.expert_token_bytes) * busiest), ep, costs);
    module.forward_s += expert_exchange_s(0, ep, costs) + 2.0 * rows;
    module.backward_s += 2.0 * rows;
    if (module.backward_input_s + module.backward_weight_s > 0.0) module.backward_input_s += 2.0 * rows;
  }
}

// A ring all-reduce of `bytes` over `replicas` (and ZeRO-1's broadcast after the step: one more (n - 1) / n).
double all_reduce_s(double bytes, int replicas, bool sharded, double latency_s, double bytes_per_s) {
  if (replicas <= 1 || bytes <= 0.0) return 0.0;  // nothing trained here: the reducer has no bucket to reduce
  const double share = static_cast<double>(replicas - 1) / replicas;
  return latency_s * 2 * (replicas - 1) + (2.0 * share + (sharded ? share : 0.0)) * bytes / bytes_per_s;
}

// `timeline`, when given, gets the simulated step: one row per pipeline rank. `profile` is the model's at the
// layout's tensor-parallel degree; `whole_world` and `given_costs` the whole job's.
void predict(LayoutPrediction& prediction, const ModelProfile& profile, const Config& base, int whole_world,
             const PlanningCosts& given_costs, double optimizer_moments, std::vector<RankTimeline>* timeline = nullptr) {
  const int tp = std::max(1, prediction.layout.tensor_parallel);
  const int world_size = whole_world / tp;  // pipeline ranks x replicas
  const PlanningCosts costs = per_tensor_parallel_group(given_costs, tp);
  const Layout& layout = prediction.layout;
  const Config config = config_of(layout, base);
  const int per_microbatch = base.global_batch_size / layout.replicas / layout.microbatches;
  const sched::Schedule schedule = sched::make_schedule(config.schedule_name(), layout.partitions,
                                                        layout.microbatches, layout.virtual_stages, 0);
  const int shards = layout.shard_optimizer_state ? layout.replicas : 1;
  // The experts' state is sharded over the replicas holding the same experts.
  const int ep = std::max(1, layout.experts);
  const int expert_shards = layout.shard_optimizer_state ? layout.replicas / ep : 1;
  if (per_microbatch < profile.least_microbatch ||
      (profile.most_microbatch > 0 && per_microbatch > profile.most_microbatch)) {
    prediction.rejected = "microbatches of " + std::to_string(per_microbatch) +
                          (per_microbatch == 1 ? " sample" : " samples") + ": the model takes " +
                          (per_microbatch < profile.least_microbatch
                               ? "at least " + std::to_string(profile.least_microbatch)
                               : "at most " + std::to_string(profile.most_microbatch)) +
                          " (as captured: the sizes its code allows, and batch norm's more than one value a "
                          "channel)";
    return;
  }
  StagePlan plan;
  StageDevices devices;
  try {
    // Devices that differ are given per rank of the whole world: a pipeline rank's stages run at its slowest
    // member's speed (its replicas and tensor-parallel peers wait for it) within its least memory.
    Config whole = config;
    whole.tensor_parallel_degree = tp;
    devices = stage_devices(whole, Topology(whole, whole_world), schedule.stage_to_rank, {});
    auto modules = profile.at(per_microbatch, costs.compute_scale);
    // An experts layer's exchange carries every member's microbatch.
    divide_experts(modules, ep, profile.experts_split, ep * per_microbatch, costs);
    // The limit steers the cut; the per-rank peak below judges it (the search's additive count is cruder).
    plan = plan_stages(modules, config, activation_copies(schedule, weight_pass_share(modules)), shards, &devices,
                       MemoryLimit::kGuides);
  } catch (const std::exception& error) {
    prediction.rejected = error.what();
    return;
  }
  // Per stage: its compute as the partition search sees it, split for the zero-bubble schedules as profiled (I and
  // W timed through smp::WeightPass, which on small operations cost more together than B), else as the paper
  // assumes (I + W = B, half each); a recompute runs before I.
  const int stages = plan.num_stages;
  for (int stage = 0; stage < stages; ++stage) {
    const auto members = plan.modules_of_stage(stage);
    const std::string& first = plan.modules[static_cast<std::size_t>(members.front())].name;
    const std::string& last = plan.modules[static_cast<std::size_t>(members.back())].name;
    prediction.stages.push_back(members.size() == 1 ? first : first + ".." + last);
  }
  // A job dividing the experts captures them as one opaque call each, whose graph names its nodes otherwise than
  // the profile's: it cuts its own graph, from its own profile.
  if (ep == 1) prediction.cut = pinned_cut(plan);
  sched::SimulationCosts simulated;
  simulated.stages.resize(static_cast<std::size_t>(stages));
  std::vector<double> parameter_bytes(static_cast<std::size_t>(stages), 0.0);
  // Of parameter_bytes, what trains: the dense parameters' and the experts' (gradients, optimizer state, reductions).
  std::vector<double> trained_dense(static_cast<std::size_t>(stages), 0.0);
  std::vector<double> trained_experts(static_cast<std::size_t>(stages), 0.0);
  std::vector<double> activation_bytes(static_cast<std::size_t>(stages), 0.0);
  double largest_transfer = 0.0;
  for (int stage = 0; stage < stages; ++stage) {
    double forward = 0.0, backward = 0.0, input_pass = 0.0, weight_pass = 0.0;
    double forward_collectives = 0.0, backward_collectives = 0.0;
    for (int module : plan.modules_of_stage(stage)) {
      const auto& profile = plan.modules[static_cast<std::size_t>(module)];
      forward_collectives += tensor_parallel_s(profile.tp_forward_collectives, profile.tp_forward_ring_bytes, tp, costs);
      backward_collectives +=
          tensor_parallel_s(profile.tp_backward_collectives, profile.tp_backward_ring_bytes, tp, costs);
      forward += profile.forward_s;
      backward += profile.backward_s;
      input_pass += profile.backward_input_s;
      weight_pass += profile.backward_weight_s;
      parameter_bytes[stage] += static_cast<double>(profile.parameter_bytes);
      trained_dense[stage] += static_cast<double>(profile.trained_dense_bytes());
      trained_experts[stage] += static_cast<double>(profile.trained_expert_bytes());
      activation_bytes[stage] += static_cast<double>(profile.activation_bytes + profile.output_bytes);
    }
    // On a slower device, everything it computes takes longer.
    const double slowness = devices.speeds.empty() ? 1.0 : 1.0 / devices.speeds[static_cast<std::size_t>(stage)];
    forward *= slowness;
    backward *= slowness;
    const bool split_profiled = input_pass + weight_pass > 0.0;
    input_pass = split_profiled ? input_pass * slowness : backward / 2;
    weight_pass = split_profiled ? weight_pass * slowness : backward / 2;
    // The collectives wait on the group, not on the device's speed; a backward's (the gradients of inputs that met
    // sharded weights, summed) are the input pass's.
    forward += forward_collectives;
    backward += backward_collectives;
    input_pass += backward_collectives;
    const double recompute = layout.recompute ? forward : 0.0;
    auto& cost = simulated.stages[static_cast<std::size_t>(stage)];
    cost.forward = forward;
    cost.backward = backward + recompute;
    cost.backward_input = input_pass + recompute;
    cost.backward_weight = weight_pass;
    largest_transfer = std::max(largest_transfer, static_cast<double>(plan.stage_sent_bytes(stage)));
  }
  const bool across_nodes = costs.ranks_per_node > 0 && costs.inter_node_bytes_per_s > 0;
  const bool pipeline_across = across_nodes && layout.partitions > costs.ranks_per_node;
  const bool replicas_across = across_nodes && world_size > costs.ranks_per_node;
  simulated.p2p = {pipeline_across ? costs.inter_node_latency_s : costs.latency_s, largest_transfer,
                   pipeline_across ? costs.inter_node_bytes_per_s : costs.p2p_bytes_per_s};
  // The host's processors divided evenly among the pipelines (replicas, tensor-parallel ranks) it holds.
  const int host_ranks = costs.ranks_per_node > 0 ? std::min(costs.ranks_per_node, world_size) : world_size;
  const double sharing = costs.shared_processors > 0 ? std::max(1.0, host_ranks / costs.shared_processors) : 1.0;
  if (sharing > 1.0) simulated.processors = layout.partitions / sharing;
  if (!layout.recompute) {
    // What each rank holds through the step, stage by stage: a microbatch's activations from its F to its B (under
    // the split, what W reads from I to W; the first stage's input takes no gradient, so its W is its backward),
    // each stage's gradients from its first backward on.
    simulated.activation_bytes = activation_bytes;
    for (int stage = 0; stage < stages; ++stage) {
      simulated.gradient_bytes.push_back(trained_dense[stage] + trained_experts[stage]);
    }
    if (schedule.split_backward) {
      for (int stage = 0; stage < stages; ++stage) {
        simulated.weight_pass_share.push_back(stage == 0 ? 1.0
                                                         : weight_pass_share(plan.modules, plan.modules_of_stage(stage)));
      }
    }
  }
  const auto lowered = sched::lower_communication(schedule, sched::StageGraph::chain(stages));
  const auto result = sched::simulate(lowered, sched::StageGraph::chain(stages), simulated);
  prediction.pipeline_s = result.makespan;
  prediction.bubble_fraction = result.bubble_fraction;
  if (timeline != nullptr) {
    for (std::size_t rank = 0; rank < lowered.ranks.size(); ++rank) {
      RankTimeline row;
      row.rank = row.pp_rank = static_cast<int>(rank);
      for (std::size_t index = 0; index < lowered.ranks[rank].size(); ++index) {
        const auto& action = lowered.ranks[rank][index];
        const auto& timing = result.timings[rank][index];
        row.events.push_back({sched::to_string(action.kind), action.stage, action.microbatch, timing.start * 1e6,
                              timing.end * 1e6, action.peer_stage});
      }
      timeline->push_back(std::move(row));
    }
  }

  // Per pipeline rank: what its stages hold (as the partition search's memory model counts it), and the bytes
  // its replicas reduce after the step.
  const auto ranks = static_cast<std::size_t>(layout.partitions);
  std::vector<double> rank_dense_bytes(ranks, 0.0), rank_expert_bytes(ranks, 0.0), held_bytes(ranks, 0.0),
      activations_held(ranks, 0.0), largest_parameter(ranks, 0.0);  // the first two: what trains
  for (int stage = 0; stage < stages; ++stage) {
    const int rank = schedule.stage_to_rank.at(stage);
    const double copies = layout.recompute ? 1.0 : plan.activation_copies.at(stage);
    // Parameters and optimizer state: the gradients come and go with the step (below).
    held_bytes[rank] += parameter_bytes[stage] + optimizer_moments / shards * trained_dense[stage] +
                        optimizer_moments / expert_shards * trained_experts[stage];
    activations_held[rank] += copies * activation_bytes[stage];
    rank_dense_bytes[rank] += trained_dense[stage];
    rank_expert_bytes[rank] += trained_experts[stage];
    for (int module : plan.modules_of_stage(stage)) {
      largest_parameter[rank] = std::max(
          largest_parameter[rank], static_cast<double>(plan.modules[static_cast<std::size_t>(module)].largest_parameter_bytes));
    }
  }
  prediction.memory_mib.assign(ranks, 0.0);
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    // Adam's step (two moments) holds temporaries once the step's activations are gone: a ResNet stage of two
    // 9 MiB convolutions held 19 MiB more than its parameters, gradients, moments and activations. One parameter
    // at a time, two of the largest, at most twice what the rank trains (a frozen backbone's large weights take no
    // step); under ZeRO-1 the replica owning the largest steps it whole.
    const double stepped = rank_dense_bytes[rank] / shards + rank_expert_bytes[rank] / expert_shards;
    const double scratch = optimizer_moments < 2.0          ? 0.0
                           : costs.optimizer_foreach ? stepped
                                                     : std::min(2.0 * largest_parameter[rank],
                                                                2.0 * (rank_dense_bytes[rank] + rank_expert_bytes[rank]));
    // A step starts without gradients (zero_grad frees them by default): until a rank's first backward its
    // activations are all it holds beside its parameters and optimizer state; from then on its gradients too, with
    // what it still holds or forwards then (GPipe's peak of activations never meets the gradients; a steady 1F1B's
    // does). Replicas' buckets copy the gradients to reduce them at the end of the backward (a second copy, for a
    // moment); the optimizer's temporaries come after the activations are gone.
    const double gradients = rank_dense_bytes[rank] + rank_expert_bytes[rank];
    const double buckets = layout.replicas > 1 ? gradients : 0.0;
    // A recomputing stage rebuilds a microbatch's activations inside its backward, beside the gradients.
    const double during_step =
        result.peak_step_bytes.empty() ? gradients + activations_held[rank] : result.peak_step_bytes[rank];
    prediction.memory_mib[rank] =
        (held_bytes[rank] + std::max({during_step, gradients + buckets, gradients + scratch})) / kMiB;
  }
  // The rank with the most parameters reduces the most and steps the longest: the dense ones over every replica,
  // the experts' over the replicas holding the same experts.
  const double latency = replicas_across ? costs.inter_node_latency_s : costs.latency_s;
  const double bytes_per_s = replicas_across ? costs.inter_node_bytes_per_s : costs.all_reduce_bytes_per_s;
  double stepped_most = 0.0;
  for (std::size_t rank = 0; rank < ranks; ++rank) {
    const double dense = rank_dense_bytes[rank];
    const bool apart = ep > 1 && rank_expert_bytes[rank] > 0;  // else one reduction takes both
    const double sync =
        all_reduce_s(apart ? dense : dense + rank_expert_bytes[rank], layout.replicas, layout.shard_optimizer_state, latency,
                     bytes_per_s) +
        (apart ? all_reduce_s(rank_expert_bytes[rank], layout.replicas / ep, layout.shard_optimizer_state, latency,
                              bytes_per_s)
               : 0.0);
    prediction.gradient_sync_s = std::max(prediction.gradient_sync_s, sync);
    stepped_most = std::max(stepped_most, dense / shards + rank_expert_bytes[rank] / expert_shards);
  }
  prediction.optimizer_s = costs.optimizer_s_per_byte * stepped_most * sharing;
  prediction.step_s = prediction.pipeline_s + prediction.gradient_sync_s + prediction.optimizer_s;
  // A rank without parameters cannot build its optimizer (torch.optim refuses an empty parameter list).
  std::vector<bool> rank_holds(ranks, false);
  bool model_holds = false;
  for (int stage = 0; stage < stages; ++stage) {
    for (int module : plan.modules_of_stage(stage)) {
      const auto& node = plan.modules[static_cast<std::size_t>(module)];
      const bool holds = node.holds_parameters || node.parameter_bytes > 0;
      model_holds |= holds;
      if (holds) rank_holds[static_cast<std::size_t>(schedule.stage_to_rank.at(stage))] = true;
    }
  }
  for (std::size_t rank = 0; rank < ranks && model_holds; ++rank) {
    if (rank_holds[rank]) continue;
    std::string held;
    for (int stage = 0; stage < stages; ++stage) {
      if (schedule.stage_to_rank.at(stage) != static_cast<int>(rank)) continue;
      held += (held.empty() ? "" : ", ") + prediction.stages[static_cast<std::size_t>(stage)];
    }
    prediction.rejected = "pipeline rank " + std::to_string(rank) + " would hold no parameters (it runs modules " +
                          held + "), and torch.optim refuses an empty parameter list";
    return;
  }
  for (int rank = 0; rank < layout.partitions; ++rank) {
    // The rank's own device, where devices differ in memory (its first stage's: a rank's stages share it).
    double limit = base.memory_limit_mb;
    for (int stage = 0; stage < stages && !devices.memory_mb.empty(); ++stage) {
      if (schedule.stage_to_rank.at(stage) == rank) limit = devices.memory_mb[static_cast<std::size_t>(stage)];
    }
    if (limit > 0 && prediction.memory_mib[rank] > limit) {
      char why[160];
      std::snprintf(why, sizeof why, "needs %.1f MiB on pipeline rank %d%s%.1f MiB", prediction.memory_mib[rank], rank,
                    kOverMemoryLimit, limit);
      prediction.rejected = why;
      break;
    }
  }
}

// Why a layout cannot divide the experts over `ep` replicas; empty when it can (or divides nothing).
std::string experts_refusal(int ep, int experts, int tp, bool sequence_parallel) {
  if (ep <= 1) return {};
  if (tp > 1 && sequence_parallel) return "expert parallelism with \"sequence_parallel\" is not supported yet";
  if (experts == 0) return "the model has no experts to divide";
  if (experts % ep != 0) {
    return "expert_parallel_degree " + std::to_string(ep) + " does not divide the " + std::to_string(experts) +
           " experts";
  }
  return {};
}

// Every schedule, microbatch count, recompute and ZeRO-1 choice for `partitions` pipeline ranks x `replicas`, each
// replica taking `per_replica` samples a step, of a model cut into `modules` nodes whose microbatches hold at least
// `least_microbatch` samples. `fixed_microbatches` (0: none): the count a job's config fixes, considered whatever the
// ranges below say, since the job takes no other.
std::vector<Layout> layouts_of(int partitions, int replicas, int per_replica, int modules, int least_microbatch,
                               int fixed_microbatches) {
  // The most microbatches a replica's batch makes that the model takes.
  int most_microbatches = 1;
  for (int count : divisors(per_replica)) {
    if (per_replica / count >= least_microbatch) most_microbatches = count;
  }
  std::vector<Layout> layouts;
  for (const auto& choice : planned_schedules()) {
    // One stage runs GPipe's order alone: every schedule is the same there.
    if (partitions == 1 && (choice.virtual_stages > 1 || std::string(choice.name) != "gpipe")) continue;
    if (partitions * choice.virtual_stages > modules) continue;
    for (int microbatches : divisors(per_replica)) {
      // Fewer microbatches than stages leave most of a pipeline idle (unless the replica's batch makes no more that
      // the model takes); more than 8 per stage gain little and multiply the runs.
      const int stages = partitions * choice.virtual_stages;
      const bool fewest = microbatches < partitions && microbatches != most_microbatches;
      const bool in_range = partitions > 1 ? !fewest && microbatches <= 8 * stages : microbatches <= 4;
      if (fixed_microbatches > 0 ? microbatches != fixed_microbatches : !in_range) continue;
      for (bool recompute : {false, true}) {
        for (bool sharded : {false, true}) {
          if (sharded && replicas == 1) continue;
          layouts.push_back({partitions, replicas, choice.virtual_stages, microbatches, choice.name, recompute, sharded});
        }
      }
    }
  }
  return layouts;
}

}  // namespace

// Every module whose path selects modules of its own stage alone. Not each stage's first and last alone: in a DAG
// those leave a parallel branch free (a ResNet block's convolutions beside its downsample moved a stage on). A path
// selects every call of its module ("layer4.1.relu" and its second call "layer4.1.relu#1", which a ResNet block makes
// after its residual sum) and every part of it, and those may lie in two stages: such a path pins nothing.
std::map<std::string, int> pinned_cut(const StagePlan& plan) {
  auto alone_in = [&](const std::string& path, int stage) {
    if (path.find('#') != std::string::npos) return false;  // a call's own name: not a path a capture keeps
    for (std::size_t i = 0; i < plan.modules.size(); ++i) {
      if (cut_from(plan.modules[i].name, path) && plan.stage_of_module[i] != stage) return false;
    }
    return true;
  };
  std::map<std::string, int> cut;
  for (std::size_t i = 0; i < plan.modules.size(); ++i) {
    if (alone_in(plan.modules[i].name, plan.stage_of_module[i])) cut[plan.modules[i].name] = plan.stage_of_module[i];
  }
  return cut;
}

std::vector<int> divisors(int n) {
  std::vector<int> found;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) found.push_back(d);
  }
  return found;
}

std::string Layout::describe() const {
  std::ostringstream text;
  if (tensor_parallel > 1) text << "tp " << tensor_parallel << " x ";
  text << "pp " << partitions << " x dp " << replicas;
  if (experts > 1) text << ", ep " << experts;
  text << ", " << pipeline << ", m " << microbatches;
  if (recompute) text << ", recompute";
  if (shard_optimizer_state) text << ", ZeRO-1";
  return text.str();
}

std::string Layout::config_json() const {
  std::ostringstream text;
  text << "{\"partitions\": " << partitions << ", \"virtual_stages\": " << virtual_stages << ", \"microbatches\": "
       << microbatches << ", \"pipeline\": \"" << pipeline << "\", \"ddp\": " << (replicas > 1 ? "true" : "false")
       << ", \"activation_checkpointing\": " << (recompute ? "true" : "false")
       << ", \"shard_optimizer_state\": " << (shard_optimizer_state ? "true" : "false")
       << ", \"tensor_parallel_degree\": " << tensor_parallel << ", \"expert_parallel_degree\": " << experts << "}";
  return text.str();
}

std::string LayoutPrediction::config_json() const {
  nlohmann::json keys = nlohmann::json::parse(layout.config_json());
  if (!cut.empty()) keys["partition_overrides"] = cut;
  return keys.dump();
}

bool LayoutPrediction::over_memory_limit() const {
  return rejected.find(kOverMemoryLimit) != std::string::npos && !memory_mib.empty();
}

double LayoutPrediction::peak_memory_mib() const {
  return memory_mib.empty() ? 0.0 : *std::max_element(memory_mib.begin(), memory_mib.end());
}

std::vector<LayoutPrediction> plan_layouts(const ModelProfile& profile, const Config& base, int world_size,
                                           const PlanningCosts& costs, double optimizer_moments, bool for_a_job) {
  return plan_layouts(std::map<int, ModelProfile>{{1, profile}}, base, world_size, costs, optimizer_moments, for_a_job);
}

std::vector<LayoutPrediction> plan_layouts(const std::map<int, ModelProfile>& by_degree, const Config& base,
                                           int world_size, const PlanningCosts& costs, double optimizer_moments,
                                           bool for_a_job) {
  if (by_degree.empty() || world_size < 1) {
    throw ConfigError("plan_layouts: needs a profiled model, its microbatch size and a world size");
  }
  for (const auto& [tp, profile] : by_degree) {
    if (tp < 1 || profile.modules.empty() || profile.batch < 1) {
      throw ConfigError("plan_layouts: needs a profiled model, its microbatch size and a world size");
    }
  }
  if (base.global_batch_size < 1) {
    throw ConfigError(base.source + ": planning a layout needs \"global_batch_size\" (the batch a step takes)");
  }
  if (base.global_batch_size > kMostSamples) {  // as the config takes it: sample counts stay in int arithmetic
    throw ConfigError(base.source + ": a global batch of " + std::to_string(base.global_batch_size) +
                      " samples: at most " + std::to_string(kMostSamples));
  }
  // Layouts of more stages than the model has nodes are never enumerated (layouts_of): a job fixing that many would
  // otherwise hear only of the layouts its keys exclude.
  if (for_a_job && !base.plans("partitions") && !base.plans("virtual_stages")) {
    std::size_t nodes = 0;
    for (const auto& [tp, profile] : by_degree) nodes = std::max(nodes, profile.modules.size());
    if (static_cast<std::size_t>(base.num_stages()) > nodes) {
      throw ConfigError(base.source + ": cannot split the model's " + std::to_string(nodes) + " modules into " +
                        std::to_string(base.num_stages()) + " pipeline stages (\"partitions\" " +
                        std::to_string(base.partitions) + " x \"virtual_stages\" " +
                        std::to_string(base.virtual_stages) + ", which the config fixes): fix fewer, or let the " +
                        "planner choose them (\"auto\")");
    }
  }
  const bool experts_planned = base.plans("expert_parallel_degree");
  // The expert-parallel degrees a layout of `replicas` can take: the config's, or for "auto" each divisor of the
  // replicas that divides the experts. With tensor parallelism each tensor-parallel rank holds its experts whole
  // (ModelProfile::experts_split undone) and divides them with the same tp rank of the other replicas.
  const auto expert_degrees = [&](int replicas, const ModelProfile& profile) {
    if (!experts_planned) {
      return replicas % base.expert_parallel_degree == 0 ? std::vector<int>{base.expert_parallel_degree}
                                                         : std::vector<int>{};
    }
    std::vector<int> degrees;
    for (int ep : divisors(replicas)) {
      if (ep == 1 || (profile.experts > 0 && profile.experts % ep == 0)) degrees.push_back(ep);
    }
    return degrees;
  };
  std::vector<LayoutPrediction> predictions;
  for (const auto& [tp, profile] : by_degree) {
    if (world_size % tp != 0) continue;
    const int ranks = world_size / tp;  // pipeline ranks x replicas
    const int modules = static_cast<int>(profile.modules.size());
    for (int partitions : divisors(ranks)) {
      const int replicas = ranks / partitions;
      if (base.global_batch_size % replicas != 0) continue;
      const int per_replica = base.global_batch_size / replicas;
      for (int ep : expert_degrees(replicas, profile)) {
        const std::string refused = experts_refusal(ep, profile.experts, tp, base.sequence_parallel);
        for (Layout& layout : layouts_of(partitions, replicas, per_replica, modules, profile.least_microbatch,
                                               for_a_job && !base.plans("microbatches") ? base.microbatches : 0)) {
          LayoutPrediction prediction;
          layout.tensor_parallel = tp;
          layout.experts = ep;
          prediction.layout = layout;
          if (refused.empty()) {
            predict(prediction, profile, base, world_size, costs, optimizer_moments);
          } else {
            prediction.rejected = refused;
          }
          predictions.push_back(std::move(prediction));
        }
      }
    }
  }
  std::stable_sort(predictions.begin(), predictions.end(), [](const LayoutPrediction& a, const LayoutPrediction& b) {
    if (a.rejected.empty() != b.rejected.empty()) return a.rejected.empty();
    // Equal predictions: the one that holds less, then the one with fewer (larger) microbatches, which the linear
    // model cannot tell apart but which pay less per-microbatch overhead.
    if (a.step_s != b.step_s) return a.step_s < b.step_s;
    if (a.peak_memory_mib() != b.peak_memory_mib()) return a.peak_memory_mib() < b.peak_memory_mib();
    return a.layout.microbatches < b.layout.microbatches;
  });
  if (for_a_job) keep_what_the_config_fixes(predictions, base, world_size);
  if (!predictions.empty() && predictions.front().rejected.empty()) {
    const Layout& best = predictions.front().layout;
    predictions.front().timeline_svg = layout_timeline_svg(by_degree.at(std::max(1, best.tensor_parallel)), base,
                                                           world_size, best, costs, optimizer_moments);
  }
  return predictions;
}

std::string layout_timeline_svg(const ModelProfile& profile, const Config& base, int world_size, const Layout& layout,
                                const PlanningCosts& costs, double optimizer_moments) {
  LayoutPrediction prediction;
  prediction.layout = layout;
  std::vector<RankTimeline> timeline;
  predict(prediction, profile, base, world_size, costs, optimizer_moments, &timeline);
  if (!prediction.rejected.empty()) return {};
  char title[256];
  std::snprintf(title, sizeof title, "planned: %s, simulated step %.1f ms (pipeline %.1f ms, bubble %.1f%%)",
                layout.describe().c_str(), prediction.step_s * 1e3, prediction.pipeline_s * 1e3,
                prediction.bubble_fraction * 100);
  return to_svg(timeline, title);
}

}  // namespace smp
