// Multi-process tests: real processes under smprun, Gloo over loopback, ports picked at run time by smprun,
// one intra-op thread per process, every run bounded by `timeout`.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <iterator>

#include "multiprocess.h"

using Catch::Matchers::Contains;

using namespace smp_test;

TEST_CASE("pipeline x data parallel training equals single-process training", "[training][multiprocess]") {
  struct Case {
    int pp, dp, microbatches;
  };
  const Case cases[] = {{4, 2, 4}, {2, 1, 8}, {3, 2, 6}};
  for (const auto& c : cases) {
    for (const std::string pipeline : {"simple", "interleaved"}) {
      for (const std::string placement : {"cluster", "spread"}) {
        if (c.dp == 1 && placement == "spread") continue;  // one replica: both placements are the same ranks
        const int global_batch = c.dp * c.microbatches * 2;
        const std::string name = std::to_string(c.pp) + "x" + std::to_string(c.dp) + "_" + pipeline + "_" + placement;
        const auto config = write_config(name, smp_config(c.pp, c.dp, c.microbatches, pipeline, placement, global_batch));
        DYNAMIC_SECTION("pp=" << c.pp << " dp=" << c.dp << " m=" << c.microbatches << " " << pipeline << " " << placement) {
          const auto result = run_command(std::string(paths::smprun) + " -n " + std::to_string(c.pp * c.dp) + " -- " +
                                              training_worker_command() + " --config " + config + " --steps 3 --clip 0.5",
                                          240);
          check_clean_run(result, c.pp * c.dp);
          CHECK(step_losses(result.output).size() == 3);
        }
      }
    }
  }
}

namespace {

// One job compared with single-process training: `model` is a training_worker model, `extra_keys` more config.
struct EquivalenceCase {
  const char* label;
  const char* model;
  int pp, dp, microbatches;
  const char* pipeline;
  const char* extra_keys;
};

void check_equivalence(const EquivalenceCase& c, const std::string& name) {
  const auto config = write_config(name, smp_config(c.pp, c.dp, c.microbatches, c.pipeline, "cluster",
                                                    c.dp * c.microbatches * 2, 60, c.extra_keys));
  const auto result = run_worker(c.pp * c.dp, config, std::string("--model ") + c.model + " --steps 3 --clip 0.5");
  check_clean_run(result, c.pp * c.dp);
}

}  // namespace

TEST_CASE("every schedule trains like single-process training", "[training][multiprocess][schedules]") {
  const EquivalenceCase cases[] = {
      {"zero bubble H1", "mlp", 4, 1, 8, "zero_bubble", ""},
      {"zero bubble H1, m < p", "mlp", 3, 2, 2, "zero_bubble", ""},
      {"zero bubble H2", "mlp", 2, 2, 5, "zero_bubble_h2", ""},
      {"interleaved 1F1B v=2", "mlp", 4, 1, 8, "interleaved", R"(, "virtual_stages": 2)"},
      {"interleaved 1F1B v=3, m not divisible by p", "mlp", 3, 1, 4, "interleaved", R"(, "virtual_stages": 3)"},
      {"interleaved 1F1B v=2 with replicas and a cap", "mlp", 2, 2, 6, "interleaved", R"(, "virtual_stages": 2, "active_microbatches": 2)"},
      {"1F1B, m < p", "mlp", 4, 1, 2, "interleaved", ""},
      {"breadth-first looped v=2 with replicas, m not divisible by p", "mlp", 2, 2, 3, "looped_bfs", R"(, "virtual_stages": 2)"},
      {"one stage", "mlp", 1, 2, 4, "simple", ""},
      {"activation checkpointing, 1F1B", "mlp", 3, 1, 6, "interleaved", R"(, "activation_checkpointing": true)"},
      {"activation checkpointing on some stages, ZB-H1", "mlp", 4, 1, 4, "zero_bubble", R"(, "activation_checkpointing": [0, 3])"},
      // The V schedules: two stages per rank, the last stage (and the loss) back on rank 0.
      {"ZB-V", "mlp", 3, 1, 6, "zb_v", ""},
      {"ZB-V with replicas, m < 2p", "mlp", 2, 2, 2, "zb_v", ""},
      {"DualPipeV", "mlp", 2, 1, 5, "dualpipe_v", ""},
      {"DualPipeV, m < 2p, activation checkpointing", "mlp", 3, 1, 4, "dualpipe_v", R"(, "activation_checkpointing": [1, 4])"},
  };
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.label) { check_equivalence(c, "schedules_" + std::to_string(&c - cases)); }
  }
}

