// Profiling and the partition it feeds, in one process: what each module's forward keeps alive for backward, the
// loss train_step will add to the last stage, memory limits by the microbatches in flight, and a profile that leaves
// the training state as it found it.

#include "catch_torch.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "profiled_model.h"
#include "smp/checkpoint_manifest.h"
#include "smp/cluster_plan.h"
#include "smp/config.h"
#include "smp/graph_model.h"
#include "smp/layout_plan.h"
#include "smp/planned_layout.h"
#include "smp/stage_plan.h"
#include "smp/collectives.h"
#include "smp/timeline.h"
#include "smp/tp.h"

TEST_CASE("profiling counts what a module's forward keeps for backward", "[profile]") {
  constexpr int64_t kBatch = 8, kWidth = 32;
  const smp::GraphModel model = smp_test::linear_then_gelu(kWidth);
  c10::Allocator* before = c10::GetCPUAllocator();
  const auto profiles = smp::profile_graph(model, at::randn({kBatch, 16}), 1);
  CHECK(c10::GetCPUAllocator() == before);  // the counting allocator is gone again
  REQUIRE(profiles.size() == 2);
  CHECK(profiles[0].activation_bytes == 0);
  CHECK(profiles[0].output_bytes == kBatch * kWidth * 4);
  CHECK(profiles[1].activation_bytes == kBatch * kWidth * 4);

  // The plan keeps it, and the partition search weighs it by the microbatches in flight.
  smp::StagePlan plan;
  plan.modules = profiles;
  plan.stage_of_module = {0, 0};
  plan.num_stages = 1;
  CHECK(smp::StagePlan::from_json(plan.to_json()).modules[1].activation_bytes == kBatch * kWidth * 4);
  // Per microbatch a stage keeps its modules' saved tensors and outputs: 1 KiB each of three here.
  CHECK_THAT(plan.report(), Catch::Matchers::Contains("activations 3.0 KiB per microbatch"));
}

namespace {

// A chain of `count` equal modules of 1 ms forward and 1 ms backward.
std::vector<smp::ModuleProfile> equal_chain(int count, std::int64_t parameter_bytes, std::int64_t activation_bytes) {
  std::vector<smp::ModuleProfile> modules(count);
  for (int i = 0; i < count; ++i) {
    modules[i].name = "m" + std::to_string(i);
    modules[i].forward_s = modules[i].backward_s = 1e-3;
    modules[i].parameter_bytes = parameter_bytes;
    modules[i].activation_bytes = activation_bytes;
    if (i > 0) modules[i].producers = {i - 1};
  }
  return modules;
}

}  // namespace

TEST_CASE("a memory limit counts activations times the microbatches in flight", "[profile]") {
  // Two equal modules whose parameters fit one stage but whose activations for 4 microbatches do not.
  const auto modules = equal_chain(2, 1 << 20, 4 << 20);
  smp::Config config = smp::Config::from_json_text(R"({"partitions": 2, "memory_limit_mb": 16})", "test");
  CHECK_NOTHROW(smp::plan_stages(modules, config, {1, 1}));   // 4 + 4 MiB per module and stage
  CHECK_THROWS_WITH(smp::plan_stages(modules, config, {4, 4}),  // 4 + 16 MiB
                    Catch::Matchers::Contains("memory"));
  CHECK_NOTHROW(smp::plan_stages(modules, config, {2, 1}));     // 1F1B on 2 ranks: 4 + 8 MiB, 4 + 4 MiB
  CHECK_THROWS_WITH(smp::plan_stages(modules, config, {1, 1, 1}), Catch::Matchers::Contains("3 stages"));

  // A checkpointed stage holds one microbatch's activations at a time (while it recomputes).
  smp::Config checkpointed = smp::Config::from_json_text(
      R"({"partitions": 2, "memory_limit_mb": 16, "activation_checkpointing": true})", "test");
  const smp::StagePlan plan = smp::plan_stages(modules, checkpointed, {4, 4});
  CHECK(plan.activation_copies == std::vector<double>{1, 1});
  CHECK_THAT(plan.report(), Catch::Matchers::Contains("x 1 held"));
  CHECK(smp::StagePlan::from_json(plan.to_json()).activation_copies == plan.activation_copies);
}

TEST_CASE("a limit the search's count cannot meet guides a caller that judges the memory itself", "[profile]") {
  const auto modules = equal_chain(2, 1 << 20, 4 << 20);
  const smp::Config config = smp::Config::from_json_text(R"({"partitions": 2, "memory_limit_mb": 16})", "test");
  CHECK_THROWS_WITH(smp::plan_stages(modules, config, {4, 4}), Catch::Matchers::Contains("memory"));
  const smp::StagePlan guided = smp::plan_stages(modules, config, {4, 4}, 1, nullptr, smp::MemoryLimit::kGuides);
  CHECK(guided.stage_of_module == std::vector<int>{0, 1});
  CHECK_THAT(guided.memory_limit_unmet, Catch::Matchers::Contains("memory limit of 16"));
  CHECK(smp::plan_stages(modules, config, {1, 1}, 1, nullptr, smp::MemoryLimit::kGuides).memory_limit_unmet.empty());
  // A failure that is not the limit's still throws (a pin to a stage the config lacks).
  smp::Config pinned = config;
  pinned.partition_overrides = {{"m0", 1}, {"m1", 0}};
  CHECK_THROWS(smp::plan_stages(modules, pinned, {4, 4}, 1, nullptr, smp::MemoryLimit::kGuides));
}

TEST_CASE("a lone stage's modules, profiled untimed, are reported as not timed rather than as taking 0 ms", "[profile]") {
  auto modules = equal_chain(2, 1 << 10, 1 << 10);
  for (auto& module : modules) module.forward_s = module.backward_s = 0.0;
  const smp::StagePlan plan = smp::plan_stages(modules, smp::Config::from_json_text(R"({"partitions": 1})", "test"));
  CHECK_THAT(plan.report(), Catch::Matchers::Contains("est. fwd+bwd not timed") &&
                                !Catch::Matchers::Contains("0.000 ms"));
}

TEST_CASE("the planner judges a layout by its predicted peak: one listed at a peak fits a limit just above it",
          "[profile]") {
  // Two equal modules whose parameters, gradients and moments fit but whose activations, counted beside the
  // gradients all at once by the partition search, do not: the predicted peak (activations freed as gradients
  // appear) is what the table shows and what the limit is held to.
  auto modules = equal_chain(4, 1 << 20, 2 << 20);
  for (auto& module : modules) module.output_bytes = 1 << 10;
  const smp::Config free = smp::Config::from_json_text(R"({"global_batch_size": 4})", "plan");
  const auto unlimited = smp::plan_layouts({modules, 2}, free, 2, {0.0, 1e9, 1e9});
  int checked = 0;
  for (const auto& prediction : unlimited) {
    if (!prediction.rejected.empty()) continue;
    smp::Config limited = free;
    limited.memory_limit_mb = prediction.peak_memory_mib() + 0.01;
    for (const auto& again : smp::plan_layouts({modules, 2}, limited, 2, {0.0, 1e9, 1e9})) {
      if (again.layout.describe() != prediction.layout.describe()) continue;
      INFO(again.layout.describe() << " at " << limited.memory_limit_mb << " MiB: " << again.rejected);
      CHECK(again.rejected.empty());
      ++checked;
    }
  }
  CHECK(checked > 4);
}

TEST_CASE("a checkpointed module counts no saved activations and its forward twice", "[profile]") {
  // As in the test above: 4 microbatches' activations of a module do not fit 16 MiB; checkpointed, they are gone.
  const auto modules = equal_chain(2, 1 << 20, 4 << 20);
  const auto config = [](const std::string& checkpointed) {
    return smp::Config::from_json_text(
        R"({"partitions": 2, "memory_limit_mb": 16, "activation_checkpointing": [)" + checkpointed + "]}", "test");
  };
  CHECK_THROWS_WITH(smp::plan_stages(modules, config(R"("m0")"), {4, 4}), Catch::Matchers::Contains("memory"));
  CHECK_NOTHROW(smp::plan_stages(modules, config(R"("m0", "m1")"), {4, 4}));
  CHECK_THROWS_WITH(smp::plan_stages(modules, config(R"("m2")"), {4, 4}),
                    Catch::Matchers::Contains("no module \"m2\" in the model") && Catch::Matchers::Contains("(its modules: m0, m1)"));

  // Seven equal modules on 2 stages, time alone: without checkpointing 3 + 4 and 4 + 3 tie; the modules that run
  // their forward again make their side the smaller one.
  const auto seven = equal_chain(7, 1 << 10, 1 << 10);
  const auto stage_sizes = [&](const std::string& checkpointed) {
    const smp::StagePlan plan = smp::plan_stages(
        seven, smp::Config::from_json_text(R"({"partitions": 2, "memory_weight": 0, "link_bandwidth_gbps": 0,
                                              "activation_checkpointing": [)" + checkpointed + "]}", "test"));
    return std::pair{plan.modules_of_stage(0).size(), plan.modules_of_stage(1).size()};
  };
  CHECK(stage_sizes(R"("m0", "m1", "m2")") == std::pair<std::size_t, std::size_t>{3, 4});
  CHECK(stage_sizes(R"("m4", "m5", "m6")") == std::pair<std::size_t, std::size_t>{4, 3});
}

TEST_CASE("with virtual stages the memory limit holds for a rank's stages together", "[profile]") {
  // Four equal modules on 2 ranks x 2 virtual stages, one each: 4 MiB of parameters and optimizer state and 4 MiB
  // of activations per stage, so 16 MiB per rank.
  const auto modules = equal_chain(4, 1 << 20, 4 << 20);
  const auto config = [](int limit_mb) {
    return smp::Config::from_json_text(
        R"({"partitions": 2, "virtual_stages": 2, "memory_limit_mb": )" + std::to_string(limit_mb) + "}", "test");
  };
  CHECK_NOTHROW(smp::plan_stages(modules, config(16), {1, 1, 1, 1}));
  CHECK_THROWS_WITH(smp::plan_stages(modules, config(12), {1, 1, 1, 1}),
                    Catch::Matchers::Contains("memory") && Catch::Matchers::Contains("per rank") &&
                        Catch::Matchers::Contains("gets 6 MiB"));
}

TEST_CASE("under 1F1B the stage that holds more microbatches gets fewer modules", "[profile]") {
  // Eight equal modules whose activations dominate their memory; memory balancing alone decides.
  const auto modules = equal_chain(8, 1 << 10, 4 << 20);
  const smp::Config config = smp::Config::from_json_text(R"({"partitions": 2, "memory_weight": 1.0})", "test");
  const smp::StagePlan plan = smp::plan_stages(modules, config, {2, 1});
  CHECK(plan.modules_of_stage(0).size() < plan.modules_of_stage(1).size());
  CHECK_THAT(plan.report(), Catch::Matchers::Contains("x 2 held"));
}

