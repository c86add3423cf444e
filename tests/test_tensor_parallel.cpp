// Tensor parallelism: the layers of smp::tp on groups of 2 and 4 ranks, and the example GPT's stages under
// tp x pp x dp, train like the whole model in one process; configs that cannot work are refused, naming the key.

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>

#include "multiprocess.h"

using namespace smp_test;

namespace {
int count_clean(const std::string& output) {
  const std::regex line(R"(rank \d+: \d+ tensors checked, 0 mismatches)");
  return static_cast<int>(std::distance(std::sregex_iterator(output.begin(), output.end(), line), std::sregex_iterator()));
}
}  // namespace

TEST_CASE("tensor-parallel layers train like the whole model in one process", "[tp][multiprocess]") {
  for (int tp : {2, 4}) {
    DYNAMIC_SECTION("tensor_parallel_degree " << tp) {
      const auto config = write_config("tp" + std::to_string(tp),
                                       R"({"tensor_parallel_degree": )" + std::to_string(tp) + R"(, "device": "cpu", "seed": 5})");
      const auto result = run_command(std::string(paths::smprun) + " -n " + std::to_string(tp) + " -- " + paths::tp_worker +
                                          " --config " + config + " --steps 3",
                                      180);
      INFO(result.output);
      CHECK(result.status == 0);
      CHECK(count_clean(result.output) == tp);
    }
  }
}

TEST_CASE("tensor-parallel configs that cannot work are refused, naming the key", "[tp][multiprocess]") {
  // Three processes cannot hold 2 shards x 1 stage x whole replicas: refused before the rendezvous.
  const auto odd = write_config("tp_odd", R"({"tensor_parallel_degree": 2, "device": "cpu", "ddp": true})");
  auto result = run_command(std::string(paths::smprun) + " -n 3 -- " + paths::tp_worker + " --config " + odd, 60);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Catch::Contains("world size 3 is not a multiple of \"partitions\" x \"tensor_parallel_degree\" (1 x 2)"));
  // The GPT's two heads cannot be split four ways: the model's key is named.
  const auto four = write_config("tp_four", smp_config(1, 1, 2, "interleaved", "cluster", 4, 60, R"(, "tensor_parallel_degree": 4)"));
  result = run_command(std::string(paths::smprun) + " -n 4 -- " + training_worker_command() + " --config " + four + " --model gpt --steps 1", 60);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Catch::Contains("model.heads 2 does not divide by \"tensor_parallel_degree\" 4"));
  // A layer whose size does not divide names itself: heads 4 on 3 ranks.
  const auto three = write_config("tp_three", R"({"tensor_parallel_degree": 3, "device": "cpu"})");
  result = run_command(std::string(paths::smprun) + " -n 3 -- " + paths::tp_worker + " --config " + three, 60);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Catch::Contains("does not divide by \"tensor_parallel_degree\" 3"));
}

TEST_CASE("the GPT's stages under tp x pp x dp train like single-process training", "[tp][multiprocess]") {
  struct Case {
    int pp, dp;
    std::string pipeline, placement, extra;
  };
  const Case cases[] = {{2, 2, "interleaved", "cluster", ""},
                        {2, 1, "interleaved", "cluster", R"(, "bf16": true)"},
                        {2, 1, "zero_bubble", "cluster", ""},
                        {1, 2, "interleaved", "cluster", R"(, "shard_optimizer_state": true)"},
                        {2, 2, "interleaved", "TPD", ""},
                        // Sequence parallelism: the blocks' activations and norms on slices of the sequence.
                        {2, 2, "interleaved", "cluster", R"(, "sequence_parallel": true)"},
                        {2, 1, "zero_bubble", "cluster", R"(, "sequence_parallel": true)"}};
  for (const auto& c : cases) {
    const int world = 2 * c.pp * c.dp;
    DYNAMIC_SECTION("tp 2 x pp " << c.pp << " x dp " << c.dp << " " << c.pipeline << " " << c.placement << c.extra) {
      const auto config = write_config("tp_gpt", smp_config(c.pp, c.dp, 4, c.pipeline, c.placement, 8 * c.dp, 60,
                                                            R"(, "tensor_parallel_degree": 2)" + c.extra));
      // bf16 against float32 within the tolerance of the pipeline's own bf16 test, with its optimizer (SGD: AdamW's
      // first steps move every weight by about the learning rate whatever the gradient's size, so bf16's rounding
      // of near-zero gradients flips whole steps).
      const bool bf16 = c.extra.find("bf16") != std::string::npos;
      const auto result = run_worker(world, config, bf16 ? "--model gpt --steps 3 --clip 0.5 --rtol 0.02"
                                                         : "--model gpt --optimizer adamw --steps 3 --clip 0.5");
      check_clean_run(result, world);
      CHECK(step_losses(result.output).size() == 3);
    }
  }
}

