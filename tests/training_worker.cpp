// Launched by the multi-process tests (under smprun). Trains a model with smp for a few steps and, on every rank,
// also trains the same model the plain single-process LibTorch way on the same global batches; exits 0 only if
// this rank's parameters and the step losses agree with that reference within float tolerance.

#include <cmath>
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <csignal>
#include <thread>
#include <map>
#include <optional>
#include <algorithm>
#include <set>
#include <tuple>

#include "common/gpt.h"
#include "smp/checkpoint.h"
#include "smp/distributed_model.h"
#include "smp/distributed_optimizer.h"
#include "smp/main.h"
#include "smp/runtime.h"
#include "smp/tp.h"
#include "warm_worker/server.h"

namespace {

struct Options {
  std::string config_path;
  std::string model = "mlp";
  std::string optimizer = "sgd";
  int steps = 3;
  double clip = 0.0;
  int fail_rank = -1;
  int fail_step = -1;
  int kill_rank = -1;   // this rank SIGKILLs itself at the start of kill_step
  int kill_step = -1;
  int stop_rank = -1;   // this rank stops answering (SIGSTOP) at the start of stop_step
  int stop_step = -1;
  int nan_step = -1;    // the inputs of this step are NaN (under --accumulate, its first half's)
  std::set<int> spike_steps;  // the loss of these steps is multiplied by 1e30: finite, but fp16 gradients overflow
  int input_width = 8;  // a width the model does not take gives a shape error
  int step_sleep_ms = 0;  // each step starts this much later: a job that lasts, whatever the machine's speed
  bool vary_length = false;  // gpt: the sequence length changes from step to step
  bool accumulate = false;   // each step is two train_steps on the batch's halves, gradients accumulated between
  bool skip_resume = false;  // never calls Checkpointer::resume (a program that forgot it)
  int lr_step = 0;  // > 0: a StepLR halves the learning rate every this many steps, kept in checkpoints
  std::string load_full;  // a full-model file (smp_checkpoint export) to load instead of training
  int expect_step = -1;   // with load_full: the file holds the state after this step
  double rtol = 1e-4;
  double atol = 1e-5;
};

constexpr int64_t kMlpIn = 8, kMlpOut = 4, kGptLength = 16;

class AddImpl : public torch::nn::Module {
 public:
  at::Tensor forward(const at::Tensor& a, const at::Tensor& b) { return a + b; }
};
TORCH_MODULE(Add);

class TanhLinearImpl : public torch::nn::Module {
 public:
  TanhLinearImpl(int64_t in, int64_t out) : linear_(register_module("linear", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(linear_->forward(x)); }

 private:
  torch::nn::Linear linear_;
};
TORCH_MODULE(TanhLinear);

// Uses the weight of another Linear (transposed), as a tied embedding and LM head do.
class TiedLinearImpl : public torch::nn::Module {
 public:
  explicit TiedLinearImpl(const at::Tensor& weight) : weight_(register_parameter("weight", weight)) {}
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight_); }

 private:
  at::Tensor weight_;
};
TORCH_MODULE(TiedLinear);

// The same tie held as a plain member, LibTorch's other way: correct in one process, refused across stages.
class HeldLinearImpl : public torch::nn::Module {
 public:
  explicit HeldLinearImpl(const at::Tensor& weight) : weight_(weight) {}
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight_); }

 private:
  at::Tensor weight_;
};
TORCH_MODULE(HeldLinear);

