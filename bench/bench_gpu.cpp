// GPU benchmark, one process on one GPU (scripts/device_gpu.sh runs it there; without a CUDA device it says so and
// exits 77). Prints one JSON line per measurement:
//   engine_overhead  time per schedule action that smp adds over plain LibTorch on a model too small to hide it
//   gpt_stage        achieved TFLOP/s of a GPT-style stage under smp vs the same model in plain LibTorch (fp32, bf16)
//   nccl_transfer    NCCL send/receive time vs bytes (the one-rank channel: a send to oneself through NCCL)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "common/gpt.h"
#include "smp/comm/communicator.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/main.h"
#include "smp/runtime.h"

namespace {

const c10::Device kGpu(c10::kCUDA, 0);

double median_seconds(int warmup, int measured, const std::function<void()>& step) {
  std::vector<double> times;
  for (int i = 0; i < warmup + measured; ++i) {
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    step();
    torch::cuda::synchronize();
    if (i >= warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

smp::Config config_of(const std::string& keys) {
  return smp::Config::from_json_text(R"({"device": "cuda", "seed": 3)" + keys + "}", "bench_gpu");
}

// Medians of two steps timed in alternation, so that the GPU's clocks and temperature drifting over the run
// weigh on both alike (timed one after the other, the second ran up to 3% apart from run to run).
std::pair<double, double> alternating_median_seconds(int warmup, int measured, const std::function<void()>& first,
                                                     const std::function<void()>& second) {
  std::vector<double> first_times, second_times;
  auto timed = [](const std::function<void()>& step) {
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    step();
    torch::cuda::synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (int i = 0; i < warmup + measured; ++i) {
    const double a = timed(first), b = timed(second);
    if (i < warmup) continue;
    first_times.push_back(a);
    second_times.push_back(b);
  }
  std::sort(first_times.begin(), first_times.end());
  std::sort(second_times.begin(), second_times.end());
  return {first_times[first_times.size() / 2], second_times[second_times.size() / 2]};
}

// Plain LibTorch's step for a GraphModel: forward through every node, loss, backward, SGD.
std::function<void()> plain_step(smp::GraphModel& model, const at::Tensor& inputs, const at::Tensor& targets,
                                 const smp::LossFunction& loss, int microbatches, bool bf16) {
  for (const auto& node : model.nodes()) node.module->to(kGpu);
  std::vector<at::Tensor> parameters;
  for (const auto& [name, parameter] : model.named_parameters()) parameters.push_back(parameter);
  auto optimizer = std::make_shared<torch::optim::SGD>(parameters, torch::optim::SGDOptions(1e-4));
  const auto input_chunks = inputs.to(kGpu).chunk(microbatches), target_chunks = targets.to(kGpu).chunk(microbatches);
  return [&model, optimizer, input_chunks, target_chunks, loss, microbatches, bf16] {
    optimizer->zero_grad();
    double total = 0.0;
    for (int i = 0; i < microbatches; ++i) {
      at::Tensor output;
      if (bf16) {
        at::autocast::set_autocast_enabled(c10::kCUDA, true);
        at::autocast::set_autocast_dtype(c10::kCUDA, at::kBFloat16);
        at::autocast::increment_nesting();
      }
      output = model.forward(input_chunks[i]);
      if (bf16) {
        if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
        at::autocast::set_autocast_enabled(c10::kCUDA, false);
        output = output.to(at::kFloat);
      }
      const at::Tensor value = loss(output, target_chunks[i]) / microbatches;
      value.backward();
      total += value.item<double>();
    }
    optimizer->step();
    (void)total;
  };
}

struct SmpTraining {
  std::unique_ptr<smp::DistributedModel> model;
  std::unique_ptr<smp::DistributedOptimizer> optimizer;
};

// smp's step; the model and its optimizer live as long as the step does.
std::function<void()> smp_step(const std::shared_ptr<smp::Runtime>& runtime, smp::GraphModel model,
                               const at::Tensor& inputs, const at::Tensor& targets, const smp::LossFunction& loss,
                               int* actions = nullptr) {
  const int64_t microbatch = inputs.size(0) / runtime->config().microbatches;
  auto training = std::make_shared<SmpTraining>();
  training->model = std::make_unique<smp::DistributedModel>(runtime, std::move(model), inputs.narrow(0, 0, microbatch));
  training->optimizer = std::make_unique<smp::DistributedOptimizer>(
      *training->model,
      std::make_unique<torch::optim::SGD>(training->model->parameters(), torch::optim::SGDOptions(1e-4)));
  if (actions) *actions = static_cast<int>(training->model->schedule().ranks[0].size());
  return [training, inputs, targets, loss] {
    training->optimizer->zero_grad();
    training->model->train_step(inputs, targets, loss);
    training->optimizer->step();
  };
}

void engine_overhead() {
  // Eight tiny stages in one process: the GPU work is a few microseconds, so the step time is mostly overhead.
  const int stages = 8, microbatches = 8;
  auto build = [] {
    at::manual_seed(3);
    torch::nn::Sequential chain;
    for (int i = 0; i < stages; ++i) chain->push_back(torch::nn::Linear(16, 16));
    return smp::GraphModel::from_sequential(chain);
  };
  const at::Tensor inputs = at::randn({64, 16}), targets = at::randn({64, 16});
  const smp::LossFunction loss = [](const at::Tensor& output, const at::Tensor& target) {
    return (output - target).pow(2).mean();
  };
  auto runtime = smp::Runtime::init(config_of(R"(, "microbatches": 8, "virtual_stages": 8)"));
  int actions = 0;
  auto plain_model = build();
  const auto [smp_s, plain_s] =
      alternating_median_seconds(5, 30, smp_step(runtime, build(), inputs, targets, loss, &actions),
                                 plain_step(plain_model, inputs, targets, loss, microbatches, false));
  std::printf("{\"bench\": \"engine_overhead\", \"stages\": %d, \"microbatches\": %d, \"actions_per_step\": %d, "
              "\"smp_step_ms\": %.3f, \"plain_step_ms\": %.3f, \"overhead_us_per_action\": %.1f}\n",
              stages, microbatches, actions, smp_s * 1e3, plain_s * 1e3, (smp_s - plain_s) / actions * 1e6);
  std::fflush(stdout);
}

void gpt_stage(bool bf16) {
  smp::examples::GptOptions options;
  options.vocab_size = 8192;
  options.context = 1024;
  options.d_model = 1024;
  options.heads = 16;
  options.layers = 8;
  const int64_t batch = 8;
  auto build = [&] {
    at::manual_seed(3);
    return smp::examples::make_gpt(options);
  };
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto tokens = at::randint(options.vocab_size, {batch, options.context + 1}, generator, at::kLong);
  const at::Tensor inputs = tokens.narrow(1, 0, options.context).contiguous();
  const at::Tensor targets = tokens.narrow(1, 1, options.context).contiguous();
  // Matrix products: 6 x parameters x tokens (forward + backward), plus attention's two T x T products per layer.
  int64_t parameters = 0;
  for (const auto& [name, parameter] : build().named_parameters()) parameters += parameter.numel();
  const double tokens_per_step = static_cast<double>(batch * options.context);
  const double flops = 6.0 * static_cast<double>(parameters) * tokens_per_step +
                       3.0 * 4.0 * options.layers * batch * static_cast<double>(options.context) * options.context *
                           options.d_model;
  const std::string precision = bf16 ? R"(, "bf16": true)" : "";
  auto runtime = smp::Runtime::init(config_of(R"(, "microbatches": 1)" + precision));
  auto plain_model = build();
  const auto [smp_s, plain_s] =
      alternating_median_seconds(3, 15, smp_step(runtime, build(), inputs, targets, smp::examples::gpt_loss),
                                 plain_step(plain_model, inputs, targets, smp::examples::gpt_loss, 1, bf16));
  std::printf("{\"bench\": \"gpt_stage\", \"precision\": \"%s\", \"parameters\": %lld, \"tokens\": %.0f, "
              "\"smp_step_ms\": %.2f, \"plain_step_ms\": %.2f, \"smp_tflops\": %.1f, \"plain_tflops\": %.1f, "
              "\"ratio\": %.3f}\n",
              bf16 ? "bf16" : "fp32", static_cast<long long>(parameters), tokens_per_step, smp_s * 1e3, plain_s * 1e3,
              flops / smp_s / 1e12, flops / plain_s / 1e12, plain_s / smp_s);
  std::fflush(stdout);
}

void nccl_transfer() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto host = smp::comm::make_gloo_group(store, {0}, 0, "bench", "127.0.0.1", std::chrono::seconds(60), kGpu);
  auto group = smp::comm::make_nccl_group(store, host, kGpu);
  group->connect({{0, 0}});
  for (int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) {
    const at::Tensor source = at::randn({bytes / 4}, kGpu), target = at::empty({bytes / 4}, kGpu);
    const double seconds = median_seconds(3, 20, [&] {
      auto receive = group->irecv(target, 0, 0);
      auto send = group->isend(source, 0, 0);
      send->wait();
      receive->wait();
    });
    std::printf("{\"bench\": \"nccl_transfer\", \"bytes\": %lld, \"us\": %.1f, \"gb_per_s\": %.2f}\n",
                static_cast<long long>(bytes), seconds * 1e6, static_cast<double>(bytes) / seconds / 1e9);
    std::fflush(stdout);
  }
}

int run(int argc, char** argv) {
  (void)argc;
  (void)argv;
  if (torch::cuda::device_count() == 0) {
    std::printf("SKIPPED: bench_gpu needs a CUDA device (run it on a GPU machine: scripts/device_gpu.sh)\n");
    return 77;
  }
  engine_overhead();
  gpt_stage(false);
  gpt_stage(true);
  nccl_transfer();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