TEST_CASE("profiling leaves batch norm statistics and the random number sequence as they were", "[profile]") {
  at::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6), torch::nn::Dropout(0.5),
                            torch::nn::Linear(6, 2));
  const auto model = smp::GraphModel::from_sequential(net);
  std::vector<at::Tensor> buffers_before;
  for (const auto& buffer : net->buffers()) buffers_before.push_back(buffer.clone());
  at::manual_seed(11);
  smp::profile_graph(model, at::randn({8, 4}), 3);
  const at::Tensor drawn_after_profile = at::rand({4});
  at::manual_seed(11);
  at::randn({8, 4});  // the sample, drawn the same way
  CHECK(at::equal(drawn_after_profile, at::rand({4})));
  const auto buffers_after = net->buffers();
  REQUIRE(buffers_after.size() == buffers_before.size());
  for (std::size_t i = 0; i < buffers_after.size(); ++i) CHECK(at::equal(buffers_after[i], buffers_before[i]));
}

TEST_CASE("the planner profiles two sizes, or the sample's alone when the model refuses twice it", "[profile][plan]") {
  auto model_of = [](bool rows_written_in) {
    smp::GraphModel model("x");
    model.add("embed", torch::nn::Linear(4, 8), {"x"});
    torch::nn::Linear head(8, 8);
    model.add("head", head.ptr(), [head, rows_written_in](const std::vector<at::Tensor>& in) mutable {
      return head->forward(rows_written_in ? in[0].reshape({4, 8}) : in[0]);  // the sample's 4 rows, or any
    }, {"embed"});
    return model;
  };
  const at::Tensor sample = at::randn({4, 4});
  const c10::Device cpu(c10::kCPU);
  const auto both = smp::profile_for_planning(model_of(false), {sample}, cpu);
  CHECK(both.batch == 4);
  CHECK(both.larger_batch == 8);
  REQUIRE(both.larger.size() == 2);
  CHECK(both.larger[0].output_bytes == 2 * both.modules[0].output_bytes);  // measured on twice the rows
  const auto refusing = model_of(true);
  const auto alone = smp::profile_for_planning(refusing, {sample}, cpu);
  CHECK(alone.batch == 4);
  CHECK(alone.larger_batch == 0);
  CHECK(alone.larger.empty());
  CHECK(alone.modules.size() == 2);
  // The failed profile leaves no gradients behind, which a first train_step would add to its own.
  for (const auto& node : refusing.nodes()) {
    for (const auto& parameter : node.module->parameters()) CHECK_FALSE(parameter.grad().defined());
  }

  // An input of another first dimension than the batch's goes to both sizes as it is; without a batched input
  // there is one size.
  smp::GraphModel scaled(std::vector<std::string>{"x", "scale"});
  scaled.add("embed", torch::nn::Linear(4, 8), {"x"});
  scaled.add("scaled", std::make_shared<torch::nn::Module>(),
             [](const std::vector<at::Tensor>& in) { return in[0] * in[1].sum(); }, {"embed", "scale"});
  const auto with_unbatched = smp::profile_for_planning(scaled, {sample, at::ones({3})}, cpu);
  CHECK(with_unbatched.larger_batch == 8);
  smp::GraphModel scalar("x");
  scalar.add("doubled", std::make_shared<torch::nn::Module>(),
             [](const std::vector<at::Tensor>& in) { return in[0] * 2; }, {"x"});
  const auto unbatched = smp::profile_for_planning(scalar, {at::ones({})}, cpu);
  CHECK(unbatched.larger.empty());
}

TEST_CASE("the last stage is charged the loss train_step will compute, unless the model computes its own",
          "[profile]") {
  // Scores over 4096 classes: their cross-entropy, forward and backward, costs far more than the tiny linear layer
  // that made them.
  smp::GraphModel scores("x");
  scores.add("embed", torch::nn::Linear(4, 8), {"x"});
  scores.add("scores", torch::nn::Linear(8, 4096), {"embed"});
  const auto charged = smp::profile_graph(scores, at::randn({64, 4}), 3);
  REQUIRE(charged.size() == 2);
  CHECK(charged[0].assumed_loss_s == 0.0);
  CHECK(charged[1].assumed_loss_s > 0.0);
  CHECK(charged[1].forward_s + charged[1].backward_s >= charged[1].assumed_loss_s);
  smp::StagePlan plan;
  plan.modules = charged;
  plan.stage_of_module = {0, 1};
  plan.num_stages = 2;
  CHECK(smp::StagePlan::from_json(plan.to_json()).modules[1].assumed_loss_s == charged[1].assumed_loss_s);
  CHECK_THAT(plan.report(), Catch::Matchers::Contains("for a cross-entropy loss on the output"));

  // A model whose last node returns its loss (a 0-dim output, as a Hugging Face model given labels) has the loss
  // in its own profile.
  smp::GraphModel own_loss("x");
  own_loss.add("embed", torch::nn::Linear(4, 8), {"x"});
  torch::nn::Linear head(8, 4096);
  own_loss.add("loss", head.ptr(), [head](const std::vector<at::Tensor>& in) mutable {
    return at::cross_entropy_loss(head->forward(in[0]), at::zeros({in[0].size(0)}, at::kLong));
  }, {"embed"});
  for (const auto& profile : smp::profile_graph(own_loss, at::randn({64, 4}), 3)) CHECK(profile.assumed_loss_s == 0.0);

  // Without timing (one stage: nothing to balance) nothing is charged.
  for (const auto& profile : smp::profile_graph(scores, at::randn({64, 4}), 0)) CHECK(profile.assumed_loss_s == 0.0);
}

TEST_CASE("layouts are planned by simulation, ranked by predicted step, and rejected when over the memory limit",
          "[profile][plan]") {
  // 8 equal modules of 1 ms forward and 1 ms backward on a microbatch of 2 samples.
  const auto modules = equal_chain(8, 1 << 20, 1 << 20);
  const smp::Config config = smp::Config::from_json_text(R"({"global_batch_size": 16})", "test");
  const auto predictions = smp::plan_layouts({modules, 2}, config, 4, {0.0, 1e9, 1e9});
  REQUIRE_FALSE(predictions.empty());
  for (const auto& prediction : predictions) {
    CHECK(prediction.layout.partitions * prediction.layout.replicas == 4);
    CHECK(prediction.rejected.empty());
  }
  for (std::size_t i = 1; i < predictions.size(); ++i) CHECK(predictions[i - 1].step_s <= predictions[i].step_s);
  // The choice's simulated step is drawn, one row per pipeline rank; no other layout's.
  CHECK_THAT(predictions.front().timeline_svg,
             Catch::Matchers::StartsWith("<svg") && Catch::Matchers::Contains("planned: " + predictions.front().layout.describe()));
  for (std::size_t i = 1; i < predictions.size(); ++i) CHECK(predictions[i].timeline_svg.empty());
  const auto find = [&](int pp, const std::string& pipeline, int m, bool recompute, bool sharded) {
    for (const auto& prediction : predictions) {
      const auto& layout = prediction.layout;
      if (layout.partitions == pp && layout.pipeline == pipeline && layout.microbatches == m &&
          layout.recompute == recompute && layout.shard_optimizer_state == sharded) {
        return prediction;
      }
    }
    FAIL("no layout pp " << pp << " " << pipeline << " m " << m);
    return smp::LayoutPrediction{};
  };
  // One stage, 4 replicas, one microbatch of 4 samples: 8 modules x 2 ms x 2 (twice the profiled samples).
  const auto data_parallel = find(1, "gpipe", 1, false, false);
  CHECK(data_parallel.pipeline_s == Approx(0.032));
  CHECK(data_parallel.gradient_sync_s > 0.0);
  // ZeRO-1 keeps a quarter of Adam's two moments per replica: 8 MiB of parameters, 12 MiB of moments less.
  CHECK(find(1, "gpipe", 1, false, true).peak_memory_mib() ==
        Approx(data_parallel.peak_memory_mib() - 2.0 * 8 * 3 / 4));
  // Adam's step holds temporaries once the activations are gone: two of the largest parameter's size when it
  // steps one parameter at a time, a copy of the rank's parameters when it steps all at once (foreach).
  auto large_weights = equal_chain(8, 1 << 20, 1 << 10);
  for (auto& module : large_weights) module.largest_parameter_bytes = 1 << 20;
  smp::PlanningCosts foreach_costs{0.0, 1e9, 1e9};
  foreach_costs.optimizer_foreach = true;
  for (const auto& [costs, scratch_mib] : {std::pair{smp::PlanningCosts{0.0, 1e9, 1e9}, 2.0}, std::pair{foreach_costs, 8.0}}) {
    // One process: parameters, two moments, and after the backward the gradients and the step's temporaries.
    for (const auto& prediction : smp::plan_layouts({large_weights, 2}, config, 1, costs)) {
      if (prediction.layout.recompute) continue;
      CHECK(prediction.peak_memory_mib() == Approx(4.0 * 8 + scratch_mib));
    }
    // Replicas: at the end of the backward their buckets copy the 8 MiB of gradients to reduce them, which the
    // temporaries (after the reduction) do not exceed.
    for (const auto& prediction : smp::plan_layouts({large_weights, 2}, config, 4, costs)) {
      const auto& layout = prediction.layout;
      if (layout.partitions != 1 || layout.shard_optimizer_state || layout.recompute) continue;
      CHECK(prediction.peak_memory_mib() == Approx(3.0 * 8 + 2.0 * 8));
    }
  }
  // A step starts without gradients: GPipe's peak of activations (every microbatch's, before the first backward)
  // never meets them, where 1F1B's steady state forwards beside them. 2 stages of 4 modules of 1 MiB, 4 microbatches
  // of 2 samples (1 MiB of activations per module and microbatch), no replicas, SGD without state.
  {
    const auto deep = equal_chain(8, 1 << 20, 1 << 20);
    const smp::Config two_stages =
        smp::Config::from_json_text(R"({"global_batch_size": 8, "partitions": 2, "microbatches": 4})", "test");
    const smp::PlanningCosts links{0.0, 1e9, 1e9};
    double gpipe = 0, one_f_one_b = 0;
    for (const auto& prediction : smp::plan_layouts({deep, 2}, two_stages, 2, links, /*optimizer_moments=*/0.0)) {
      const auto& layout = prediction.layout;
      if (layout.partitions != 2 || layout.microbatches != 4 || layout.recompute || layout.virtual_stages != 1) continue;
      // Stage 0: 4 MiB of parameters, and GPipe's 4 microbatches' 16 MiB of activations against, after the first
      // backward, 4 MiB of gradients beside 3 microbatches' 12 MiB. 1F1B holds 2 microbatches (8 MiB) at most,
      // and forwards again beside its gradients: 4 + 4 + 8.
      if (layout.pipeline == "gpipe") gpipe = prediction.memory_mib.at(0);
      if (layout.pipeline == "1f1b") one_f_one_b = prediction.memory_mib.at(0);
    }
    CHECK(gpipe == Approx(4.0 + 16.0));
    CHECK(one_f_one_b == Approx(4.0 + 4.0 + 8.0));
  }
  // Recompute trades time for activations.
  const auto kept = find(2, "1f1b", 4, false, false), recomputed = find(2, "1f1b", 4, true, false);
  CHECK(recomputed.peak_memory_mib() < kept.peak_memory_mib());
  CHECK(recomputed.step_s > kept.step_s);
  CHECK(kept.bubble_fraction > find(2, "1f1b", 8, false, false).bubble_fraction);

  // A limit below the fastest layout's memory rejects it, naming why; the choice then fits.
  smp::Config limited = config;
  limited.memory_limit_mb = predictions.front().peak_memory_mib() - 0.5;
  const auto within = smp::plan_layouts({modules, 2}, limited, 4, {0.0, 1e9, 1e9});
  REQUIRE(within.front().rejected.empty());
  CHECK(within.front().peak_memory_mib() <= limited.memory_limit_mb);
  CHECK(within.front().step_s >= predictions.front().step_s);
  const bool fastest_rejected = std::any_of(within.begin(), within.end(), [&](const smp::LayoutPrediction& p) {
    return p.layout.describe() == predictions.front().layout.describe() && !p.rejected.empty();
  });
  CHECK(fastest_rejected);
  const std::string report = smp::layout_report(within);
  CHECK_THAT(report, Catch::Matchers::Contains("chosen: " + within.front().layout.describe()));
  CHECK_THAT(report, Catch::Matchers::Contains("rejected:"));
  CHECK_THROWS_WITH(smp::plan_layouts({modules, 2}, smp::Config{}, 4), Catch::Matchers::Contains("global_batch_size"));

  // Measured on 2 and 4 samples, 1 and 1.5 ms: 0.5 ms of it fixed, 0.25 ms per sample; bytes per sample.
  auto larger = equal_chain(8, 1 << 20, 2 << 20);
  for (auto& module : larger) module.forward_s = module.backward_s = 1.5e-3;
  const smp::ModelProfile two_sizes{modules, 2, larger, 4};
  CHECK(two_sizes.at(1)[0].forward_s == Approx(0.75e-3));
  CHECK(two_sizes.at(8, 2.0)[0].backward_s == Approx(2 * 2.5e-3));
  CHECK(two_sizes.at(1)[0].activation_bytes == (1 << 20) / 2);
  CHECK(smp::ModelProfile{modules, 2}.at(1)[0].forward_s == Approx(0.5e-3));
  // The optimizer's step counts on the rank with the most parameters, a replica's share under ZeRO-1.
  smp::PlanningCosts optimizer_costs{0.0, 1e9, 1e9, 1.0, 1e-9};
  const auto with_optimizer = smp::plan_layouts({modules, 2}, config, 4, optimizer_costs);
  for (const auto& prediction : with_optimizer) {
    const double fullest_bytes = prediction.optimizer_s / 1e-9 * (prediction.layout.shard_optimizer_state ? 4 : 1);
    CHECK(fullest_bytes >= 8.0 * (1 << 20) / prediction.layout.partitions - 1.0);
  }
}

