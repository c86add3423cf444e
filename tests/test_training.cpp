// Multi-process tests: real processes under smprun, Gloo over loopback, ports picked at run time by smprun,
// one intra-op thread per process, every run bounded by `timeout`.

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

using Catch::Matchers::Contains;

namespace {

struct Result {
  int status = -1;
  std::string output;
  double seconds = 0;
};

Result run_command(const std::string& command, int timeout_s) {
  // `timeout -k` also kills what ignores SIGTERM; a test can never hang past its bound.
  const std::string bounded = "OMP_NUM_THREADS=1 timeout -k 5 " + std::to_string(timeout_s) + " " + command + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  Result result;
  FILE* pipe = popen(bounded.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe)) result.output += buffer.data();
  const int raw = pclose(pipe);
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

std::string write_config(const std::string& name, const std::string& json) {
  const std::string path = "/tmp/smp_test_" + std::to_string(getpid()) + "_" + name + ".json";
  std::ofstream(path) << json;
  return path;
}

std::string smp_config(int pp, int dp, int microbatches, const std::string& pipeline, const std::string& placement,
                       int global_batch, double timeout_s = 60) {
  std::ostringstream json;
  json << R"({"partitions": )" << pp << R"(, "microbatches": )" << microbatches << R"(, "pipeline": ")" << pipeline
       << R"(", "ddp": )" << (dp > 1 ? "true" : "false") << R"(, "placement_strategy": ")" << placement
       << R"(", "global_batch_size": )" << global_batch << R"(, "seed": 5, "comm_timeout_s": )" << timeout_s << "}";
  return json.str();
}

std::vector<double> step_losses(const std::string& output) {
  std::vector<double> losses;
  const std::regex line(R"(\[rank 0\] step \d+ loss ([0-9.eE+-]+))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    losses.push_back(std::stod((*it)[1].str()));
  }
  return losses;
}

// Ranks whose every parameter matched single-process training (the worker's closing line).
int count_clean_ranks(const std::string& output) {
  const std::regex line(R"(rank \d+ stage \d+: \d+ parameters checked, 0 mismatches)");
  return static_cast<int>(std::distance(std::sregex_iterator(output.begin(), output.end(), line), std::sregex_iterator()));
}

}  // namespace

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
          const auto result = run_command(std::string(SMPRUN_PATH) + " -n " + std::to_string(c.pp * c.dp) + " -- " +
                                              WORKER_PATH + " --config " + config + " --steps 3 --clip 0.5",
                                          240);
          INFO(result.output);
          CHECK(result.status == 0);
          CHECK(count_clean_ranks(result.output) == c.pp * c.dp);
          CHECK(step_losses(result.output).size() == 3);
        }
      }
    }
  }
}

TEST_CASE("a transformer trains the same through the pipeline (AdamW)", "[training][multiprocess]") {
  const auto config = write_config("gpt", smp_config(4, 2, 4, "interleaved", "cluster", 16));
  const auto result = run_command(std::string(SMPRUN_PATH) + " -n 8 -- " + WORKER_PATH + " --config " + config +
                                      " --model gpt --optimizer adamw --steps 3 --clip 1.0 --rtol 1e-3",
                                  240);
  INFO(result.output);
  CHECK(result.status == 0);
  CHECK(count_clean_ranks(result.output) == 8);
}

TEST_CASE("the 2x4 example's losses depend only on the seed and the global batch", "[training][example]") {
  const auto hybrid = run_command(std::string(SMPRUN_PATH) + " -n 8 -- " + EXAMPLE_PATH + " --config " +
                                      EXAMPLE_CONFIG + " --steps 4",
                                  300);
  INFO(hybrid.output);
  REQUIRE(hybrid.status == 0);
  CHECK(hybrid.output.find("stage 3: modules") != std::string::npos);
  const auto hybrid_losses = step_losses(hybrid.output);
  REQUIRE(hybrid_losses.size() == 4);

  // The same file with one stage, one replica and one microbatch: plain single-process training.
  std::ifstream original(EXAMPLE_CONFIG);
  std::string text((std::istreambuf_iterator<char>(original)), std::istreambuf_iterator<char>());
  text = std::regex_replace(text, std::regex(R"("partitions": \d+)"), R"("partitions": 1)");
  text = std::regex_replace(text, std::regex(R"("microbatches": \d+)"), R"("microbatches": 1)");
  text = std::regex_replace(text, std::regex(R"("ddp": true)"), R"("ddp": false)");
  const auto single_config = write_config("single", text);
  const auto single = run_command(std::string(SMPRUN_PATH) + " -n 1 -- " + EXAMPLE_PATH + " --config " +
                                      single_config + " --steps 4",
                                  300);
  INFO(single.output);
  REQUIRE(single.status == 0);
  const auto single_losses = step_losses(single.output);
  REQUIRE(single_losses.size() == 4);
  for (std::size_t i = 0; i < hybrid_losses.size(); ++i) {
    CHECK(hybrid_losses[i] == Approx(single_losses[i]).epsilon(1e-4));
  }
  CHECK(hybrid_losses.back() < hybrid_losses.front());
}

TEST_CASE("a failing rank stops the whole job with a message", "[training][faults]") {
  const auto config = write_config("fail", smp_config(2, 2, 2, "interleaved", "cluster", 8, 20));
  const auto result = run_command(std::string(SMPRUN_PATH) + " -n 4 -- " + WORKER_PATH + " --config " + config +
                                      " --steps 5 --fail-rank 2 --fail-step 1",
                                  120);
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK(result.status != 124);  // not stopped by the test's own timeout
  CHECK_THAT(result.output, Contains("injected failure on rank 2 at step 1"));
  CHECK_THAT(result.output, Contains("rank 2"));
  CHECK(result.seconds < 60);
}

TEST_CASE("a bad config fails before any communication, naming the key", "[training][config]") {
  const auto config = write_config("bad", R"({"partitions": 3, "microbatches": 2, "global_batch_size": 8})");
  const auto result = run_command(std::string(SMPRUN_PATH) + " -n 4 -- " + WORKER_PATH + " --config " + config, 60);
  INFO(result.output);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Contains("world size 4 is not a multiple of \"partitions\" (3)"));
  CHECK(result.seconds < 30);
}
