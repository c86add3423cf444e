#pragma once
// What the benchmarks that compare smp with plain LibTorch on one process share: the two steps, timed in
// alternation, the engine-overhead measurement and a GPT stage's speed (bench_gpu on a GPU, bench_engine on the CPU).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "common/gpt.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/runtime.h"

namespace smp_bench {

// Medians of two steps timed in alternation, so that the GPU's clocks and temperature drifting over the run
// weigh on both alike (timed one after the other, the second ran up to 3% apart from run to run).
inline std::pair<double, double> alternating_median_seconds(int warmup, int measured,
                                                            const std::function<void()>& first,
                                                            const std::function<void()>& second, c10::Device device) {
  std::vector<double> first_times, second_times;
  auto timed = [device](const std::function<void()>& step) {
    if (device.is_cuda()) torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    step();
    if (device.is_cuda()) torch::cuda::synchronize();
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
inline std::function<void()> plain_step(smp::GraphModel& model, const at::Tensor& inputs, const at::Tensor& targets,
                                        const smp::LossFunction& loss, int microbatches, bool bf16, c10::Device device) {
  for (const auto& node : model.nodes()) node.module->to(device);
  std::vector<at::Tensor> parameters;
  for (const auto& [name, parameter] : model.named_parameters()) parameters.push_back(parameter);
  auto optimizer = std::make_shared<torch::optim::SGD>(parameters, torch::optim::SGDOptions(1e-4));
  const auto input_chunks = inputs.to(device).chunk(microbatches), target_chunks = targets.to(device).chunk(microbatches);
  return [&model, optimizer, input_chunks, target_chunks, loss, microbatches, bf16, device] {
    optimizer->zero_grad();
    double total = 0.0;
    for (int i = 0; i < microbatches; ++i) {
      at::Tensor output;
      if (bf16) {
        at::autocast::set_autocast_enabled(device.type(), true);
        at::autocast::set_autocast_dtype(device.type(), at::kBFloat16);
        at::autocast::increment_nesting();
      }
      output = model.forward(input_chunks[i]);
      if (bf16) {
        if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
        at::autocast::set_autocast_enabled(device.type(), false);
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
inline std::function<void()> smp_step(const std::shared_ptr<smp::Runtime>& runtime, smp::GraphModel model,
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

// Prints the time per schedule action that smp adds over plain LibTorch: eight one-layer stages in one process on
// `device`, whose arithmetic is a few microseconds, so the step time is mostly overhead.
inline void print_engine_overhead(c10::Device device) {
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
  auto runtime = smp::Runtime::init(smp::Config::from_json_text(
      std::string(R"({"device": ")") + (device.is_cuda() ? "cuda" : "cpu") +
          R"(", "seed": 3, "microbatches": 8, "virtual_stages": 8})",
      "engine overhead"));
  int actions = 0;
  auto plain_model = build();
  const auto [smp_s, plain_s] =
      alternating_median_seconds(5, 30, smp_step(runtime, build(), inputs, targets, loss, &actions),
                                 plain_step(plain_model, inputs, targets, loss, microbatches, false, device), device);
  std::printf("{\"bench\": \"engine_overhead\", \"device\": \"%s\", \"stages\": %d, \"microbatches\": %d, \"actions_per_step\": %d, "
              "\"smp_step_ms\": %.3f, \"plain_step_ms\": %.3f, \"overhead_us_per_action\": %.1f}\n",
              device.is_cuda() ? "cuda" : "cpu", stages, microbatches, actions, smp_s * 1e3, plain_s * 1e3, (smp_s - plain_s) / actions * 1e6);
  std::fflush(stdout);
}

// Prints a GPT-style stage's speed under smp (one stage, one microbatch) against the same model in plain LibTorch,
// as achieved TFLOP/s and their ratio.
inline void print_gpt_stage(c10::Device device, const smp::examples::GptOptions& options, int64_t batch, bool bf16,
                            int warmup, int measured) {
  auto build = [&] {
    return smp::examples::make_gpt(options).materialize(3);
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
  const std::string device_name = device.is_cuda() ? "cuda" : "cpu";
  auto runtime = smp::Runtime::init(smp::Config::from_json_text(
      R"({"device": ")" + device_name + R"(", "seed": 3, "microbatches": 1)" + (bf16 ? R"(, "bf16": true})" : "}"),
      "gpt stage"));
  auto plain_model = build();
  const auto [smp_s, plain_s] = alternating_median_seconds(
      warmup, measured, smp_step(runtime, build(), inputs, targets, smp::examples::gpt_loss),
      plain_step(plain_model, inputs, targets, smp::examples::gpt_loss, 1, bf16, device), device);
  std::printf("{\"bench\": \"gpt_stage\", \"device\": \"%s\", \"precision\": \"%s\", \"parameters\": %lld, "
              "\"tokens\": %.0f, \"smp_step_ms\": %.2f, \"plain_step_ms\": %.2f, \"smp_tflops\": %.3f, "
              "\"plain_tflops\": %.3f, \"ratio\": %.3f}\n",
              device_name.c_str(), bf16 ? "bf16" : "fp32", static_cast<long long>(parameters), tokens_per_step,
              smp_s * 1e3, plain_s * 1e3, flops / smp_s / 1e12, flops / plain_s / 1e12, plain_s / smp_s);
  std::fflush(stdout);
}

}  // namespace smp_bench