TEST_CASE("graphs with skips across stages, branches and tied weights train like single-process training",
          "[training][multiprocess][graph]") {
  const EquivalenceCase cases[] = {
      {"residual", "residual", 4, 2, 4, "interleaved", ""},
      {"residual", "residual", 4, 1, 4, "zero_bubble", ""},
      {"branch", "branch", 4, 2, 4, "simple", ""},
      {"branch", "branch", 2, 1, 4, "interleaved", R"(, "virtual_stages": 2)"},
      {"tied", "tied", 4, 2, 4, "interleaved", ""},
      {"nested Sequentials expanded for 4 stages", "nested", 4, 1, 4, "interleaved", ""},
      {"nested Sequentials expanded for 8 stages", "nested", 4, 1, 4, "interleaved", R"(, "virtual_stages": 2)"},
      {"tied", "tied", 3, 1, 3, "zero_bubble_h2", R"(, "activation_checkpointing": [0])"},
      // A V puts the first and the last stage on one rank: the tied pair, and skips that go down and back up.
      {"tied", "tied", 2, 1, 4, "zb_v", ""},
      // Its pairs overlapped: skips sent between the rank's own stages are held while the forward runs, the
      // replicas' gradient hooks fire beside it.
      {"residual", "residual", 2, 2, 4, "dualpipe_v", R"(, "overlap_forward_backward": true)"},
      // Single modules checkpointed: under the split backward (I, W) with replicas reducing gradients by hooks, a
      // tied weight, and the children of an expanded Sequential selected by its name.
      {"checkpointed modules", "residual", 2, 2, 4, "zero_bubble", R"(, "activation_checkpointing": ["a", "c", "out"])"},
      {"checkpointed modules", "tied", 3, 1, 3, "interleaved", R"(, "activation_checkpointing": ["first", "tied"])"},
      {"checkpointed modules", "nested", 4, 1, 4, "zero_bubble_h2", R"(, "activation_checkpointing": ["encoder"])"},
      // Pinned by hand: the skip's source and its consumer two stages apart.
      {"residual", "residual", 4, 1, 4, "interleaved", R"(, "auto_partition": false, "default_partition": 3,
          "partition_overrides": {"in": 0, "a": 1, "b": 2})"},
  };
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.label << " pp=" << c.pp << " dp=" << c.dp << " " << c.pipeline << c.extra_keys) {
      check_equivalence(c, "graph_" + std::to_string(&c - cases));
    }
  }
}

