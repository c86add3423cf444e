#include <catch2/catch.hpp>

#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "smp/config.h"
#include "smp/topology.h"
#include "test_paths.h"

using smp::Config;
using smp::ConfigError;
using Catch::Matchers::Contains;

namespace {
Config parse(const std::string& text) { return Config::from_json_text(text, "job.json"); }
}  // namespace

TEST_CASE("config: defaults and SMP keys", "[config]") {
  const Config defaults = parse("{}");
  CHECK(defaults.partitions == 1);
  CHECK(defaults.microbatches == 1);
  CHECK(defaults.pipeline == "interleaved");
  CHECK_FALSE(defaults.ddp);
  CHECK_FALSE(defaults.shard_optimizer_state);
  CHECK(defaults.memory_weight == 0.2);
  CHECK(parse(R"({"optimize": "memory"})").memory_weight == 0.8);

  const Config config = parse(R"({"partitions": 4, "microbatches": 8, "pipeline": "simple", "ddp": true,
      "placement_strategy": "spread", "auto_partition": false, "default_partition": 2,
      "optimize": "memory", "memory_weight": 0.5, "seed": 7, "global_batch_size": 64, "comm_timeout_s": 12.5,
      "partition_overrides": {"block3": 1}})");
  CHECK(config.partitions == 4);
  CHECK(config.microbatches == 8);
  CHECK(config.pipeline == "simple");
  CHECK(config.ddp);
  CHECK(config.placement_strategy == "spread");
  CHECK_FALSE(config.auto_partition);
  CHECK(config.default_partition == 2);
  CHECK(config.optimize == "memory");
  CHECK(config.memory_weight == 0.5);
  CHECK(config.seed == 7);
  CHECK(config.global_batch_size == 64);
  CHECK(config.comm_timeout_s == 12.5);
  CHECK(config.partition_overrides.at("block3") == 1);

  CHECK(parse(R"({"pipeline_parallel_degree": 3})").partitions == 3);
  CHECK(parse(R"({"ddp": true, "shard_optimizer_state": true})").shard_optimizer_state);
}

TEST_CASE("config: device and backend", "[config]") {
  const Config defaults = parse("{}");
  CHECK(defaults.device == "auto");
  CHECK(defaults.backend == "auto");
  const Config gpu = parse(R"({"device": "cuda", "backend": "nccl"})");
  CHECK(gpu.device == "cuda");
  CHECK(gpu.backend == "nccl");
  CHECK(parse(R"({"device": "cuda", "ddp_dist_backend": "gloo"})").backend == "gloo");
  CHECK_THROWS_WITH(parse(R"({"device": "gpu"})"), Contains("key \"device\": expected one of \"auto\", \"cpu\", \"cuda\""));
  CHECK_THROWS_WITH(parse(R"({"backend": "mpi"})"), Contains("key \"backend\""));
  CHECK_THROWS_WITH(parse(R"({"device": "cpu", "backend": "nccl"})"), Contains("key \"backend\": \"nccl\" moves GPU tensors only"));
  CHECK_THROWS_WITH(parse(R"({"backend": "gloo", "ddp_dist_backend": "gloo"})"), Contains("give only one of them"));
}

TEST_CASE("config: log_level takes Python's names too", "[config]") {
  CHECK(parse(R"({"log_level": "warning"})").log_level == "warn");
  CHECK(parse(R"({"log_level": "critical"})").log_level == "error");
  CHECK(parse(R"({"log_level": "debug"})").log_level == "debug");
  CHECK_THROWS_WITH(parse(R"({"log_level": "loud"})"), Contains("log_level"));
}