TEST_CASE("frozen parameters are held without gradients, optimizer state or reductions", "[profile][plan]") {
  // Profiled: a module built frozen (a LoRA base, a frozen backbone) counts its bytes as frozen.
  smp::GraphModel model("x");
  torch::nn::Linear frozen(16, 32), trained(32, 8);
  for (auto& parameter : frozen->parameters()) parameter.requires_grad_(false);
  model.add("frozen", frozen, {"x"});
  model.add("trained", trained, {"frozen"});
  const auto profiles = smp::profile_graph(model, at::randn({4, 16}), 1);
  REQUIRE(profiles.size() == 2);
  CHECK(profiles[0].frozen_parameter_bytes == profiles[0].parameter_bytes);
  CHECK(profiles[0].parameter_bytes == (16 * 32 + 32) * 4);
  CHECK(profiles[1].frozen_parameter_bytes == 0);
  smp::StagePlan plan;
  plan.modules = profiles;
  plan.stage_of_module = {0, 0};
  plan.num_stages = 1;
  CHECK(smp::StagePlan::from_json(plan.to_json()).modules[0].frozen_parameter_bytes == profiles[0].parameter_bytes);

  // The partition search's memory: 4 MiB of parameters a module, trained 16 MiB (gradients, two moments), frozen 4.
  auto modules = equal_chain(2, 4 << 20, 0);
  const smp::Config limited = smp::Config::from_json_text(R"({"partitions": 2, "memory_limit_mb": 8})", "test");
  CHECK_THROWS_WITH(smp::plan_stages(modules, limited, {1, 1}), Catch::Matchers::Contains("memory"));
  for (auto& module : modules) module.frozen_parameter_bytes = module.parameter_bytes;
  CHECK_NOTHROW(smp::plan_stages(modules, limited, {1, 1}));

  // The planner: 8 modules of 1 MiB, the first 6 frozen. One process holds 8 MiB of parameters, gradients and two
  // moments of the 2 MiB trained, and Adam's temporaries (two of the largest trained parameter): 8 + 3 x 2 + 2.
  auto backbone = equal_chain(8, 1 << 20, 1 << 10);
  for (int i = 0; i < 8; ++i) {
    backbone[i].largest_parameter_bytes = 1 << 20;
    if (i < 6) backbone[i].frozen_parameter_bytes = 1 << 20;
  }
  const smp::Config config = smp::Config::from_json_text(R"({"global_batch_size": 16})", "test");
  smp::PlanningCosts costs{1e-4, 1e9, 1e9, 1.0, 1e-9};
  for (const auto& prediction : smp::plan_layouts({backbone, 2}, config, 1, costs)) {
    if (prediction.layout.recompute) continue;
    CHECK(prediction.peak_memory_mib() == Approx(8.0 + 3.0 * 2 + 2.0));
    CHECK(prediction.optimizer_s == Approx(1e-9 * (2 << 20)));  // the trained bytes alone step
  }
  // Replicas reduce the trained gradients alone; a pipeline rank holding only frozen stages reduces nothing.
  const auto all_trained = equal_chain(8, 1 << 20, 1 << 10);
  const auto sync_of = [&](const std::vector<smp::ModuleProfile>& profile, int pp) {
    for (const auto& prediction : smp::plan_layouts({profile, 2}, config, 4, costs)) {
      const auto& layout = prediction.layout;
      if (layout.partitions == pp && !layout.shard_optimizer_state && layout.virtual_stages == 1) {
        return prediction.gradient_sync_s;
      }
    }
    FAIL("no layout of " << pp << " stages");
    return 0.0;
  };
  CHECK(sync_of(backbone, 1) < sync_of(all_trained, 1));
  CHECK(sync_of(backbone, 1) > 0.0);
  auto frozen_front = all_trained;
  for (int i = 0; i < 4; ++i) frozen_front[i].frozen_parameter_bytes = 1 << 20;
  auto frozen_back = all_trained;
  for (int i = 4; i < 8; ++i) frozen_back[i].frozen_parameter_bytes = 1 << 20;
  // Two stages of four modules over two replicas: the stage that trains reduces, the slowest rank sets the time.
  CHECK(sync_of(frozen_front, 2) == Approx(sync_of(frozen_back, 2)));
  CHECK(sync_of(frozen_front, 2) == Approx(sync_of(all_trained, 2)));
  auto all_frozen = all_trained;
  for (auto& module : all_frozen) module.frozen_parameter_bytes = 1 << 20;
  CHECK(sync_of(all_frozen, 2) == 0.0);

  // ZeRO-1 gives each parameter to one replica whole: the one owning the largest steps two of it, whatever its
  // share of the rank's bytes. One module of 8 MiB on 4 replicas: 8 of parameters, 2 of moments, then 8 of
  // gradients with 16 of temporaries.
  auto one_large = equal_chain(1, 8 << 20, 1 << 10);
  one_large[0].largest_parameter_bytes = 8 << 20;
  int sharded_layouts = 0;
  for (const auto& prediction : smp::plan_layouts({one_large, 2}, config, 4, smp::PlanningCosts{0.0, 1e9, 1e9})) {
    const auto& layout = prediction.layout;
    if (!layout.shard_optimizer_state || layout.recompute) continue;
    ++sharded_layouts;
    CHECK(prediction.peak_memory_mib() == Approx(8.0 + 2.0 * 8 / 4 + 8 + 16));
  }
  CHECK(sharded_layouts > 0);
}

TEST_CASE("a planned layout carries its cut, and a job adopting it partitions as planned", "[profile][plan]") {
  // Unequal modules, so that a cut of the job's own could fall elsewhere than the plan's.
  auto modules = equal_chain(8, 1 << 20, 1 << 20);
  for (int i = 0; i < 8; ++i) modules[i].forward_s = modules[i].backward_s = i < 4 ? 1e-3 : 3e-3;
  const smp::Config given = smp::Config::from_json_text(
      R"({"global_batch_size": 16, "partitions": "auto", "microbatches": "auto", "pipeline": "auto"})", "test");
  const auto predictions = smp::plan_layouts({modules, 2}, given, 4, {0.0, 1e9, 1e9});
  const auto four = std::find_if(predictions.begin(), predictions.end(),
                                 [](const smp::LayoutPrediction& p) {
                                   return p.layout.partitions == 4 && p.layout.virtual_stages == 1 && p.rejected.empty();
                                 });
  REQUIRE(four != predictions.end());
  REQUIRE(four->stages.size() == 4);
  CHECK_THAT(four->config_json(), Catch::Matchers::Contains("\"partition_overrides\""));
  const auto adopted = smp::adopting_layout(given, four->config_json(), 4);
  REQUIRE(adopted);
  CHECK(adopted->partition_overrides == four->cut);
  // The job's own profile weighs the modules the other way round; its cut is still the plan's.
  auto reversed = modules;
  for (int i = 0; i < 8; ++i) reversed[i].forward_s = reversed[i].backward_s = modules[7 - i].forward_s;
  const auto job = smp::plan_stages(smp::ModelProfile{reversed, 2}.at(2), *adopted);
  smp::Config unpinned = *adopted;
  unpinned.partition_overrides.clear();
  CHECK(smp::plan_stages(smp::ModelProfile{reversed, 2}.at(2), unpinned).stage_of_module != job.stage_of_module);
  for (int stage = 0; stage < 4; ++stage) {
    const auto members = job.modules_of_stage(stage);
    const std::string& first = job.modules[members.front()].name;
    CHECK(four->stages[stage] == (members.size() == 1 ? first : first + ".." + job.modules[members.back()].name));
  }

  // A module called twice, its second call on the next stage ("b" and "b#1", as a ResNet block's relu after its
  // residual sum): its path selects both calls, so it pins nothing; the modules around it do.
  smp::StagePlan plan;
  for (const char* name : {"a", "b", "b#1", "c"}) {
    plan.modules.push_back({});
    plan.modules.back().name = name;
  }
  plan.stage_of_module = {0, 0, 1, 1};
  plan.num_stages = 2;
  CHECK(smp::pinned_cut(plan) == std::map<std::string, int>{{"a", 0}, {"c", 1}});

  // A C++ job's model is cut as deep as its pins name: the Sequential holding a pinned path is expanded to reach it.
  smp::GraphModel graph("x");
  graph.add("in", torch::nn::Linear(4, 4), {"x"});
  torch::nn::Sequential block(torch::nn::Linear(4, 4), torch::nn::GELU(), torch::nn::Linear(4, 4));
  graph.add("block", block.ptr(), [block](const std::vector<at::Tensor>& in) mutable { return block->forward(in[0]); },
            {"in"});
  graph.add("out", torch::nn::Linear(4, 4), {"block"});
  std::vector<std::string> names;
  const smp::GraphModel expanded = graph.expanded_to_paths({"block.2"});
  for (const auto& node : expanded.nodes()) names.push_back(node.name);
  CHECK(names == std::vector<std::string>{"in", "block.0", "block.1", "block.2", "out"});
  CHECK(graph.expanded_to_paths({"block", "out"}).nodes().size() == 3);  // already nodes
  CHECK(graph.expanded_to_paths({"head"}).nodes().size() == 3);          // no such module: plan_stages names it

  // For more stages than nodes, the Sequential is expanded until enough nodes hold parameters: a residual sum beside
  // it, holding none, left it whole on 4 stages (one of them the sum's alone, training nothing).
  graph.add("sum", std::make_shared<torch::nn::Module>(),
            [](const std::vector<at::Tensor>& in) { return in[0] + in[1]; }, {"out", "in"});
  std::vector<std::string> cut;
  const smp::GraphModel for_four = graph.expanded_to(4);
  for (const auto& node : for_four.nodes()) cut.push_back(node.name);
  CHECK(cut == std::vector<std::string>{"in", "block.0", "block.1", "block.2", "out", "sum"});
}

