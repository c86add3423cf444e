// Trains a small Sequential for a few steps through smp and prints each step's loss: run with 2 processes
// (2 stages) and with 1, the losses must agree (check_install.sh compares them).
#include <cstdio>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/main.h"

namespace {

int run(int argc, char** argv) {
  if (argc != 2) throw smp::ConfigError("usage: consumer CONFIG.json");
  const auto config = smp::Config::from_file(argv[1]);
  auto runtime = smp::Runtime::init(config);
  at::manual_seed(config.seed);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32),
                              torch::nn::Tanh(), torch::nn::Linear(32, 4));
  const auto inputs = at::randn({16, 8}), targets = at::randn({16, 4});
  smp::DistributedModel distributed(runtime, model, inputs.narrow(0, 0, 16 / config.microbatches));
  smp::DistributedOptimizer optimizer(
      distributed, std::make_unique<torch::optim::SGD>(distributed.parameters(), torch::optim::SGDOptions(0.1)));
  auto loss_fn = [](const at::Tensor& output, const at::Tensor& target) {
    return torch::nn::functional::mse_loss(output, target);
  };
  for (int step = 0; step < 4; ++step) {
    optimizer.zero_grad();
    const double loss = distributed.train_step(inputs, targets, loss_fn).loss;
    optimizer.step();
    if (runtime->rank() == 0) std::printf("step %d loss %.7f\n", step, loss);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