// `tensor_parallel`: the group whose shards the GPT's layers hold (none: the whole model, the reference), with the
// activations between them split along the sequence when `sequence_parallel`.
smp::GraphModel make_model(const Options& options, const smp::tp::Group& tensor_parallel = nullptr,
                           bool sequence_parallel = false) {
  if (options.model == "gpt") {
    smp::examples::GptOptions gpt;
    gpt.vocab_size = 32, gpt.context = kGptLength, gpt.d_model = 16, gpt.heads = 2, gpt.layers = 4;
    gpt.sequence_parallel = sequence_parallel;
    return smp::examples::make_gpt(gpt, tensor_parallel);
  }
  if (options.model == "residual" || options.model == "long_residual") {
    // A skip from "in" over three blocks to "join": on 4 stages it crosses two stage boundaries. long_residual puts
    // one more module in front, so that pins can put the skip's source on stage 1 of 6.
    smp::GraphModel graph("x");
    const bool longer = options.model == "long_residual";
    if (longer) graph.add("pre", TanhLinear(kMlpIn, kMlpIn), {"x"});
    graph.add("in", TanhLinear(kMlpIn, 32), {longer ? "pre" : "x"});
    graph.add("a", TanhLinear(32, 32), {"in"});
    graph.add("b", TanhLinear(32, 32), {"a"});
    graph.add("c", TanhLinear(32, 32), {"b"});
    graph.add("join", Add(), {"c", "in"});
    graph.add("d", TanhLinear(32, 32), {"join"});
    graph.add("out", torch::nn::Linear(32, kMlpOut), {"d"});
    return graph;
  }
  if (options.model == "branch") {
    // Two branches of one input, joined later; the model input is also read deep in the graph.
    smp::GraphModel graph("x");
    graph.add("in", TanhLinear(kMlpIn, 32), {"x"});
    graph.add("left", TanhLinear(32, 32), {"in"});
    graph.add("left2", TanhLinear(32, 32), {"left"});
    graph.add("right", TanhLinear(32, 32), {"in"});
    graph.add("join", Add(), {"left2", "right"});
    graph.add("late_input", TanhLinear(kMlpIn, 32), {"x"});
    graph.add("join2", Add(), {"join", "late_input"});
    graph.add("out", torch::nn::Linear(32, kMlpOut), {"join2"});
    return graph;
  }
  if (options.model == "tied" || options.model == "held_tie") {
    // The first and the last layer share one matrix, so on several stages two ranks hold copies.
    smp::GraphModel graph("x");
    torch::nn::Linear first(torch::nn::LinearOptions(kMlpIn, 32).bias(false));
    graph.add("first", first, {"x"});
    graph.add("a", TanhLinear(32, 32), {"first"});
    graph.add("b", TanhLinear(32, 32), {"a"});
    graph.add("c", TanhLinear(32, kMlpIn), {"b"});
    graph.add("d", TanhLinear(kMlpIn, 32), {"c"});
    if (options.model == "held_tie") {
      graph.add("tied", HeldLinear(first->weight), {"d"});
    } else {
      graph.add("tied", TiedLinear(first->weight), {"d"});  // [.., 32] x [32, 8] -> [.., 8]
    }
    graph.add("out", torch::nn::Linear(kMlpIn, kMlpOut), {"tied"});
    return graph;
  }
  if (options.model == "nested") {
    // Three top-level modules, two of them Sequentials: more stages than that need the module tree's children.
    auto block = [](int64_t in) {
      return torch::nn::Sequential(torch::nn::Linear(in, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32), torch::nn::Tanh());
    };
    smp::GraphModel graph("x");
    for (const auto& [name, input, width] : {std::tuple{"encoder", "x", kMlpIn}, std::tuple{"decoder", "encoder", int64_t{32}}}) {
      auto sequential = block(width);
      graph.add(name, sequential.ptr(), [sequential](const std::vector<at::Tensor>& in) mutable { return sequential->forward(in[0]); },
                {input});
    }
    graph.add("out", torch::nn::Linear(32, kMlpOut), {"decoder"});
    return graph;
  }
  if (options.model == "frozen") {
    // A frozen layer and a parameter no forward uses: neither gets a gradient, so neither may move, whatever the
    // optimizer's weight decay (as in plain training, where their .grad stays undefined).
    torch::nn::Linear frozen(kMlpIn, 32);
    for (auto& parameter : frozen->parameters()) parameter.requires_grad_(false);
    torch::nn::Linear unused_holder(32, 32);
    unused_holder->register_parameter("unused", at::randn({7}));
    torch::nn::Sequential model(frozen, torch::nn::Tanh(), unused_holder, torch::nn::Tanh(),
                                torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Linear(32, kMlpOut));
    return smp::GraphModel::from_sequential(model);
  }
  if (options.model == "inplace") {
    // In-place ReLUs, as CNNs use them: cut before one, a stage writes into the tensor it received.
    torch::nn::Sequential inplace(torch::nn::Linear(kMlpIn, 32), torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                  torch::nn::Linear(32, 32), torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                  torch::nn::Linear(32, kMlpOut));
    return smp::GraphModel::from_sequential(inplace);
  }
  torch::nn::Sequential mlp;
  mlp->push_back(torch::nn::Linear(kMlpIn, 32));
  for (int layer = 0; layer < 3; ++layer) {
    mlp->push_back(torch::nn::Tanh());
    mlp->push_back(torch::nn::Linear(32, 32));
  }
  mlp->push_back(torch::nn::Tanh());
  mlp->push_back(torch::nn::Linear(32, kMlpOut));
  return smp::GraphModel::from_sequential(mlp);
}