TEST_CASE("a job's plan rejects the layouts its fixed keys exclude, naming the key, and its report chooses among the "
          "rest", "[profile][plan]") {
  const auto modules = equal_chain(8, 1 << 20, 1 << 20);
  // virtual_stages and shard_optimizer_state fixed by the defaults, replicas by "ddp": false.
  const smp::Config given = smp::Config::from_json_text(
      R"({"global_batch_size": 16, "partitions": "auto", "microbatches": "auto", "pipeline": "auto", "ddp": false})",
      "job.json");
  auto predictions = smp::plan_layouts({modules, 2}, given, 4, {0.0, 1e9, 1e9});
  auto rejected_for = [&](auto is_layout) {
    const auto found = std::find_if(predictions.begin(), predictions.end(), is_layout);
    REQUIRE(found != predictions.end());
    return found->rejected;
  };
  auto interleaved = [](const smp::LayoutPrediction& p) {
    return p.layout.pipeline == "interleaved_1f1b" && p.layout.replicas == 1;  // else ddp may differ first
  };
  auto replicated = [](const smp::LayoutPrediction& p) { return p.layout.replicas > 1; };
  auto adoptable = [](const smp::LayoutPrediction& p) {
    // A V's two stages per rank are its schedule's, whatever virtual_stages says.
    return p.layout.replicas == 1 && p.layout.pipeline != "interleaved_1f1b" && !p.layout.recompute;
  };
  REQUIRE(rejected_for(interleaved).empty());  // smp.plan alone ranks them all
  smp::keep_what_the_config_fixes(predictions, given, 4);
  CHECK(rejected_for(interleaved) == "the config fixes virtual_stages otherwise");
  CHECK(rejected_for(replicated) == "the config fixes ddp otherwise");
  CHECK(rejected_for(adoptable).empty());
  // The fitting ones stay first, so that a job's first fitting layout is its choice, drawn when planned for it.
  const auto first_rejected = std::find_if(predictions.begin(), predictions.end(),
                                           [](const smp::LayoutPrediction& p) { return !p.rejected.empty(); });
  CHECK(std::all_of(first_rejected, predictions.end(), [](const smp::LayoutPrediction& p) { return !p.rejected.empty(); }));
  const auto chosen = smp::choose_layout(predictions, given, 4).first;
  CHECK(adoptable(chosen));
  CHECK(chosen.layout.describe() == predictions.front().layout.describe());
  const auto for_the_job = smp::plan_layouts({modules, 2}, given, 4, {0.0, 1e9, 1e9}, 2.0, /*for_a_job=*/true);
  CHECK(for_the_job.front().layout.describe() == chosen.layout.describe());
  CHECK_THAT(for_the_job.front().timeline_svg, Catch::Matchers::StartsWith("<svg"));
  const std::string report = smp::layout_report(predictions);
  CHECK_THAT(report, Catch::Matchers::Contains("chosen: " + chosen.layout.describe() + " (the fastest predicted that fits"));
  CHECK_THAT(report, Catch::Matchers::Contains("excluded by the keys the config fixes (layouts that set them otherwise): "
                                               "activation_checkpointing "));
  CHECK_THAT(report, !Catch::Matchers::Contains(": the config fixes"));  // counted, not listed
  // The job's fixed microbatch count is considered even where the planner alone would not go (1 on 4 stages), and
  // so is a replica's whole batch as its microbatches when it has fewer samples than stages.
  const smp::Config one_microbatch = smp::Config::from_json_text(
      R"({"global_batch_size": 16, "partitions": "auto", "ddp": false})", "job.json");
  const auto fixed_count = smp::plan_layouts({modules, 2}, one_microbatch, 4, {0.0, 1e9, 1e9}, 2.0, true);
  REQUIRE_FALSE(fixed_count.empty());
  CHECK(fixed_count.front().rejected.empty());
  CHECK(fixed_count.front().layout.microbatches == 1);
  CHECK(fixed_count.front().layout.partitions == 4);
  smp::Config three = smp::Config::from_json_text(R"({"global_batch_size": 3})", "plan");
  const auto small_batch = smp::plan_layouts({modules, 2}, three, 4, {0.0, 1e9, 1e9});
  CHECK(std::any_of(small_batch.begin(), small_batch.end(), [](const smp::LayoutPrediction& p) {
    return p.rejected.empty() && p.layout.partitions == 4 && p.layout.microbatches == 3;
  }));
  three.global_batch_size = (1 << 30) + 1;  // past what the config takes: refused, not divided into
  CHECK_THROWS_WITH(smp::plan_layouts({modules, 2}, three, 4), Catch::Matchers::Contains("at most 1073741824"));
  // A schedule the config fixes names the key, not the invalid config a layout's other keys would make with it.
  const smp::Config fixed_v = smp::Config::from_json_text(
      R"({"global_batch_size": 16, "partitions": "auto", "virtual_stages": "auto", "microbatches": "auto",
          "pipeline": "zb_v"})", "job.json");
  const auto v_only = smp::plan_layouts({modules, 2}, fixed_v, 2, {0.0, 1e9, 1e9}, 2.0, true);
  for (const auto& prediction : v_only) {
    if (prediction.layout.pipeline != "zb_v") CHECK(prediction.rejected == "the config fixes pipeline otherwise");
  }
  // Rejected for what they need (memory), they are still listed one by one.
  smp::Config tight = given;
  tight.memory_limit_mb = 1e-3;
  auto none_fit = smp::plan_layouts({modules, 2}, tight, 4, {0.0, 1e9, 1e9});
  smp::keep_what_the_config_fixes(none_fit, tight, 4);
  CHECK_THAT(smp::layout_report(none_fit), Catch::Matchers::Contains("no layout fits within the keys the config fixes\n"));
  // And says what the limit would have to be: the least peak among those over it that the config's keys allow
  // (as `adoptable` above: a layout of replicas, excluded, could need less).
  double least = 1e300;
  for (const auto& prediction : smp::plan_layouts({modules, 2}, tight, 4, {0.0, 1e9, 1e9})) {
    const auto& layout = prediction.layout;
    const bool allowed = layout.replicas == 1 && layout.pipeline != "interleaved_1f1b" && !layout.recompute;  // adoptable
    if (allowed && prediction.over_memory_limit()) least = std::min(least, prediction.peak_memory_mib());
  }
  for (const auto& prediction : none_fit) {
    if (prediction.over_memory_limit()) CHECK(prediction.layout.replicas == 1);  // the others: excluded
  }
  REQUIRE(least < 1e300);
  char least_text[64];
  std::snprintf(least_text, sizeof least_text, "the least a layout considered needs: %.1f MiB per rank (", least);
  CHECK_THAT(smp::layout_report(none_fit), Catch::Matchers::Contains(least_text));
  // The error's first line gives a reason a layout of the job's own keys met, not one the config excludes.
  try {
    smp::choose_layout(none_fit, tight, 4);
    FAIL("no layout fits, yet one was chosen");
  } catch (const smp::ConfigError& error) {
    const std::string first_line = std::string(error.what()).substr(0, std::string(error.what()).find('\n'));
    CHECK_THAT(first_line, Catch::Matchers::Contains("memory limit") && !Catch::Matchers::Contains("the config fixes"));
  }
}

TEST_CASE("ranks that outnumber their cores share them: a pipeline's fill and drain run faster than its steady state",
          "[profile][plan]") {
  const auto modules = equal_chain(8, 1 << 20, 1 << 20);
  const smp::Config config = smp::Config::from_json_text(R"({"global_batch_size": 16})", "test");
  const auto predicted = [&](const smp::PlanningCosts& costs, int pp, const std::string& pipeline, int m) {
    for (const auto& prediction : smp::plan_layouts({modules, 2}, config, 4, costs)) {
      const auto& layout = prediction.layout;
      if (layout.partitions == pp && layout.pipeline == pipeline && layout.microbatches == m && !layout.recompute &&
          !layout.shard_optimizer_state) {
        return prediction;
      }
    }
    FAIL("no layout pp " << pp << " " << pipeline << " m " << m);
    return smp::LayoutPrediction{};
  };
  const smp::PlanningCosts own{0.0, 1e9, 1e9, 1.0, 1e-9};
  smp::PlanningCosts two_cores = own, four_cores = own, twice_slower = own;
  two_cores.shared_processors = 2.0;
  four_cores.shared_processors = 4.0;
  twice_slower.compute_scale = 2.0;
  twice_slower.optimizer_s_per_byte *= 2.0;
  // Four replicas on two cores: always all four computing, each at half speed.
  CHECK(predicted(two_cores, 1, "gpipe", 1).pipeline_s == Approx(predicted(twice_slower, 1, "gpipe", 1).pipeline_s));
  CHECK(predicted(two_cores, 1, "gpipe", 1).optimizer_s == Approx(2.0 * predicted(own, 1, "gpipe", 1).optimizer_s));
  // Four stages and four microbatches: fill and drain with fewer than three ranks busy run at full speed.
  const double shared = predicted(two_cores, 4, "gpipe", 4).pipeline_s;
  CHECK(shared > predicted(own, 4, "gpipe", 4).pipeline_s * 1.2);
  CHECK(shared < predicted(twice_slower, 4, "gpipe", 4).pipeline_s * 0.9);
  // As many cores as ranks: nothing is shared.
  CHECK(predicted(four_cores, 4, "1f1b", 8).step_s == Approx(predicted(own, 4, "1f1b", 8).step_s));
}