TEST_CASE("the 2x4 example under tp 2 x pp 2 x dp 2 gives one process's losses", "[tp][example]") {
  std::ifstream original(paths::example_config);
  const std::string text((std::istreambuf_iterator<char>(original)), std::istreambuf_iterator<char>());
  const auto run = [&](const std::string& name, const std::string& config_text, int processes,
                       const std::string& flags = "") {
    const auto result = run_command(std::string(paths::smprun) + " -n " + std::to_string(processes) + " -- " + paths::example +
                                        " --config " + write_config(name, config_text) + " --steps 3" + flags,
                                    300);
    INFO(result.output);
    REQUIRE(result.status == 0);
    return result.output;
  };
  const std::string traces = scratch_path("tp_traces");
  const std::string sharded = run(
      "example_tp", std::regex_replace(text, std::regex(R"("partitions": \d+)"), R"("partitions": 2, "tensor_parallel_degree": 2)"), 8,
      " --trace " + traces);
  CHECK_THAT(sharded, Catch::Contains("x 2 tensor-parallel shards"));
  // The traced step's timeline shows every rank, shards apart, and the tensor-parallel collectives in the compute.
  std::ifstream trace_file(traces + "/step1_trace.json"), picture_file(traces + "/step1_pipeline.svg");
  const std::string trace((std::istreambuf_iterator<char>(trace_file)), std::istreambuf_iterator<char>());
  const std::string picture((std::istreambuf_iterator<char>(picture_file)), std::istreambuf_iterator<char>());
  CHECK_THAT(trace, Catch::Contains(R"("cat":"tensor parallel")") && Catch::Contains("TP_ALL_REDUCE") &&
                        Catch::Contains("(pp 1, tp 1)"));
  CHECK_THAT(picture, Catch::Contains("stage-rank 1 tp 1") && Catch::Contains("tensor-parallel collectives"));
  std::string single_text = std::regex_replace(text, std::regex(R"("partitions": \d+)"), R"("partitions": 1)");
  single_text = std::regex_replace(single_text, std::regex(R"("microbatches": \d+)"), R"("microbatches": 1)");
  single_text = std::regex_replace(single_text, std::regex(R"("ddp": true)"), R"("ddp": false)");
  const std::string single = run("example_single", single_text, 1);
  const auto sharded_losses = step_losses(sharded), single_losses = step_losses(single);
  REQUIRE(sharded_losses.size() == 3);
  REQUIRE(single_losses.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(sharded_losses[i] == Approx(single_losses[i]).epsilon(1e-5));
  const std::regex accuracy(R"(\[rank 0\] validation next-byte accuracy ([0-9.eE+-]+))");
  std::smatch sharded_accuracy, single_accuracy;
  REQUIRE(std::regex_search(sharded, sharded_accuracy, accuracy));
  REQUIRE(std::regex_search(single, single_accuracy, accuracy));
  CHECK(std::stod(sharded_accuracy[1].str()) == Approx(std::stod(single_accuracy[1].str())).margin(2e-3));
}

TEST_CASE("a killed rank of a tensor-parallel group fails the job, naming it", "[tp][multiprocess][faults]") {
  const auto config = write_config("tp_killed", smp_config(2, 1, 4, "interleaved", "cluster", 8, 20,
                                                           R"(, "tensor_parallel_degree": 2)"));
  const auto killed = run_worker(4, config, "--model gpt --steps 6 --kill-rank 1 --kill-step 3");
  INFO(killed.output);
  CHECK(killed.status != 0);
  CHECK(killed.status != 124);
  CHECK_THAT(killed.output, Catch::Contains("rank 1 was killed by signal SIGKILL"));
  CHECK(killed.seconds < 30);
}

TEST_CASE("tensor-parallel checkpoints resume, export whole and load into another degree", "[tp][multiprocess][checkpoint]") {
  const std::string dir = scratch_path("tp_checkpoint");
  REQUIRE(run_command("rm -rf " + dir, 30).status == 0);
  const std::string keys = R"(, "tensor_parallel_degree": 2, "checkpoint_dir": ")" + dir + R"(", "checkpoint_interval": 1)";
  const std::string flags = "--model gpt --optimizer adamw --clip 0.5";
  const auto saved = run_worker(4, write_config("tp_saved", smp_config(2, 1, 4, "interleaved", "cluster", 8, 60, keys)),
                                flags + " --steps 3");
  check_clean_run(saved, 4);
  // Each shard of each pipeline rank wrote its own file.
  for (const char* file : {"partition-0000-tp00.pt", "partition-0000-tp01.pt", "partition-0001-tp00.pt", "partition-0001-tp01.pt"}) {
    CHECK(std::filesystem::exists(dir + "/step-00000002/" + file));
  }

  // Resumed by a job of the same shape, it trains on as single-process training does.
  const auto resumed = run_worker(4, write_config("tp_resumed", smp_config(2, 1, 4, "interleaved", "cluster", 8, 60,
                                                                           keys + R"(, "resume": true)")),
                                  flags + " --steps 5");
  check_clean_run(resumed, 4);
  CHECK_THAT(resumed.output, Catch::Contains("resumed from " + dir + "/step-00000002"));
  CHECK(step_losses(resumed.output).size() == 2);

  // Exported whole (the shards put together), it is the one-process model after step 4, and loads into another
  // tensor-parallel degree (each rank cutting its shards) as into one process.
  const std::string whole = dir + "/whole.pt";
  const auto exported = run_command(std::string(paths::smp_checkpoint) + " export " + dir + "/step-00000004 " + whole, 60);
  INFO(exported.output);
  REQUIRE(exported.status == 0);
  const std::string load = flags + " --steps 0 --load-full " + whole + " --expect-step 4";
  check_clean_run(run_worker(1, write_config("tp_whole_one", smp_config(1, 1, 4, "interleaved", "cluster", 8, 60)), load), 1);
  check_clean_run(run_worker(2, write_config("tp_whole_tp2", smp_config(1, 1, 4, "interleaved", "cluster", 8, 60,
                                                                        R"(, "tensor_parallel_degree": 2)")),
                             load),
                  2);

  // Resuming under another degree is refused, naming both and the way there.
  const auto other = run_worker(2, write_config("tp_resume_other", smp_config(2, 1, 4, "interleaved", "cluster", 8, 60,
                                                                             R"(, "checkpoint_dir": ")" + dir +
                                                                                 R"(", "resume": true)")),
                                flags + " --steps 6");
  CHECK(other.status != 0);
  CHECK_THAT(other.output, Catch::Contains("written with \"tensor_parallel_degree\" 2, this job has 1"));
}
