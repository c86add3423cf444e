// Engine pieces in one process, without communication. The zero-bubble split backward: I then W must leave exactly
// the gradients of one plain backward, and W must run only the weight nodes whenever I reached them all.

#include "catch_torch.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/core/CPUAllocator.h>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <filesystem>
#include <fstream>
#include <map>

#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdlib>

#include "profiled_model.h"
#include "smp/checkpoint.h"
#include "smp/collectives.h"
#include "smp/executor.h"
#include "smp/comm/communicator.h"
#include "smp/comm/launch_info.h"
#include "smp/config.h"
#include "smp/cpu_tensor_meter.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/graph_model.h"
#include "smp/optimizer_shards.h"
#include "smp/runtime.h"
#include "smp/torchscript_graph.h"
#include "smp/stage_plan.h"
#include "checkpoint/optimizer_snapshot.h"
#include "pipeline/split_backward.h"
#include "training/loss_scaler.h"
#include "training/model_random_stream.h"
#include "training/nonfinite_steps.h"

namespace {

struct Layer {
  at::Tensor weight, bias;
};

std::vector<Layer> make_layers(int count, int64_t width) {
  at::manual_seed(11);
  std::vector<Layer> layers;
  for (int i = 0; i < count; ++i) {
    layers.push_back({(at::randn({width, width}) * 0.3).requires_grad_(true), at::randn({width}).requires_grad_(true)});
  }
  return layers;
}

std::vector<at::Tensor> parameters_of(const std::vector<Layer>& layers) {
  std::vector<at::Tensor> parameters;
  for (const auto& layer : layers) {
    parameters.push_back(layer.weight);
    parameters.push_back(layer.bias);
  }
  return parameters;
}

enum class Tie { None, Parallel, Sequential };

// A stage: linear layers with tanh and residuals. Parallel: the first weight also applies to the stage input
// beside its first use; Sequential: it applies again to the last layer's output (as a tied LM head would).
at::Tensor stage(const at::Tensor& input, const std::vector<Layer>& layers, Tie tie = Tie::None) {
  at::Tensor x = input;
  for (const auto& layer : layers) x = at::tanh(at::linear(x, layer.weight, layer.bias)) + x;
  if (tie == Tie::Parallel) x = x + at::linear(at::tanh(input), layers.front().weight);
  if (tie == Tie::Sequential) x = at::linear(x, layers.front().weight);
  return x;
}

void clear_grads(const std::vector<at::Tensor>& tensors) {
  for (auto tensor : tensors) tensor.mutable_grad() = at::Tensor();
}

// Runs I and W on the stage and compares every gradient with one plain backward.
void check_split_equals_plain(bool input_requires_grad, bool bf16, Tie tie, bool expect_weight_nodes_only) {
  const auto layers = make_layers(3, 16);
  const auto parameters = parameters_of(layers);
  at::Tensor input = at::randn({4, 16});
  if (input_requires_grad) input.requires_grad_(true);
  const at::Tensor output_grad = at::randn({4, 16});

  auto forward = [&] {
    if (!bf16) return stage(input, layers, tie);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
    at::Tensor out = stage(input, layers, tie);
    at::autocast::decrement_nesting();
    at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, false);
    return out;
  };

  // Plain backward: the reference.
  torch::autograd::backward({forward()}, {bf16 ? output_grad.to(at::kBFloat16) : output_grad});
  std::vector<at::Tensor> expected;
  for (const auto& parameter : parameters) expected.push_back(parameter.grad().clone());
  const at::Tensor expected_input_grad = input_requires_grad ? input.grad().clone() : at::Tensor();
  clear_grads(parameters);
  if (input_requires_grad) clear_grads({input});

  at::Tensor out = forward();
  auto [input_grads, weight_pass] =
      smp::WeightPass::run_input_pass({out}, {bf16 ? output_grad.to(at::kBFloat16) : output_grad}, {input}, parameters);
  CHECK(weight_pass.runs_weight_nodes_only() == expect_weight_nodes_only);
  // I computes no weight gradient.
  for (const auto& parameter : parameters) CHECK_FALSE(parameter.grad().defined());
  if (input_requires_grad) CHECK(at::allclose(input_grads[0], expected_input_grad, 1e-5, 1e-6));
  out = at::Tensor();  // W must not need the stage's output any more
  weight_pass.run();
  CHECK_FALSE(weight_pass.pending());
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(parameters[i].grad().defined());
    CHECK(at::allclose(parameters[i].grad(), expected[i], 1e-5, 1e-6));
  }
}

}  // namespace

TEST_CASE("split backward: I then W equals one backward, W runs the weight nodes only", "[split_backward]") {
  SECTION("float32") { check_split_equals_plain(true, false, Tie::None, true); }
  SECTION("bf16 autocast (weights reach the matmuls through casts)") {
    check_split_equals_plain(true, true, Tie::None, true);
  }
  SECTION("a weight used twice side by side") { check_split_equals_plain(true, false, Tie::Parallel, true); }
  SECTION("a weight used again on its own output (a tied head): W runs each use's weight node once") {
    check_split_equals_plain(true, false, Tie::Sequential, true);
  }
  SECTION("an input without gradient: W falls back to one backward pass") {
    check_split_equals_plain(false, false, Tie::None, false);
  }
}

namespace {

// Layers whose weight work is partly cheap: a layer norm's scale and shift, a scale multiplied in, a bias added after
// a matrix product. `shared_scale`: every layer multiplies by the first layer's scale (one parameter fed from several
// cheap nodes, which W must then compute).
struct NormedLayer {
  at::Tensor gamma, beta, weight, bias, scale;
};

std::vector<NormedLayer> make_normed_layers(int count, int64_t width) {
  at::manual_seed(5);
  std::vector<NormedLayer> layers;
  for (int i = 0; i < count; ++i) {
    layers.push_back({(1 + 0.1 * at::randn({width})).requires_grad_(true), (0.1 * at::randn({width})).requires_grad_(true),
                      (at::randn({width, width}) * 0.3).requires_grad_(true), at::randn({width}).requires_grad_(true),
                      (1 + 0.1 * at::randn({width})).requires_grad_(true)});
  }
  return layers;
}

at::Tensor normed_stage(const at::Tensor& input, const std::vector<NormedLayer>& layers, bool shared_scale) {
  at::Tensor x = input;
  for (const auto& layer : layers) {
    const at::Tensor normed = at::layer_norm(x, {x.size(-1)}, layer.gamma, layer.beta);
    const at::Tensor& scale = shared_scale ? layers.front().scale : layer.scale;
    x = at::tanh(at::matmul(normed, layer.weight.t()) + layer.bias) * scale + x;
  }
  return x;
}

}  // namespace

TEST_CASE("split backward: I computes cheap weight work itself, frees what W will not read, and W accumulates it",
          "[split_backward]") {
  const bool shared_scale = GENERATE(false, true);
  INFO("shared scale: " << shared_scale);
  const auto layers = make_normed_layers(3, 32);
  std::vector<at::Tensor> parameters;
  for (const auto& layer : layers) {
    for (const auto& parameter : {layer.gamma, layer.beta, layer.weight, layer.bias}) parameters.push_back(parameter);
    if (!shared_scale || &layer == &layers.front()) parameters.push_back(layer.scale);
  }
  const at::Tensor input = at::randn({64, 32}).requires_grad_(true);
  const at::Tensor output_grad = at::randn({64, 32});
  torch::autograd::backward({normed_stage(input, layers, shared_scale)}, {output_grad});
  std::vector<at::Tensor> expected;
  for (const auto& parameter : parameters) expected.push_back(parameter.grad().clone());
  const at::Tensor expected_input_grad = input.grad().clone();
  clear_grads(parameters);
  clear_grads({input});

  // A hook on one bias: it must run once, in W, however the bias's node is split.
  int bias_hook_calls = 0;
  layers[1].bias.register_hook([&](const at::Tensor& grad) {
    ++bias_hook_calls;
    return grad;
  });
  const smp::CpuTensorMeter meter;
  const std::int64_t before = meter.live_bytes();
  at::Tensor out = normed_stage(input, layers, shared_scale);
  const std::int64_t held_by_forward = meter.live_bytes() - before;  // the activations the graph saved, and out
  auto [input_grads, weight_pass] = smp::WeightPass::run_input_pass({out}, {output_grad}, {input}, parameters);
  REQUIRE(weight_pass.runs_weight_nodes_only());
  for (const auto& parameter : parameters) CHECK_FALSE(parameter.grad().defined());
  CHECK(at::allclose(input_grads[0], expected_input_grad, 1e-5, 1e-6));
  out = at::Tensor();
  // Between I and W the graph holds what W reads (each matrix product's input and the gradient that reached it) and
  // the cheap parameters' gradients, not the norms' and tanh's saved tensors: less than the forward kept. (A scale
  // shared by every layer is computed in W, whose multiplications then keep tanh's outputs.)
  const std::int64_t held_for_w = meter.live_bytes() - before - input_grads[0].nbytes();
  if (!shared_scale) CHECK(held_for_w < held_by_forward * 3 / 4);
  weight_pass.run();
  CHECK(bias_hook_calls == 1);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(parameters[i].grad().defined());
    CHECK(at::allclose(parameters[i].grad(), expected[i], 1e-5, 1e-6));
  }
}

