#include "smp/planned_layout.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <torch/optim/adamw.h>

#include "pipeline/autocast_scope.h"
#include "pipeline/split_backward.h"
#include "training/timed_work.h"
#include "smp/device_speeds.h"

#include "smp/checkpoint_manifest.h"
#include "smp/collectives.h"
#include "smp/distributed_model.h"
#include "smp/layout_plan.h"
#include "smp/log.h"
#include "smp/stage_plan.h"
#include "smp/timeline.h"
#include "smp/tp.h"

namespace smp {

// On the job's device, as the job's own profile runs (each module goes there for its rounds: a GPU job's costs are
// the GPU's, whatever device the sample was made on), and on the sample twice over (its batched inputs
// concatenated): a layout's microbatch size moves a stage call's fixed cost, which one size alone cannot tell from
// its cost per sample (priced in proportion, the C++ worker's small GPT's one-sample microbatches came to 1/16 of a
// 16-sample call, 0.04 ms against 0.5 ms measured, and an auto job of 2 ranks chose pp 2 with 16 of them: predicted
// 1.4 ms, measured 9.8).
ModelProfile profile_for_planning(const GraphModel& model, const ModelInputs& sample, c10::Device device) {
  ModelInputs on_device;
  for (const auto& input : sample) on_device.push_back(input.defined() ? input.to(device) : input);
  const std::vector<bool> batched = DistributedModel::batched_inputs(on_device, at::Tensor());
  int batch = 1;
  ModelInputs doubled = on_device;
  for (std::size_t i = 0; i < on_device.size(); ++i) {
    if (!batched[i]) continue;
    batch = static_cast<int>(on_device[i].size(0));
    doubled[i] = at::cat({on_device[i], on_device[i]});
  }
  const WithoutCollectives alone;
  const SplitBackwardTimer time_split = split_backward_timer();  // one eviction buffer for both sizes
  ModelProfile profile{profile_graph(model, on_device, 3, time_split, /*scale_to_whole=*/true), batch, {}, 0};
  if (std::none_of(batched.begin(), batched.end(), [](bool is) { return is; })) return profile;
  try {
    profile.larger = profile_graph(model, doubled, 3, time_split, /*scale_to_whole=*/true);
    profile.larger_batch = 2 * batch;
  } catch (const std::exception& error) {
    // A model that takes the sample may still refuse twice it (a reshape to the sample's size, memory): planned
    // from the one size, each microbatch's cost then in proportion to its samples. Not a device that failed: one
    // that refuses further work (a CUDA device-side assert) ends the plan here, naming that error.
    if (!device.is_cpu()) at::accelerator::synchronizeDevice(device.index());
    log::warn("planning from the sample's size alone: the model on " + std::to_string(2 * batch) +
              " samples failed (" + std::string(error.what()).substr(0, 300) + ")");
  }
  return profile;
}

namespace {

// Cut as finely as the most stages considered (two per rank).
ModelProfile planning_profile(const GraphModel& model, const ModelInputs& sample, int world, c10::Device device) {
  return profile_for_planning(model.expanded_to(static_cast<std::size_t>(2 * world)), sample, device);
}

// LibTorch's AdamW stepping tensors of the model's own parameter shapes (the profile's, up to 16 Mi elements of
// them; one tensor of 4 Mi when none fits): seconds per parameter byte, the median of 5 steps after 2. The shapes
// matter on a CPU: a small model's parameters, gradients and moments stay in the caches through the step's passes
// over them, where one tensor of 4 Mi took 1.6 to 1.9 times as long per byte (as Python's smp.plan times
// torch.optim's, which a Python job steps with).
double optimizer_seconds_per_byte(const ModelProfile& profile, c10::Device device) {
  constexpr std::int64_t kMostElements = std::int64_t{1} << 24;
  std::vector<at::Tensor> parameters;
  std::int64_t elements = 0;
  for (const auto& node : profile.modules) {
    for (const auto& [name, shape] : parameter_shapes_of(node)) {
      std::int64_t count = 1;
      for (std::int64_t size : shape) count *= size;
      if (count <= 0 || elements + count > kMostElements) continue;
      elements += count;
      parameters.push_back(at::zeros(shape, at::TensorOptions().device(device)).requires_grad_());
    }
  }
  if (parameters.empty()) parameters.push_back(at::zeros({1 << 22}, at::TensorOptions().device(device)).requires_grad_());
  double bytes = 0.0;
  for (auto& parameter : parameters) {
    parameter.mutable_grad() = at::ones_like(parameter);
    bytes += static_cast<double>(parameter.nbytes());
  }
  torch::optim::AdamW optimizer(parameters, torch::optim::AdamWOptions(1e-3));
  std::vector<double> times;
  for (int round = 0; round < 7; ++round) {
    const auto start = std::chrono::steady_clock::now();
    optimizer.step();
    if (device.is_cuda()) at::accelerator::synchronizeDevice(device.index());
    if (round >= 2) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] / bytes;
}

// Rank 0's choice: the chosen config's document. `unplanned`: the tensor-parallel degrees the model could not be
// built for, with why (reported).
std::string plan_on_rank0(Runtime& runtime, const std::map<int, ModelProfile>& by_degree,
                          const std::map<int, std::string>& unplanned, const PlanningCosts& measured,
                          const std::vector<double>& speeds) {
  PlanningCosts costs = measured;
  costs.optimizer_s_per_byte = optimizer_seconds_per_byte(by_degree.begin()->second, runtime.device());
  // Measured speeds stand in for "measure" in what the planner reads (a list, one per rank).
  Config config = runtime.config();
  if (config.measure_device_speeds) config.device_speeds = speeds;
  const int world = runtime.world_size();
  char links[200];
  const int written = std::snprintf(links, sizeof links, "links measured over the %d ranks: latency %.1f us, %.2f GB/s",
                                    world, costs.latency_s * 1e6, costs.p2p_bytes_per_s / 1e9);
  if (costs.shared_processors > 0 && written > 0 && written < static_cast<int>(sizeof links)) {
    std::snprintf(links + written, sizeof links - static_cast<std::size_t>(written),
                  "; the ranks computing at once had %.2f processors", costs.shared_processors);
  }
  log::info(links);
  const auto predictions = plan_layouts(by_degree, config, world, costs, /*optimizer_moments=*/2.0, /*for_a_job=*/true);
  std::string not_planned;
  for (const auto& [degree, why] : unplanned) not_planned += "tp " + std::to_string(degree) + ": not planned: " + why + "\n";
  const ModelProfile& profiled = by_degree.begin()->second;
  const std::string sizes = profiled.larger_batch > profiled.batch
                                ? std::to_string(profiled.batch) + " and " + std::to_string(profiled.larger_batch)
                                : std::to_string(profiled.batch);
  log::info("layouts planned for the \"auto\" keys of " + config.source + " (the model profiled on " + sizes +
            " samples a call):\n" + layout_report(predictions) + not_planned);
  auto [prediction, chosen] = choose_layout(predictions, runtime.config(), world);
  char chosen_line[200];
  std::snprintf(chosen_line, sizeof chosen_line,
                ", predicted step %.1f ms (the optimizer's step %.1f ms of it), peak %.3f MiB per rank",
                prediction.step_s * 1e3, prediction.optimizer_s * 1e3, prediction.peak_memory_mib());
  log::info("planned layout " + prediction.layout.describe() + chosen_line);
  // train_step is measured without the optimizer's step, which the program takes after it.
  runtime.note_planned_step({prediction.layout.describe(), prediction.step_s - prediction.optimizer_s,
                             prediction.optimizer_s, {}});
  if (!config.trace_dir.empty()) {
    std::filesystem::create_directories(config.trace_dir);
    const std::string path = config.trace_dir + "/planned_layout.svg";
    write_file_atomically(path, prediction.timeline_svg);
    log::info("wrote the planned layout's simulated step to " + path);
  }
  return chosen.text;
}

// The processors the host's ranks get at once, measured rather than counted: model-sized matrix work (TimedMatrixWork)
// timed on rank 0 alone, as the profile runs with its peers waiting, then repeated by every rank at once for the same
// window; each rank's speed is the share alone / at once of a processor, and their sum the processors the ranks have
// (at most the cores). Other tenants of the host, cache and memory contention and switching between ranks show in it;
// a count of cores does not (4 ranks on 2 cores computed at 1.7 processors' speed, not 2). The median of 3 rounds.
double processors_at_once(Runtime& runtime, int cores) {
  const TimedMatrixWork work(c10::Device(c10::kCPU));
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  comm::Communicator& world = runtime.world();
  const int ranks = runtime.world_size();
  std::vector<double> estimates;
  for (int round = 0; round < 3; ++round) {
    // Alone: the others wait on the store (a blocked socket, not a spinning wait).
    const std::string key = "processors_at_once/" + std::to_string(runtime.next_exchange());
    double alone_s = 0.0;
    if (runtime.rank() == 0) {
      alone_s = work.fastest_seconds(3);
      runtime.publish(key, std::to_string(alone_s));
    } else {
      alone_s = std::stod(runtime.fetch(key));
    }
    at::Tensor barrier = at::zeros({1});
    world.all_reduce_sum(barrier);
    // At once, for a window of 24 passes alone: every rank runnable throughout, however the host interleaves them.
    const auto start = Clock::now();
    int passes = 0;
    while (seconds_since(start) < 24 * alone_s) {
      work.run();
      ++passes;
    }
    at::Tensor speed = at::full({1}, passes * alone_s / seconds_since(start), at::kFloat);
    world.all_reduce_sum(speed);
    estimates.push_back(speed.item<double>());
  }
  std::sort(estimates.begin(), estimates.end());
  return std::clamp(estimates[1], 0.25, static_cast<double>(std::min(cores, ranks)));
}

// The last-level cache this process's core reads through. glibc's sysconf answers the whole package's (on this
// host's AMD EPYC, 320 MiB against the 32 MiB the core's complex shares), which made the split timer write 640 MiB
// between each I and its W; the kernel's cache description says what the core has.
std::size_t last_level_cache_bytes() {
  std::size_t largest = 0;
  int level = 0;
  const int cpu = std::max(::sched_getcpu(), 0);
  const std::filesystem::path caches = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/cache";
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(caches, error)) {
    int entry_level = 0;
    std::string size;
    if (!(std::ifstream(entry.path() / "level") >> entry_level) || !(std::ifstream(entry.path() / "size") >> size)) continue;
    std::size_t bytes = 0;
    try {
      bytes = std::stoull(size);
    } catch (const std::exception&) {
      continue;
    }
    if (size.back() == 'K') bytes <<= 10;
    if (size.back() == 'M') bytes <<= 20;
    if (entry_level > level || (entry_level == level && bytes > largest)) {
      level = entry_level;
      largest = bytes;
    }
  }
  if (largest > 0) return largest;
  const long reported = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  return reported > 0 ? static_cast<std::size_t>(reported) : 0;
}

}  // namespace