std::vector<at::Tensor> parameters_of(const smp::GraphModel& model) {
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : model.named_parameters()) tensors.push_back(tensor);
  return tensors;
}

// NaN inputs; only the first half's when the step is two train_steps on the halves (--accumulate).
at::Tensor not_finite(at::Tensor inputs, bool first_half) {
  inputs = inputs.clone();
  (first_half ? inputs.narrow(0, 0, inputs.size(0) / 2) : inputs).fill_(std::nan(""));
  return inputs;
}

std::pair<at::Tensor, at::Tensor> global_batch(const Options& options, int64_t size, int step, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed * 7919 + static_cast<uint64_t>(step));
  if (options.model == "gpt") {
    // Activation shapes then differ between steps, and every transfer must still match.
    const int64_t length = options.vary_length ? kGptLength - 4 * (step % 3) : kGptLength;
    auto tokens = at::randint(32, {size, length + 1}, generator, at::kLong);
    return {tokens.narrow(1, 0, length).contiguous(), tokens.narrow(1, 1, length).contiguous()};
  }
  return {at::randn({size, options.input_width}, generator), at::randn({size, kMlpOut}, generator)};
}

smp::LossFunction loss_of(const Options& options, const smp::tp::Group& tensor_parallel = nullptr) {
  if (options.model == "gpt") return smp::examples::gpt_loss_for(tensor_parallel);
  return [](const at::Tensor& output, const at::Tensor& target) { return at::mse_loss(output, target); };
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Options& options, std::vector<at::Tensor> parameters) {
  if (options.optimizer == "adamw") {
    // eps 1e-6, not 1e-8: AdamW divides by the gradient's running magnitude, so a gradient that is zero in exact
    // arithmetic (attention's key bias) turns rounding noise into steps near the learning rate, whose sign the
    // microbatching decides (on a GPU, 2.7e-4 against the 2.6e-4 that rtol 1e-3 allowed); eps bounds those steps.
    return std::make_unique<torch::optim::AdamW>(parameters, torch::optim::AdamWOptions(1e-2).eps(1e-6));
  }
  return std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(0.1).momentum(0.9));
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--config") options.config_path = value;
    else if (flag == "--model") options.model = value;
    else if (flag == "--optimizer") options.optimizer = value;
    else if (flag == "--steps") options.steps = std::stoi(value);
    else if (flag == "--clip") options.clip = std::stod(value);
    else if (flag == "--fail-rank") options.fail_rank = std::stoi(value);
    else if (flag == "--fail-step") options.fail_step = std::stoi(value);
    else if (flag == "--rtol") options.rtol = std::stod(value);
    else if (flag == "--kill-rank") options.kill_rank = std::stoi(value);
    else if (flag == "--kill-step") options.kill_step = std::stoi(value);
    else if (flag == "--stop-rank") options.stop_rank = std::stoi(value);
    else if (flag == "--stop-step") options.stop_step = std::stoi(value);
    else if (flag == "--nan-step") options.nan_step = std::stoi(value);
    else if (flag == "--spike-step") options.spike_steps.insert(std::stoi(value));
    else if (flag == "--input-width") options.input_width = std::stoi(value);
    else if (flag == "--step-sleep-ms") options.step_sleep_ms = std::stoi(value);
    else if (flag == "--vary-length") options.vary_length = value == "1";
    else if (flag == "--accumulate") options.accumulate = value == "1";
    else if (flag == "--skip-resume") options.skip_resume = value == "1";
    else if (flag == "--lr-step") options.lr_step = std::stoi(value);
    else if (flag == "--load-full") options.load_full = value;
    else if (flag == "--expect-step") options.expect_step = std::stoi(value);
    else throw std::runtime_error("training_worker: unknown flag " + flag);
  }
  return options;
}