TEST_CASE("split backward: a stage output made of parameters alone still gets its gradient", "[split_backward]") {
  const auto layers = make_layers(2, 8);
  auto parameters = parameters_of(layers);
  const at::Tensor position = at::randn({3, 8}).requires_grad_(true);  // e.g. a learned table sent on as it is
  parameters.push_back(position);
  const at::Tensor input = at::randn({3, 8}).requires_grad_(true);
  const at::Tensor grad_a = at::randn({3, 8}), grad_b = at::randn({3, 8});
  auto outputs = [&] { return std::vector<at::Tensor>{stage(input, layers), position * 2.0}; };

  torch::autograd::backward(outputs(), {grad_a, grad_b});
  std::vector<at::Tensor> expected;
  for (const auto& parameter : parameters) expected.push_back(parameter.grad().clone());
  clear_grads(parameters);

  auto [grads, weight_pass] = smp::WeightPass::run_input_pass(outputs(), {grad_a, grad_b}, {input}, parameters);
  CHECK_FALSE(weight_pass.runs_weight_nodes_only());  // the second output's gradient reaches no weight node
  weight_pass.run();
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(parameters[i].grad().defined());
    CHECK(at::allclose(parameters[i].grad(), expected[i], 1e-5, 1e-6));
  }
}

TEST_CASE("split backward: a gradient accumulates once per W, onto what earlier microbatches left", "[split_backward]") {
  const auto layers = make_layers(2, 8);
  const auto parameters = parameters_of(layers);
  int accumulations = 0;
  struct Counter : torch::autograd::PostAccumulateGradHook {
    explicit Counter(int& count) : count(count) {}
    void operator()(const torch::autograd::Variable&) override { ++count; }
    int& count;
  };
  // The first weight feeds two matmuls: W must still accumulate it once.
  torch::autograd::impl::set_post_acc_grad_hooks(parameters[0], std::make_unique<Counter>(accumulations));
  for (int microbatch = 0; microbatch < 2; ++microbatch) {
    const at::Tensor input = at::randn({3, 8}).requires_grad_(true);
    at::Tensor out = stage(input, layers, Tie::Parallel);
    auto [grads, weight_pass] = smp::WeightPass::run_input_pass({out}, {at::ones_like(out)}, {input}, parameters);
    REQUIRE(weight_pass.runs_weight_nodes_only());
    weight_pass.run();
  }
  CHECK(accumulations == 2);
  torch::autograd::impl::set_post_acc_grad_hooks(parameters[0], nullptr);
}

namespace {

// One optimizer step of a small linear model on fixed data.
void optimizer_step(torch::nn::Linear& model, torch::optim::Optimizer& optimizer, int seed) {
  at::manual_seed(seed);
  optimizer.zero_grad();
  model->forward(at::randn({4, 3})).pow(2).sum().backward();
  optimizer.step();
}

// The state a fresh optimizer of the same kind holds after loading `bytes`, as one flat tensor per state field.
template <typename Kind, typename Options>
std::vector<at::Tensor> loaded_state(const std::string& bytes, const std::vector<at::Tensor>& parameters,
                                     Options options, const std::function<std::vector<at::Tensor>(Kind&)>& fields) {
  Kind fresh(parameters, options);
  torch::serialize::InputArchive archive;
  std::istringstream stream(bytes);
  archive.load_from(stream);
  fresh.load(archive);
  return fields(fresh);
}

template <typename Kind, typename Options>
void check_snapshot(Options options, const std::function<std::vector<at::Tensor>(Kind&)>& fields) {
  at::manual_seed(0);
  torch::nn::Linear model(3, 2);
  Kind optimizer(model->parameters(), options);
  optimizer_step(model, optimizer, 1);
  optimizer_step(model, optimizer, 2);
  const std::vector<at::Tensor> at_snapshot = [&] {
    std::vector<at::Tensor> copies;
    for (const auto& field : fields(optimizer)) copies.push_back(field.clone());
    return copies;
  }();
  const auto snapshot = smp::snapshot_optimizer(optimizer);
  optimizer_step(model, optimizer, 3);  // changes the live state in place
  const auto restored = loaded_state<Kind, Options>(snapshot(), model->parameters(), options, fields);
  REQUIRE(restored.size() == at_snapshot.size());
  for (std::size_t i = 0; i < restored.size(); ++i) {
    CHECK(at::equal(restored[i], at_snapshot[i]));
    CHECK_FALSE(at::equal(restored[i], fields(optimizer)[i]));  // the step after the snapshot moved it
  }
}

}  // namespace

TEST_CASE("an optimizer snapshot saves the state of its moment, not what later steps make of it", "[checkpoint]") {
  using namespace torch::optim;
  // Each kind's state for the first parameter (the weight), flattened into tensors.
  SECTION("AdamW") {
    check_snapshot<AdamW, AdamWOptions>(AdamWOptions(0.1), [](AdamW& optimizer) {
      auto& state = static_cast<AdamWParamState&>(
          *optimizer.state().at(optimizer.param_groups()[0].params()[0].unsafeGetTensorImpl()));
      return std::vector<at::Tensor>{state.exp_avg(), state.exp_avg_sq(), at::tensor(state.step())};
    });
  }
  SECTION("SGD with momentum") {
    check_snapshot<SGD, SGDOptions>(SGDOptions(0.1).momentum(0.9), [](SGD& optimizer) {
      auto& state = static_cast<SGDParamState&>(
          *optimizer.state().at(optimizer.param_groups()[0].params()[0].unsafeGetTensorImpl()));
      return std::vector<at::Tensor>{state.momentum_buffer()};
    });
  }
  SECTION("RMSprop") {
    check_snapshot<RMSprop, RMSpropOptions>(RMSpropOptions(0.01).momentum(0.5), [](RMSprop& optimizer) {
      auto& state = static_cast<RMSpropParamState&>(
          *optimizer.state().at(optimizer.param_groups()[0].params()[0].unsafeGetTensorImpl()));
      return std::vector<at::Tensor>{state.square_avg(), state.momentum_buffer()};
    });
  }
  SECTION("another kind (Adagrad) is serialized at once") {
    check_snapshot<Adagrad, AdagradOptions>(AdagradOptions(0.1), [](Adagrad& optimizer) {
      auto& state = static_cast<AdagradParamState&>(
          *optimizer.state().at(optimizer.param_groups()[0].params()[0].unsafeGetTensorImpl()));
      return std::vector<at::Tensor>{state.sum(), at::tensor(state.step())};
    });
  }
}

namespace {

// Optimizer state of another serialization than LibTorch's (as the Python package's torch.optim one is).
class RecordedOptimizerState final : public smp::OptimizerCheckpointState {
 public:
  std::string saved = "state of step 0";
  std::string loaded;
  std::function<std::string()> snapshot() override {
    return [bytes = saved] { return bytes; };
  }
  void load(const smp::SavedOptimizerState& saved, c10::Device) override {
    REQUIRE(saved.share_count == 1);
    REQUIRE(saved.shares_to_read == 1);
    loaded = saved.read(0).bytes;
  }
  std::string format() const override { return "recorded"; }
};

struct OneProcessJob {
  std::shared_ptr<smp::Runtime> runtime;
  std::unique_ptr<smp::DistributedModel> model;
};

OneProcessJob one_process_job(const std::string& checkpoint_dir, bool resume) {
  const auto config = smp::Config::from_json_text(R"({"device": "cpu", "checkpoint_dir": ")" + checkpoint_dir +
                                                      R"(", "resume": )" + (resume ? "true" : "false") + "}",
                                                  "test config");
  OneProcessJob job;
  job.runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  at::manual_seed(5);
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  job.model = std::make_unique<smp::DistributedModel>(job.runtime, net, at::zeros({2, 3}));
  return job;
}