TEST_CASE("payloads matched in order, as NCCL matches them, still train like single-process training",
          "[training][multiprocess][graph]") {
  // Interleaved 1F1B on 3 ranks x 2 virtual stages with a skip from stage 1 to stage 3: rank 0 sends rank 1 a
  // gradient before an activation that rank 1 needs first, so rank 1 must take the gradient in early.
  const auto config = write_config(
      "in_order", smp_config(3, 1, 4, "interleaved", "cluster", 8, 60, R"(, "virtual_stages": 2, "auto_partition": false,
          "partition_overrides": {"pre": 0, "in": 1, "a": 2, "b": 2, "c": 3, "join": 3, "d": 4, "out": 5})"));
  const auto result = run_command("env SMP_GLOO_IN_ORDER=1 " + std::string(paths::smprun) + " -n 3 -- " + training_worker_command() +
                                      " --config " + config + " --model long_residual --steps 3",
                                  240);
  check_clean_run(result, 3);
}

TEST_CASE("a stage may write into what it received, as in-place ReLUs do", "[training][multiprocess][graph]") {
  // Stages 1 and 2 begin with an in-place ReLU.
  const std::string pins = R"(, "auto_partition": false, "partition_overrides": {"0": 0, "1": 1, "2": 1, "3": 2, "4": 3})";
  const auto config = write_config("inplace", smp_config(4, 1, 4, "zero_bubble", "cluster", 8, 60, pins));
  check_clean_run(run_worker(4, config, "--model inplace --steps 3"), 4);

  // Checkpointed, such a stage would recompute from the overwritten values: refused, naming it.
  const auto checkpointed = write_config("inplace_checkpointed", smp_config(4, 1, 4, "interleaved", "cluster", 8, 60,
                                                                         pins + R"(, "activation_checkpointing": [1])"));
  const auto refused = run_worker(4, checkpointed, "--model inplace --steps 1");
  CHECK(refused.status != 0);
  CHECK_THAT(refused.output, Contains("stage 1 modifies what it receives from stage 0 in place"));
}

TEST_CASE("impossible partitions are refused naming the modules", "[training][multiprocess][graph]") {
  const auto too_many = write_config("too_many_stages", smp_config(8, 1, 2, "interleaved", "cluster", 4, 30,
                                                                   R"(, "virtual_stages": 2)"));
  auto result = run_worker(8, too_many, "--model residual --steps 1");
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("cannot split 7 modules into 16 pipeline stages"));

  const auto backwards = write_config("pins_backwards", smp_config(2, 1, 2, "interleaved", "cluster", 4, 30,
                                                                   R"(, "partition_overrides": {"in": 1, "out": 0})"));
  result = run_worker(2, backwards, "--model residual --steps 1");
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("module 'out' is pinned to stage 0 but depends on module 'in' pinned to stage 1"));
  // Rank 1 says rank 0's reason, not that it waited for what rank 0 never published.
  CHECK_THAT(result.output, Contains("rank 0 failed: ") && !Contains("in the rendezvous store"));

  const auto unknown = write_config("unknown_module", smp_config(2, 1, 2, "interleaved", "cluster", 4, 30,
                                                                 R"(, "partition_overrides": {"nope": 1})"));
  result = run_worker(2, unknown, "--model residual --steps 1");
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("no module \"nope\" in the model") && Contains("(its modules: in, a, b, c, join, d, out)"));

  // A tie held as a plain member (not registered in the node that reads it) across stages: the copy on the reading
  // rank would never be stepped, training otherwise than one process without a word.
  const auto held = write_config("held_tie", smp_config(2, 1, 2, "1f1b", "cluster", 4, 30));
  result = run_worker(2, held, "--model held_tie --steps 1");
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("computed with 'first.weight', a tensor its node holds on another stage's rank"));

  const auto no_experts = write_config("no_experts", smp_config(1, 2, 2, "interleaved", "cluster", 4, 30,
                                                                R"(, "expert_parallel_degree": 2)"));
  result = run_worker(2, no_experts, "--model residual --steps 1");
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("\"expert_parallel_degree\" 2, but the model holds no experts to divide"));
}

