#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "smp/checkpoint_manifest.h"
#include "smp/timeline.h"

using namespace smp;
using Catch::Matchers::Contains;

namespace {

CheckpointManifest sample_manifest(std::int64_t step) {
  CheckpointManifest manifest;
  manifest.step = step;
  manifest.partitions = 2;
  manifest.replicas = 2;
  manifest.schedule = "1f1b";
  manifest.module_names = {"a", "b", "c"};
  manifest.stage_of_module = {0, 1, 1};
  manifest.model_signature = "3 parameters";
  manifest.config_json = "{}";
  return manifest;
}

// A complete checkpoint directory with two partition files of the given contents.
std::string write_checkpoint(const std::string& root, std::int64_t step) {
  const std::string directory = root + "/" + checkpoint_directory_name(step);
  std::filesystem::create_directories(directory);
  auto manifest = sample_manifest(step);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string contents = "partition " + std::to_string(rank) + " of step " + std::to_string(step);
    write_file_atomically(directory + "/" + partition_file_name(rank), contents);
    manifest.files.push_back({partition_file_name(rank), rank, contents.size(), crc32(contents.data(), contents.size())});
  }
  write_file_atomically(directory + "/manifest.json", manifest.to_json());
  return directory;
}

std::string fresh_root(const char* name) {
  const std::string root = "/tmp/smp_manifest_test_" + std::to_string(getpid()) + "_" + name;
  std::filesystem::remove_all(root);
  return root;
}

}  // namespace

TEST_CASE("checkpoint: CRC-32 matches the standard check value", "[checkpoint]") {
  CHECK(crc32("123456789", 9) == 0xCBF43926u);
  CHECK(crc32("", 0) == 0u);
  // Incremental use gives the same answer as one pass.
  CHECK(crc32("6789", 4, crc32("12345", 5)) == 0xCBF43926u);
}

TEST_CASE("checkpoint: manifest round trip and strict parsing", "[checkpoint]") {
  auto manifest = sample_manifest(7);
  manifest.files = {{"partition-0000.pt", 0, 10, 1}, {"partition-0001.pt", 1, 20, 2}};
  const auto back = CheckpointManifest::parse(manifest.to_json(), "m.json");
  CHECK(back.step == 7);
  CHECK(back.stage_of_module == manifest.stage_of_module);
  CHECK(back.files.size() == 2);
  CHECK(back.files[1].crc32 == 2);
  CHECK(back.model_parameters.empty());  // written before the list was kept
  manifest.model_parameters = "0.weight:4,3,;0.bias:4,;";
  CHECK(CheckpointManifest::parse(manifest.to_json(), "m.json").model_parameters == manifest.model_parameters);

  CHECK_THROWS_WITH(CheckpointManifest::parse("{", "m.json"), Contains("m.json: not a valid manifest"));
  CHECK_THROWS_WITH(CheckpointManifest::parse("[]", "m.json"), Contains("expected an object"));
  auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    auto document = nlohmann::json::parse(manifest.to_json());
    change(document);
    return document.dump();
  };
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["format_version"] = 99; }), "m"), Contains("format version 99"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d.erase("step"); }), "m"), Contains("missing \"step\""));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["step"] = "7"; }), "m"), Contains("\"step\" must be"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][0]["name"] = "../../etc/passwd"; }), "m"), Contains("unsafe file name"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][1]["pp_rank"] = 0; }), "m"), Contains("repeated pp_rank"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"].erase(1); }), "m"), Contains("no file for pipeline rank 1"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["stage_of_module"][2] = 5; }), "m"), Contains("stage_of_module[2]"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][0]["crc32"] = -1; }), "m"), Contains("files entry"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["model_parameters"] = 3; }), "m"),
                    Contains("model_parameters must be a string"));
}

TEST_CASE("checkpoint: sharded optimizer state needs one shard file per pipeline rank and later replica",
          "[checkpoint]") {
  auto manifest = sample_manifest(4);
  manifest.replicas = 3;
  manifest.optimizer_shards = 3;
  manifest.files = {{"partition-0000.pt", 0, 10, 1}, {"partition-0001.pt", 1, 20, 2}};
  for (int pp = 0; pp < 2; ++pp) {
    for (int dp = 1; dp < 3; ++dp) manifest.files.push_back({optimizer_shard_file_name(pp, dp), pp, 5, 3, dp});
  }
  const auto back = CheckpointManifest::parse(manifest.to_json(), "m.json");
  CHECK(back.optimizer_shards == 3);
  REQUIRE(back.files.size() == 6);
  CHECK(back.files[5].name == "optimizer-0001-0002.pt");
  CHECK(back.files[5].dp_rank == 2);
  CHECK(back.files[0].dp_rank == -1);

  auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    auto document = nlohmann::json::parse(manifest.to_json());
    change(document);
    return document.dump();
  };
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"].erase(5); }), "m"),
                    Contains("no optimizer shard file for pipeline rank 1 replica 2"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][5]["dp_rank"] = 1; }), "m"),
                    Contains("repeated pp_rank 1 and dp_rank 1"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][5]["dp_rank"] = 3; }), "m"),
                    Contains("dp_rank 3, outside [1, 2]"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][5]["dp_rank"] = 0; }), "m"),
                    Contains("dp_rank 0, outside"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["optimizer_shards"] = 2; }), "m"),
                    Contains("must equal replicas (3)"));
  // Unsharded: a shard file has no place.
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["optimizer_shards"] = 1; }), "m"),
                    Contains("no replica writes an optimizer shard file"));
  // Manifests from before sharding have no optimizer_shards: the partition files hold all the state.
  manifest.files.resize(2);
  CHECK(CheckpointManifest::parse(edit([](auto& d) {
          d.erase("optimizer_shards");
          d["replicas"] = 3;
        }), "m").optimizer_shards == 1);
}

