// Memory of the C++ GPT (examples/common) whose nodes are built on demand: each rank builds its own stages' nodes,
// rank 0 the others one at a time while it profiles them. Run under smprun with one process per pipeline stage;
// each rank prints one JSON line with its peak resident memory growth (from just after Runtime::init to after the
// last step) against the bytes of the parameters it holds. --whole builds the whole model on every rank first (what
// every rank did before nodes were built on demand), for the comparison.
//
//   smprun -n 4 -- bench_memory --layers 16 --width 1024 [--whole]     # 0.78 GiB of float32 parameters

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <torch/optim/sgd.h>

#include "common/gpt.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/main.h"
#include "smp/runtime.h"

namespace {

double peak_resident_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

double resident_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0.0;
}

int run(int argc, char** argv) {
  smp::examples::GptOptions options;
  options.layers = 16, options.d_model = 1024, options.heads = 16, options.vocab_size = 8192, options.context = 32;
  int steps = 2;
  bool whole = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--whole") {
      whole = true;
      continue;
    }
    if (flag == "--help" || flag == "-h") {
      std::puts("usage: smprun -n P -- bench_memory [--layers N] [--width D] [--steps N] [--whole]");
      return 0;
    }
    if (i + 1 >= argc) throw smp::ConfigError("bench_memory: " + flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--layers") options.layers = std::stoll(value);
    else if (flag == "--width") options.d_model = std::stoll(value), options.heads = options.d_model / 64;
    else if (flag == "--steps") steps = std::stoi(value);
    else throw smp::ConfigError("bench_memory: unknown flag " + flag);
  }
  const char* world = std::getenv("WORLD_SIZE");
  const std::string partitions = world ? world : "1";
  auto runtime = smp::Runtime::init(smp::Config::from_json_text(
      R"({"partitions": )" + partitions + R"(, "microbatches": 4, "global_batch_size": 4, "seed": 1, "device": "cpu"})",
      "bench_memory"));
  const double baseline = resident_mib();
  const auto started = std::chrono::steady_clock::now();
  auto model = smp::examples::make_gpt(options);
  if (whole) model.materialize(1);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(0);
  const auto tokens = at::randint(options.vocab_size, {4, options.context + 1}, generator, at::kLong);
  const at::Tensor inputs = tokens.narrow(1, 0, options.context).contiguous();
  const at::Tensor targets = tokens.narrow(1, 1, options.context).contiguous();
  smp::DistributedModel distributed(runtime, model, inputs.narrow(0, 0, 1));
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  smp::DistributedOptimizer optimizer(
      distributed, std::make_unique<torch::optim::SGD>(distributed.parameters(), torch::optim::SGDOptions(1e-3)));
  double own_bytes = 0.0;
  for (const auto& parameter : distributed.parameters()) own_bytes += static_cast<double>(parameter.nbytes());
  double loss = 0.0;
  std::string step_seconds;
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    const auto output = distributed.train_step(inputs, targets, smp::examples::gpt_loss);
    optimizer.step();
    loss = output.loss;
    step_seconds += (step_seconds.empty() ? "" : ", ") + std::to_string(output.seconds);
  }
  const double growth = peak_resident_mib() - baseline;
  const double own_mib = own_bytes / (1 << 20);
  std::printf("{\"rank\": %d, \"whole\": %s, \"own_parameters_mib\": %.1f, \"peak_growth_mib\": %.1f, "
              "\"growth_over_own\": %.2f, \"limit_mib\": %.1f, \"build_s\": %.2f, \"step_s\": [%s], \"loss\": %.6f}\n",
              runtime->rank(), whole ? "true" : "false", own_mib, growth, growth / own_mib, 2.5 * own_mib + 150.0,
              build_s, step_seconds.c_str(), loss);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
