// The engine's own cost on the CPU, against plain LibTorch (bench_gpu measures the same on a GPU). Prints one JSON line
// each: the time per schedule action smp adds (eight one-layer stages in one process), a small GPT stage's speed, and
// the zero-bubble split's cost: a middle stage's input-gradient pass (I) plus weight-gradient pass (W) against one
// backward (B), at two sizes. `bench_engine --split-nodes` prints instead where B, I and W spend their time, by
// autograd node kind (hooks around every node: the totals run higher than unhooked).

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>

#include <torch/csrc/autograd/function.h>

#include "pipeline/split_backward.h"
#include "smp/main.h"
#include "step_timing.h"

namespace {

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The GPT's blocks (no embedding, no head) as one stage fed hidden states that need their gradient, as a middle
// stage's are.
struct MiddleStage {
  smp::GraphModel model;
  std::vector<at::Tensor> parameters;
  at::Tensor hidden;

  MiddleStage(const smp::examples::GptOptions& options, int64_t batch)
      : model(smp::examples::make_gpt(options).materialize(3)) {
    for (const auto& [name, parameter] : model.named_parameters()) parameters.push_back(parameter);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
    const auto tokens = at::randint(options.vocab_size, {batch, options.context}, generator, at::kLong);
    hidden = model.nodes().front().forward({tokens}).detach().requires_grad_(true);
  }
  at::Tensor forward() const {
    const auto& nodes = model.nodes();
    at::Tensor h = hidden;
    for (std::size_t k = 1; k + 1 < nodes.size(); ++k) h = nodes[k].forward({h});
    return h;
  }
};

// A middle stage's B, then I and W on a fresh forward, alternating, medians over `rounds`. Also I alone as plain autograd
// computes it (torch::autograd::grad to the input): what I would cost without recording W's inputs.
void print_split_backward(const smp::examples::GptOptions& options, int64_t batch, int rounds) {
  MiddleStage middle(options, batch);
  auto& parameters = middle.parameters;
  const at::Tensor& hidden = middle.hidden;
  auto stage = [&] { return middle.forward(); };
  auto clear = [&] {
    for (auto& parameter : parameters) parameter.mutable_grad() = at::Tensor();
    hidden.mutable_grad() = at::Tensor();
  };
  std::vector<double> b, i, w, plain_i;
  for (int round = 0; round < rounds + 2; ++round) {
    clear();
    at::Tensor out = stage();
    const at::Tensor grad = at::randn_like(out);
    auto start = std::chrono::steady_clock::now();
    torch::autograd::backward({out}, {grad});
    const double b_ms = ms_since(start);
    clear();
    out = stage();
    start = std::chrono::steady_clock::now();
    auto [input_grads, weight_pass] = smp::WeightPass::run_input_pass({out}, {grad}, {hidden}, parameters);
    const double i_ms = ms_since(start);
    out = at::Tensor();
    start = std::chrono::steady_clock::now();
    weight_pass.run();
    const double w_ms = ms_since(start);
    clear();
    out = stage();
    start = std::chrono::steady_clock::now();
    (void)torch::autograd::grad({out}, {hidden}, {grad}, /*retain_graph=*/true);
    const double plain_i_ms = ms_since(start);
    if (round < 2) continue;
    b.push_back(b_ms), i.push_back(i_ms), w.push_back(w_ms), plain_i.push_back(plain_i_ms);
  }
  auto median = [](std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
  };
  std::printf("{\"bench\": \"split_backward\", \"d_model\": %lld, \"context\": %lld, \"batch\": %lld, \"layers\": %lld, "
              "\"b_ms\": %.3f, \"i_ms\": %.3f, \"w_ms\": %.3f, \"plain_i_ms\": %.3f, \"i_plus_w_over_b\": %.3f}\n",
              static_cast<long long>(options.d_model), static_cast<long long>(options.context),
              static_cast<long long>(batch), static_cast<long long>(options.layers), median(b), median(i), median(w),
              median(plain_i), (median(i) + median(w)) / median(b));
  std::fflush(stdout);
}

// Milliseconds per node kind, summed over the nodes a pass runs: a pre-hook starts each node's clock, a post-hook
// stops it. The hooks stay on the graph, so that W's runs land in the table current when it runs.
struct NodeTimes {
  std::map<std::string, double>* into = nullptr;
  std::map<const torch::autograd::Node*, std::chrono::steady_clock::time_point> started;
};

void time_every_node(const at::Tensor& root, NodeTimes* times) {
  struct Start final : torch::autograd::FunctionPreHook {
    Start(NodeTimes* times, const torch::autograd::Node* node) : times(times), node(node) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
      times->started[node] = std::chrono::steady_clock::now();
      return grads;
    }
    NodeTimes* times;
    const torch::autograd::Node* node;
  };
  struct Stop final : torch::autograd::FunctionPostHook {
    Stop(NodeTimes* times, const torch::autograd::Node* node) : times(times), node(node) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      (*times->into)[node->name()] += ms_since(times->started.at(node));
      return outputs;
    }
    NodeTimes* times;
    const torch::autograd::Node* node;
  };
  std::vector<torch::autograd::Node*> stack{root.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    node->add_pre_hook(std::make_unique<Start>(times, node));
    node->add_post_hook(std::make_unique<Stop>(times, node));
    for (const auto& edge : node->next_edges()) {
      if (edge.is_valid()) stack.push_back(edge.function.get());
    }
  }
}