TEST_CASE("a schedule loaded from a CSV file runs", "[training][multiprocess][schedules]") {
  const std::string csv = scratch_path("schedule.csv");
  // The config's name for it ("zero_bubble") is the generator's (zb_h1).
  const auto dumped = run_command(std::string(paths::smp_schedule) + " --schedule zero_bubble --ranks 2 --microbatches 4 --csv " + csv, 30);
  INFO(dumped.output);
  REQUIRE(dumped.status == 0);
  CHECK_THAT(dumped.output, Contains("schedule zb_h1"));
  const auto help = run_command(std::string(paths::smp_schedule) + " --help", 30);
  CHECK(help.status == 0);
  CHECK_THAT(help.output, Contains("zb_h1 (config \"zero_bubble\")"));
  // A V takes its 2 stages per rank untold, as the config's "pipeline": "zb_v" does.
  const auto v = run_command(std::string(paths::smp_schedule) + " --schedule zb_v --ranks 2 --microbatches 4", 30);
  CHECK(v.status == 0);
  CHECK_THAT(v.output, Contains("schedule zb_v"));
  const auto config = write_config("from_csv", smp_config(2, 1, 4, "interleaved", "cluster", 8, 60, R"(, "schedule_file": ")" + csv + "\""));
  const auto result = run_worker(2, config, "--steps 2");
  check_clean_run(result, 2);

  // A schedule for another shape is refused before training, naming the file.
  const auto mismatched = write_config("from_csv_bad", smp_config(2, 1, 2, "interleaved", "cluster", 4, 60, R"(, "schedule_file": ")" + csv + "\""));
  const auto refused = run_worker(2, mismatched, "--steps 1");
  CHECK(refused.status != 0);
  CHECK_THAT(refused.output, Contains(csv) && Contains("the config asks for"));
}