TEST_CASE("devices that differ: stages get the model in proportion to their device's speed and memory",
          "[profile][plan]") {
  const auto modules = equal_chain(12, 1 << 20, 1 << 20);
  // 4 ranks as 2 stages x 2 replicas; rank 3 (stage 1 of replica 1, placement "cluster") is half as fast, and
  // stage 1 goes as fast as its slowest holder.
  const smp::Config config = smp::Config::from_json_text(
      R"({"partitions": 2, "ddp": true, "memory_weight": 0, "device_speeds": [1, 1, 1, 0.5]})", "test");
  const smp::Topology topology(config, 4);
  const auto devices = smp::stage_devices(config, topology, {0, 1}, {});
  CHECK(devices.speeds == std::vector<double>{1.0, 0.5});
  CHECK(devices.memory_mb.empty());
  const smp::StagePlan plan = smp::plan_stages(modules, config, {}, 1, &devices);
  CHECK(plan.modules_of_stage(0).size() == 8);
  CHECK(plan.modules_of_stage(1).size() == 4);
  CHECK(plan.stage_time(0) == Approx(plan.stage_time(1)));  // each on its own device
  CHECK_THAT(plan.report(), Catch::Matchers::Contains("on a device of speed 0.5"));
  CHECK(smp::StagePlan::from_json(plan.to_json()).stage_speeds == plan.stage_speeds);
  // The same speeds given as measured ones (one per rank) override the config's.
  CHECK(smp::stage_devices(config, topology, {0, 1}, {0.25, 1, 1, 1}).speeds == std::vector<double>{0.25, 1.0});

  // A rank with less memory: its stage holds fewer modules (each 4 MiB of state and 1 MiB of activations).
  const smp::Config small = smp::Config::from_json_text(
      R"({"partitions": 2, "memory_weight": 0, "device_memory_mb": [100, 21]})", "test");
  const auto small_devices = smp::stage_devices(small, smp::Topology(small, 2), {0, 1}, {});
  CHECK(small_devices.memory_mb == std::vector<double>{100.0, 21.0});
  const smp::StagePlan fitted = smp::plan_stages(modules, small, {}, 1, &small_devices);
  CHECK(fitted.modules_of_stage(1).size() == 4);
  // A 0 entry takes memory_limit_mb; a limit nothing fits names the stages' limits.
  const smp::Config tight = smp::Config::from_json_text(
      R"({"partitions": 2, "memory_limit_mb": 8, "device_memory_mb": [0, 4]})", "test");
  const auto tight_devices = smp::stage_devices(tight, smp::Topology(tight, 2), {0, 1}, {});
  CHECK(tight_devices.memory_mb == std::vector<double>{8.0, 4.0});
  CHECK_THROWS_WITH(smp::plan_stages(modules, tight, {}, 1, &tight_devices),
                    Catch::Matchers::Contains("cannot partition the model"));

  // The planner predicts each layout on its devices: with the last rank slow, a pipeline that gives it a short
  // stage beats the replicas, which all wait for it.
  const smp::Config planned = smp::Config::from_json_text(
      R"({"global_batch_size": 16, "memory_weight": 0, "device_speeds": [1, 0.25]})", "test");
  const auto predictions = smp::plan_layouts({modules, 2}, planned, 2, {0.0, 1e9, 1e9});
  const smp::Config alike = smp::Config::from_json_text(R"({"global_batch_size": 16, "memory_weight": 0})", "test");
  const auto even = smp::plan_layouts({modules, 2}, alike, 2, {0.0, 1e9, 1e9});
  REQUIRE(predictions.front().rejected.empty());
  CHECK(predictions.front().layout.partitions == 2);
  CHECK(predictions.front().step_s > even.front().step_s);
}

TEST_CASE("plans beyond this machine: a decoder's shape on a described cluster", "[plan]") {
  const auto llama8b = smp::DecoderShape::from_json_text(
      R"({"name": "Llama-3 8B", "layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8,
          "vocab": 128256, "sequence": 8192})", "llama3_8b.json");
  CHECK(llama8b.parameters() == Approx(8.03e9).epsilon(0.001));  // Meta's count
  // The input embedding is a lookup, not a product: left out of the model FLOPs (its 0.53e9 parameters).
  CHECK(llama8b.flops_per_token() == Approx(6 * (llama8b.parameters() - 128256.0 * 4096) + 12.0 * 32 * 4096 * 8192));
  const auto node = smp::ClusterSpec::from_json_text(R"({"nodes": 1, "devices_per_node": 8})", "h100.json");

  // One sequence's costs: the blocks' products at peak x efficiency, halved by tp, plus tp's all-reduces.
  const auto whole = smp::decoder_profile(llama8b, node, 1), halves = smp::decoder_profile(llama8b, node, 2);
  REQUIRE(whole.modules.size() == 34);  // embedding, 32 blocks, head
  const auto& block = whole.modules[1];
  CHECK(block.backward_s == Approx(2 * block.forward_s));
  CHECK(halves.modules[1].forward_s > block.forward_s / 2);  // the all-reduces are not free
  CHECK(halves.modules[1].parameter_bytes == block.parameter_bytes / 2);
  CHECK(halves.modules[1].activation_bytes < block.activation_bytes);

  const auto planned = smp::plan_on_cluster(llama8b, node, 8);
  REQUIRE_FALSE(planned.empty());
  REQUIRE(planned.front().prediction.rejected.empty());
  bool some_rejected = false;
  for (const auto& cluster_prediction : planned) {
    const auto& layout = cluster_prediction.prediction.layout;
    CHECK(layout.tensor_parallel * layout.partitions * layout.replicas == 8);
    if (!cluster_prediction.prediction.rejected.empty()) {
      some_rejected = true;
      continue;
    }
    CHECK(cluster_prediction.prediction.peak_memory_mib() <= 80 * 1024.0);
    CHECK(cluster_prediction.mfu > 0.0);
    CHECK(cluster_prediction.mfu < 1.0);
  }
  CHECK(some_rejected);  // 8B whole on one 80 GiB device with Adam does not fit
  const std::string report = smp::cluster_report(planned, llama8b, node, 8);
  CHECK_THAT(report, Catch::Matchers::Contains("chosen: " + planned.front().prediction.layout.describe()));
  CHECK_THAT(report, Catch::Matchers::Contains("tokens/s/dev"));

  // Across nodes, slower links between them make a layout that crosses them slower; inside one node they do not
  // matter.
  auto slow_links = node;
  slow_links.inter_node_gbps = 1;
  auto two_nodes = node, two_slow_nodes = slow_links;
  two_nodes.nodes = two_slow_nodes.nodes = 2;
  const auto fastest_step = [](const std::vector<smp::ClusterPrediction>& predictions) {
    return predictions.front().prediction.step_s;
  };
  CHECK(fastest_step(smp::plan_on_cluster(llama8b, slow_links, 8)) == Approx(fastest_step(planned)));
  CHECK(fastest_step(smp::plan_on_cluster(llama8b, two_slow_nodes, 16)) >
        fastest_step(smp::plan_on_cluster(llama8b, two_nodes, 16)));

  CHECK_THROWS_WITH(smp::ClusterSpec::from_json_text(R"({"nodes": 0})", "c.json"),
                    Catch::Matchers::Contains("c.json: key \"nodes\": expected a positive integer"));
  CHECK_THROWS_WITH(smp::ClusterSpec::from_json_text(R"({"node": 2})", "c.json"),
                    Catch::Matchers::Contains("unknown key \"node\""));
  CHECK_THROWS_WITH(smp::DecoderShape::from_json_text(R"({"hidden": 100, "heads": 3})", "m.json"),
                    Catch::Matchers::Contains("must divide"));
}

namespace {

// Two linear nodes that run slower right after each other than again on their own, as a block does whose weights
// the previous block pushed out of the caches: 8 ms after the other node, 1 ms after itself. The second returns its
// sum, a loss of the model's own: no cross-entropy is charged, whose time on a busy host would blur the sleeps.
smp::GraphModel flushing_each_other(std::shared_ptr<int> last_node) {
  smp::GraphModel model("x");
  for (int index : {0, 1}) {
    torch::nn::Linear linear(index == 0 ? 4 : 6, index == 0 ? 6 : 4);
    model.add("linear" + std::to_string(index), linear.ptr(),
              [linear, index, last_node](const std::vector<at::Tensor>& in) mutable {
                std::this_thread::sleep_for(std::chrono::milliseconds(*last_node == index ? 1 : 8));
                *last_node = index;
                const at::Tensor out = linear->forward(in[0]);
                return index == 1 ? out.sum() : out;
              },
              {index == 0 ? "x" : "linear0"});
  }
  return model;
}

double forward_sum(const std::vector<smp::ModuleProfile>& profiles) {
  double sum = 0;
  for (const auto& profile : profiles) sum += profile.forward_s;
  return sum;
}

}  // namespace

TEST_CASE("the planner's profile is scaled to a pass of the whole model", "[profile][plan]") {
  const std::vector<at::Tensor> sample{at::randn({8, 4})};
  const smp::GraphModel model = flushing_each_other(std::make_shared<int>(-1));
  // Alone each node reruns at 1 ms; whole, each follows the other at 8 ms.
  CHECK(forward_sum(smp::profile_graph(model, sample, 3)) < 6e-3);
  const auto scaled = smp::profile_graph(model, sample, 3, nullptr, /*scale_to_whole=*/true);
  CHECK(forward_sum(scaled) >= 16e-3);
  for (const auto& profile : scaled) CHECK(profile.backward_s > 0.0);

  // A model that cannot run whole here (a node built on demand) keeps its nodes' own times.
  smp::GraphModel on_demand = flushing_each_other(std::make_shared<int>(-1));
  on_demand.add("head", [] { return torch::nn::Identity(); }, {"linear1"});
  CHECK(forward_sum(smp::profile_graph(on_demand, sample, 3, nullptr, /*scale_to_whole=*/true)) < 6e-3);
}