// The same middle stage as print_split_backward: B, then I and W on another forward, per node kind, mean over rounds.
void print_split_nodes(const smp::examples::GptOptions& options, int64_t batch, int rounds) {
  MiddleStage middle(options, batch);
  auto& parameters = middle.parameters;
  const at::Tensor& hidden = middle.hidden;
  auto stage = [&] { return middle.forward(); };
  std::map<std::string, double> b, i, w;
  for (int round = 0; round < rounds; ++round) {
    for (auto& parameter : parameters) parameter.mutable_grad() = at::Tensor();
    NodeTimes times;
    at::Tensor out = stage();
    const at::Tensor grad = at::randn_like(out);
    times.into = &b;
    time_every_node(out, &times);
    torch::autograd::backward({out}, {grad});
    for (auto& parameter : parameters) parameter.mutable_grad() = at::Tensor();
    out = stage();
    times.into = &i;
    time_every_node(out, &times);
    auto [input_grads, weight_pass] = smp::WeightPass::run_input_pass({out}, {grad}, {hidden}, parameters);
    out = at::Tensor();
    times.into = &w;
    weight_pass.run();
  }
  for (const auto& [pass, table] : {std::pair{"B", &b}, std::pair{"I", &i}, std::pair{"W", &w}}) {
    std::printf("{\"bench\": \"split_nodes\", \"d_model\": %lld, \"pass\": \"%s\"",
                static_cast<long long>(options.d_model), pass);
    double total = 0.0;
    for (const auto& [kind, ms] : *table) {
      std::printf(", \"%s\": %.3f", kind.c_str(), ms / rounds);
      total += ms;
    }
    std::printf(", \"total\": %.3f}\n", total / rounds);
  }
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) != "--split-nodes") {
    const bool help = std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h";
    std::fputs("usage: bench_engine [--split-nodes]   (one process; about 10 s)\n", help ? stdout : stderr);
    return help ? 0 : 2;
  }
  if (argc > 1 && std::string(argv[1]) == "--split-nodes") {
    at::set_num_threads(1);
    print_split_nodes({256, 64, 128, 4, 4}, /*batch=*/4, /*rounds=*/50);
    print_split_nodes({256, 128, 256, 4, 4}, /*batch=*/4, /*rounds=*/10);
    return 0;
  }
  const c10::Device cpu(c10::kCPU);
  smp_bench::print_engine_overhead(cpu);
  // vocabulary 256, context 128, d_model 256, 4 heads, 4 layers: 3.3M parameters
  const smp::examples::GptOptions options{256, 128, 256, 4, 4};
  smp_bench::print_gpt_stage(cpu, options, /*batch=*/8, /*bf16=*/false, /*warmup=*/2, /*measured=*/9);
  at::set_num_threads(1);  // as each rank of a job on this host
  print_split_backward({256, 64, 128, 4, 4}, /*batch=*/4, /*rounds=*/15);  // run_benchmarks' pipeline GPT's size
  print_split_backward(options, /*batch=*/4, /*rounds=*/9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