TEST_CASE("the example writes a timeline", "[training][example][timeline]") {
  const std::string dir = scratch_path("trace");
  const auto result = run_command(std::string(paths::smprun) + " -n 8 -- " + paths::example + " --config " +
                                      paths::example_config + " --steps 2 --trace " + dir,
                                  300);
  INFO(result.output);
  REQUIRE(result.status == 0);
  CHECK_THAT(result.output, Contains("timeline of step 1: bubble") && Contains("simulated"));
  std::ifstream trace(dir + "/step1_trace.json");
  REQUIRE(trace.good());
  std::string text((std::istreambuf_iterator<char>(trace)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Contains("\"traceEvents\"") && Contains("\"name\":\"F0\"") && Contains("\"name\":\"B3\""));
  std::ifstream svg(dir + "/step1_pipeline.svg");
  REQUIRE(svg.good());
  std::string picture((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  CHECK_THAT(picture, Contains("<svg") && Contains("replica 1 stage-rank 3"));
}

TEST_CASE("a transformer trains the same through the pipeline (AdamW)", "[training][multiprocess]") {
  const auto config = write_config("gpt", smp_config(4, 2, 4, "interleaved", "cluster", 16));
  const auto result = run_worker(8, config, "--model gpt --optimizer adamw --steps 3 --clip 1.0 --rtol 1e-3");
  check_clean_run(result, 8);
}

TEST_CASE("bf16 and fp16 training match float32 within tolerance", "[training][multiprocess][precision]") {
  for (const std::string precision : {"bf16", "fp16"}) {
    DYNAMIC_SECTION(precision) {
      const auto config = write_config("precision_" + precision, smp_config(2, 2, 2, "interleaved", "cluster", 8, 60,
                                                                          ", \"" + precision + "\": true"));
      const auto result = run_worker(4, config, "--model gpt --steps 3 --rtol 0.02");
      check_clean_run(result, 4);
    }
  }
}

TEST_CASE("fp16 with a pipeline rank that holds no gradient", "[training][multiprocess][precision]") {
  // Stage 0 is the frozen layer and a Tanh: its rank has nothing to unscale (multi-tensor ops refuse empty lists).
  const auto config = write_config(
      "fp16_no_gradients", smp_config(2, 1, 2, "interleaved", "cluster", 8, 60, R"(, "fp16": true,
          "auto_partition": false, "partition_overrides": {"0": 0, "1": 0, "2": 1, "3": 1, "4": 1, "5": 1, "6": 1})"));
  check_clean_run(run_worker(2, config, "--model frozen --steps 3 --rtol 0.02"), 2);
}

TEST_CASE("gradients accumulate over train_steps as in plain training", "[training][multiprocess]") {
  // Two train_steps on a batch's halves before the optimizer step: what a step does to its gradients (the replicas'
  // mean, a tied weight's sum over its holders, the fp16 unscale) must touch that step's gradients alone. A first
  // half whose gradients are not finite drops the whole step, as GradScaler skips it: the second half's gradients
  // alone must not move the weights.
  const EquivalenceCase cases[] = {
      {"tied weights with replicas, a non-finite first half", "tied", 3, 2, 2, "interleaved",
       R"(, "nonfinite": "skip")"},
      {"fp16", "gpt", 2, 1, 2, "zero_bubble", R"(, "fp16": true)"},
  };
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.label) {
      const auto config = write_config("accumulate_" + std::to_string(&c - cases),
                                       smp_config(c.pp, c.dp, c.microbatches, c.pipeline, "cluster",
                                                  c.dp * c.microbatches * 2, 60, c.extra_keys));
      const auto result = run_worker(c.pp * c.dp, config,
                                     std::string("--model ") + c.model + " --accumulate 1 --steps 3 --clip 0.5" +
                                         (std::string(c.model) == "gpt" ? " --rtol 0.02" : " --nan-step 1"));
      check_clean_run(result, c.pp * c.dp);
    }
  }
}

TEST_CASE("frozen and unused parameters keep their values under replicas and weight decay",
          "[training][multiprocess]") {
  const auto config = write_config("frozen", smp_config(2, 2, 2, "interleaved", "cluster", 8));
  check_clean_run(run_worker(4, config, "--model frozen --optimizer adamw --steps 3 --rtol 1e-3"), 4);
}

TEST_CASE("sharded optimizer state trains like single-process training", "[training][multiprocess][zero]") {
  // Each replica keeps state for, and updates, only its share of the parameters, then they exchange the updates:
  // the parameters must still equal plain training with momentum and Adam state, clipping, tied weights, frozen
  // parameters, fp16 and replica counts that do not divide the parameters evenly. The worker checks that the
  // replicas' optimizers hold every trainable parameter exactly once between them.
  struct Case {
    const char* label;
    int pp, dp;
    const char* flags;
    const char* extra_keys;
  };
  const Case cases[] = {
      {"SGD with momentum", 2, 2, "--model mlp --clip 0.5", ""},
      {"AdamW on a transformer", 2, 2, "--model gpt --optimizer adamw --clip 1.0 --rtol 1e-3", ""},
      {"three replicas", 1, 3, "--model mlp --optimizer adamw --rtol 1e-3", ""},
      {"tied weights", 3, 2, "--model tied --clip 0.5", ""},
      {"frozen and unused parameters", 2, 2, "--model frozen --optimizer adamw --rtol 1e-3", ""},
      {"fp16 with an overflowed step", 2, 2, "--model gpt --spike-step 1 --rtol 0.02", R"(, "fp16": true)"},
      {"bf16", 2, 2, "--model gpt --rtol 0.02", R"(, "bf16": true)"},
      {"virtual stages", 2, 2, "--model gpt --optimizer adamw --rtol 1e-3", R"(, "virtual_stages": 2)"},
      {"gradient accumulation", 2, 2, "--model tied --accumulate 1 --clip 0.5", ""},
      {"a dropped non-finite step", 2, 2, "--model mlp --nan-step 1", R"(, "nonfinite": "skip")"},
  };
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.label) {
      const int microbatches = 2;
      const auto config = write_config("zero_" + std::to_string(&c - cases),
                                       smp_config(c.pp, c.dp, microbatches, "interleaved", "cluster",
                                                  c.dp * microbatches * 2, 60,
                                                  std::string(R"(, "shard_optimizer_state": true)") + c.extra_keys));
      const auto result = run_worker(c.pp * c.dp, config, std::string(c.flags) + " --steps 3");
      check_clean_run(result, c.pp * c.dp);
      CHECK_THAT(result.output, Contains("optimizer holds"));
    }
  }
}