TEST_CASE("the planner's profile times the zero-bubble split, and ZB layouts are predicted with it", "[profile][plan]") {
  const smp::GraphModel model = smp_test::linear_then_gelu(32);
  const auto profiles = smp::profile_graph(model, std::vector<at::Tensor>{at::randn({8, 16})}, 2, smp::split_backward_timer());
  REQUIRE(profiles.size() == 2);
  for (const auto& profile : profiles) {
    INFO(profile.name);
    CHECK(profile.backward_input_s > 0.0);
    CHECK(profile.backward_weight_s > 0.0);
    CHECK(profile.weight_pass_bytes >= 0);
    CHECK(profile.weight_pass_bytes <= profile.activation_bytes);
  }
  CHECK(smp::profile_graph(model, at::randn({8, 16}), 1)[1].backward_input_s == 0.0);  // without the timer

  // 8 equal modules whose I and W each cost their whole B (a split twice the backward): every zero-bubble layout
  // is predicted slower than with the halves the paper assumes, the others alike.
  auto halves = equal_chain(8, 1 << 20, 1 << 20);
  auto doubled = halves;
  for (auto& module : doubled) module.backward_input_s = module.backward_weight_s = module.backward_s;
  const smp::Config config = smp::Config::from_json_text(R"({"global_batch_size": 16})", "test");
  const auto assumed = smp::plan_layouts({halves, 2}, config, 4, {0.0, 1e9, 1e9});
  const auto profiled = smp::plan_layouts({doubled, 2}, config, 4, {0.0, 1e9, 1e9});
  int zero_bubble = 0;
  for (const auto& with_split : profiled) {
    for (const auto& with_halves : assumed) {
      if (with_split.layout.describe() != with_halves.layout.describe()) continue;
      const bool splits = with_split.layout.pipeline == "zb_h1" || with_split.layout.pipeline == "zb_v" ||
                          with_split.layout.pipeline == "dualpipe_v";
      INFO(with_split.layout.describe());
      if (splits) {
        CHECK(with_split.step_s > with_halves.step_s);
        ++zero_bubble;
      } else {
        CHECK(with_split.step_s == Approx(with_halves.step_s));
      }
    }
  }
  CHECK(zero_bubble > 0);

  // Modules whose W reads a quarter of what their forward keeps: every zero-bubble layout of several stages is
  // predicted to need less memory on some rank and more on none (its later stages free the rest at I; the first
  // holds everything to W), the others the same as without the measurement.
  auto quartered = halves;
  for (auto& module : quartered) module.weight_pass_bytes = module.activation_bytes / 4;
  const auto freed = smp::plan_layouts({quartered, 2}, config, 4, {0.0, 1e9, 1e9});
  int lighter = 0;
  for (const auto& with_share : freed) {
    for (const auto& whole : assumed) {
      if (with_share.layout.describe() != whole.layout.describe() || !with_share.rejected.empty()) continue;
      INFO(with_share.layout.describe());
      REQUIRE(with_share.memory_mib.size() == whole.memory_mib.size());
      const bool splits = with_share.layout.pipeline == "zb_h1" || with_share.layout.pipeline == "zb_v" ||
                          with_share.layout.pipeline == "dualpipe_v";
      bool less_somewhere = false;
      for (std::size_t rank = 0; rank < whole.memory_mib.size(); ++rank) {
        CHECK(with_share.memory_mib[rank] <= whole.memory_mib[rank] + 1e-9);
        less_somewhere = less_somewhere || with_share.memory_mib[rank] < whole.memory_mib[rank] - 1e-6;
      }
      if (splits && with_share.layout.partitions > 1 && !with_share.layout.recompute) {
        lighter += less_somewhere;
      } else if (!splits) {
        CHECK_FALSE(less_somewhere);
      }
    }
  }
  CHECK(lighter > 0);
}

TEST_CASE("tensor-parallel layouts: a shard profiled alone counts its collectives, and the plan prices them",
          "[profile][plan][tp]") {
  {
    // A column then a row layer of degree 2, built and profiled as rank 0 of a group that is not there.
    const smp::tp::ProfiledDegree degree(2);
    const smp::WithoutCollectives alone;
    const auto group = smp::tp::process_group();
    REQUIRE(group->size() == 2);
    smp::GraphModel model("x");
    model.add("up", smp::tp::ColumnParallelLinear(16, 64, group), {"x"});
    model.add("down", smp::tp::RowParallelLinear(64, 16, group), {"up"});
    const auto profiles = smp::profile_graph(model, at::randn({8, 16}), 1);
    REQUIRE(profiles.size() == 2);
    // The column layer's input gradient is summed over the group (backward), the row layer's output (forward):
    // one all-reduce each of 8 x 16 floats, a ring moving twice that.
    CHECK(profiles[0].tp_forward_collectives == 0);
    CHECK(profiles[0].tp_backward_collectives == 1);
    CHECK(profiles[0].tp_backward_ring_bytes == 2 * 8 * 16 * 4);
    CHECK(profiles[1].tp_forward_collectives == 1);
    CHECK(profiles[1].tp_forward_ring_bytes == 2 * 8 * 16 * 4);
    CHECK(profiles[1].tp_backward_collectives == 0);
    CHECK(profiles[0].parameter_bytes == (32 * 16 + 32) * 4);  // the shard's
    CHECK_THROWS_WITH(group->barrier(), Catch::Matchers::Contains("moves nothing"));
  }
  CHECK((smp::tp::process_group() == nullptr || smp::tp::process_group()->size() == 1));  // the one before

  // Two modules of 1 ms each way on 2 samples; at degree 2 each computes half, holds half, and runs one all-reduce
  // of 1 MB (ring bytes 2 MB) per pass.
  const auto whole = equal_chain(2, 1 << 20, 1 << 20);
  auto shard = equal_chain(2, 1 << 19, 1 << 19);
  for (auto& module : shard) {
    module.forward_s = module.backward_s = 0.5e-3;
    module.tp_forward_collectives = module.tp_backward_collectives = 1;
    module.tp_forward_ring_bytes = module.tp_backward_ring_bytes = 2000000;
  }
  const smp::Config config = smp::Config::from_json_text(R"({"global_batch_size": 4})", "test");
  const smp::PlanningCosts links{10e-6, 1e9, 1e9};
  const auto predictions = smp::plan_layouts(std::map<int, smp::ModelProfile>{{1, {whole, 2}}, {2, {shard, 2}}},
                                             config, 2, links);
  const smp::LayoutPrediction* tensor_parallel = nullptr;
  for (const auto& prediction : predictions) {
    const auto& layout = prediction.layout;
    CHECK(layout.tensor_parallel * layout.partitions * layout.replicas == 2);
    if (layout.tensor_parallel == 2 && layout.microbatches == 1 && !layout.recompute) tensor_parallel = &prediction;
  }
  REQUIRE(tensor_parallel != nullptr);
  CHECK(tensor_parallel->layout.describe() == "tp 2 x pp 1 x dp 1, gpipe, m 1");
  // A microbatch of 4 samples: per module and pass 1 ms of compute and 2 x 10 us + 4 MB x 1/2 / 1 GB/s = 2.02 ms of
  // collectives; two modules, forward and backward.
  CHECK(tensor_parallel->step_s == Approx(4 * (1e-3 + 2.02e-3)));
  CHECK(tensor_parallel->peak_memory_mib() < 4.0 * 2 + 4.0);  // half of 4 x 2 MiB of parameters and state, and more
  // Where ranks share cores a collective costs at least the synchronization measured after computing, its bytes at
  // the bandwidth measured so: 1 ms + 4 MB x 1/2 / 0.5 GB/s = 5 ms per module and pass.
  smp::PlanningCosts synchronized = links;
  synchronized.synchronization_s = 1e-3;
  synchronized.synchronized_bytes_per_s = 0.5e9;
  bool priced = false;
  for (const auto& prediction : smp::plan_layouts(std::map<int, smp::ModelProfile>{{1, {whole, 2}}, {2, {shard, 2}}},
                                                  config, 2, synchronized)) {
    if (prediction.layout.describe() != tensor_parallel->layout.describe()) continue;
    CHECK(prediction.step_s == Approx(4 * (1e-3 + 5e-3)));
    priced = true;
  }
  CHECK(priced);
  // The job adopts the degree with the rest of the layout.
  const smp::Config given = smp::Config::from_json_text(
      R"({"global_batch_size": 4, "tensor_parallel_degree": "auto", "partitions": "auto", "ddp": "auto",
          "pipeline": "auto"})", "test");
  const auto adopted = smp::adopting_layout(given, tensor_parallel->config_json(), 2);
  REQUIRE(adopted.has_value());
  CHECK(adopted->tensor_parallel_degree == 2);
  CHECK_FALSE(adopted->ddp);
  CHECK_FALSE(smp::adopting_layout(smp::Config::from_json_text(
      R"({"global_batch_size": 4, "tensor_parallel_degree": 1, "partitions": "auto", "ddp": "auto",
          "pipeline": "auto"})", "test"),
      tensor_parallel->config_json(), 2).has_value());

  // Devices given per rank: a tensor-parallel group computes at its slowest member's speed (its collectives wait for
  // it, and take as long as before) within its least memory.
  smp::Config uneven = config;
  uneven.device_speeds = {1.0, 0.5};
  bool slowed = false;
  for (const auto& prediction : smp::plan_layouts(std::map<int, smp::ModelProfile>{{1, {whole, 2}}, {2, {shard, 2}}},
                                                  uneven, 2, links)) {
    if (prediction.layout.describe() != tensor_parallel->layout.describe()) continue;
    CHECK(prediction.rejected.empty());
    CHECK(prediction.step_s == Approx(4 * (2e-3 + 2.02e-3)));
    slowed = true;
  }
  CHECK(slowed);
  smp::Config small = config;
  small.device_memory_mb = {64, 1};
  int limited = 0;
  for (const auto& prediction : smp::plan_layouts(std::map<int, smp::ModelProfile>{{1, {whole, 2}}, {2, {shard, 2}}},
                                                  small, 2, links)) {
    if (prediction.layout.tensor_parallel == 2) {
      CHECK_THAT(prediction.rejected, Catch::Matchers::Contains("memory limit of 1.0 MiB"));
      ++limited;
    }
  }
  CHECK(limited > 0);
}