TEST_CASE("checkpoint: divided experts need a partition file per pipeline rank and share, then shard files", "[checkpoint]") {
  auto manifest = sample_manifest(4);
  manifest.replicas = 4;
  manifest.expert_parallel_degree = 2;
  for (int pp = 0; pp < 2; ++pp) {
    for (int ep = 0; ep < 2; ++ep) {
      CheckpointFile file{partition_file_name(pp, -1, ep), pp, 10, 1};
      file.ep_rank = ep;
      manifest.files.push_back(file);
    }
  }
  const auto back = CheckpointManifest::parse(manifest.to_json(), "m.json");
  CHECK(back.expert_parallel_degree == 2);
  REQUIRE(back.files.size() == 4);
  CHECK(back.files[3].name == "partition-0001-ep01.pt");
  CHECK(back.files[3].ep_rank == 1);
  CHECK(back.files[2].ep_rank == 0);
  CHECK(partition_file_name(3, 1, 2) == "partition-0003-ep02-tp01.pt");

  auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    auto document = nlohmann::json::parse(manifest.to_json());
    change(document);
    return document.dump();
  };
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"].erase(3); }), "m"),
                    Contains("no file for pipeline rank 1 experts share 1"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][3]["ep_rank"] = 2; }), "m"),
                    Contains("ep_rank 2, outside [0, 1]"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][1]["ep_rank"] = 0; }), "m"),
                    Contains("repeated pp_rank 0"));
  // Sharded optimizer state: the first replicas' shares are in their partition files, the later ones' in their own.
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["optimizer_shards"] = 4; }), "m"),
                    Contains("no optimizer shard file for pipeline rank 0 replica 2"));
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["optimizer_shards"] = 3; }), "m"),
                    Contains("expert_parallel_degree (2) does not divide optimizer_shards (3)"));
  manifest.optimizer_shards = 4;
  for (int pp = 0; pp < 2; ++pp) {
    for (int dp = 2; dp < 4; ++dp) manifest.files.push_back({optimizer_shard_file_name(pp, dp), pp, 5, 3, dp});
  }
  CHECK(CheckpointManifest::parse(manifest.to_json(), "m.json").files.size() == 8);
  CHECK_THROWS_WITH(CheckpointManifest::parse(edit([](auto& d) { d["files"][4]["dp_rank"] = 1; }), "m"),
                    Contains("dp_rank 1, outside [2, 3]"));
}

TEST_CASE("checkpoint: the newest complete checkpoint wins, damaged ones are skipped with a reason", "[checkpoint]") {
  const auto root = fresh_root("latest");
  CHECK_FALSE(find_latest_checkpoint(root).has_value());
  write_checkpoint(root, 3);
  const auto newest = write_checkpoint(root, 5);
  auto found = find_latest_checkpoint(root);
  REQUIRE(found.has_value());
  CHECK(found->manifest.step == 5);

  // A save that died before its manifest, and a flipped byte: both skipped.
  std::filesystem::create_directories(root + "/" + checkpoint_directory_name(9));
  { std::ofstream(newest + "/partition-0001.pt", std::ios::app) << "x"; }
  std::vector<std::string> skipped;
  found = find_latest_checkpoint(root, &skipped);
  REQUIRE(found.has_value());
  CHECK(found->manifest.step == 3);
  REQUIRE(skipped.size() == 2);
  CHECK_THAT(skipped[0], Contains("manifest.json: missing"));
  CHECK_THAT(skipped[1], Contains("partition-0001.pt") && Contains("truncated or replaced"));
  std::filesystem::remove_all(root);
}

TEST_CASE("checkpoint: pruning keeps the newest complete ones and a save in progress", "[checkpoint]") {
  const auto root = fresh_root("prune");
  for (int step : {1, 2, 3, 4}) write_checkpoint(root, step);
  std::filesystem::create_directories(root + "/" + checkpoint_directory_name(0));  // stale, incomplete
  std::filesystem::create_directories(root + "/" + checkpoint_directory_name(8));  // newer, in progress
  std::filesystem::create_directories(root + "/step-0000007");  // not a name a save gives: the user's, kept
  std::filesystem::create_directories(root + "/step-000000002");
  prune_checkpoints(root, 2);
  CHECK(std::filesystem::exists(root + "/step-0000007"));
  CHECK(std::filesystem::exists(root + "/step-000000002"));
  CHECK(std::filesystem::exists(root + "/step-00000008"));
  CHECK(std::filesystem::exists(root + "/step-00000004"));
  CHECK(std::filesystem::exists(root + "/step-00000003"));
  CHECK_FALSE(std::filesystem::exists(root + "/step-00000002"));
  CHECK_FALSE(std::filesystem::exists(root + "/step-00000001"));
  CHECK_FALSE(std::filesystem::exists(root + "/step-00000000"));
  std::filesystem::remove_all(root);
}