TEST_CASE("fp16 overflow skips the step and lowers the loss scale", "[training][multiprocess][precision]") {
  const auto config = write_config("fp16_overflow", smp_config(2, 1, 2, "interleaved", "cluster", 4, 60, R"(, "fp16": true)"));
  const auto result = run_worker(2, config, "--model gpt --steps 3 --spike-step 1 --rtol 0.02");
  INFO(result.output);
  CHECK(result.status == 0);
  CHECK_THAT(result.output, Contains("step 1: fp16 gradients overflowed; skipping the step, loss scale now 32768"));
  CHECK_THAT(result.output, Contains("step 1 skipped"));
  CHECK(count_clean_ranks(result.output) == 2);
}

TEST_CASE("sequence lengths may change from step to step", "[training][multiprocess]") {
  const auto config = write_config("vary_length", smp_config(4, 1, 2, "zero_bubble", "cluster", 4));
  const auto result = run_worker(4, config, "--model gpt --optimizer adamw --steps 4 --vary-length 1 --rtol 1e-3");
  check_clean_run(result, 4);
}

TEST_CASE("the 2x4 example's losses depend only on the seed and the global batch", "[training][example]") {
  const auto hybrid = run_command(std::string(paths::smprun) + " -n 8 -- " + paths::example + " --config " +
                                      paths::example_config + " --steps 4",
                                  300);
  INFO(hybrid.output);
  REQUIRE(hybrid.status == 0);
  CHECK(hybrid.output.find("stage 3: modules") != std::string::npos);
  const auto hybrid_losses = step_losses(hybrid.output);
  REQUIRE(hybrid_losses.size() == 4);

  // The same file with one stage, one replica and one microbatch: plain single-process training.
  std::ifstream original(paths::example_config);
  std::string text((std::istreambuf_iterator<char>(original)), std::istreambuf_iterator<char>());
  text = std::regex_replace(text, std::regex(R"("partitions": \d+)"), R"("partitions": 1)");
  text = std::regex_replace(text, std::regex(R"("microbatches": \d+)"), R"("microbatches": 1)");
  text = std::regex_replace(text, std::regex(R"("ddp": true)"), R"("ddp": false)");
  const auto single_config = write_config("single", text);
  const auto single = run_command(std::string(paths::smprun) + " -n 1 -- " + paths::example + " --config " +
                                      single_config + " --steps 4",
                                  300);
  INFO(single.output);
  REQUIRE(single.status == 0);
  const auto single_losses = step_losses(single.output);
  REQUIRE(single_losses.size() == 4);
  // The closing validation (evaluate: forwards alone) agrees as well.
  const std::regex validation(R"(\[rank 0\] validation loss ([0-9.eE+-]+))");
  std::smatch hybrid_validation, single_validation;
  REQUIRE(std::regex_search(hybrid.output, hybrid_validation, validation));
  REQUIRE(std::regex_search(single.output, single_validation, validation));
  CHECK(std::stod(hybrid_validation[1].str()) == Approx(std::stod(single_validation[1].str())).epsilon(1e-4));
  // And its accuracy, counted from the outputs that come back on the last stages' ranks (one guess that flips
  // between near-equal logits moves it by 1 / 4096).
  const std::regex accuracy(R"(\[rank 0\] validation next-byte accuracy ([0-9.eE+-]+))");
  std::smatch hybrid_accuracy, single_accuracy;
  REQUIRE(std::regex_search(hybrid.output, hybrid_accuracy, accuracy));
  REQUIRE(std::regex_search(single.output, single_accuracy, accuracy));
  CHECK(std::stod(hybrid_accuracy[1].str()) == Approx(std::stod(single_accuracy[1].str())).margin(2e-3));
  CHECK(std::stod(single_accuracy[1].str()) > 0.0);
  for (std::size_t i = 0; i < hybrid_losses.size(); ++i) {
    CHECK(hybrid_losses[i] == Approx(single_losses[i]).epsilon(1e-4));
  }
  CHECK(hybrid_losses.back() < hybrid_losses.front());
}

TEST_CASE("a failing rank stops the whole job with a message", "[training][faults]") {
  const auto config = write_config("fail", smp_config(2, 2, 2, "interleaved", "cluster", 8, 20));
  const auto result = run_worker(4, config, "--steps 5 --fail-rank 2 --fail-step 1");
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK(result.status != 124);  // not stopped by the test's own timeout
  CHECK_THAT(result.output, Contains("injected failure on rank 2 at step 1"));
  CHECK_THAT(result.output, Contains("rank 2"));
  CHECK(result.seconds < 60);
}