TEST_CASE("uneven routing: the busiest expert-parallel rank computes, holds and exchanges its extra rows",
          "[profile][plan]") {
  // Ranks hold consecutive blocks of the experts; the busiest block against an even share. One row of counts (a
  // job's totals): taken nearly as it is, less what its tokens' chance explains, which also stays in an exchange of
  // few samples.
  CHECK(smp::routing_imbalance({{10, 10, 10, 10}}, 2, 1000) == Approx(1.0).epsilon(0.01));
  CHECK(smp::routing_imbalance({{10, 10, 10, 10}}, 2, 1) > 1.05);
  CHECK(smp::routing_imbalance({{30, 10, 0, 0}}, 2, 1) == Approx(2.0));
  CHECK(smp::routing_imbalance({{0, 0, 10, 30}}, 4, 1000) == Approx(3.0).epsilon(0.02));
  CHECK(smp::routing_imbalance({{30, 10, 0, 0}}, 1, 1) == 1.0);
  CHECK(smp::routing_imbalance({{0, 0, 0, 0}}, 2, 1) == 1.0);
  CHECK(smp::routing_imbalance({{1, 2, 3}}, 2, 1) == 1.0);  // a degree that does not divide the experts
  CHECK(smp::routing_imbalance({{-5, 10}, {5, 5}}, 2, 1000) == Approx(1.0).epsilon(0.01));  // a negative row is not read
  // At most every row on one rank: ep times its share.
  CHECK(smp::routing_imbalance({{10, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 10}}, 8, 1) <= 8.0);
  // Rows per sample: two samples each sending every token to one block, a different one. Their mean is even and
  // their spread says so by chance: an exchange of one sample still finds one block busier (short of the 2x that
  // one such sample is: the draws about the mean are normal, capped at every row), one of many samples hardly.
  const smp::ExpertRouting apart{{10, 0, 0, 0}, {0, 0, 10, 0}};
  const double one = smp::routing_imbalance(apart, 2, 1);
  const double many = smp::routing_imbalance(apart, 2, 256);
  CHECK(one > 1.3);
  CHECK(one < 2.0);
  CHECK(many < 1.06);
  CHECK(smp::routing_imbalance(apart, 2, 1) == one);  // the same every time
  // A lasting skew, every sample alike, stays whatever the exchange's size.
  const smp::ExpertRouting alike{{30, 10, 0, 0}, {15, 5, 0, 0}};
  CHECK(smp::routing_imbalance(alike, 2, 1) == Approx(2.0));
  CHECK(smp::routing_imbalance(alike, 2, 256) == Approx(2.0));
  // Skew beyond what the spread explains is kept in part: 3 of 4 samples lean to the first block.
  const smp::ExpertRouting leaning{{8, 0, 2, 0}, {7, 1, 1, 1}, {6, 2, 2, 0}, {2, 1, 5, 2}};
  const double lean = smp::routing_imbalance(leaning, 2, 256);
  CHECK(lean > 1.1);
  CHECK(lean < 2 * 0.675);  // below the samples' mean share of the first block (0.675), taken at face value

  // A node holding a dense layer (256 x 256) and 4 stacked experts (4 x 256 x 256, its largest tensor), 2 chosen per
  // token: per token the experts do 2 x 256 x 256 of work against the dense layer's 256 x 256, two thirds of the
  // node's. 8 MiB of activations per node and 2 samples, so that they set the memory.
  auto modules = equal_chain(2, 1 << 20, 8 << 20);
  modules[0].parameter_shapes = "embedding.weight:1024,256,;";
  modules[1].parameter_bytes = 5 << 18;
  modules[1].largest_parameter_bytes = 1 << 20;
  modules[1].parameter_shapes = "layer.dense.weight:256,256,;layer.experts.weight:4,256,256,;";
  smp::ModelProfile even{modules, 2};
  even.mark_experts({{"layer.experts", 1000000}}, 4, 1, {}, 2);
  CHECK(even.modules[1].expert_compute_share == Approx(2.0 / 3.0));
  CHECK(even.modules[1].largest_expert_parameter_bytes == 1 << 20);
  CHECK(even.modules[1].largest_other_parameter_bytes == 1 << 18);
  CHECK(even.modules[1].expert_routing.empty());
  smp::ModelProfile counted_even{modules, 2};
  counted_even.mark_experts({{"layer.experts", 1000000}}, 4, 1, {{"layer.experts", {{1000, 1000, 1000, 1000}}}}, 2);
  smp::ModelProfile skewed{modules, 2};
  skewed.mark_experts({{"layer.experts", 1000000}}, 4, 1, {{"layer.experts", {{30, 10, 0, 0}}}}, 2);
  REQUIRE(skewed.modules[1].expert_routing.size() == 1);
  CHECK(skewed.modules[0].expert_routing.empty());
  // Without top-k the node's compute counts as the experts' alone.
  smp::ModelProfile unknown_k{modules, 2};
  unknown_k.mark_experts({{"layer.experts", 1000000}}, 4);
  CHECK(unknown_k.modules[1].expert_compute_share == 1.0);

  const smp::PlanningCosts links{10e-6, 1e9, 1e9};
  const smp::Config planned =
      smp::Config::from_json_text(R"({"global_batch_size": 4, "expert_parallel_degree": "auto"})", "test");
  const auto predict = [&](const smp::ModelProfile& profile, const std::string& described) {
    const auto predictions = smp::plan_layouts(profile, planned, 4, links);
    const auto found = std::find_if(predictions.begin(), predictions.end(),
                                    [&](const smp::LayoutPrediction& p) { return p.layout.describe() == described; });
    REQUIRE(found != predictions.end());
    REQUIRE(found->rejected.empty());
    return *found;
  };
  const std::string divided = "pp 1 x dp 4, ep 2, gpipe, m 1";
  const auto at_even = predict(even, divided);
  CHECK(predict(counted_even, divided).step_s == Approx(at_even.step_s).epsilon(0.01));
  const auto at_skewed = predict(skewed, divided);
  // One sample a microbatch: the node's 1 ms of compute two thirds more on the rank receiving twice its share, and
  // each of the four exchanges moves twice half of 0.5 MB over 1 GB/s.
  CHECK(at_skewed.pipeline_s - at_even.pipeline_s == Approx(2e-3 / 3 + 4 * 0.25e-3));
  // Undivided, every rank computes all its own tokens' rows: routing does not matter.
  const std::string whole = "pp 1 x dp 4, gpipe, m 1";
  CHECK(predict(skewed, whole).step_s == Approx(predict(even, whole).step_s));
  // Memory, AdamW: undivided, 3 x 2.25 MiB of parameters and moments and the most of 8 MiB of activations (4 per
  // node and sample), the gradients twice (the replicas' buckets copy them: 4.5) and the gradients with the step's
  // temporaries (two of its largest tensor, the experts' 1 MiB: 4.25): 14.75 MiB. Divided by 2: 3 x 1.75 MiB and
  // the activations, 13.25 MiB.
  CHECK(predict(even, whole).peak_memory_mib() == Approx(14.75));
  CHECK(at_even.peak_memory_mib() == Approx(13.25));
  // Skewed, the activations of the busiest rank's experts two thirds of the node's 4 MiB more.
  CHECK(at_skewed.peak_memory_mib() == Approx(13.25 + 4.0 * 2.0 / 3.0));
}

