// Pipeline efficiency on CPU: the same GPT-style model and global batch trained by `partitions` processes
// (one stage each) and by one process. scripts/bench.sh runs both and prints the ratio against the ideal
// m/(m+p-1)*p. Prints one JSON line (rank 0) with the median step time over the measured steps (train_step alone,
// and with the optimizer step: "iteration").

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "common/gpt.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/main.h"
#include "smp/runtime.h"
#include "smp/tp.h"

namespace {

int run(int argc, char** argv) {
  std::string config_path;
  int warmup = 2, measured = 10;
  std::string optimizer_name = "sgd";
  static const char* const kUsage =
      "usage: smprun -n P -- bench_pipeline --config FILE [--warmup N] [--steps N] [--optimizer sgd|adamw]\n"
      "  FILE: smp's keys in an \"smp\" section and the GPT's in \"model\" (bench/run_benchmarks.py writes them)\n";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") return std::fputs(kUsage, stdout), 0;
  }
  if (argc % 2 == 0) throw smp::ConfigError(std::string("bench_pipeline: ") + argv[argc - 1] + " needs a value\n" + kUsage);
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--config") config_path = argv[i + 1];
    else if (flag == "--warmup") warmup = std::stoi(argv[i + 1]);
    else if (flag == "--steps") measured = std::stoi(argv[i + 1]);
    else if (flag == "--optimizer") optimizer_name = argv[i + 1];
    else throw smp::ConfigError("bench_pipeline: unknown flag " + flag);
  }
  if (config_path.empty()) throw smp::ConfigError(std::string("bench_pipeline: no --config\n") + kUsage);
  const auto config = smp::Config::from_file(config_path);
  config.check_sections({"model"});
  auto runtime = smp::Runtime::init(config);
  auto model_options = smp::examples::gpt_options_from_section(config.application("model").dump(), config.source);
  model_options.sequence_parallel = config.sequence_parallel;
  const int64_t batch = config.global_batch_size, length = model_options.context;
  at::manual_seed(config.seed);
  // With "tensor_parallel_degree" > 1 the blocks, the embedding and the output layer hold this rank's shards.
  auto model = smp::examples::make_gpt(model_options, runtime->tensor_parallel_group());
  const auto loss = smp::examples::gpt_loss_for(runtime->tensor_parallel_group());
  auto tokens = [&](int step) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(step));
    auto all = at::randint(model_options.vocab_size, {batch, length + 1}, generator, at::kLong);
    return std::make_pair(all.narrow(1, 0, length).contiguous(), all.narrow(1, 1, length).contiguous());
  };
  const int64_t microbatch = batch / runtime->topology().data_parallel_degree() / config.microbatches;
  smp::DistributedModel distributed(runtime, model, tokens(0).first.narrow(0, 0, microbatch));
  std::unique_ptr<torch::optim::Optimizer> local_optimizer;
  if (optimizer_name == "adamw") {
    local_optimizer = std::make_unique<torch::optim::AdamW>(distributed.parameters(), torch::optim::AdamWOptions(1e-4));
  } else if (optimizer_name == "sgd") {
    local_optimizer = std::make_unique<torch::optim::SGD>(distributed.parameters(), torch::optim::SGDOptions(1e-3));
  } else {
    throw smp::ConfigError("bench_pipeline: --optimizer must be sgd or adamw, got " + optimizer_name);
  }
  smp::DistributedOptimizer optimizer(distributed, std::move(local_optimizer));
  std::vector<double> times, iteration_times;  // train_step alone; with the optimizer step
  int sends_posted = 0, peak_sends_held = 0;  // of the last step, on this rank
  smp::CollectiveBytes tp_before;  // at the first measured step
  for (int step = 0; step < warmup + measured; ++step) {
    if (step == warmup) tp_before = smp::collective_bytes();
    const auto [inputs, targets] = tokens(step);
    runtime->world().barrier();  // every rank starts the step together, so the slowest stage sets the time
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    const auto output = distributed.train_step(runtime->replica_slice(inputs), runtime->replica_slice(targets), loss);
    optimizer.step();  // with sharded optimizer state, the exchange of the updated parameters too
    if (step >= warmup) {
      times.push_back(output.seconds);
      iteration_times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    sends_posted = output.sends_posted;
    peak_sends_held = output.peak_sends_held;
  }
  // The job's step time is its slowest rank's: gather every rank's median (a sum of one-hot vectors).
  const auto job_median_of = [&](std::vector<double> values) {
    std::sort(values.begin(), values.end());
    at::Tensor all_medians = at::zeros({runtime->world_size()}, at::kDouble);
    all_medians[runtime->rank()] = values[values.size() / 2];
    runtime->world().all_reduce_sum(all_medians);
    return all_medians.max().item<double>();
  };
  const double job_median = job_median_of(times), job_iteration_median = job_median_of(iteration_times);
  // Steady-step spread: the slowest over the fastest iteration of rank 0 (every rank waits for the slowest stage).
  const double spread = *std::max_element(iteration_times.begin(), iteration_times.end()) /
                        *std::min_element(iteration_times.begin(), iteration_times.end());
  // Peak resident memory of the largest process: what activation checkpointing is meant to lower.
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  at::Tensor peaks = at::zeros({runtime->world_size()}, at::kDouble);
  peaks[runtime->rank()] = static_cast<double>(usage.ru_maxrss) / 1024.0;
  runtime->world().all_reduce_sum(peaks);
  // The optimizer state this rank holds (AdamW's two moments; SGD without momentum has none): what
  // shard_optimizer_state divides among the replicas. The largest rank's.
  double state_bytes = 0;
  for (const auto& [key, state] : optimizer.local().state()) {
    if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      state_bytes += static_cast<double>(adamw->exp_avg().nbytes() + adamw->exp_avg_sq().nbytes());
    }
  }
  at::Tensor states = at::zeros({runtime->world_size()}, at::kDouble);
  states[runtime->rank()] = state_bytes / (1 << 20);
  runtime->world().all_reduce_sum(states);
  const auto tp_after = smp::collective_bytes();
  if (runtime->rank() == 0) {
    // Rank 0 (stage 0's first shard): its tensor-parallel collectives per measured step.
    std::printf("{\"tensor_parallel\": %d, \"tp_all_reduced_bytes_per_step\": %.0f, "
                "\"tp_all_gathered_bytes_per_step\": %.0f, \"tp_reduce_scattered_bytes_per_step\": %.0f, ",
                runtime->topology().tensor_parallel_degree(),
                static_cast<double>(tp_after.all_reduced - tp_before.all_reduced) / measured,
                static_cast<double>(tp_after.all_gathered - tp_before.all_gathered) / measured,
                static_cast<double>(tp_after.reduce_scattered - tp_before.reduce_scattered) / measured);
    std::printf("\"partitions\": %d, \"replicas\": %d, \"microbatches\": %d, \"schedule\": \"%s\", "
                "\"global_batch\": %lld, \"median_step_s\": %.6f, \"median_iteration_s\": %.6f, \"samples_per_s\": %.2f, "
                "\"iteration_samples_per_s\": %.2f, \"spread\": %.3f, \"peak_rss_mib\": %.1f, "
                "\"optimizer_state_mib\": %.1f, \"rank0_sends_posted\": %d, \"rank0_peak_sends_held\": %d}\n",
                config.partitions, runtime->topology().data_parallel_degree(), config.microbatches,
                distributed.schedule().name.c_str(), static_cast<long long>(batch), job_median, job_iteration_median,
                static_cast<double>(batch) / job_median, static_cast<double>(batch) / job_iteration_median, spread,
                peaks.max().item<double>(), states.max().item<double>(),
                sends_posted, peak_sends_held);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