TEST_CASE("config: schedules, virtual stages, checkpointing, trace", "[config]") {
  CHECK(parse("{}").schedule_name() == "1f1b");
  CHECK(parse(R"({"pipeline": "dualpipe_v", "overlap_forward_backward": true})").overlap_forward_backward);
  CHECK_THROWS_WITH(parse(R"({"overlap_forward_backward": true, "activation_checkpointing": [0]})"),
                    Contains("key \"overlap_forward_backward\"") && Contains("activation_checkpointing"));
  CHECK(parse(R"({"pipeline": "simple"})").schedule_name() == "gpipe");
  CHECK(parse(R"({"pipeline": "zero_bubble"})").schedule_name() == "zb_h1");
  CHECK(parse(R"({"pipeline": "zero_bubble_h2"})").schedule_name() == "zb_h2");
  // The generators' own names too; a V runs two stages per rank whether virtual_stages says so or not.
  CHECK(parse(R"({"pipeline": "1f1b"})").schedule_name() == "1f1b");
  for (const char* v : {"zb_v", "dualpipe_v"}) {
    const Config shaped = parse(std::string(R"({"partitions": 3, "pipeline": ")") + v + "\"}");
    CHECK(shaped.schedule_name() == v);
    CHECK(shaped.virtual_stages == 2);
    CHECK(shaped.num_stages() == 6);
    CHECK(shaped.splits_backward());
    CHECK(parse(std::string(R"({"pipeline": ")") + v + R"(", "virtual_stages": 2})").num_stages() == 2);
    CHECK_THROWS_WITH(parse(std::string(R"({"pipeline": ")") + v + R"(", "virtual_stages": 3})"),
                      Contains("key \"virtual_stages\": must be 2"));
    CHECK_THROWS_WITH(parse(std::string(R"({"pipeline": ")") + v + R"(", "active_microbatches": 2})"),
                      Contains("key \"active_microbatches\": has no effect"));
  }
  // Breadth-first looped takes any number of stages per rank, as interleaved 1F1B does.
  CHECK(parse(R"({"partitions": 2, "pipeline": "looped_bfs", "virtual_stages": 3})").schedule_name() == "looped_bfs");
  CHECK(parse(R"({"partitions": 2, "pipeline": "looped_bfs", "virtual_stages": 3})").num_stages() == 6);
  CHECK(parse(R"({"pipeline": "looped_bfs"})").virtual_stages == 1);
  CHECK_THROWS_WITH(parse(R"({"pipeline": "looped_bfs", "virtual_stages": 2, "active_microbatches": 4})"),
                    Contains("key \"active_microbatches\": has no effect"));
  CHECK_FALSE(parse(R"({"pipeline": "interleaved"})").splits_backward());
  const Config interleaved = parse(R"({"partitions": 2, "virtual_stages": 3, "activation_checkpointing": [0, 5],
      "partition_overrides": {"head": 5}, "trace_dir": "/tmp/t", "trace_step": 4})");
  CHECK(interleaved.schedule_name() == "interleaved_1f1b");
  CHECK(interleaved.num_stages() == 6);
  CHECK(interleaved.checkpointed_stages == std::vector<int>{0, 5});
  CHECK(interleaved.trace_dir == "/tmp/t");
  CHECK(interleaved.trace_step == 4);
  CHECK(parse(R"({"partitions": 3, "activation_checkpointing": true})").checkpointed_stages == std::vector<int>{0, 1, 2});
  CHECK(parse(R"({"activation_checkpointing": false})").checkpointed_stages.empty());
  CHECK_THROWS_WITH(parse(R"({"pipeline": "simple", "virtual_stages": 2})"), Contains("key \"virtual_stages\": needs a \"pipeline\" of several stages per rank (\"interleaved\", \"looped_bfs\", \"zb_v\", \"dualpipe_v\")"));
  CHECK_THROWS_WITH(parse(R"({"partitions": 2, "activation_checkpointing": [2]})"), Contains("stage 2 is not in [0, 1]"));
  CHECK_THROWS_WITH(parse(R"({"activation_checkpointing": "yes"})"), Contains("key \"activation_checkpointing\""));
  // Module names and stage indices in one list: stages recompute whole, modules one by one.
  const Config mixed = parse(R"({"partitions": 2, "activation_checkpointing": [1, "block3", "head"]})");
  CHECK(mixed.checkpointed_stages == std::vector<int>{1});
  CHECK(mixed.checkpointed_modules == std::vector<std::string>{"block3", "head"});
  CHECK_THROWS_WITH(parse(R"({"activation_checkpointing": [1.5]})"), Contains("1.5 is neither a stage index nor a module name"));
  CHECK_THROWS_WITH(parse(R"({"activation_checkpointing": [""]})"), Contains("is neither a stage index nor a module name"));
  CHECK_THROWS_WITH(parse(R"({"virtual_stages": 0})"), Contains("key \"virtual_stages\""));
  CHECK(parse(R"({"active_microbatches": 3})").active_microbatches == 3);
  CHECK_THROWS_WITH(parse(R"({"pipeline": "simple", "active_microbatches": 3})"), Contains("key \"active_microbatches\": has no effect"));
  CHECK_THROWS_WITH(parse(R"({"virtual_stages": 3, "active_microbatches": 2})"), Contains("must be 0 or at least \"virtual_stages\" (3)"));
}

TEST_CASE("config: an smp section leaves the other sections to the application", "[config]") {
  const Config config = parse(R"({"smp": {"partitions": 2}, "model": {"layers": 3}})");
  CHECK(config.partitions == 2);
  CHECK(config.application("model").at("layers") == 3);
  CHECK(config.application("training").is_null());
  CHECK_THROWS_WITH(parse(R"({"smp": 3})"), Contains("\"smp\": expected an object"));
}

TEST_CASE("config: a key beside the smp section is an smp key misplaced or a section the application does not read",
          "[config]") {
  CHECK_THROWS_WITH(parse(R"({"smp": {"partitions": 2}, "checkpoint_dir": "/tmp/x"})"),
                    Contains("key \"checkpoint_dir\" is at the top level, beside the \"smp\" section"));
  const Config config = parse(R"({"smp": {"partitions": 2}, "model": {}, "trainig": {"steps": 3}})");
  CHECK_NOTHROW(config.check_sections({"model", "trainig"}));
  CHECK_THROWS_WITH(config.check_sections({"model", "training"}),
                    Contains("unknown top-level key \"trainig\"") && Contains("\"smp\", \"model\", \"training\""));
  CHECK_NOTHROW(parse(R"({"partitions": 2})").check_sections({"model"}));  // no sections: nothing to check
}

TEST_CASE("config: every bad value is a one-line error naming the key", "[config]") {
  CHECK_THROWS_WITH(parse(R"({"microbatchs": 4})"), Contains("unknown key \"microbatchs\"") && Contains("did you mean \"microbatches\""));
  CHECK_THROWS_WITH(parse(R"({"zzzzzzzzzz": 4})"), Contains("unknown key \"zzzzzzzzzz\"") && Contains("see README"));
  // SageMaker SMP's keys without a counterpart say so and what to do, not "unknown" or a key merely like them.
  CHECK_THROWS_WITH(parse(R"({"fp16_params": true})"),
                    Contains("key \"fp16_params\" is SageMaker SMP's, which smp does not take: parameters stay float32"));
  CHECK_THROWS_WITH(parse(R"({"sdp_max_live_parameters": 1})"), Contains("\"shard_optimizer_state\" shards the optimizer"));
  // Those whose false asks for what smp does anyway (an SMP config's defaults written out) are taken.
  CHECK_NOTHROW(parse(R"({"skip_tracing": false, "delayed_parameter_initialization": false, "fp16_params": false,
                          "offload_activations": false, "prescaled_batch": false, "partitions": 1})"));
  CHECK_THROWS_WITH(parse(R"({"prescaled_batch": false, "tensor_parallel_degree": 2})"),
                    Contains("key \"prescaled_batch\" is SageMaker SMP's"));
  CHECK_THROWS_WITH(parse(R"({"skip_tracing": true})"), Contains("key \"skip_tracing\" is SageMaker SMP's"));
  CHECK_THROWS_WITH(parse(R"({"enabled": true, "parameters": {"partitions": 2}})"),
                    Contains("key \"enabled\" is SageMaker SMP's, which smp does not take: SageMaker's modelparallel "
                             "options: give their \"parameters\" object as smp's config"));
  CHECK_THROWS_WITH(parse(R"({"smdistributed": {"modelparallel": {}}})"),
                    Contains("an application's own section? then put smp's keys under an \"smp\" section") &&
                        Contains("give distribution[\"smdistributed\"][\"modelparallel\"][\"parameters\"]"));
  CHECK_THROWS_WITH(parse(R"({"partitions": 2, "training": {"steps": 5}})"),
                    Contains("unknown key \"training\" (an application's own section? then put smp's keys under an "
                             "\"smp\" section beside it)"));
  // Other frameworks' names are no typos of smp's: known ones are named, others get the keys sharing their words.
  CHECK_THROWS_WITH(parse(R"({"tensor_model_parallel_size": 2})"),
                    Contains("unknown key \"tensor_model_parallel_size\" (smp's is \"tensor_parallel_degree\")"));
  CHECK_THROWS_WITH(parse(R"({"gradient_accumulation_steps": 4})"), Contains("(smp's is \"microbatches\")"));
  CHECK_THROWS_WITH(parse(R"({"checkpoint_frequency": 1})"),
                    Contains("unknown key \"checkpoint_frequency\" (smp's keys like it: ") &&
                        Contains("\"checkpoint_interval\"") && Contains("\"checkpoint_dir\""));
  CHECK_THROWS_WITH(parse(R"({"sequence_parallel_size": 2})"),
                    Contains("(smp's keys like it: \"sequence_parallel\", ") && !Contains("global_batch_size"));
  CHECK_THROWS_WITH(parse(R"({"partitions": "4"})"), Contains("key \"partitions\": expected an integer, got string"));
  CHECK_THROWS_WITH(parse(R"({"partitions": 0})"), Contains("key \"partitions\": must be in [1, 4096], got 0"));
  CHECK_THROWS_WITH(parse(R"({"partitions": 2.5})"), Contains("key \"partitions\": expected an integer"));
  CHECK_THROWS_WITH(parse(R"({"microbatches": -3})"), Contains("key \"microbatches\""));
  CHECK_THROWS_WITH(parse(R"({"microbatches": 99999999999999999999})"), Contains("key \"microbatches\""));
  CHECK_THROWS_WITH(parse(R"({"pipeline": "1f2b"})"),
                    Contains("key \"pipeline\": expected one of \"simple\", \"interleaved\"") && Contains("\"dualpipe_v\""));
  CHECK_THROWS_WITH(parse(R"({"ddp": 1})"), Contains("key \"ddp\": expected true or false"));
  CHECK_THROWS_WITH(parse(R"({"shard_optimizer_state": "yes"})"), Contains("key \"shard_optimizer_state\": expected true or false"));
  CHECK_THROWS_WITH(parse(R"({"shard_optimiser_state": true})"), Contains("did you mean \"shard_optimizer_state\""));
  CHECK_THROWS_WITH(parse(R"({"placement_strategy": "DD"})"), Contains("key \"placement_strategy\""));
  CHECK_THROWS_WITH(parse(R"({"memory_weight": 1.5})"), Contains("key \"memory_weight\": must be in [0, 1]"));
  CHECK_THROWS_WITH(parse(R"({"optimize": "fast"})"), Contains("key \"optimize\""));
  CHECK_THROWS_WITH(parse(R"({"partitions": 2, "default_partition": 2})"), Contains("key \"default_partition\""));
  CHECK_THROWS_WITH(parse(R"({"partitions": 2, "partition_overrides": {"a": 5}})"), Contains("module \"a\" must map to a stage in [0, 1]"));
  CHECK_THROWS_WITH(parse(R"({"partitions": 2, "pipeline_parallel_degree": 2})"), Contains("give only one of them"));
  CHECK_THROWS_WITH(parse(R"({"microbatches": 3, "global_batch_size": 32})"), Contains("does not split into 3 microbatches"));
  CHECK_THROWS_WITH(parse(R"({"comm_timeout_s": 0})"), Contains("key \"comm_timeout_s\""));
}

TEST_CASE("config: malformed documents", "[config]") {
  CHECK_THROWS_WITH(parse("{\"partitions\": 4"), Contains("job.json: not valid JSON"));
  CHECK_THROWS_WITH(parse("[1, 2]"), Contains("expected a JSON object"));
  CHECK_THROWS_WITH(parse(std::string(1000, '[') + std::string(1000, ']')), Contains("nested 1000 levels deep"));
  CHECK_THROWS_WITH(parse("{\"seed\": \"\xff\xfe\"}"), Contains("not valid JSON"));
  // JSON parsers keep the last of a repeated key silently: 2 stages written, 1 trained.
  CHECK_THROWS_WITH(parse("{\"partitions\": 2, \"microbatches\": 2, \"partitions\": 1}"),
                    Contains("job.json: key \"partitions\" is given twice"));
  CHECK_THROWS_WITH(parse("{\"smp\": {\"ddp\": true, \"ddp\": false}}"), Contains("key \"ddp\" is given twice"));
  CHECK_NOTHROW(parse("{\"smp\": {\"partitions\": 2}, \"app\": {\"partitions\": 3}}"));
  CHECK_THROWS_AS(Config::from_file("/nonexistent/job.json"), ConfigError);
}

TEST_CASE("config: world size must be partitions x replicas", "[config]") {
  Config config = parse(R"({"partitions": 4, "ddp": true, "microbatches": 4, "global_batch_size": 32})");
  CHECK(config.replicas_for_world(8) == 2);
  CHECK(config.replicas_for_world(4) == 1);
  CHECK_THROWS_WITH(config.replicas_for_world(6), Contains("world size 6 is not a multiple of \"partitions\" (4)"));
  CHECK_THROWS_WITH(config.replicas_for_world(12), Contains("does not split into 3 replicas x 4 microbatches"));
  config.ddp = false;
  CHECK_THROWS_WITH(config.replicas_for_world(8), Contains("\"ddp\" is false"));
  CHECK_NOTHROW(config.check_batch(64, 2));
  CHECK_THROWS_WITH(config.check_batch(20, 2), Contains("a global batch of 20 does not split into 2 replicas x 4 microbatches"));
  CHECK_THROWS_WITH(config.check_batch(20, 2), Contains("make \"global_batch_size\" a multiple of 8"));
  // "ddp": "auto" is not false: the planner has yet to choose.
  const auto planned = smp::Config::from_json_text(R"({"partitions": 2, "microbatches": 4, "ddp": "auto",
                                                      "global_batch_size": 32})", "auto config");
  CHECK_THROWS_WITH(planned.replicas_for_world(4), Contains("\"ddp\" is \"auto\": the planner chooses the replicas"));
  // A step's batch may split unevenly (an epoch's last), into a sample at least per microbatch.
  config.global_batch_size = 64;
  CHECK_NOTHROW(config.check_batch(20, 2, true));
  CHECK_NOTHROW(config.check_batch(8, 2, true));
  CHECK_THROWS_WITH(config.check_batch(7, 2, true),
                    Contains("the step's batch: a global batch of 7 samples is fewer than 2 replicas x 4 microbatches, "
                             "each of which needs a sample at least"));
}

TEST_CASE("expert_parallel_degree divides the replicas", "[config]") {
  const auto config = smp::Config::from_json_text(R"({"expert_parallel_degree": 2, "partitions": 2, "ddp": true})", "t");
  CHECK(config.expert_parallel_degree == 2);
  CHECK(config.replicas_for_world(8) == 4);
  CHECK_THROWS_WITH(config.replicas_for_world(6),
                    Catch::Contains("\"expert_parallel_degree\" 2 does not divide the 3 data-parallel replicas") &&
                        Catch::Contains("launch a multiple of 4 processes"));
  CHECK_THROWS_WITH(smp::Config::from_json_text(R"({"expert_parallel_degree": 0})", "t"),
                    Catch::Contains("expert_parallel_degree"));
  // ZeRO-1 composes: experts' state is divided over the replicas holding the same experts, the rest over all.
  CHECK(smp::Config::from_json_text(R"({"expert_parallel_degree": 2, "ddp": true, "shard_optimizer_state": true})", "t")
            .shard_optimizer_state);
}

TEST_CASE("tensor_parallel_degree is read, bounded, and divides the world with the partitions", "[config]") {
  const auto config = smp::Config::from_json_text(R"({"tensor_parallel_degree": 2, "partitions": 2, "ddp": true})", "t");
  CHECK(config.tensor_parallel_degree == 2);
  CHECK(config.replicas_for_world(8) == 2);
  CHECK_THROWS_WITH(config.replicas_for_world(6), Catch::Contains("world size 6 is not a multiple of \"partitions\" x \"tensor_parallel_degree\" (2 x 2)"));
  CHECK_THROWS_WITH(smp::Config::from_json_text(R"({"tensor_parallel_degree": 0})", "t"), Catch::Contains("key \"tensor_parallel_degree\""));
  CHECK_THROWS_WITH(smp::Config::from_json_text(R"({"placement_strategy": "DPX"})", "t"), Catch::Contains("letters D, P and T"));
  CHECK(smp::Config::from_json_text(R"({"placement_strategy": "PTD"})", "t").placement_strategy == "PTD");
}

TEST_CASE("config: README's config table lists every key the reader takes, and no other", "[config]") {
  std::ifstream readme(smp_test::paths::readme);
  REQUIRE(readme);
  std::string line;
  bool in_table = false;
  std::set<std::string> documented;
  while (std::getline(readme, line)) {
    if (line.rfind("### The config file", 0) == 0) in_table = true;
    else if (in_table && line.rfind("## ", 0) == 0) break;
    if (!in_table || line.rfind("| `", 0) != 0) continue;
    // The first column names the key and its aliases, each in backticks: "`backend` (alias SMP's `ddp_dist_backend`)".
    const std::string first = line.substr(1, line.find('|', 1) - 1);
    for (std::size_t open = first.find('`'); open != std::string::npos; open = first.find('`', open)) {
      const std::size_t close = first.find('`', open + 1);
      documented.insert(first.substr(open + 1, close - open - 1));
      open = close + 1;
    }
  }
  const auto keys = Config::keys();
  const std::set<std::string> read(keys.begin(), keys.end());
  CHECK(documented == read);
}

TEST_CASE("config: auto layout keys are left to the planner, with a provisional layout until then", "[config]") {
  const Config planned = parse(R"({"partitions": "auto", "microbatches": "auto", "ddp": "auto",
      "activation_checkpointing": "auto", "global_batch_size": 16})");
  CHECK(planned.auto_keys == std::vector<std::string>{"partitions", "microbatches", "ddp", "activation_checkpointing"});
  CHECK_THAT(planned.describe(), Contains("planned when the model is known: partitions microbatches"));
  // Every rank a replica where replicas are allowed.
  const Config replicas = planned.provisional_layout(4);
  CHECK(replicas.partitions == 1);
  CHECK(replicas.ddp);
  CHECK(replicas.microbatches == 1);
  CHECK(replicas.replicas_for_world(4) == 4);
  CHECK(replicas.auto_keys == planned.auto_keys);  // still to be chosen
  // Without replicas, every rank a stage.
  const Config stages = parse(R"({"partitions": "auto", "ddp": false, "global_batch_size": 8})").provisional_layout(4);
  CHECK(stages.partitions == 4);
  CHECK_FALSE(stages.ddp);
  // A global batch the ranks cannot all share: as few stages as leave replicas that share it (6 on 4 ranks: 2 stages;
  // 7: 4).
  const Config odd = parse(R"({"partitions": "auto", "ddp": "auto", "global_batch_size": 6})").provisional_layout(4);
  CHECK(odd.partitions == 2);
  CHECK(odd.replicas_for_world(4) == 2);
  CHECK(parse(R"({"partitions": "auto", "ddp": "auto", "global_batch_size": 7})").provisional_layout(4).partitions == 4);
  // Keys fixed beside "auto" are read as ever.
  CHECK(parse(R"({"pipeline": "auto", "partitions": 2, "global_batch_size": 8})").partitions == 2);
  // The alias takes "auto" too; a misspelt "auto" is named as one.
  CHECK(parse(R"({"pipeline_parallel_degree": "auto", "global_batch_size": 8})").auto_keys ==
        std::vector<std::string>{"partitions"});
  CHECK_THROWS_WITH(parse(R"({"pipeline_parallel_degree": "auto", "partitions": 2, "global_batch_size": 8})"),
                    Contains("is an alias of \"partitions\""));
  CHECK_THROWS_WITH(parse(R"({"partitions": "Auto", "global_batch_size": 8})"),
                    Contains("key \"partitions\": \"Auto\" (did you mean \"auto\"?"));

  CHECK_THROWS_WITH(parse(R"({"partitions": "auto"})"),
                    Contains("\"partitions\": \"auto\" needs \"global_batch_size\""));
  CHECK_THROWS_WITH(parse(R"({"microbatches": "auto", "global_batch_size": 8, "schedule_file": "s.csv"})"),
                    Contains("\"schedule_file\" fixes stages"));
  // Tensor and expert parallelism are planned too, or fixed beside "auto" keys.
  CHECK(parse(R"({"ddp": "auto", "tensor_parallel_degree": 2, "global_batch_size": 8})").tensor_parallel_degree == 2);
  const Config tp_planned = parse(R"({"tensor_parallel_degree": "auto", "global_batch_size": 8})");
  CHECK(tp_planned.auto_keys == std::vector<std::string>{"tensor_parallel_degree"});
  // Until planned: without replicas (ddp is false) and one stage, the tensor-parallel ranks fill the world; with
  // replicas allowed every rank is one.
  CHECK(tp_planned.provisional_layout(4).tensor_parallel_degree == 4);
  CHECK(parse(R"({"tensor_parallel_degree": "auto", "ddp": "auto", "global_batch_size": 8})")
            .provisional_layout(4)
            .tensor_parallel_degree == 1);
  CHECK(parse(R"({"ddp": "auto", "expert_parallel_degree": 2, "global_batch_size": 8})").expert_parallel_degree == 2);
  const Config ep_planned = parse(R"({"expert_parallel_degree": "auto", "global_batch_size": 8})");
  CHECK(ep_planned.auto_keys == std::vector<std::string>{"expert_parallel_degree"});
  CHECK(ep_planned.provisional_layout(4).expert_parallel_degree == 1);
  // Keys the planner does not choose take no "auto".
  CHECK_THROWS_WITH(parse(R"({"sequence_parallel": "auto", "global_batch_size": 8})"), Contains("sequence_parallel"));
}