SplitBackwardTimer split_backward_timer() {
  // In a step W runs well after its I (other microbatches' work between them), from memory that work has replaced
  // in the caches; timed right after I it would read what I just left there. On a CPU the timer writes over more
  // than a last-level cache between them: the split then costs what a stage pays in a step (a middle stage of 4 GPT
  // blocks, d 128: I + W 1.17 times B so timed, 1.02 without, 1.07 to 1.09 in bench_engine's stage-level run).
  const auto larger_than_caches = std::make_shared<std::vector<char>>();
  const std::size_t eviction_bytes = std::max<std::size_t>(std::size_t{64} << 20, 2 * last_level_cache_bytes());
  return [larger_than_caches, eviction_bytes](const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                              const std::vector<at::Tensor>& parameters, const std::function<std::int64_t()>& live_bytes) {
    const c10::Device device = output.device();
    auto settle = [&] {
      if (!device.is_cpu()) at::accelerator::synchronizeDevice(device.index());
    };
    settle();
    SplitBackwardTiming timing;
    auto start = std::chrono::steady_clock::now();
    auto [gradients, weight_pass] = WeightPass::run_input_pass({output}, {at::ones_like(output)}, inputs, parameters);
    settle();
    timing.input_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    timing.live_bytes_between = live_bytes();
    for (const auto& gradient : gradients) {
      if (gradient.defined()) timing.live_bytes_between -= gradient.numel() * static_cast<std::int64_t>(gradient.element_size());
    }
    if (device.is_cpu()) {
      if (larger_than_caches->size() < eviction_bytes) larger_than_caches->resize(eviction_bytes);
      std::fill(larger_than_caches->begin(), larger_than_caches->end(), char{1});
    }
    start = std::chrono::steady_clock::now();
    weight_pass.run();
    settle();
    timing.weight_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return timing;
  };
}

