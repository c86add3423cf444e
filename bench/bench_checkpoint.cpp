// Checkpoint throughput: a GPT-style model trained one step with AdamW, then saved (partition files, manifest)
// and loaded back (resume). Prints one JSON line (rank 0): bytes written, save (until the manifest is written) and
// load seconds, MB/s, and the pause a save adds to the step (the copy of the state; the writing is in the
// background).

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "common/gpt.h"
#include "smp/checkpoint.h"
#include "smp/main.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int run(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "--config") throw smp::ConfigError("usage: bench_checkpoint --config FILE");
  smp::Config config = smp::Config::from_file(argv[2]);
  config.check_sections({"model"});
  config.resume = true;  // the first model finds nothing to resume; the second one loads what the first saved
  auto runtime = smp::Runtime::init(config);
  const auto model_options = smp::examples::gpt_options_from_section(config.application("model").dump(), config.source);
  const int64_t batch = config.global_batch_size, length = model_options.context;
  // Drawn alike on every rank (the ranks of a replica must be given the same batch: a step refuses others).
  auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.seed));
  auto tokens = at::randint(model_options.vocab_size, {batch, length + 1}, generator, at::kLong);
  const auto inputs = tokens.narrow(1, 0, length).contiguous(), targets = tokens.narrow(1, 1, length).contiguous();
  const int64_t microbatch = batch / runtime->topology().data_parallel_degree() / config.microbatches;

  auto build = [&] {
    at::manual_seed(config.seed);
    auto model = smp::examples::make_gpt(model_options);
    auto distributed = std::make_unique<smp::DistributedModel>(runtime, model, inputs.narrow(0, 0, microbatch));
    auto optimizer = std::make_unique<smp::DistributedOptimizer>(
        *distributed, std::make_unique<torch::optim::AdamW>(distributed->parameters(), torch::optim::AdamWOptions(1e-3)));
    return std::make_pair(std::move(distributed), std::move(optimizer));
  };
  auto [model, optimizer] = build();
  optimizer->zero_grad();
  model->train_step(runtime->replica_slice(inputs), runtime->replica_slice(targets), smp::examples::gpt_loss);
  optimizer->step();

  double save_s = 0.0, save_all_s = 0.0;
  auto start = std::chrono::steady_clock::now();
  {
    // Let go before the loader is made: one Checkpointer of a job holds the directory at a time.
    smp::Checkpointer saver(*model, *optimizer);
    runtime->world().barrier();
    start = std::chrono::steady_clock::now();
    saver.save(0);
    save_s = seconds_since(start);  // what the step waits for: the copy of the state
    saver.wait();
    runtime->world().barrier();
    save_all_s = seconds_since(start);
  }

  auto [reloaded, reloaded_optimizer] = build();
  smp::Checkpointer loader(*reloaded, *reloaded_optimizer);
  runtime->world().barrier();
  start = std::chrono::steady_clock::now();
  const auto next_step = loader.resume();
  runtime->world().barrier();
  const double load_s = seconds_since(start);
  if (next_step != 1) throw std::runtime_error("resume did not find the checkpoint just saved");

  if (runtime->rank() == 0) {
    std::uintmax_t bytes = 0;
    const std::string directory = config.checkpoint_dir + "/" + smp::checkpoint_directory_name(0);
    for (const auto& entry : std::filesystem::directory_iterator(directory)) bytes += entry.file_size();
    std::printf("{\"bytes\": %ju, \"save_s\": %.4f, \"save_mb_per_s\": %.1f, \"load_s\": %.4f, \"load_mb_per_s\": %.1f, "
                "\"step_pause_s\": %.4f}\n",
                bytes, save_all_s, bytes / 1e6 / save_all_s, load_s, bytes / 1e6 / load_s, save_s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