TEST_CASE("config: devices that differ are given per rank and a list of the wrong length is named once the world is known",
          "[config]") {
  const auto given = smp::Config::from_json_text(
      R"({"device_speeds": [1, 0.5], "device_memory_mb": [0, 512], "emulated_slowdown": [1, 2]})", "t");
  CHECK(given.device_speeds == std::vector<double>{1.0, 0.5});
  CHECK(given.device_memory_mb == std::vector<double>{0.0, 512.0});
  CHECK(given.emulated_slowdown == std::vector<double>{1.0, 2.0});
  CHECK_FALSE(given.measure_device_speeds);
  CHECK(smp::Config::from_json_text(R"({"device_speeds": "measure"})", "t").measure_device_speeds);
  CHECK_THROWS_WITH(smp::Config::from_json_text(R"({"device_speeds": [1, 0]})", "t"),
                    Catch::Contains("key \"device_speeds\": entry 1 must be a number in"));
  CHECK_THROWS_WITH(smp::Config::from_json_text(R"({"device_speeds": "fast"})", "t"),
                    Catch::Contains("or \"measure\""));
  CHECK_THROWS_WITH(smp::Config::from_json_text(R"({"emulated_slowdown": [0.5]})", "t"),
                    Catch::Contains("key \"emulated_slowdown\": entry 0"));
  const auto four_stages = smp::Config::from_json_text(R"({"partitions": 4, "device_speeds": [1, 0.5]})", "t");
  CHECK_THROWS_WITH(smp::Topology(four_stages, 4), Catch::Contains("key \"device_speeds\": has 2 entries, one per rank, but the job has 4 ranks"));
}