// A new empty directory under /tmp, "/tmp/smp_<name>_XXXXXX".
std::string fresh_temporary_directory(const std::string& name) {
  std::string path = "/tmp/smp_" + name + "_XXXXXX";
  REQUIRE(::mkdtemp(path.data()) != nullptr);
  return path;
}

}  // namespace

TEST_CASE("a checkpoint_dir that cannot be written is refused when the Checkpointer is made", "[checkpoint]") {
  const std::string blocker = fresh_temporary_directory("unwritable") + "/a-file";
  std::ofstream(blocker) << "not a directory";
  auto job = one_process_job(blocker + "/checkpoints", false);
  CHECK_THROWS_WITH(smp::Checkpointer(*job.model, std::make_unique<RecordedOptimizerState>()),
                    Catch::Contains("checkpoint_dir \"" + blocker + "/checkpoints\": rank 0 cannot write there"));
}

TEST_CASE("one job at a time saves into a checkpoint_dir", "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("locked");
  auto job = one_process_job(directory, false);
  {
    smp::Checkpointer first(*job.model, std::make_unique<RecordedOptimizerState>());
    CHECK_THROWS_WITH(smp::Checkpointer(*job.model, std::make_unique<RecordedOptimizerState>()),
                      Catch::Contains("checkpoint_dir \"" + directory + "\" is held by another Checkpointer of this "
                                      "job (this process, pid " + std::to_string(::getpid())));
  }
  CHECK_NOTHROW(smp::Checkpointer(*job.model, std::make_unique<RecordedOptimizerState>()));  // let go with the first
  {
    // Another process holding it: another job.
    int ready[2];
    REQUIRE(::pipe(ready) == 0);
    const pid_t holder = ::fork();
    if (holder == 0) {  // as another job's rank 0 holds it: the lock, and who holds it
      const int fd = ::open((directory + "/.smp-lock").c_str(), O_RDWR | O_CREAT, 0644);
      if (fd < 0 || ::flock(fd, LOCK_EX) != 0 || ::ftruncate(fd, 0) != 0) ::_exit(1);
      const std::string who = "pid " + std::to_string(::getpid()) + " on elsewhere";
      [[maybe_unused]] const auto wrote = ::pwrite(fd, who.data(), who.size(), 0);
      [[maybe_unused]] const auto told = ::write(ready[1], "x", 1);
      ::pause();  // until killed
      ::_exit(0);
    }
    char told = 0;
    REQUIRE(::read(ready[0], &told, 1) == 1);
    CHECK_THROWS_WITH(smp::Checkpointer(*job.model, std::make_unique<RecordedOptimizerState>()),
                      Catch::Contains("checkpoint_dir \"" + directory + "\" is in use by another job (pid " +
                                      std::to_string(holder)));
    ::kill(holder, SIGKILL);
    ::waitpid(holder, nullptr, 0);
    ::close(ready[0]);
    ::close(ready[1]);
  }
  CHECK(std::system(("rm -rf " + directory).c_str()) == 0);
}

TEST_CASE("a step saved again over a save that was killed while writing keeps none of its temporary files",
          "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("leftover");
  std::filesystem::create_directories(directory + "/step-00000000");
  const std::string leftover = directory + "/step-00000000/partition-0000.pt.tmp.99999";
  std::ofstream(leftover) << "half of a partition";
  {
    auto job = one_process_job(directory, false);
    smp::Checkpointer checkpointer(*job.model, std::make_unique<RecordedOptimizerState>());
    checkpointer.save(0);
    checkpointer.wait();
  }
  CHECK(std::filesystem::exists(directory + "/step-00000000/manifest.json"));
  CHECK_FALSE(std::filesystem::exists(leftover));
  CHECK(std::system(("rm -rf " + directory).c_str()) == 0);
}

TEST_CASE("a program that ends without wait() after a failed save exits with status 1", "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("failed_save");
  std::fflush(nullptr);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    {
      auto job = one_process_job(directory, false);
      smp::Checkpointer checkpointer(*job.model, std::make_unique<RecordedOptimizerState>());
      REQUIRE(std::system(("rm -rf " + directory).c_str()) == 0);  // not remove_all: libtorch.so's crashes
      std::ofstream(directory) << "the directory became a file";  // the save cannot make its directory
      checkpointer.save(0);
    }
    std::_Exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  std::filesystem::remove(directory);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 1);
}

TEST_CASE("a save that pruning would delete at once is refused: a step lower than the last, another run's directory",
          "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("save_order");
  {
    auto job = one_process_job(directory, false);
    smp::Checkpointer checkpointer(*job.model, std::make_unique<RecordedOptimizerState>());
    checkpointer.save(5);
    CHECK_THROWS_WITH(checkpointer.save(2), Catch::Contains("save(2) after save(5)") &&
                                                Catch::Contains("a step that only grows"));
    checkpointer.save(6);
    checkpointer.wait();
  }
  {  // a fresh run in the same directory, not resumed: refused when the Checkpointer is made, before any training
    auto job = one_process_job(directory, false);
    CHECK_THROWS_WITH(smp::Checkpointer(*job.model, std::make_unique<RecordedOptimizerState>()),
                      Catch::Contains("holds checkpoints up to step 6 of an earlier run") &&
                          Catch::Contains("\"resume\" is false") && Catch::Contains("empty checkpoint_dir"));
  }
  {  // resumed from them, it goes on
    auto job = one_process_job(directory, true);
    smp::Checkpointer checkpointer(*job.model, std::make_unique<RecordedOptimizerState>());
    CHECK(checkpointer.resume() == 7);
    checkpointer.save(7);
    checkpointer.wait();
    CHECK(smp::highest_saved_step(directory) == 7);
  }
  // Not std::filesystem::remove_all: libtorch.so's copy of it crashes in programs linked with LibTorch.
  CHECK(std::system(("rm -rf " + directory).c_str()) == 0);
}