TEST_CASE("expert-parallel layouts: each rank holds its share of the experts and pays their token exchanges",
          "[profile][plan]") {
  // A dense module and an experts module of 1 MiB each (4 experts stacked), 1 ms each way on 2 samples; the experts
  // read 1 MB of token rows per 2 samples.
  auto modules = equal_chain(2, 1 << 20, 1 << 20);
  modules[0].parameter_shapes = "dense.weight:512,512,;";
  modules[1].parameter_shapes = "layer.experts.gate_up_proj:4,256,128,;layer.experts.down_proj:4,128,256,;";
  smp::ModelProfile profile{modules, 2};
  profile.mark_experts({{"layer.experts", 1000000}}, 4);
  CHECK(profile.experts == 4);
  CHECK(profile.modules[0].expert_parameter_bytes == 0);
  CHECK(profile.modules[1].expert_parameter_bytes == 1 << 20);
  CHECK(profile.modules[1].expert_token_bytes == 1000000);

  const smp::PlanningCosts links{10e-6, 1e9, 1e9};
  const auto find = [](const std::vector<smp::LayoutPrediction>& predictions, const std::string& described) {
    const auto found = std::find_if(predictions.begin(), predictions.end(),
                                    [&](const smp::LayoutPrediction& p) { return p.layout.describe() == described; });
    REQUIRE(found != predictions.end());
    return *found;
  };
  // Only with "auto" does the plan divide the experts; every degree dividing the 4 replicas and the 4 experts.
  const auto fixed = smp::plan_layouts(profile, smp::Config::from_json_text(R"({"global_batch_size": 4})", "test"), 4, links);
  CHECK(std::none_of(fixed.begin(), fixed.end(), [](const auto& p) { return p.layout.experts > 1; }));
  const smp::Config planned =
      smp::Config::from_json_text(R"({"global_batch_size": 4, "expert_parallel_degree": "auto"})", "test");
  const auto predictions = smp::plan_layouts(profile, planned, 4, links);
  const auto whole = find(predictions, "pp 1 x dp 4, gpipe, m 1");
  const auto halves = find(predictions, "pp 1 x dp 4, ep 2, gpipe, m 1");
  const auto quarters = find(predictions, "pp 1 x dp 4, ep 4, gpipe, m 1");
  REQUIRE(whole.rejected.empty());
  REQUIRE(halves.rejected.empty());
  // Half the experts' parameters, AdamW moments and gradients fewer, the gradients twice (the replicas' buckets copy
  // them at the end of the backward, more than the 1 MiB of activations): 5 x 1/2 MiB.
  CHECK(whole.peak_memory_mib() - halves.peak_memory_mib() == Approx(2.5));
  CHECK(halves.peak_memory_mib() - quarters.peak_memory_mib() == Approx(1.25));
  // Four exchanges of a microbatch's rows (one sample: 0.5 MB), each a round trip and half the rows over 1 GB/s,
  // and the counts before them.
  CHECK(halves.pipeline_s - whole.pipeline_s == Approx(4 * (20e-6 + 0.25e-3) + 20e-6));
  // The experts' gradients are reduced over the 2 replicas holding the same experts: a ring of 2 moves 1 x their
  // 0.5 MiB, where 4 replicas moved 1.5 x 1 MiB with the dense ones.
  const double mib = 1 << 20;
  CHECK(whole.gradient_sync_s == Approx(6 * 10e-6 + 1.5 * 2 * mib / 1e9));
  CHECK(halves.gradient_sync_s == Approx((6 * 10e-6 + 1.5 * mib / 1e9) + (2 * 10e-6 + 0.5 * mib / 1e9)));
  CHECK_THAT(halves.config_json(), Catch::Matchers::Contains("\"expert_parallel_degree\":2"));

  // Frozen experts beside a trained router of 1 MiB in the same node (LoRA elsewhere): divided, each rank holds half
  // of them and nothing of their state; the router and the dense module train and reduce over the 4 replicas.
  auto routed = equal_chain(2, 1 << 20, 1 << 20);
  routed[0].parameter_shapes = "dense.weight:512,512,;";
  routed[1].parameter_bytes = 2 << 20;
  routed[1].parameter_shapes =
      "layer.router.weight:512,512,;layer.experts.gate_up_proj:4,256,128,;layer.experts.down_proj:4,128,256,;";
  routed[1].frozen_parameters = {"layer.experts.gate_up_proj", "layer.experts.down_proj"};
  routed[1].frozen_parameter_bytes = 1 << 20;
  smp::ModelProfile frozen_experts{routed, 2};
  frozen_experts.mark_experts({{"layer.experts", 1000000}}, 4);
  CHECK(frozen_experts.modules[1].frozen_expert_parameter_bytes == 1 << 20);
  CHECK(frozen_experts.modules[1].trained_dense_bytes() == 1 << 20);
  CHECK(frozen_experts.modules[1].trained_expert_bytes() == 0);
  const auto frozen_predictions = smp::plan_layouts(frozen_experts, planned, 4, links);
  const auto frozen_whole = find(frozen_predictions, "pp 1 x dp 4, gpipe, m 1");
  const auto frozen_halves = find(frozen_predictions, "pp 1 x dp 4, ep 2, gpipe, m 1");
  CHECK(frozen_whole.peak_memory_mib() - frozen_halves.peak_memory_mib() == Approx(0.5));
  CHECK(frozen_halves.gradient_sync_s == Approx(6 * 10e-6 + 1.5 * 2 * mib / 1e9));

  // A degree must divide the experts: with 2 of them, no ep 4.
  smp::ModelProfile two_experts = profile;
  two_experts.experts = 2;
  const auto fewer = smp::plan_layouts(two_experts, planned, 4, links);
  CHECK(std::none_of(fewer.begin(), fewer.end(), [](const auto& p) { return p.layout.experts == 4; }));
  // With tensor parallelism: the tp 2 profile holds half of each module, the experts' features split as a job at
  // ep 1 splits them (their outputs summed over the group: a collective each way). Dividing them, each
  // tensor-parallel rank holds its experts whole and divides them with the same tp rank of the other replica.
  auto sharded = modules;
  for (auto& module : sharded) {
    module.parameter_bytes /= 2;
    module.forward_s = module.backward_s = 0.5e-3;
  }
  sharded[0].parameter_shapes = "dense.weight:256,512,;";
  sharded[1].parameter_shapes = "layer.experts.gate_up_proj:4,256,64,;layer.experts.down_proj:4,64,256,;";
  sharded[1].tp_forward_collectives = sharded[1].tp_backward_collectives = 1;
  smp::ModelProfile at_two{sharded, 2};
  at_two.mark_experts({{"layer.experts", 1000000}}, 4, 2);
  CHECK(at_two.experts_split == 2);
  CHECK(at_two.modules[1].expert_parameter_bytes == 1 << 19);
  const smp::Config with_tp = smp::Config::from_json_text(
      R"({"global_batch_size": 4, "expert_parallel_degree": "auto", "tensor_parallel_degree": "auto"})", "test");
  const auto both = smp::plan_layouts(std::map<int, smp::ModelProfile>{{1, profile}, {2, at_two}}, with_tp, 4, links);
  const auto tp_split = find(both, "tp 2 x pp 1 x dp 2, gpipe, m 1");
  const auto tp_divided = find(both, "tp 2 x pp 1 x dp 2, ep 2, gpipe, m 1");
  REQUIRE(tp_split.rejected.empty());
  REQUIRE(tp_divided.rejected.empty());
  // Half the experts' state either way; whole experts keep their whole activations (1 MiB more on 2 samples).
  CHECK(tp_divided.peak_memory_mib() - tp_split.peak_memory_mib() == Approx(1.0));
  // A microbatch of 2 samples: whole experts compute twice the split ones' (1 ms more), four exchanges of its 1 MB
  // of rows and the counts, and no sums over the group (a round trip each way).
  CHECK(tp_divided.pipeline_s - tp_split.pipeline_s == Approx(1e-3 + 4 * (20e-6 + 0.5e-3) + 20e-6 - 2 * 20e-6));
  // The experts' gradients: each tensor-parallel rank's reduced over the replicas holding the same experts (here
  // none: 2 replicas, ep 2), the dense shard over both replicas.
  CHECK(tp_divided.gradient_sync_s == Approx(2 * 10e-6 + 0.5 * mib / 1e9));
  CHECK_THAT(tp_divided.config_json(), Catch::Matchers::Contains("\"tensor_parallel_degree\":2"));
  CHECK_THAT(tp_divided.config_json(), Catch::Matchers::Contains("\"expert_parallel_degree\":2"));
  // Not with sequence parallelism, which the job refuses beside ep: rejected, saying so.
  smp::Config sequence_parallel = with_tp;
  sequence_parallel.sequence_parallel = true;
  const auto refused = find(smp::plan_layouts(std::map<int, smp::ModelProfile>{{1, profile}, {2, at_two}},
                                              sequence_parallel, 4, links),
                            "tp 2 x pp 1 x dp 2, ep 2, gpipe, m 1");
  CHECK_THAT(refused.rejected, Catch::Matchers::Contains("sequence_parallel"));

  // The partition search counts the experts' optimizer state sharded over the replicas holding the same experts: 4
  // replicas, ep 2, ZeRO-1: (2 + 2 / 2) x 4 MiB of experts = 12 MiB (not 2 + 2 / 4: 10).
  auto experts_only = equal_chain(1, 4 << 20, 0);
  experts_only[0].expert_parameter_bytes = 4 << 20;
  const auto zero1 = [](int megabytes) {
    return smp::Config::from_json_text(R"({"ddp": true, "shard_optimizer_state": true, "expert_parallel_degree": 2,
        "memory_limit_mb": )" + std::to_string(megabytes) + "}", "test");
  };
  CHECK_THROWS_WITH(smp::plan_stages(experts_only, zero1(11), {1}, 4), Catch::Matchers::Contains("memory"));
  CHECK_NOTHROW(smp::plan_stages(experts_only, zero1(13), {1}, 4));
  // The job adopts the degree with the rest of the layout; a config fixing another degree does not take it.
  const smp::Config given = smp::Config::from_json_text(
      R"({"global_batch_size": 4, "expert_parallel_degree": "auto", "partitions": "auto", "ddp": "auto",
          "microbatches": "auto"})", "test");
  const auto adopted = smp::adopting_layout(given, halves.config_json(), 4);
  REQUIRE(adopted.has_value());
  CHECK(adopted->expert_parallel_degree == 2);
  CHECK(adopted->replicas_for_world(4) == 4);
  CHECK_FALSE(smp::adopting_layout(smp::Config::from_json_text(
      R"({"global_batch_size": 4, "expert_parallel_degree": 1, "partitions": "auto", "ddp": "auto",
          "microbatches": "auto"})", "test"), halves.config_json(), 4).has_value());
}

TEST_CASE("auto_partition false that leaves a stage without a module says so in its own terms", "[profile]") {
  const auto modules = equal_chain(3, 1 << 10, 1 << 10);
  const auto config = smp::Config::from_json_text(R"({"partitions": 2, "auto_partition": false})", "test");
  CHECK_THROWS_WITH(smp::plan_stages(modules, config, {1, 1}),
                    Catch::Matchers::Contains("\"auto_partition\" is false") &&
                        Catch::Matchers::Contains("leaves stage 1 without a module"));
  auto overridden = smp::Config::from_json_text(R"({"partitions": 2, "auto_partition": false,
      "partition_overrides": {")" + modules[2].name + R"(": 1}})", "test");
  CHECK_NOTHROW(smp::plan_stages(modules, overridden, {1, 1}));
}

TEST_CASE("an \"auto\" job that resumes takes the checkpoint's layout, replicas from its world", "[plan][checkpoint]") {
  const std::string root = "/tmp/smp_resumed_layout_" + std::to_string(getpid());
  const auto remove_root = [&] {  // not std::filesystem::remove_all: libtorch.so's copy of it crashes
    REQUIRE(std::system(("rm -rf " + root).c_str()) == 0);
  };
  remove_root();
  const std::string directory = root + "/" + smp::checkpoint_directory_name(3);
  std::filesystem::create_directories(directory);
  smp::CheckpointManifest manifest;
  manifest.step = 3;
  manifest.partitions = 2;
  manifest.replicas = 1;
  manifest.schedule = "interleaved";
  manifest.module_names = {"a", "b"};
  manifest.stage_of_module = {0, 1};
  manifest.model_signature = "2 parameters";
  manifest.config_json = R"({"partitions": 2, "microbatches": 4, "pipeline": "interleaved",
                             "activation_checkpointing": ["b"], "partition_overrides": {"b": 1}})";
  for (int rank = 0; rank < 2; ++rank) {
    const std::string contents = "partition " + std::to_string(rank);
    smp::write_file_atomically(directory + "/" + smp::partition_file_name(rank), contents);
    manifest.files.push_back({smp::partition_file_name(rank), rank, contents.size(),
                              smp::crc32(contents.data(), contents.size())});
  }
  smp::write_file_atomically(directory + "/manifest.json", manifest.to_json());
  const auto config = [&](const std::string& keys) {
    return smp::Config::from_json_text(R"({"checkpoint_dir": ")" + root + R"(", "resume": true, "global_batch_size": 12, )" +
                                           keys + "}",
                                       "job.json");
  };
  const std::string planned = R"("partitions": "auto", "microbatches": "auto", "ddp": "auto", "pipeline": "auto",
                                 "activation_checkpointing": "auto")";

  // 4 ranks: 2 replicas of the saved 2 stages; 12 samples over 2 replicas split into 3 microbatches, not 4.
  const auto resumed = smp::resumed_layout(config(planned), 4);
  REQUIRE(resumed);
  const smp::Config adopted = smp::Config::from_json_text(*resumed, "job.json");
  CHECK(adopted.auto_keys.empty());
  CHECK(adopted.partitions == 2);
  CHECK(adopted.microbatches == 3);
  CHECK(adopted.ddp);
  CHECK(adopted.pipeline == "interleaved");
  CHECK(adopted.checkpointed_modules == std::vector<std::string>{"b"});
  CHECK_THAT(*resumed, Catch::Matchers::Contains("partition_overrides"));

  // Nothing to take: no "auto" key, no "resume", no checkpoint yet.
  CHECK_FALSE(smp::resumed_layout(config(R"("partitions": 2)"), 4));
  CHECK_FALSE(smp::resumed_layout(smp::Config::from_json_text(R"({"partitions": "auto", "global_batch_size": 12,
      "checkpoint_dir": ")" + root + R"("})", "job.json"), 4));
  CHECK_FALSE(smp::resumed_layout(smp::Config::from_json_text(R"({"partitions": "auto", "global_batch_size": 12,
      "resume": true, "checkpoint_dir": ")" + root + R"(/none"})", "job.json"), 4));

  // A world the saved stages do not divide, and fixed keys the layout contradicts: named.
  CHECK_THROWS_WITH(smp::resumed_layout(config(planned), 3), Catch::Matchers::Contains("launch a multiple of 2"));
  CHECK_THROWS_WITH(smp::resumed_layout(config(R"("partitions": 4, "microbatches": "auto")"), 4),
                    Catch::Matchers::Contains("\"partitions\" 2") && Catch::Matchers::Contains("fixes 4"));
  CHECK_THROWS_WITH(smp::resumed_layout(config(R"("partitions": 2, "ddp": false, "microbatches": "auto")"), 4),
                    Catch::Matchers::Contains("\"ddp\" true (2 replicas on 4 ranks)"));
  remove_root();
}