int run(int argc, char** argv) {
  const Options options = parse(argc, argv);
  const smp::Config config = smp::Config::from_file(options.config_path);
  auto runtime = smp::Runtime::init(config);
  const int64_t batch = config.global_batch_size;
  const int64_t microbatch = batch / runtime->topology().data_parallel_degree() / config.microbatches;

  // Built over the tensor-parallel group, by a builder: with "tensor_parallel_degree": "auto" the planner builds it
  // for each degree on rank 0, then every rank for the chosen one. Seeded in it, so that every build draws alike.
  const smp::ModelBuilder build = [&](const smp::tp::Group& group) {
    at::manual_seed(config.seed);
    return make_model(options, group, config.sequence_parallel);
  };
  const at::Tensor sample = runtime->replica_slice(global_batch(options, batch, 0, config.seed).first).narrow(0, 0, microbatch);
  smp::DistributedModel distributed(runtime, build, smp::ModelInputs{sample});
  // Nodes built on demand (the GPT's): this rank built those of its own stages and no other.
  const auto own_stages = distributed.stages();
  for (std::size_t i = 0; i < distributed.model().nodes().size(); ++i) {
    const auto& node = distributed.model().nodes()[i];
    const bool own = std::count(own_stages.begin(), own_stages.end(), distributed.plan().stage_of_module[i]) > 0;
    if (node.factory && node.built() != own) {
      std::fprintf(stderr, "rank %d: node %s is %sbuilt here, but its stage is %s\n", runtime->rank(), node.name.c_str(),
                   node.built() ? "" : "not ", own ? "this rank's" : "another rank's");
      return 1;
    }
  }
  smp::DistributedOptimizer optimizer(distributed, make_optimizer(options, distributed.parameters()));
  std::optional<torch::optim::StepLR> scheduler;
  smp::ProgramStates program_state;
  if (options.lr_step > 0) {
    scheduler.emplace(optimizer.local(), options.lr_step, 0.5);
    program_state["lr_scheduler"] = smp::lr_scheduler_state(*scheduler);
  }
  smp::Checkpointer checkpointer(distributed, optimizer, std::move(program_state));
  const int first_step = options.skip_resume ? 0 : static_cast<int>(checkpointer.resume());
  if (first_step > 0) {
    // Every rank's program generator continues alike, a replica the saving job did not have included (it kept a
    // fresh state, and a program drawing its global batch from it failed the step).
    const at::Tensor state = at::detail::getDefaultCPUGenerator().get_state();
    const at::Tensor first_rank_state = state.clone();
    runtime->world().broadcast(first_rank_state, 0);
    if (!at::equal(state, first_rank_state)) {
      std::fprintf(stderr, "rank %d: the program's random generator differs from rank 0's after the resume\n",
                   runtime->rank());
      return 1;
    }
  }
  at::manual_seed(config.seed);
  auto reference = make_model(options);
  reference.materialize(static_cast<std::uint64_t>(config.seed));  // nodes built on demand, with the job's weights
  // Single-device training on this rank's device: on a GPU the reference is single-GPU training.
  const c10::Device device = runtime->device();
  for (const auto& node : reference.nodes()) node.module->to(device);
  auto reference_optimizer = make_optimizer(options, parameters_of(reference));
  std::optional<torch::optim::StepLR> reference_scheduler;
  if (options.lr_step > 0) reference_scheduler.emplace(*reference_optimizer, options.lr_step, 0.5);
  int current_step = 0;
  const auto with_spikes = [&](smp::LossFunction base) -> smp::LossFunction {
    return [&, base](const at::Tensor& output, const at::Tensor& target) {
      const auto value = base(output, target);
      return options.spike_steps.count(current_step) ? value * 1e30 : value;
    };
  };
  // Under tensor parallelism smp's last stage gives this rank's share of the logits, the reference all of them.
  const smp::LossFunction loss = with_spikes(loss_of(options, runtime->tensor_parallel_group()));
  const smp::LossFunction whole_loss = with_spikes(loss_of(options));
  at::Tensor reference_output;  // of the last reference step's whole batch (not under --accumulate)
  auto reference_step = [&](int step) {
    current_step = step;
    at::rand({1});  // the program's own draw each step (a shuffle, an augmentation), which a resume continues
    auto [inputs, targets] = global_batch(options, batch, step, config.seed);
    if (step == options.nan_step) inputs = not_finite(inputs, options.accumulate);
    inputs = inputs.to(device);
    targets = targets.to(device);
    reference_optimizer->zero_grad();
    at::Tensor reference_loss;
    if (options.accumulate) {  // the halves' gradients summed in .grad, as smp's two train_steps leave them
      const int64_t half = inputs.size(0) / 2;
      const auto first = whole_loss(reference.forward(inputs.narrow(0, 0, half)), targets.narrow(0, 0, half));
      first.backward();
      const auto second = whole_loss(reference.forward(inputs.narrow(0, half, half)), targets.narrow(0, half, half));
      second.backward();
      reference_loss = (first.detach() + second.detach()) / 2;
    } else {
      const at::Tensor output = reference.forward(inputs);
      reference_output = output.detach();
      reference_loss = whole_loss(output, targets);
      reference_loss.backward();
    }
    double reference_norm = 0.0;
    if (options.clip > 0) reference_norm = torch::nn::utils::clip_grad_norm_(parameters_of(reference), options.clip);
    // smp drops these steps ("nonfinite": "skip", or an fp16 overflow); so does the reference.
    if (step != options.nan_step && !options.spike_steps.count(step)) reference_optimizer->step();
    if (reference_scheduler) reference_scheduler->step();
    return std::make_pair(reference_loss.item<double>(), reference_norm);
  };
  if (!options.load_full.empty()) {
    distributed.load_parameters(options.load_full);
    for (int step = 0; step <= options.expect_step; ++step) reference_step(step);
  }
  for (int step = 0; step < first_step; ++step) reference_step(step);

  int failures = 0;
  // Every step, each parameter this rank holds (tied copies included) must equal single-process training's.
  // A tensor-parallel shard is checked against its part of the reference's whole parameter.
  std::map<const void*, smp::tp::ShardLayout> shard_layouts;
  for (const auto& node : distributed.model().nodes()) {
    if (!node.built()) continue;
    for (const auto& layout : smp::tp::shard_layouts_in(*node.module)) shard_layouts[layout.shard.unsafeGetTensorImpl()] = layout;
  }
  auto check_parameters = [&](int step) {
    std::map<std::string, at::Tensor> reference_parameters;
    for (const auto& [name, tensor] : reference.named_parameters()) reference_parameters[name] = tensor;
    for (const auto& [name, parameter] : distributed.named_parameters()) {
      auto found = reference_parameters.find(name);
      const auto layout = shard_layouts.find(parameter.unsafeGetTensorImpl());
      at::Tensor shard_expected;
      if (found != reference_parameters.end() && layout != shard_layouts.end()) {
        shard_expected = smp::tp::shard_of(found->second, layout->second.dim, runtime->tensor_parallel_group(),
                                           layout->second.blocks);
        if (found->second.grad().defined()) shard_expected.mutable_grad() = found->second.grad();  // "got a gradient"
      }
      const at::Tensor* expected = found == reference_parameters.end() ? nullptr
                                   : shard_expected.defined()          ? &shard_expected
                                                                       : &found->second;
      if (!expected) {
        std::fprintf(stderr, "rank %d: parameter %s has no single-process counterpart\n", runtime->rank(), name.c_str());
        ++failures;
        continue;
      }
      // A parameter the reference step gave no gradient (frozen, unused) did not move there: here neither, exactly.
      if (!expected->grad().defined() && !at::equal(parameter, *expected)) {
        std::fprintf(stderr, "rank %d step %d: parameter %s got no gradient but moved\n", runtime->rank(), step,
                     name.c_str());
        ++failures;
        continue;
      }
      const double difference = (parameter - *expected).abs().max().item<double>();
      const double scale = expected->abs().max().item<double>();
      if (difference > options.atol + options.rtol * scale) {
        std::fprintf(stderr, "rank %d step %d: parameter %s differs by %.3g (scale %.3g)\n", runtime->rank(), step, name.c_str(),
                     difference, scale);
        ++failures;
      }
    }
  };
  // keep_outputs: the rank that runs the last stage gets its replica's outputs, in order; the others get none.
  const auto stages_here = distributed.stages();
  const bool runs_last_stage =
      std::find(stages_here.begin(), stages_here.end(), runtime->config().num_stages() - 1) != stages_here.end();
  auto check_outputs = [&](const std::string& when, const at::Tensor& outputs, const at::Tensor& whole_expected) {
    // Under tensor parallelism the GPT's logits come back as this rank's share of the vocabulary.
    const at::Tensor expected = runtime->topology().tensor_parallel_degree() > 1 && whole_expected.dim() > 0
                                    ? smp::tp::shard_of(whole_expected, -1, runtime->tensor_parallel_group())
                                    : whole_expected;
    if (!runs_last_stage) {
      if (outputs.defined()) {
        std::fprintf(stderr, "rank %d %s: outputs on a rank without the last stage\n", runtime->rank(), when.c_str());
        ++failures;
      }
      return;
    }
    if (!outputs.defined() || outputs.sizes() != expected.sizes()) {
      std::fprintf(stderr, "rank %d %s: outputs %s, single-process %s\n", runtime->rank(), when.c_str(),
                   outputs.defined() ? c10::str(outputs.sizes()).c_str() : "missing", c10::str(expected.sizes()).c_str());
      ++failures;
      return;
    }
    // Under bf16/fp16 single outputs stray by several percent (near-zero logits through half-precision matmuls)
    // where the averaged losses and parameters stay within tolerance: there the mean difference is held to a
    // quarter of the mean output, which a wrong or misplaced microbatch (a difference the size of the outputs)
    // still breaks.
    const bool half_precision = config.bf16 || config.fp16;
    const at::Tensor deviation = (outputs.to(at::kDouble) - expected.to(outputs.device(), at::kDouble)).abs();
    const double difference = half_precision ? deviation.mean().item<double>() : deviation.max().item<double>();
    const double scale = half_precision ? expected.abs().mean().item<double>() : expected.abs().max().item<double>();
    if (difference > options.atol + (half_precision ? 0.25 : options.rtol) * scale) {
      std::fprintf(stderr, "rank %d %s: outputs differ by %.3g (scale %.3g)\n", runtime->rank(), when.c_str(), difference,
                   scale);
      ++failures;
    }
  };
  for (int step = first_step; step < options.steps; ++step) {
    if (runtime->rank() == options.fail_rank && step == options.fail_step) {
      throw std::runtime_error("injected failure on rank " + std::to_string(runtime->rank()) + " at step " +
                               std::to_string(step));
    }
    if (runtime->rank() == options.kill_rank && step == options.kill_step) raise(SIGKILL);
    if (options.step_sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(options.step_sleep_ms));
    if (runtime->rank() == options.stop_rank && step == options.stop_step) raise(SIGSTOP);
    at::rand({1});  // the program's own draw each step (a shuffle, an augmentation), which a resume continues
    auto [inputs, targets] = global_batch(options, batch, step, config.seed);
    if (step == options.nan_step) inputs = not_finite(inputs, options.accumulate);
    optimizer.zero_grad();
    current_step = step;
    smp::StepOutput output;
    if (options.accumulate) {
      // Two train_steps without zero_grad between: the second adds its gradients to the first's.
      const int64_t half = batch / 2;
      const auto first = distributed.train_step(runtime->replica_slice(inputs.narrow(0, 0, half)),
                                                runtime->replica_slice(targets.narrow(0, 0, half)), loss);
      output = distributed.train_step(runtime->replica_slice(inputs.narrow(0, half, half)),
                                      runtime->replica_slice(targets.narrow(0, half, half)), loss);
      output.loss = (first.loss + output.loss) / 2;
      output.skipped = output.skipped || first.skipped;  // optimizer.step() was not taken
    } else {
      output = distributed.train_step(runtime->replica_slice(inputs), runtime->replica_slice(targets), loss,
                                      /*keep_outputs=*/true);
    }
    double norm = 0.0;
    if (options.clip > 0) norm = optimizer.clip_grad_norm(options.clip);
    optimizer.step();
    if (scheduler) scheduler->step();
    if (checkpointer.due(step)) checkpointer.save(step);

    const auto [expected, reference_norm] = reference_step(step);
    if (output.skipped) {
      if (runtime->rank() == 0) std::printf("step %d skipped\n", step);
      continue;
    }

    if (std::abs(output.loss - expected) > options.atol + options.rtol * std::abs(expected)) {
      std::fprintf(stderr, "rank %d step %d: loss %.8f, single-process %.8f\n", runtime->rank(), step, output.loss, expected);
      ++failures;
    }
    // The first stage's rank: its first forward's send has been taken by the time that microbatch's gradient
    // comes back, so the executor must have let its tensors go before the step ended.
    if (runtime->pp_rank() == 0 && config.partitions > 1 && config.microbatches > 1 &&
        output.sends_released_early == 0) {
      std::fprintf(stderr, "rank %d step %d: no send was released before the end of the step\n", runtime->rank(), step);
      ++failures;
    }
    // Every parameter of these models gets a gradient, so every bucket must go out while backward still runs.
    if (options.model != "frozen" && output.buckets_overlapped != output.gradient_buckets) {
      std::fprintf(stderr, "rank %d step %d: %d of %d gradient buckets were reduced during backward\n", runtime->rank(),
                   step, output.buckets_overlapped, output.gradient_buckets);
      ++failures;
    }
    if (options.clip > 0 && std::abs(norm - reference_norm) > options.rtol * reference_norm + 1e-6) {
      std::fprintf(stderr, "rank %d step %d: grad norm %.8f, single-process %.8f\n", runtime->rank(), step, norm, reference_norm);
      ++failures;
    }
    if (!options.accumulate && step != options.nan_step) {
      check_outputs("step " + std::to_string(step), output.outputs, runtime->replica_slice(reference_output));
    }
    if (runtime->rank() == 0) std::printf("step %d loss %.17g reference %.17g\n", step, output.loss, expected);
    check_parameters(step);

    // Evaluation on a batch training never sees: the same loss as a forward of the single-process model, and
    // neither the gradients nor the parameters move.
    auto [held_out_inputs, held_out_targets] = global_batch(options, batch, 1000000 + step, config.seed);
    std::vector<at::Tensor> gradients_before;
    for (const auto& parameter : distributed.parameters()) {
      gradients_before.push_back(parameter.grad().defined() ? parameter.grad().clone() : at::Tensor());
    }
    const auto evaluation = distributed.evaluate(runtime->replica_slice(held_out_inputs),
                                                 runtime->replica_slice(held_out_targets), loss_of(options, runtime->tensor_parallel_group()),
                                                 /*keep_outputs=*/true);
    double expected_evaluation = 0.0;
    {
      at::NoGradGuard no_graph;
      check_outputs("evaluation after step " + std::to_string(step), evaluation.outputs,
                    reference.forward(runtime->replica_slice(held_out_inputs).to(device)));
      expected_evaluation =
          loss_of(options)(reference.forward(held_out_inputs.to(device)), held_out_targets.to(device)).item<double>();
    }
    // With one stage per rank nothing proves an evaluation's sends delivered, but on a chain (the first rank sends
    // to the second alone; skips would add more receivers) the first rank waits for older sends rather than
    // keeping every microbatch's outputs to the end.
    const bool chain = options.model != "residual" && options.model != "long_residual" && options.model != "branch";
    if (chain && runtime->pp_rank() == 0 && config.partitions > 1 && config.virtual_stages == 1 &&
        config.microbatches > 2 && evaluation.peak_sends_held > 2) {
      std::fprintf(stderr, "rank %d step %d: evaluation held %d sends at once\n", runtime->rank(), step,
                   evaluation.peak_sends_held);
      ++failures;
    }
    // With interleaved virtual stages the outputs come back round to rank 0, and what each rank receives proves
    // some of its earlier sends taken (through the ranks in between): not every send may wait for the end. (A V
    // turns back on the last rank, and its first rank sends nothing after its first receive.)
    if (chain && config.partitions > 1 && config.schedule_name() == "interleaved_1f1b" && evaluation.sends_posted > 0 &&
        evaluation.sends_released_early == 0) {
      std::fprintf(stderr, "rank %d step %d: evaluation held all its %d sends to the end\n", runtime->rank(), step,
                   evaluation.sends_posted);
      ++failures;
    }
    if (std::abs(evaluation.loss - expected_evaluation) > options.atol + options.rtol * std::abs(expected_evaluation)) {
      std::fprintf(stderr, "rank %d step %d: evaluation loss %.8f, single-process %.8f\n", runtime->rank(), step,
                   evaluation.loss, expected_evaluation);
      ++failures;
    }
    const auto parameters_now = distributed.parameters();
    for (std::size_t i = 0; i < parameters_now.size(); ++i) {
      const at::Tensor& gradient = parameters_now[i].grad();
      if (gradient.defined() != gradients_before[i].defined() ||
          (gradient.defined() && !at::equal(gradient, gradients_before[i]))) {
        std::fprintf(stderr, "rank %d step %d: evaluation changed a gradient\n", runtime->rank(), step);
        ++failures;
        break;
      }
    }
    check_parameters(step);
  }

  // shard_optimizer_state: each trainable parameter is in exactly one replica's optimizer.
  if (distributed.optimizer_state_shards() > 1) {
    const auto parameters = distributed.parameters();
    at::Tensor holders = at::zeros({static_cast<std::int64_t>(parameters.size())}, at::TensorOptions(at::kLong).device(device));
    std::int64_t held = 0;
    for (const auto& group : optimizer.local().param_groups()) {
      for (const auto& parameter : group.params()) {
        for (std::size_t i = 0; i < parameters.size(); ++i) {
          if (parameters[i].is_same(parameter) && parameter.requires_grad()) holders[static_cast<std::int64_t>(i)] += 1, ++held;
        }
      }
    }
    runtime->data_parallel().all_reduce_sum(holders);
    holders = holders.cpu();
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      const std::int64_t count = holders[static_cast<std::int64_t>(i)].item<std::int64_t>();
      if (parameters[i].requires_grad() && count != 1) {
        std::fprintf(stderr, "rank %d: parameter %s is in %lld replicas' optimizers, not exactly one\n", runtime->rank(),
                     distributed.named_parameters()[i].first.c_str(), static_cast<long long>(count));
        ++failures;
      }
    }
    std::printf("rank %d optimizer holds %lld of %zu parameters\n", runtime->rank(), static_cast<long long>(held),
                parameters.size());
  }
  // Whatever the sharding a checkpoint was saved with, an optimizer keeps state only for what it updates.
  {
    std::set<const void*> in_groups;
    for (const auto& group : optimizer.local().param_groups()) {
      for (const auto& parameter : group.params()) in_groups.insert(parameter.unsafeGetTensorImpl());
    }
    std::size_t stray = 0;
    for (const auto& [key, state] : optimizer.local().state()) stray += !in_groups.count(key);
    if (stray > 0) {
      std::fprintf(stderr, "rank %d: the optimizer keeps state for %zu parameters it does not update\n", runtime->rank(),
                   stray);
      ++failures;
    }
  }
  checkpointer.wait();
  if (options.steps == 0 || first_step >= options.steps) check_parameters(options.expect_step);
  std::printf("rank %d stage %d: %zu parameters checked, %d mismatches\n", runtime->rank(), distributed.stage(),
              distributed.named_parameters().size(), failures);
  return failures == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  return smp_test::warm::main_or_serve(argc, argv, [](int count, char** arguments) {
    return smp::guarded_main(count, arguments, run);
  });
}