TEST_CASE("a rank whose rank 0 never comes says so in one line, without LibTorch's C++ frames",
          "[training][config]") {
  // A port nobody listens on: bound, read, closed.
  const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(probe, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  ::close(probe);
  const auto config = write_config("alone", smp_config(2, 1, 2, "1f1b", "cluster", 4, 1));
  const auto result = run_command("env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                      std::to_string(ntohs(address.sin_port)) + " " + training_worker_command() +
                                      " --config " + config,
                                  60);
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("rendezvous at 127.0.0.1:") && Contains("rank 0 hosts the job's store") &&
                                Contains("launched by RANK and WORLD_SIZE"));
  CHECK_THAT(result.output, !Contains("frame #"));
}

TEST_CASE("a bad config fails before any communication, naming the key", "[training][config]") {
  const auto config = write_config("bad", R"({"partitions": 3, "microbatches": 2, "global_batch_size": 8})");
  const auto result = run_command(std::string(paths::smprun) + " -n 4 -- " + training_worker_command() + " --config " + config, 60);
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("world size 4 is not a multiple of \"partitions\" (3)"));
  CHECK(result.seconds < 30);
}

TEST_CASE("auto layout keys: rank 0 plans, every rank adopts the layout and trains like one process",
          "[training][multiprocess][plan]") {
  const std::string traces = scratch_path("planned_traces");
  std::filesystem::remove_all(traces);
  const auto planned = write_config("planned", R"({"partitions": "auto", "microbatches": "auto", "pipeline": "auto",
      "ddp": "auto", "global_batch_size": 16, "seed": 5, "device": "cpu", "trace_dir": ")" + traces + R"("})");
  const auto result = run_worker(4, planned, "--model mlp --steps 5");
  check_clean_run(result, 4);
  CHECK_THAT(result.output, Contains("planned layout pp "));
  CHECK_THAT(result.output, Contains("layout chosen: "));
  // Two sizes tell a stage call's fixed cost from its cost per sample (the worker's sample: 4 samples).
  CHECK_THAT(result.output, Contains("(the model profiled on 4 and 8 samples a call)"));
  // The report ranks what the job can adopt: layouts the config's fixed keys exclude are counted per key.
  const std::string excluded = "excluded by the keys the config fixes (layouts that set them otherwise):";
  const auto excluded_at = result.output.find(excluded);
  REQUIRE(excluded_at != std::string::npos);
  const std::string excluded_line =
      result.output.substr(excluded_at, result.output.find('\n', excluded_at) - excluded_at);
  CHECK_THAT(excluded_line, Contains(" activation_checkpointing "));  // the config leaves it false
  CHECK_THAT(result.output, Contains("train_step measured "));  // after step 5, beside the prediction
  CHECK_THAT(result.output, Contains("ms predicted for the optimizer's step)"));  // AdamW timed on rank 0
  // The chosen layout's simulated step, drawn where the job's traces go.
  std::ifstream svg(traces + "/planned_layout.svg");
  REQUIRE(svg);
  const std::string drawn((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  CHECK_THAT(drawn, Catch::Matchers::StartsWith("<svg") && Contains("planned: pp "));

  // Rank 0's failure to plan ends the job, its first line naming why (the other ranks, waiting for the choice, say
  // "rank 0 failed: ..." unless the launcher stopped them first): no layout fits this memory limit.
  const auto tight = write_config("tight", R"({"partitions": "auto", "global_batch_size": 16, "memory_limit_mb": 0.001,
      "seed": 5, "device": "cpu", "comm_timeout_s": 30})");
  const auto refused = run_worker(2, tight, "--model mlp");
  INFO(refused.output);
  CHECK(refused.status != 0);
  CHECK_THAT(refused.output, Contains("error: "));
  CHECK_THAT(refused.output, Contains("no planned layout of 2 ranks fits and keeps the layout keys the config gives ("));
  CHECK_THAT(refused.output, Contains("considered; pp "));
  CHECK_THAT(refused.output, Contains("memory limit"));

  // Tensor parallelism planned for a model given as its builder (the worker's): one stage and no replicas on 2 ranks
  // leave tp 2, which the GPT, built over the chosen group, trains like one process; a model without smp::tp
  // layers is planned without it, saying why.
  const auto tensor_parallel = write_config("tp_auto", R"({"tensor_parallel_degree": "auto", "microbatches": "auto",
      "partitions": 1, "ddp": false, "global_batch_size": 8, "seed": 5, "device": "cpu"})");
  const auto tp_planned = run_worker(2, tensor_parallel, "--model gpt --steps 3");
  check_clean_run(tp_planned, 2);
  CHECK_THAT(tp_planned.output, Contains("planned layout tp 2 x pp 1 x dp 1, "));
  const auto without_layers = write_config("tp_auto_mlp", R"({"tensor_parallel_degree": "auto", "ddp": "auto",
      "global_batch_size": 8, "seed": 5, "device": "cpu"})");
  const auto replicas = run_worker(2, without_layers, "--model mlp --steps 2");
  check_clean_run(replicas, 2);
  CHECK_THAT(replicas.output, Contains("tp 2: not planned: the model built for it runs no tensor-parallel collectives"));
  CHECK_THAT(replicas.output, Contains("planned layout pp 1 x dp 2, "));
}