namespace {

double median(std::vector<double> times) {
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Where a host's ranks share its cores: what a collective costs between ranks that compute up to it, as
// tensor-parallel peers do (a shard of a layer, then a collective), into costs.synchronization_s and
// costs.synchronized_bytes_per_s. Every rank at once runs 16 chunks of layer-sized work, then the same chunks each
// followed by an all-reduce within its pair (ranks 2k and 2k + 1, a group as a tensor-parallel one is), of 1 KiB and
// then of 512 KiB; the extra time per all-reduce over the chunks alone gives a fixed part and a part per byte. A rank
// that waits gives its core away, and its reply waits for it back: idle, a 512 KiB all-reduce of a pair took 0.5 ms
// here (4 ranks on 2 cores); after computing, 1.4 to 2.7 ms, and in a tensor-parallel job's trace 0.5 to 17 ms
// (median about 4), which this still falls short of.
void collectives_while_computing(Runtime& runtime, PlanningCosts& costs) {
  comm::Communicator& world = runtime.world();
  const int me = runtime.rank(), ranks = runtime.world_size();
  const bool paired = (me | 1) < ranks;  // an odd last rank computes beside the pairs
  const auto options = at::TensorOptions().device(runtime.device());
  std::shared_ptr<comm::Communicator> pair;
  const std::string name = "planning_pair/" + std::to_string(runtime.next_exchange()) + "/" + std::to_string(me & ~1);
  if (paired) pair = runtime.make_group({me & ~1, me | 1}, name);
  // Constant values: the work's time is the point, and the job's random numbers stay as they were.
  const at::Tensor rows = at::full({256, 256}, 0.5, options), up = at::full({256, 1024}, 0.01, options),
                   down = at::full({1024, 256}, 0.01, options);
  const auto chunk = [&] { (void)at::mm(at::relu(at::mm(rows, up)), down).sum().item<float>(); };
  constexpr int kChunks = 16;
  const auto phase = [&](const at::Tensor* exchanged) {
    at::Tensor barrier = at::zeros({1}, options);
    world.all_reduce_sum(barrier);
    const auto start = std::chrono::steady_clock::now();
    for (int index = 0; index < kChunks; ++index) {
      chunk();
      if (exchanged == nullptr || !paired) continue;
      pair->all_reduce_sum(*exchanged);
      pair->synchronize();
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const at::Tensor small = at::zeros({256}, options), large = at::zeros({131072}, options);
  std::vector<double> small_extra, large_extra;
  for (int round = 0; round < 4; ++round) {
    const double computing = phase(nullptr), with_small = phase(&small), with_large = phase(&large);
    if (round == 0) continue;  // warms up
    small_extra.push_back(std::max(0.0, (with_small - computing) / kChunks));
    large_extra.push_back(std::max(0.0, (with_large - computing) / kChunks));
  }
  // Alike on every rank: the means over the paired ranks of each one's medians.
  at::Tensor sums = at::tensor({paired ? median(small_extra) : 0.0, paired ? median(large_extra) : 0.0,
                                paired ? 1.0 : 0.0}, at::TensorOptions().dtype(at::kDouble));
  world.all_reduce_sum(sums);
  const double members = sums[2].item<double>();
  if (members == 0) return;
  costs.synchronization_s = sums[0].item<double>() / members;
  const double per_byte_s = (sums[1].item<double>() / members - costs.synchronization_s);
  // A pair's ring moves the payload once each way: (n - 1) / n of twice its bytes.
  if (per_byte_s > 0) costs.synchronized_bytes_per_s = static_cast<double>(large.nbytes()) / per_byte_s;
}

}  // namespace

PlanningCosts measured_planning_costs(Runtime& runtime) {
  PlanningCosts costs;
  costs.p2p_bytes_per_s = costs.all_reduce_bytes_per_s = runtime.config().link_bandwidth_gbps * 1e9;
  if (runtime.device().is_cpu()) {
    // Ranks that outnumber this host's cores share them (one intra-op thread each).
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (runtime.launch().local_world_size > cores) {
      costs.ranks_per_node = runtime.launch().local_world_size;  // the ranks that share them (no inter-node costs)
      // One host (every rank counts), else its cores: the ranks of other hosts cannot be told apart here.
      costs.shared_processors = runtime.launch().local_world_size == runtime.world_size()
                                    ? processors_at_once(runtime, cores)
                                    : cores;
    }
  }
  const int ranks = runtime.world_size();
  if (ranks < 2) return costs;
  // The median round, what a step will see: where ranks share cores the fastest all-reduce of the model's
  // gradients took half the median (4 ranks on 2 cores: 49-62 against 124-128 ms), and predictions from the
  // fastest fell 15-20% short of data-parallel steps.
  auto median_seconds = [&](const at::Tensor& tensor) {
    std::vector<double> times;
    for (int round = 0; round < 11; ++round) {
      const auto start = std::chrono::steady_clock::now();
      runtime.world().all_reduce_sum(tensor);
      runtime.world().synchronize();
      if (round >= 2) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return median(std::move(times));
  };
  const auto options = at::TensorOptions().device(runtime.device());
  const double scalar_s = median_seconds(at::zeros({1}, options));
  const at::Tensor large = at::zeros({1 << 20}, options);
  const double large_s = median_seconds(large);
  const double steps = 2.0 * (ranks - 1);
  costs.latency_s = scalar_s / steps;
  // A transfer between two stages: half a ping-pong's round trip of 1 KiB between neighbours (0 and 1, 2 and 3, ...;
  // an odd last rank keeps the all-reduce's figure).
  comm::Communicator& world = runtime.world();
  std::vector<std::pair<int, int>> channels;
  for (int rank = 0; rank + 1 < ranks; rank += 2) channels.insert(channels.end(), {{rank, rank + 1}, {rank + 1, rank}});
  world.connect(channels);
  const int me = runtime.rank(), partner = me ^ 1;
  if (partner < ranks) {
    const at::Tensor ping = at::zeros({256}, options);
    std::vector<double> round_trips;
    for (int round = 0; round < 12; ++round) {
      const auto start = std::chrono::steady_clock::now();
      if (me % 2 == 0) {
        world.isend(ping, partner, 1)->wait();
        world.irecv(ping, partner, 2)->wait();
      } else {
        world.irecv(ping, partner, 1)->wait();
        world.isend(ping, partner, 2)->wait();
      }
      world.synchronize();
      if (round >= 2) round_trips.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    costs.latency_s = median(std::move(round_trips)) / 2;
  }
  // Only the tensor-parallel collectives and the experts' exchanges are priced on it: a job that plans neither does
  // not spend the time.
  const Config& config = runtime.config();
  const bool synchronized = config.plans("tensor_parallel_degree") || config.tensor_parallel_degree > 1 ||
                            config.plans("expert_parallel_degree") || config.expert_parallel_degree > 1;
  if (costs.shared_processors > 0 && synchronized) collectives_while_computing(runtime, costs);
  const double bytes = steps / ranks * static_cast<double>(large.nbytes());
  if (large_s > scalar_s) costs.p2p_bytes_per_s = costs.all_reduce_bytes_per_s = bytes / (large_s - scalar_s);
  return costs;
}

void log_step_against_plan(Runtime& runtime, long long step, double seconds) {
  auto& planned = runtime.planned_step();
  if (!planned || step < 1 || step > 4) return;  // counted from 0
  auto& measured = planned->measured_s;
  measured.push_back(seconds);
  if (measured.size() != 4) return;
  std::sort(measured.begin(), measured.end());
  char line[256];
  std::snprintf(line, sizeof line,
                "planned layout %s: train_step measured %.1f ms (median of steps 2-5), predicted %.1f ms (+%.1f ms "
                "predicted for the optimizer's step)",
                planned->layout.c_str(), (measured[1] + measured[2]) / 2 * 1e3, planned->predicted_s * 1e3,
                planned->optimizer_s * 1e3);
  log::info(line);
}

namespace {

// Every rank at once: the links measured, rank 0 plans (`plan`: the chosen config's document), every rank adopts.
using PlanOnRank0 = std::function<std::string(Runtime&, const PlanningCosts&, const std::vector<double>&)>;
std::shared_ptr<Runtime> adopt_plan(std::shared_ptr<Runtime> runtime, const PlanOnRank0& plan) {
  const std::string resumed = runtime->from_rank0("resumed_layout", [&] {
    return resumed_layout(runtime->config(), runtime->world_size()).value_or("");
  });
  if (!resumed.empty()) {
    runtime->adopt_layout(Config::from_json_text(resumed, runtime->config().source));
    return runtime;
  }
  const PlanningCosts costs = measured_planning_costs(*runtime);
  const std::vector<double> speeds = device_speeds(*runtime, "planned_layout/");
  const std::string text = runtime->from_rank0("planned_layout", [&] { return plan(*runtime, costs, speeds); });
  runtime->adopt_layout(Config::from_json_text(text, runtime->config().source));
  runtime->expect_planned_model();
  return runtime;
}

}  // namespace

std::optional<std::string> resumed_layout(const Config& given, int world_size) {
  if (given.auto_keys.empty() || !given.resume || given.checkpoint_dir.empty()) return std::nullopt;
  const auto found = find_latest_checkpoint(given.checkpoint_dir);
  if (!found) return std::nullopt;
  const CheckpointManifest manifest = read_manifest(found->directory);
  const std::string where = given.source + ": resuming " + found->directory;
  // The saved job's keys as written (a config this version no longer reads still gives its layout keys), the
  // manifest's where it records them.
  const nlohmann::json saved_document = nlohmann::json::parse(manifest.config_json);
  const nlohmann::json& saved = saved_document.contains("smp") ? saved_document["smp"] : saved_document;
  const int tp = manifest.tensor_parallel_degree;
  const int groups = manifest.partitions * tp;
  if (groups < 1 || world_size % groups != 0) {
    throw ConfigError(where + ", saved with " + std::to_string(manifest.partitions) + " partitions x " +
                      "tensor_parallel_degree " + std::to_string(tp) + ", which a resume keeps and " +
                      std::to_string(world_size) + " ranks do not hold; launch a multiple of " + std::to_string(groups) +
                      " ranks, or export the checkpoint and load it (smp.export_safetensors, load_parameters) into a "
                      "job planned anew");
  }
  const int replicas = world_size / groups;
  const int saved_microbatches = saved.contains("microbatches") && saved["microbatches"].is_number_integer()
                                     ? saved["microbatches"].get<int>()
                                     : Config{}.microbatches;
  int microbatches = std::max(1, saved_microbatches);
  while (microbatches > 1 && given.global_batch_size % (static_cast<long long>(replicas) * microbatches) != 0) {
    --microbatches;
  }
  const auto saved_or = [&](const char* key, nlohmann::json otherwise) {
    return saved.contains(key) ? saved[key] : otherwise;
  };
  const std::map<std::string, nlohmann::json> layout = {
      {"partitions", manifest.partitions},
      {"virtual_stages", manifest.virtual_stages},
      {"pipeline", saved_or("pipeline", Config{}.pipeline)},
      {"microbatches", microbatches},
      {"ddp", replicas > 1},
      {"activation_checkpointing", saved_or("activation_checkpointing", false)},
      {"shard_optimizer_state", saved_or("shard_optimizer_state", false)},
      {"tensor_parallel_degree", tp},
      {"expert_parallel_degree", manifest.expert_parallel_degree}};
  // A key this job fixes must agree with what the resume keeps.
  const Config fixed = given.provisional_layout(world_size);
  const auto differs = [&](const std::string& key, const std::string& theirs, const std::string& ours) {
    throw ConfigError(where + ", whose layout a resume keeps: it needs \"" + key + "\" " + theirs + ", and this job's " +
                      "config fixes " + ours + "; give that key \"auto\" or the checkpoint's value");
  };
  if (!given.plans("tensor_parallel_degree") && given.tensor_parallel_degree != tp) {
    differs("tensor_parallel_degree", std::to_string(tp), std::to_string(given.tensor_parallel_degree));
  }
  if (!given.plans("expert_parallel_degree") && given.expert_parallel_degree != manifest.expert_parallel_degree) {
    differs("expert_parallel_degree", std::to_string(manifest.expert_parallel_degree),
            std::to_string(given.expert_parallel_degree));
  }
  if (!given.plans("partitions") && fixed.partitions != manifest.partitions) {
    differs("partitions", std::to_string(manifest.partitions), std::to_string(fixed.partitions));
  }
  if (!given.plans("ddp") && !given.ddp && replicas > 1) {
    differs("ddp", "true (" + std::to_string(replicas) + " replicas on " + std::to_string(world_size) + " ranks)",
            "false");
  }
  nlohmann::json document = nlohmann::json::parse(given.text);
  nlohmann::json& section = document.contains("smp") ? document["smp"] : document;
  for (const auto& key : given.auto_keys) {
    if (key == "partitions") section.erase("pipeline_parallel_degree");  // the alias its "auto" was given by
    section[key] = layout.at(key);
  }
  for (const char* pins : {"partition_overrides", "auto_partition", "default_partition"}) {
    if (saved.contains(pins) && !section.contains(pins)) section[pins] = saved[pins];
  }
  std::string text = document.dump();
  try {
    Config::from_json_text(text, given.source);
  } catch (const ConfigError& error) {
    throw ConfigError(where + " keeps the layout it was saved with, which this job's other keys refuse: " +
                      error.what());
  }
  log::info(where + ": the \"auto\" keys take the layout it was saved with (a resume keeps its cut), " +
            std::to_string(replicas) + " replica(s) of it here, " + std::to_string(microbatches) + " microbatches" +
            (microbatches != saved_microbatches ? " (" + std::to_string(saved_microbatches) + " there: the global " +
                                                      "batch does not split into them over these replicas)"
                                                : std::string()));
  return text;
}

std::shared_ptr<Runtime> with_planned_layout(std::shared_ptr<Runtime> runtime, const GraphModel& model,
                                             const ModelInputs& sample) {
  const Config& config = runtime->config();
  if (config.auto_keys.empty()) return runtime;
  if (config.plans("tensor_parallel_degree") || config.tensor_parallel_degree > 1) {
    // A built model's smp::tp layers hold the group they were built over; a builder builds them for the choice.
    throw ConfigError(config.source + ": key \"" +
                      (config.plans("tensor_parallel_degree") ? "tensor_parallel_degree" : config.auto_keys.front()) +
                      "\": \"auto\" layouts with tensor parallelism need the model's builder (DistributedModel(runtime, "
                      "build, sample): its smp::tp layers are built over the chosen group), not a built model");
  }
  return adopt_plan(std::move(runtime), [&](Runtime& planner, const PlanningCosts& costs, const std::vector<double>& speeds) {
    std::optional<AutocastScope> autocast;  // profiled in the precision the stages compute in
    if (const auto precision = stage_precision(planner.config(), planner.device())) autocast.emplace(*precision);
    ModelProfile profile = planning_profile(model, sample, planner.world_size(), planner.device());
    autocast.reset();
    return plan_on_rank0(planner, {{1, std::move(profile)}}, {}, costs, speeds);
  });
}

std::shared_ptr<Runtime> with_planned_layout(std::shared_ptr<Runtime> runtime, const ModelBuilder& build,
                                             const ModelInputs& sample) {
  const Config& config = runtime->config();
  if (config.auto_keys.empty()) return runtime;
  const int world = runtime->world_size();
  std::vector<int> degrees{config.tensor_parallel_degree};
  if (config.plans("tensor_parallel_degree")) degrees = divisors(world);
  return adopt_plan(std::move(runtime), [&](Runtime& planner, const PlanningCosts& costs, const std::vector<double>& speeds) {
    std::map<int, ModelProfile> by_degree;
    std::map<int, std::string> unplanned;
    for (int degree : degrees) {
      // Built as tensor-parallel rank 0 of `degree` builds it, over a stand-in group that moves nothing.
      const tp::ProfiledDegree stand_in(degree);
      std::optional<AutocastScope> autocast;  // built and profiled in the precision the stages compute in
      if (const auto precision = stage_precision(planner.config(), planner.device())) autocast.emplace(*precision);
      try {
        ModelProfile profile = planning_profile(build(tp::process_group()), sample, world, planner.device());
        const bool collectives = std::any_of(profile.modules.begin(), profile.modules.end(), [](const ModuleProfile& node) {
          return node.tp_forward_collectives + node.tp_backward_collectives > 0;
        });
        if (degree > 1 && !collectives && degrees.size() > 1) {
          unplanned[degree] = "the model built for it runs no tensor-parallel collectives (no smp::tp layers over the group)";
        } else {
          by_degree[degree] = std::move(profile);
        }
      } catch (const ConfigError& error) {
        if (degrees.size() == 1) throw;
        unplanned[degree] = error.what();
      }
    }
    if (by_degree.empty()) throw ConfigError(config.source + ": the model could be built for no tensor-parallel degree");
    return plan_on_rank0(planner, by_degree, unplanned, costs, speeds);
  });
}

}  // namespace smp