TEST_CASE("backend nccl where device auto takes the CPU is refused, not taken as Gloo", "[runtime]") {
  if (torch::cuda::device_count() > 0) return;  // "auto" takes the GPU there
  for (const char* key : {"backend", "ddp_dist_backend"}) {
    const auto config = smp::Config::from_json_text(std::string(R"({")") + key + R"(": "nccl"})", "test config");
    CHECK_THROWS_WITH(smp::Runtime::init(config, smp::comm::LaunchInfo{}),
                      Catch::Contains("test config: \"nccl\" (key \"backend\" or \"ddp_dist_backend\") moves GPU "
                                      "tensors only, and \"device\": \"auto\" chose the CPU on rank 0"));
  }
}

TEST_CASE("inputs and targets of other batch sizes are said so before whether the targets split", "[graph]") {
  const auto config = smp::Config::from_json_text(R"({"device": "cpu", "microbatches": 4})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  torch::nn::Sequential net(torch::nn::Linear(3, 2));
  smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
  CHECK_THROWS_WITH(model.train_step(at::ones({16, 3}), at::zeros({2, 2}), loss),
                    Catch::Contains("train_step: 16 inputs but 2 targets"));
  // A sample of no rows (a batch over more microbatches than it has samples) is refused when the model is built.
  CHECK_THROWS_WITH(smp::DistributedModel(runtime, net, at::zeros({0, 3})),
                    Catch::Contains("the sample's input \"input\" has no rows"));
}

TEST_CASE("a loss function that fails says so, with the outputs' and target's shapes", "[graph]") {
  const auto config = smp::Config::from_json_text(R"({"device": "cpu"})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  torch::nn::Sequential net(torch::nn::Linear(3, 2));
  smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
  CHECK_THROWS_WITH(model.train_step(at::randn({2, 3}), at::randn({2, 5}), loss),
                    Catch::Matchers::Contains("the loss function failed on microbatch 0 (outputs [2, 2], target [2, 5]): "
                                              "The size of tensor a (2) must match"));
  model.train_step(at::randn({2, 3}), at::randn({2, 2}), loss);  // one process: the step can be tried again
}

TEST_CASE("a checkpoint keeps optimizer state of any serialization, and refuses to load it into another", "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("optimizer_format");
  {
    auto job = one_process_job(directory, false);
    smp::Checkpointer checkpointer(*job.model, std::make_unique<RecordedOptimizerState>());
    checkpointer.save(0);
    checkpointer.wait();
  }
  SECTION("the same kind gets its bytes back") {
    auto job = one_process_job(directory, true);
    auto state = std::make_unique<RecordedOptimizerState>();
    auto* recorded = state.get();
    smp::Checkpointer checkpointer(*job.model, std::move(state));
    CHECK(checkpointer.resume() == 1);
    CHECK(recorded->loaded == "state of step 0");
  }
  SECTION("a LibTorch optimizer is told who wrote the state") {
    auto job = one_process_job(directory, true);
    smp::DistributedOptimizer optimizer(*job.model, std::make_unique<torch::optim::SGD>(
                                                        job.model->parameters(), torch::optim::SGDOptions(0.1)));
    smp::Checkpointer checkpointer(*job.model, optimizer);
    CHECK_THROWS_WITH(checkpointer.resume(), Catch::Contains("written by a recorded optimizer") &&
                                                 Catch::Contains("reads libtorch state") &&
                                                 Catch::Contains("partition-0000.pt"));
  }
  // Not std::filesystem::remove_all: libtorch.so's copy of it crashes in programs linked with LibTorch.
  CHECK(std::system(("rm -rf " + directory).c_str()) == 0);
}

TEST_CASE("a checkpoint keeps the program's state beside the optimizer's (a resume without it refused), for the model "
          "built to resume",
          "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("program_state");
  const std::string loader_bytes("position \0\xff 42", 14);  // not text
  {
    auto job = one_process_job(directory, false);
    smp::DistributedOptimizer optimizer(*job.model, std::make_unique<torch::optim::SGD>(
                                                        job.model->parameters(), torch::optim::SGDOptions(0.8)));
    torch::optim::StepLR scheduler(optimizer.local(), 2, 0.5);
    for (int step = 0; step < 3; ++step) {
      optimizer.step();
      scheduler.step();  // LibTorch's StepLR decays at its calls 3, 5, ...: 0.4 now
    }
    smp::Checkpointer checkpointer(*job.model, optimizer,
                                   {{"lr_scheduler", smp::lr_scheduler_state(scheduler)},
                                    {"loader", {[&] { return loader_bytes; }, [](const std::string&) {}}}});
    checkpointer.save(2);
    checkpointer.wait();
  }
  const auto resumed_job = [&](smp::ProgramStates states, std::string* loaded) {
    auto job = one_process_job(directory, true);
    auto optimizer = std::make_unique<smp::DistributedOptimizer>(
        *job.model, std::make_unique<torch::optim::SGD>(job.model->parameters(), torch::optim::SGDOptions(0.8)));
    auto scheduler = std::make_unique<torch::optim::StepLR>(optimizer->local(), 2, 0.5);
    if (states.count("lr_scheduler")) states["lr_scheduler"] = smp::lr_scheduler_state(*scheduler);
    if (loaded) states["loader"] = {[] { return std::string(); }, [loaded](const std::string& bytes) { *loaded = bytes; }};
    smp::Checkpointer checkpointer(*job.model, *optimizer, std::move(states));
    const std::int64_t first = checkpointer.resume();
    return std::tuple{first, std::move(job), std::move(optimizer), std::move(scheduler)};
  };
  SECTION("the bytes come back, and the scheduler decays at the steps it would have") {
    std::string loaded;
    auto [first, job, optimizer, scheduler] = resumed_job({{"lr_scheduler", {}}}, &loaded);
    CHECK(first == 3);
    CHECK(loaded == loader_bytes);
    const auto lr = [&] { return optimizer->local().param_groups()[0].options().get_lr(); };
    CHECK(lr() == Approx(0.4));
    scheduler->step();
    CHECK(lr() == Approx(0.4));
    scheduler->step();  // its 5th call: 0.2 (a fresh scheduler's 2nd would leave 0.4)
    CHECK(lr() == Approx(0.2));
  }
  SECTION("a job's other model, built not to resume, takes no checkpoint") {
    auto job = one_process_job(directory, true);
    torch::nn::Sequential teacher_net(torch::nn::Linear(3, 5), torch::nn::Linear(5, 2));
    CHECK_THROWS_WITH(smp::DistributedModel(job.runtime, teacher_net, at::zeros({2, 3})),
                      Catch::Contains("holds another model") && Catch::Contains("smp::Resume::kNever"));
    smp::DistributedModel teacher(job.runtime, teacher_net, at::zeros({2, 3}), smp::Resume::kNever);
    CHECK_FALSE(teacher.resumed_from());
    smp::DistributedOptimizer optimizer(teacher, std::make_unique<torch::optim::SGD>(teacher.parameters(),
                                                                                      torch::optim::SGDOptions(0.1)));
    CHECK_THROWS_WITH(smp::Checkpointer(teacher, optimizer), Catch::Contains("built not to resume"));
  }
  SECTION("state the checkpoint lacks is refused, naming it") {
    CHECK_THROWS_WITH(resumed_job({{"lr_scheduler", {}}, {"sampler", {[] { return std::string(); },
                                                                      [](const std::string&) {}}}},
                                  nullptr),
                      Catch::Contains("holds no program state \"sampler\"") &&
                          !Catch::Contains("does not fit this optimizer"));
  }
  CHECK(std::system(("rm -rf " + directory).c_str()) == 0);
}

namespace {

// Gradients, buffers, the loss and the next random number after one step of a model with dropout and batch norm
// (two of its blocks nested Sequentials) under `extra_keys`.
std::vector<at::Tensor> state_after_a_step(const std::string& extra_keys) {
  const auto config = smp::Config::from_json_text(R"({"device": "cpu", "microbatches": 2)" + extra_keys + "}",
                                                  "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  at::manual_seed(9);
  smp::GraphModel net("x");
  std::vector<at::Tensor> buffers;
  std::string previous = "x";
  for (const auto& [name, in] : {std::pair{"0", int64_t{3}}, std::pair{"1", int64_t{16}}}) {
    torch::nn::Sequential block(torch::nn::Linear(in, 16), torch::nn::BatchNorm1d(16), torch::nn::Dropout(0.5),
                                torch::nn::Tanh());
    for (const auto& buffer : block->buffers()) buffers.push_back(buffer);
    net.add(name, block.ptr(), [block](const std::vector<at::Tensor>& x) mutable { return block->forward(x[0]); },
            {previous});
    previous = name;
  }
  net.add("2", torch::nn::Linear(16, 2), {previous});
  smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
  at::manual_seed(10);
  const at::Tensor inputs = at::randn({4, 3}), targets = at::randn({4, 2});
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) {
    return at::mse_loss(output.to(at::kFloat), target);
  };
  const double first_loss = model.train_step(inputs, targets, loss).loss;
  std::vector<at::Tensor> state;
  for (const auto& parameter : model.parameters()) state.push_back(parameter.grad().clone());
  for (const auto& buffer : buffers) state.push_back(buffer.clone());
  // The recompute must also leave the random sequences where a run without it would be: the model's stream, which
  // its dropout draws from, and the program's.
  state.push_back(at::tensor({first_loss, at::rand({1}).item<double>()}, at::kDouble));
  for (const at::Tensor& stream : model.random_stream().states()) state.push_back(stream.clone());
  return state;
}

void check_same_state(const std::vector<at::Tensor>& expected, const std::vector<at::Tensor>& actual) {
  REQUIRE(expected.size() == actual.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("tensor " << i);
    CHECK(at::equal(expected[i], actual[i]));
  }
}

}  // namespace

TEST_CASE("a LibTorch optimizer of another class refuses the saved state, naming both", "[checkpoint]") {
  const std::string directory = fresh_temporary_directory("optimizer_class");
  {
    auto job = one_process_job(directory, false);
    smp::DistributedOptimizer optimizer(*job.model, std::make_unique<torch::optim::AdamW>(
                                                        job.model->parameters(), torch::optim::AdamWOptions(0.1)));
    job.model->train_step(at::ones({2, 3}), at::zeros({2, 2}), [](const at::Tensor& o, const at::Tensor& t) {
      return at::mse_loss(o, t);
    });
    optimizer.step();
    smp::Checkpointer checkpointer(*job.model, optimizer);
    checkpointer.save(0);
    checkpointer.wait();
  }
  {
    auto job = one_process_job(directory, true);
    smp::DistributedOptimizer optimizer(*job.model, std::make_unique<torch::optim::SGD>(
                                                        job.model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));
    smp::Checkpointer checkpointer(*job.model, optimizer);
    CHECK_THROWS_WITH(checkpointer.resume(), Catch::Contains("AdamW") && Catch::Contains("SGD"));
  }
  // A subclass of a LibTorch optimizer (saved through a copy of its base class) resumes its own state.
  struct ClippedSGD : torch::optim::SGD {
    using torch::optim::SGD::SGD;
  };
  const std::string subclassed = fresh_temporary_directory("optimizer_subclass");
  for (const bool resume : {false, true}) {
    auto job = one_process_job(subclassed, resume);
    smp::DistributedOptimizer optimizer(*job.model, std::make_unique<ClippedSGD>(
        job.model->parameters(), torch::optim::SGDOptions(resume ? 0.5 : 0.1).momentum(0.9)));
    smp::Checkpointer checkpointer(*job.model, optimizer);
    if (resume) {
      CHECK_NOTHROW(checkpointer.resume());
      // The checkpoint's learning rate, as Optimizer::load restores it (rank 0 says so in the log).
      CHECK(optimizer.local().param_groups()[0].options().get_lr() == 0.1);
    } else {
      checkpointer.save(0);
      checkpointer.wait();
    }
  }
  CHECK(std::system(("rm -rf " + directory + " " + subclassed).c_str()) == 0);
}

TEST_CASE("a checkpointed stage recomputes with the forward's random numbers and leaves batch norm's statistics "
          "as one forward does", "[checkpoint][recompute]") {
  check_same_state(state_after_a_step(""), state_after_a_step(R"(, "activation_checkpointing": true)"));
}

TEST_CASE("checkpointed modules give the gradients of plain training bit for bit", "[checkpoint][recompute]") {
  SECTION("float32: dropout and batch norm inside a checkpointed module") {
    check_same_state(state_after_a_step(""), state_after_a_step(R"(, "activation_checkpointing": ["0", "2"])"));
  }
  SECTION("bf16: the recompute runs under the forward's autocast") {
    check_same_state(state_after_a_step(R"(, "bf16": true)"),
                     state_after_a_step(R"(, "bf16": true, "activation_checkpointing": ["1"])"));
  }
  SECTION("a checkpointed module inside a checkpointed stage") {
    check_same_state(state_after_a_step(""), state_after_a_step(R"(, "activation_checkpointing": [0, "1"])"));
  }
  SECTION("a parameter registered twice in the module, and a hook on a parameter, count once") {
    const auto gradients = [](const std::string& extra_keys) {
      const auto config = smp::Config::from_json_text(
          R"({"device": "cpu", "microbatches": 2)" + extra_keys + "}", "test config");
      auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
      at::manual_seed(4);
      torch::nn::Linear shared(4, 4);
      torch::nn::Sequential twice(shared, torch::nn::Tanh(), shared);  // one weight, registered under 0 and 2
      smp::GraphModel graph("x");
      graph.add("in", torch::nn::Linear(3, 4), {"x"});
      graph.add("twice", twice.ptr(), [twice](const std::vector<at::Tensor>& x) mutable { return twice->forward(x[0]); },
                {"in"});
      graph.add("out", torch::nn::Linear(4, 2), {"twice"});
      smp::DistributedModel model(runtime, graph, at::zeros({2, 3}));
      shared->weight.register_hook([](const at::Tensor& gradient) { return gradient * 0.5; });
      at::manual_seed(5);
      const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
      model.train_step(at::randn({4, 3}), at::randn({4, 2}), loss);
      std::vector<at::Tensor> result;
      for (const auto& parameter : model.parameters()) result.push_back(parameter.grad().clone());
      return result;
    };
    check_same_state(gradients(""), gradients(R"(, "activation_checkpointing": ["twice"])"));
  }
  SECTION("a module that writes into its input is refused, naming it") {
    const auto config = smp::Config::from_json_text(
        R"({"device": "cpu", "microbatches": 2, "activation_checkpointing": ["relu"]})", "test config");
    auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
    smp::GraphModel graph("x");
    graph.add("in", torch::nn::Linear(3, 4), {"x"});
    graph.add("relu", torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)), {"in"});
    graph.add("out", torch::nn::Linear(4, 2), {"relu"});
    smp::DistributedModel model(runtime, graph, at::zeros({2, 3}));
    const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
    CHECK_THROWS_WITH(model.train_step(at::randn({4, 3}), at::randn({4, 2}), loss),
                      Catch::Matchers::Contains("module \"relu\" modifies its input 0 in place"));
  }
  SECTION("a module name that selects nothing is refused, naming the modules") {
    CHECK_THROWS_WITH(state_after_a_step(R"(, "activation_checkpointing": ["block"])"),
                      Catch::Matchers::Contains("no module \"block\"") && Catch::Matchers::Contains("0, 1, 2"));
  }
}

TEST_CASE("graph nodes may be named by module paths, unless one path extends another", "[graph]") {
  smp::GraphModel graph("x");
  graph.add("blocks.0", torch::nn::Linear(2, 2), {"x"});
  graph.add("blocks.1", torch::nn::Linear(2, 2), {"blocks.0"});
  std::vector<std::string> names;
  for (const auto& [name, parameter] : graph.named_parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"});
  CHECK_THROWS_WITH(graph.add("blocks", torch::nn::Linear(2, 2), {"x"}),
                    Catch::Matchers::Contains("\"blocks\" is a prefix of node \"blocks.0\""));
  CHECK_THROWS_WITH(graph.add("blocks.1.inner", torch::nn::Linear(2, 2), {"x"}),
                    Catch::Matchers::Contains("\"blocks.1.inner\" extends node \"blocks.1\""));
}

namespace {

class AddOneInPlaceImpl : public torch::nn::Module {
 public:
  at::Tensor forward(const at::Tensor& x) { return x.add_(1.0); }
};
TORCH_MODULE(AddOneInPlace);

}  // namespace

TEST_CASE("a stage writing into a tensor its producer saved is refused as in plain PyTorch", "[graph]") {
  // Two stages on one rank hand tensors over in memory: the second writes into the first's tanh output, which
  // tanh's backward reads. Plain PyTorch refuses that backward; so must the pipeline.
  const auto config = smp::Config::from_json_text(
      R"({"device": "cpu", "microbatches": 2, "virtual_stages": 2, "auto_partition": false,
          "partition_overrides": {"a": 0, "shift": 1}})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  torch::nn::Sequential block(torch::nn::Linear(3, 3), torch::nn::Tanh());
  smp::GraphModel graph("x");
  graph.add("a", block.ptr(), [block](const std::vector<at::Tensor>& x) mutable { return block->forward(x[0]); }, {"x"});
  graph.add("shift", AddOneInPlace(), {"a"});
  smp::DistributedModel model(runtime, graph, at::zeros({2, 3}));
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
  CHECK_THROWS_WITH(model.train_step(at::randn({4, 3}), at::randn({4, 3}), loss),
                    Catch::Matchers::Contains("modified by an inplace operation"));
}

TEST_CASE("fp16 gradients come out unscaled whatever the loss scale, above or below 1", "[precision]") {
  // Above 1 the fused unscale-and-check kernel runs; at or below 1 the gradients are divided and then checked.
  const auto config = smp::Config::from_json_text(R"({"device": "cpu", "fp16": true, "microbatches": 2})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
  at::manual_seed(5);
  const at::Tensor inputs = at::randn({4, 3}), targets = at::randn({4, 2});
  std::vector<std::vector<at::Tensor>> gradients;
  for (const double scale : {65536.0, 1.0, 0.25}) {
    at::manual_seed(3);
    torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
    smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
    model.restore_loss_scale(scale, 0);
    REQUIRE_FALSE(model.train_step(inputs, targets, loss).skipped);
    gradients.emplace_back();
    for (const auto& parameter : model.parameters()) gradients.back().push_back(parameter.grad().clone());
  }
  for (std::size_t run = 1; run < gradients.size(); ++run) {
    for (std::size_t i = 0; i < gradients[0].size(); ++i) {
      INFO("run " << run << ", parameter " << i);
      CHECK(at::allclose(gradients[run][i], gradients[0][i], 1e-2, 1e-4));
    }
  }
}

TEST_CASE("freezing a parameter after the model was built is refused, naming it", "[graph]") {
  const auto config = smp::Config::from_json_text(R"({"device": "cpu"})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  torch::nn::Sequential net(torch::nn::Linear(3, 2));
  smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
  net[0]->as<torch::nn::Linear>()->bias.requires_grad_(false);
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
  CHECK_THROWS_WITH(model.train_step(at::randn({2, 3}), at::randn({2, 2}), loss),
                    Catch::Matchers::Contains("parameter 0.bias was frozen after the DistributedModel was built"));
}

TEST_CASE("kept outputs are the model's, in batch order, and 0-dim outputs give one value per microbatch", "[outputs]") {
  // Two virtual stages on one rank, the second checkpointed: its recompute in backward must not add outputs.
  const auto config = smp::Config::from_json_text(
      R"({"device": "cpu", "microbatches": 3, "virtual_stages": 2, "pipeline": "interleaved", "auto_partition": false,
          "partition_overrides": {"0": 0, "1": 1, "2": 1}, "activation_checkpointing": [1]})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  at::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
  const auto loss = [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
  const at::Tensor inputs = at::randn({6, 3}), targets = at::randn({6, 2});
  at::Tensor expected;
  {
    at::NoGradGuard no_graph;
    expected = net->forward(inputs);
  }
  const auto trained = model.train_step(inputs, targets, loss, /*keep_outputs=*/true);
  REQUIRE(trained.outputs.defined());
  CHECK(trained.outputs.sizes() == expected.sizes());
  CHECK(at::allclose(trained.outputs, expected, 1e-5, 1e-6));
  CHECK_FALSE(model.evaluate(inputs, targets, loss).outputs.defined());

  smp::GraphModel summed("x");
  torch::nn::Linear linear(3, 2);
  summed.add("linear", linear.ptr(), [linear](const std::vector<at::Tensor>& x) mutable { return linear->forward(x[0]); }, {"x"});
  summed.add("sum", std::make_shared<torch::nn::Module>(), [](const std::vector<at::Tensor>& x) { return x[0].sum(); },
             {"linear"});
  const auto one_stage = smp::Config::from_json_text(R"({"device": "cpu", "microbatches": 3})", "test config");
  smp::DistributedModel scalar_model(smp::Runtime::init(one_stage, smp::comm::LaunchInfo{}), summed, at::zeros({2, 3}));
  const auto scalar_loss = [](const at::Tensor& output, const at::Tensor&) { return output * output; };
  const auto evaluation = scalar_model.evaluate(inputs, targets, scalar_loss, /*keep_outputs=*/true);
  REQUIRE(evaluation.outputs.defined());
  at::NoGradGuard no_graph;
  CHECK(at::allclose(evaluation.outputs, linear->forward(inputs).reshape({3, 2, 2}).sum({1, 2}), 1e-5, 1e-6));
}

TEST_CASE("several named inputs and outputs: batched inputs split, the others shared, the loss sees every output",
          "[inputs]") {
  // Two virtual stages on one rank: "scaled" is made on stage 0 and is an output, so it travels to the last stage.
  const auto config = smp::Config::from_json_text(
      R"({"device": "cpu", "microbatches": 2, "virtual_stages": 2, "pipeline": "interleaved", "auto_partition": false,
          "partition_overrides": {"scaled": 0, "masked": 0, "head": 1}})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  at::manual_seed(5);
  torch::nn::Linear project(3, 3), head(3, 2);
  smp::GraphModel graph({"x", "mask", "scale"});
  graph.add("scaled", project.ptr(), [project](const std::vector<at::Tensor>& in) mutable {
    return project->forward(in[0]) * in[1];  // scale: one row, the same for every microbatch
  }, {"x", "scale"});
  graph.add("masked", std::make_shared<torch::nn::Module>(), [](const std::vector<at::Tensor>& in) {
    return in[0] * in[1].unsqueeze(-1);
  }, {"scaled", "mask"});
  graph.add("head", head.ptr(), [head](const std::vector<at::Tensor>& in) mutable { return head->forward(in[0]); },
            {"masked"});
  graph.set_outputs({"head", "scaled"});
  CHECK_THROWS_WITH(smp::GraphModel(graph).set_outputs({"x"}), Catch::Matchers::Contains("not a node"));

  const at::Tensor x = at::randn({4, 3}), mask = (at::rand({4}) > 0.3).to(at::kFloat), scale = at::randn({1, 3});
  const at::Tensor targets = at::randn({4, 2});
  CHECK(smp::DistributedModel::batched_inputs({x, mask, scale}, targets) == std::vector<bool>{true, true, false});
  const smp::OutputsLossFunction loss = [](const std::vector<at::Tensor>& outputs, const at::Tensor& target) {
    return at::mse_loss(outputs[0], target) + outputs[1].pow(2).mean();
  };
  // Plain LibTorch on the same microbatches first, on copies of the weights.
  torch::nn::Linear project_copy(3, 3), head_copy(3, 2);
  {
    at::NoGradGuard no_graph;
    project_copy->weight.copy_(project->weight), project_copy->bias.copy_(project->bias);
    head_copy->weight.copy_(head->weight), head_copy->bias.copy_(head->bias);
  }
  double expected = 0.0;
  for (int m = 0; m < 2; ++m) {
    const at::Tensor scaled = project_copy->forward(x.chunk(2)[m]) * scale;
    const at::Tensor out = head_copy->forward(scaled * mask.chunk(2)[m].unsqueeze(-1));
    const at::Tensor value = at::mse_loss(out, targets.chunk(2)[m]) + scaled.pow(2).mean();
    (value / 2).backward();
    expected += value.item<double>() / 2;
  }

  smp::DistributedModel model(runtime, graph, smp::ModelInputs{x.narrow(0, 0, 2), mask.narrow(0, 0, 2), scale});
  const auto step = model.train_step(std::map<std::string, at::Tensor>{{"x", x}, {"mask", mask}, {"scale", scale}},
                                     targets, loss, /*keep_outputs=*/true);
  CHECK(step.loss == Approx(expected).epsilon(1e-6));
  CHECK(at::allclose(project->weight.grad(), project_copy->weight.grad(), 1e-5, 1e-6));
  CHECK(at::allclose(head->weight.grad(), head_copy->weight.grad(), 1e-5, 1e-6));
  REQUIRE(step.all_outputs.size() == 2);
  CHECK(step.all_outputs[1].sizes() == x.sizes());
  CHECK(step.outputs.sizes() == targets.sizes());
  CHECK_THROWS_WITH(model.train_step(std::map<std::string, at::Tensor>{{"x", x}, {"mask", mask}}, targets, loss),
                    Catch::Matchers::Contains("no input \"scale\""));
  CHECK_THROWS_WITH(model.train_step(std::map<std::string, at::Tensor>{{"x", x}, {"mask", mask}, {"scale", scale},
                                                                       {"extra", x}}, targets, loss),
                    Catch::Matchers::Contains("\"extra\" is not one of the model's inputs"));
  // Without targets the batch is the first batched input's; the loss gets an undefined target.
  const smp::OutputsLossFunction own = [](const std::vector<at::Tensor>& outputs, const at::Tensor& target) {
    CHECK_FALSE(target.defined());
    return outputs[0].pow(2).mean();
  };
  CHECK(std::isfinite(model.evaluate(smp::ModelInputs{x, mask, scale}, at::Tensor(), own).loss));
}

namespace {

// A TorchScript module as a user would script one in Python: blocks with residuals, a ModuleList, a parameter of
// the model itself, a mask computed from the input (no parameter), and two outputs.
torch::jit::Module scripted_model() {
  auto linear = [](int64_t in, int64_t out) {
    torch::jit::Module module("Linear");
    module.register_parameter("weight", (at::randn({out, in}) * 0.3).requires_grad_(), false);
    module.register_parameter("bias", (at::randn({out}) * 0.1).requires_grad_(), false);
    module.define("def forward(self, x):\n  return torch.matmul(x, self.weight.t()) + self.bias\n");
    return module;
  };
  torch::jit::Module root("Model");
  root.register_module("embed", linear(3, 8));
  for (int i = 0; i < 4; ++i) {
    torch::jit::Module block("Block");
    block.register_module("attention", linear(8, 8));
    block.register_module("mlp", linear(8, 8));
    block.define(R"(
def forward(self, x, mask):
  h = x + torch.tanh(self.attention.forward(x)) * mask
  return h + torch.relu(self.mlp.forward(h))
)");
    root.register_module("block" + std::to_string(i), block);
  }
  root.register_parameter("scale", (at::ones({8}) * 0.5).requires_grad_(), false);
  root.register_module("head", linear(8, 2));
  root.define(R"(
def forward(self, x, lengths):
  mask = (lengths > 0.5).to(x.dtype).unsqueeze(-1)
  h = self.embed.forward(x)
  h = self.block0.forward(h, mask)
  h = self.block1.forward(h, mask)
  h = self.block2.forward(h, mask)
  h = self.block3.forward(h, mask)
  return self.head.forward(h * self.scale), h
)");
  return root;
}

}  // namespace

TEST_CASE("a TorchScript module is cut between its submodule calls at any depth and trains as itself",
          "[torchscript]") {
  at::manual_seed(7);
  torch::jit::Module scripted = scripted_model();
  at::manual_seed(7);
  torch::jit::Module reference = scripted_model();
  // Four stages for a model whose blocks each hold a fifth of the parameters: the blocks are cut into their
  // attention and MLP calls.
  const smp::GraphModel graph = smp::graph_from_torchscript(scripted, 4);
  const auto names = [&] {
    std::vector<std::string> found;
    for (const auto& node : graph.nodes()) found.push_back(node.name);
    return found;
  }();
  CHECK(std::find(names.begin(), names.end(), "block1.attention") != names.end());
  CHECK(graph.input_names() == std::vector<std::string>{"x", "lengths"});
  REQUIRE(graph.output_names().size() == 2);
  std::set<std::string> parameter_names;
  for (const auto& [name, tensor] : graph.named_parameters()) parameter_names.insert(name);
  CHECK(parameter_names.count("block2.mlp.weight"));
  CHECK(parameter_names.count("scale"));
  CHECK(parameter_names.size() == 2 + 4 * 4 + 1 + 2);

  const auto config = smp::Config::from_json_text(
      R"({"device": "cpu", "microbatches": 2, "virtual_stages": 4, "pipeline": "interleaved"})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  const at::Tensor x = at::randn({4, 5, 3}), lengths = at::rand({4, 5}), targets = at::randn({4, 5, 2});
  smp::DistributedModel model(runtime, graph, smp::ModelInputs{x.narrow(0, 0, 2), lengths.narrow(0, 0, 2)});
  const smp::OutputsLossFunction loss = [](const std::vector<at::Tensor>& outputs, const at::Tensor& target) {
    return at::mse_loss(outputs[0], target) + 0.1 * outputs[1].pow(2).mean();
  };
  const auto step = model.train_step(smp::ModelInputs{x, lengths}, targets, loss);
  double expected = 0.0;
  for (int m = 0; m < 2; ++m) {
    const auto out = reference.forward({x.chunk(2)[m], lengths.chunk(2)[m]}).toTuple();
    const at::Tensor value = loss({out->elements()[0].toTensor(), out->elements()[1].toTensor()}, targets.chunk(2)[m]);
    (value / 2).backward();
    expected += value.item<double>() / 2;
  }
  CHECK(step.loss == Approx(expected).epsilon(1e-6));
  std::map<std::string, at::Tensor> reference_parameters;
  for (const auto& parameter : reference.named_parameters(true)) reference_parameters[parameter.name] = parameter.value;
  for (const auto& [name, parameter] : model.named_parameters()) {
    REQUIRE(reference_parameters.count(name));
    REQUIRE(parameter.grad().defined());
    CHECK(at::allclose(parameter.grad(), reference_parameters[name].grad(), 1e-5, 1e-6));
  }
  // The TorchScript module's own tensors are the ones trained.
  CHECK(scripted.attr("scale").toTensor().grad().defined());

  // A write in place into what parameters computed would not be seen across stages: refused, naming it.
  torch::jit::Module in_place("InPlace");
  in_place.register_parameter("weight", at::randn({3, 3}).requires_grad_(), false);
  in_place.define(R"(
def forward(self, x):
  h = torch.matmul(x, self.weight)
  h.relu_()
  return torch.matmul(h, self.weight)
)");
  CHECK_THROWS_WITH(smp::graph_from_torchscript(in_place, 2), Catch::Matchers::Contains("writes in place"));
}

TEST_CASE("optimizer shards: whole parameters, balanced by bytes, the same on every replica", "[zero]") {
  // Largest first to the lightest replica (ties to the lower one): 100 | 60 + 20 + 10 | 50 + 30 + 5.
  const std::vector<std::int64_t> bytes = {10, 100, 30, 50, 20, 60, 5};
  const auto owners = smp::assign_shard_owners(bytes, 3);
  CHECK(owners == std::vector<int>{1, 0, 2, 2, 1, 1, 2});
  std::vector<std::int64_t> load(3, 0);
  for (std::size_t i = 0; i < bytes.size(); ++i) load[owners[i]] += bytes[i];
  CHECK(load == std::vector<std::int64_t>{100, 90, 85});
  CHECK(smp::assign_shard_owners(bytes, 1) == std::vector<int>(bytes.size(), 0));
  // More replicas than parameters: some replicas own nothing (their optimizer holds no parameter).
  CHECK(smp::assign_shard_owners({8, 8}, 4) == std::vector<int>{0, 1});
  CHECK(smp::assign_shard_owners({}, 2).empty());
  CHECK_THROWS(smp::assign_shard_owners(bytes, 0));
}

TEST_CASE("optimizer shards: every replica ends with each owner's values, across buckets and dtypes", "[zero]") {
  // Two replicas as two threads over Gloo on loopback. Small buckets split the shares into several broadcasts; a
  // half-precision parameter needs a bucket of its own; an empty one has nothing to send.
  auto store = c10::make_intrusive<c10d::HashStore>();
  constexpr int kReplicas = 2;
  std::vector<std::vector<at::Tensor>> results(kReplicas);
  std::vector<std::string> errors(kReplicas);
  auto replica = [&](int rank) {
    try {
      auto group = smp::comm::make_gloo_group(store, {0, 1}, rank, "shards_test", "127.0.0.1", std::chrono::seconds(30));
      std::vector<at::Tensor> parameters = {
          at::zeros({3, 4}), at::zeros({5}), at::zeros({2, 2}, at::kHalf), at::zeros({0}), at::zeros({7}),
          at::zeros({6}, at::kHalf), at::zeros({4, 4})};
      for (auto& parameter : parameters) parameter.requires_grad_(true);
      std::vector<std::int64_t> bytes;
      for (const auto& parameter : parameters) bytes.push_back(static_cast<std::int64_t>(parameter.nbytes()));
      smp::OptimizerShards shards(parameters, smp::assign_shard_owners(bytes, 2), *group, /*bucket_bytes=*/40);
      // What an optimizer step would do: each replica writes its own parameters only (owner's rank + 1 + index).
      {
        at::NoGradGuard no_graph;
        for (std::size_t i = 0; i < parameters.size(); ++i) {
          if (shards.owns(parameters[i])) parameters[i].fill_(static_cast<double>(rank + 1) + 0.25 * i);
        }
      }
      shards.share_updates();
      results[rank] = parameters;
    } catch (const std::exception& error) {
      errors[rank] = error.what();
    }
  };
  std::thread other(replica, 1);
  replica(0);
  other.join();
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  REQUIRE(results[0].size() == 7);
  REQUIRE(results[1].size() == 7);
  const auto owners = smp::assign_shard_owners({48, 20, 8, 0, 28, 12, 64}, kReplicas);
  for (std::size_t i = 0; i < 7; ++i) {
    INFO("parameter " << i << " owned by replica " << owners[i]);
    CHECK(at::equal(results[0][i], results[1][i]));
    if (results[0][i].numel() > 0) {
      CHECK(results[0][i].to(at::kFloat).eq(static_cast<float>(owners[i] + 1) + 0.25f * i).all().item<bool>());
    }
  }
}

TEST_CASE("device choice: GPUs bound per process through CUDA_VISIBLE_DEVICES are told from one shared GPU",
          "[runtime]") {
  CHECK(smp::gpus_assigned_per_process({"0", "1", "2", "3"}));
  CHECK(smp::gpus_assigned_per_process({"GPU-8a1f", "GPU-77c2"}));  // UUIDs, as some launchers write them
  CHECK_FALSE(smp::gpus_assigned_per_process({"0", "0"}));          // one GPU, shared
  CHECK_FALSE(smp::gpus_assigned_per_process({"0", ""}));           // a process that sees every GPU
  CHECK_FALSE(smp::gpus_assigned_per_process({"0,1", "2,3"}));      // several each: LOCAL_RANK picks among them
  CHECK_FALSE(smp::gpus_assigned_per_process({"0"}));               // one process: nothing to tell apart
}

TEST_CASE("fp16's loss scale halves on an overflow, doubles after a run of good steps, and is 1 without fp16",
          "[loss_scale]") {
  smp::LossScaler scaler(true);
  CHECK(scaler.scale() == smp::LossScaler::kInitialScale);
  for (long long step = 1; step < smp::LossScaler::kGrowthInterval; ++step) scaler.stepped();
  CHECK(scaler.scale() == smp::LossScaler::kInitialScale);
  scaler.overflowed();
  CHECK(scaler.scale() == smp::LossScaler::kInitialScale / 2);
  CHECK(scaler.steps_since_change() == 0);
  for (long long step = 0; step < smp::LossScaler::kGrowthInterval; ++step) scaler.stepped();
  CHECK(scaler.scale() == smp::LossScaler::kInitialScale);
  scaler.restore(8.0, 5);
  CHECK(scaler.scale() == 8.0);
  CHECK(scaler.steps_since_change() == 5);

  smp::LossScaler plain(false);
  for (long long step = 0; step < 3 * smp::LossScaler::kGrowthInterval; ++step) plain.stepped();
  plain.restore(8.0, 5);
  CHECK(plain.scale() == 1.0);
}

TEST_CASE("a non-finite step: an fp16 overflow is skipped, anything else stops the job unless told to skip",
          "[loss_scale]") {
  smp::Config fp16;
  fp16.fp16 = true;
  smp::LossScaler scaler(true);
  CHECK_FALSE(smp::skips_step(fp16, 3, 1.5, "", scaler, false));
  CHECK(scaler.steps_since_change() == 1);
  CHECK(smp::skips_step(fp16, 4, 1.5, "rank 1 (stage-rank 1)", scaler, false));
  CHECK(scaler.scale() == smp::LossScaler::kInitialScale / 2);
  // A non-finite loss is no overflow, under fp16 or not.
  CHECK_THROWS_WITH(smp::skips_step(fp16, 5, std::nan(""), "", scaler, false),
                    Catch::Matchers::Contains("step 5: the loss is nan") &&
                        Catch::Matchers::Contains("\"nonfinite\": \"skip\""));
  smp::Config plain;
  smp::LossScaler unscaled(false);
  CHECK_THROWS_AS(smp::skips_step(plain, 6, 2.0, "rank 0 (stage-rank 0)", unscaled, false), smp::NonFiniteError);
  plain.skip_nonfinite_steps = true;
  CHECK(smp::skips_step(plain, 6, 2.0, "rank 0 (stage-rank 0)", unscaled, false));
  CHECK(unscaled.scale() == 1.0);
}

TEST_CASE("collectives stay off in every thread while rank 0 profiles alone", "[tp][profile]") {
  // On a GPU, autograd runs backward (a tensor-parallel gradient's all-reduce) in a thread of its own.
  auto seen_elsewhere = [] {
    bool off = false;
    std::thread other([&] { off = smp::without_collectives(); });
    other.join();
    return off;
  };
  CHECK_FALSE(seen_elsewhere());
  {
    const smp::WithoutCollectives alone;
    CHECK(seen_elsewhere());
    {
      const smp::WithoutCollectives nested;
      CHECK(smp::without_collectives());
    }
    CHECK(smp::without_collectives());
  }
  CHECK_FALSE(smp::without_collectives());
  CHECK_FALSE(seen_elsewhere());
}

TEST_CASE("a module sees recomputing() only while it runs again for its backward, checkpointed as a stage or alone",
          "[checkpoint][recompute]") {
  // A module's own counters (tokens routed per expert) skip the recompute by it.
  for (const std::string checkpointing : {R"(true)", R"(["counted"])"}) {
    DYNAMIC_SECTION("activation_checkpointing " << checkpointing) {
      const auto config = smp::Config::from_json_text(
          R"({"device": "cpu", "microbatches": 2, "activation_checkpointing": )" + checkpointing + "}", "test config");
      auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
      auto seen = std::make_shared<std::vector<bool>>();
      torch::nn::Linear linear(3, 4);
      smp::GraphModel net("x");
      net.add("counted", linear.ptr(),
              [linear, seen](const std::vector<at::Tensor>& x) mutable {
                seen->push_back(smp::recomputing());
                return linear->forward(x[0]);
              },
              {"x"});
      net.add("out", torch::nn::Linear(4, 2), {"counted"});
      smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
      seen->clear();  // the profile's runs
      model.train_step(at::randn({4, 3}), at::randn({4, 2}),
                       [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); });
      CHECK(*seen == std::vector<bool>{false, true, false, true});  // 1F1B on one stage: F0 B0 F1 B1
      CHECK_FALSE(smp::recomputing());
    }
  }
}

TEST_CASE("launch variables: torchrun's agent store is joined, a world size without a rank refused", "[launch]") {
  const auto from = [](std::map<std::string, std::string> variables) {
    return smp::comm::LaunchInfo::from_environment([variables](const char* name) -> const char* {
      const auto found = variables.find(name);
      return found == variables.end() ? nullptr : found->second.c_str();
    });
  };
  const std::map<std::string, std::string> torchrun = {
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  CHECK_FALSE(from(torchrun).store_hosted_by_launcher);  // smprun's, or torchrun's of old: rank 0 hosts it
  auto agent = torchrun;
  agent["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  agent["TORCHELASTIC_RESTART_COUNT"] = "3";
  const auto joined = from(agent);
  CHECK(joined.store_hosted_by_launcher);
  CHECK(joined.store_prefix == "smp_attempt_3");  // a restart's keys apart from the attempt before
  // smprun's: smp's store on SMP_MASTER_PORT, MASTER_PORT the program's torch.distributed's.
  auto smprun = torchrun;
  smprun["SMP_MASTER_PORT"] = "29611";
  CHECK(from(smprun).master_port == 29611);
  auto nested = agent;  // torchrun started from an smprun rank: its agent's store, on MASTER_PORT, is the one
  nested["SMP_MASTER_PORT"] = "29611";
  CHECK(from(nested).master_port == 29500);
  CHECK(from(nested).store_hosted_by_launcher);
  CHECK_THROWS_WITH(from({{"WORLD_SIZE", "2"}}),
                    Catch::Contains("WORLD_SIZE=\"2\" is set but RANK is not") && Catch::Contains("neither"));
  CHECK(from({{"WORLD_SIZE", "1"}}).world_size == 1);
}

TEST_CASE("a dropped train_step drops the step of its accumulation, until its gradients are cleared however it is done",
          "[loss_scale]") {
  auto config = smp::Config::from_json_text(R"({"device": "cpu", "nonfinite": "skip"})", "test config");
  auto runtime = smp::Runtime::init(config, smp::comm::LaunchInfo{});
  at::manual_seed(5);
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  smp::DistributedModel model(runtime, net, at::zeros({2, 3}));
  auto parameters = model.parameters();
  smp::DistributedOptimizer optimizer(model, std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(0.1)));
  const smp::LossFunction loss = [](const at::Tensor& output, const at::Tensor& target) {
    return at::mse_loss(output, target);
  };
  const at::Tensor inputs = at::randn({2, 3}), targets = at::randn({2, 2});
  const auto moved_by_step = [&] {
    const at::Tensor before = parameters[0].detach().clone();
    optimizer.step();
    return !at::equal(before, parameters[0]);
  };
  const at::Tensor nan_inputs = at::full({2, 3}, std::nan(""));
  CHECK_THROWS_WITH(model.train_step(at::zeros({2, 3}, at::TensorOptions().device(at::kMeta)), targets, loss),
                    Catch::Contains("train_step: input 'input' is on the meta device"));
  // A dropped call, then a good one added to it: the accumulation's step is not taken (GradScaler's rule).
  CHECK(model.train_step(nan_inputs, targets, loss).skipped);
  CHECK_FALSE(model.train_step(inputs, targets, loss).skipped);
  CHECK_FALSE(moved_by_step());
  // Gradients cleared in place (zero_grad(set_to_none=False), .grad.zero_()) forget the dropped call.
  for (const auto& clearing : {"zeroed in place", "set to none"}) {
    DYNAMIC_SECTION(clearing) {
      CHECK(model.train_step(nan_inputs, targets, loss).skipped);
      for (auto& parameter : parameters) {
        if (std::string(clearing) == "zeroed in place") parameter.mutable_grad().zero_();
        else parameter.mutable_grad() = at::Tensor();
      }
      CHECK_FALSE(model.train_step(inputs, targets, loss).skipped);
      CHECK(moved_by_step());
    }
  }
}
