// Tensor parallelism: the layers of smp::tp on groups of 2 and 4 ranks train like the whole model in one process,
// and configs that cannot work are refused before any communication.

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
      const auto result = run_command(std::string(SMPRUN_PATH) + " -n " + std::to_string(tp) + " -- " + TP_WORKER_PATH +
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
  auto result = run_command(std::string(SMPRUN_PATH) + " -n 3 -- " + TP_WORKER_PATH + " --config " + odd, 60);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Catch::Contains("world size 3 is not a multiple of \"partitions\" x \"tensor_parallel_degree\" (1 x 2)"));
  // DistributedModel does not run tensor-parallel stages yet, and says so rather than training replicas.
  const auto staged = write_config("tp_staged", R"({"tensor_parallel_degree": 2, "partitions": 1, "microbatches": 2, "device": "cpu"})");
  result = run_command(std::string(SMPRUN_PATH) + " -n 2 -- " + WORKER_PATH + " --config " + staged + " --steps 1", 60);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Catch::Contains("DistributedModel does not run tensor-parallel stages yet"));
  // A layer whose size does not divide names itself: heads 4 on 3 ranks.
  const auto three = write_config("tp_three", R"({"tensor_parallel_degree": 3, "device": "cpu"})");
  result = run_command(std::string(SMPRUN_PATH) + " -n 3 -- " + TP_WORKER_PATH + " --config " + three, 60);
  CHECK(result.status != 0);
  CHECK_THAT(result.output, Catch::Contains("does not divide by \"tensor_parallel_degree\" 3"));
}