TEST_CASE("devices that differ: a measured slow rank gets a shorter stage, and the job trains like one process",
          "[training][multiprocess][plan]") {
  // Rank 1 emulates a device 6 times slower; the ranks measure their speeds at start-up. (3 times slower measured
  // equal on a loaded host, every one of rank 0's timed rounds sharing its core with other tests' processes.)
  const auto config = write_config("slow_rank", R"({"partitions": 2, "microbatches": 4, "global_batch_size": 16,
      "memory_weight": 0, "device_speeds": "measure", "emulated_slowdown": [1, 6], "seed": 5, "device": "cpu"})");
  const auto result = run_worker(2, config, "--model gpt --steps 2 --rtol 0.02");
  check_clean_run(result, 2);
  CHECK_THAT(result.output, Contains("device speeds measured, by rank: 1.000, 0."));
  CHECK_THAT(result.output, Contains("on a device of speed 0."));
  const auto modules_on = [&](int stage) {
    const std::string marker = "stage " + std::to_string(stage) + ": modules ";
    const auto at = result.output.find(marker);
    REQUIRE(at != std::string::npos);
    const auto open = result.output.find(" (", at + marker.size());
    return std::stoi(result.output.substr(open + 2));
  };
  CHECK(modules_on(0) > modules_on(1));

  // With "auto" layout keys the planner predicts on the measured speeds (measured once, for it and the cut): two
  // replicas would wait for the slow one, a pipeline gives it the shorter stage. 5 times slower here: at 3 the
  // small GPT's two replicas and its pipeline were predicted within 10% of each other (2.4 and 2.6 ms), and the
  // speeds' noise chose either.
  const auto planned = write_config("slow_rank_auto", R"({"partitions": "auto", "microbatches": "auto",
      "pipeline": "auto", "ddp": "auto", "global_batch_size": 16, "memory_weight": 0, "device_speeds": "measure",
      "emulated_slowdown": [1, 5], "seed": 5, "device": "cpu"})");
  const auto adopted = run_worker(2, planned, "--model gpt --steps 2 --rtol 0.02");
  check_clean_run(adopted, 2);
  CHECK_THAT(adopted.output, Contains("planned layout pp 2 x dp 1"));
  const auto first = adopted.output.find("device speeds measured");
  REQUIRE(first != std::string::npos);
  CHECK(adopted.output.find("device speeds measured", first + 1) == std::string::npos);
}
