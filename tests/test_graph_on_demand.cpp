// GraphModel nodes built on demand (factories), and profiles shared by identical nodes.

#include <map>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "catch_torch.h"
#include "smp/config.h"
#include "smp/errors.h"
#include "smp/graph_model.h"
#include "smp/stage_plan.h"

namespace {

class UsesWeightImpl : public torch::nn::Module {
 public:
  explicit UsesWeightImpl(const at::Tensor& weight) : weight_(register_parameter("weight", weight)) {}
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight_); }

 private:
  at::Tensor weight_;
};
TORCH_MODULE(UsesWeight);

// embed (8 -> 16), two blocks (16 -> 16), and a head (16 -> 8) that multiplies by embed's weight [16, 8], as a
// tied LM head does.
smp::GraphModel on_demand_model() {
  smp::GraphModel model("x");
  model.add("embed", [] { return torch::nn::Linear(torch::nn::LinearOptions(8, 16).bias(false)); }, {"x"});
  model.add("block0", [] { return torch::nn::Linear(16, 16); }, {"embed"});
  model.add("block1", [] { return torch::nn::Linear(16, 16); }, {"block0"});
  model.add("head", [](const std::vector<at::Tensor>& shared) { return UsesWeight(shared[0]); }, {"block1"},
            {"embed.weight"});
  return model;
}

std::map<std::string, at::Tensor> parameters_by_name(const smp::GraphModel& model) {
  std::map<std::string, at::Tensor> named;
  for (const auto& [name, tensor] : model.named_parameters()) named[name] = tensor;
  return named;
}

}  // namespace

TEST_CASE("a node built on demand gets weights that depend on the seed and its name alone", "[graph][on_demand]") {
  smp::GraphModel whole = on_demand_model();
  whole.materialize(7);
  const auto expected = parameters_by_name(whole);

  // Built one at a time, last first, with other random numbers drawn in between: the same weights.
  smp::GraphModel reversed = on_demand_model();
  reversed.set_build_seed(7);
  at::manual_seed(1);
  const at::Tensor drawn = at::rand({3});
  at::manual_seed(1);
  for (int node : {2, 1, 0}) {
    reversed.build(node);
    at::randn({5});
  }
  const auto rebuilt = parameters_by_name(reversed);
  for (const char* name : {"embed.weight", "block0.weight", "block0.bias", "block1.weight"}) {
    INFO(name);
    REQUIRE(rebuilt.count(name));
    CHECK(at::equal(rebuilt.at(name), expected.at(name)));
  }
  // Building leaves the global generator's sequence alone.
  at::manual_seed(1);
  smp::GraphModel other = on_demand_model();
  other.materialize(7);
  CHECK(at::equal(at::rand({3}), drawn));

  // Another seed, other weights; two identical blocks, different weights.
  smp::GraphModel reseeded = on_demand_model();
  reseeded.materialize(8);
  CHECK_FALSE(at::equal(parameters_by_name(reseeded).at("block0.weight"), expected.at("block0.weight")));
  CHECK_FALSE(at::equal(expected.at("block0.weight"), expected.at("block1.weight")));

  // A node built apart for a moment has the same weights, and the model stays unbuilt.
  smp::GraphModel unbuilt = on_demand_model();
  unbuilt.set_build_seed(7);
  const auto apart = unbuilt.built_apart(1);
  CHECK(at::equal(apart.module->named_parameters()["weight"], expected.at("block0.weight")));
  CHECK_FALSE(unbuilt.nodes()[1].built());
  CHECK_THROWS_WITH(unbuilt.forward(at::zeros({2, 8})), Catch::Matchers::Contains("not built in this process"));
}

TEST_CASE("a node sharing an earlier node's parameter holds that tensor, named after its owner", "[graph][on_demand]") {
  smp::GraphModel whole = on_demand_model();
  whole.materialize(7);
  const auto& nodes = whole.nodes();
  const at::Tensor embed = nodes[0].module->named_parameters()["weight"];
  CHECK(nodes[3].shared_tensors.at(0).is_same(embed));
  const auto named = parameters_by_name(whole);
  CHECK(named.size() == 5);  // embed.weight (the head's too), block0's and block1's weights and biases
  const auto ties = whole.ties();
  REQUIRE(ties.size() == 1);
  CHECK(ties[0].parameter == "embed.weight");
  CHECK(ties[0].nodes == std::vector<int>{0, 3});
  CHECK(ties[0].tensor.is_same(embed));

  // Only the head built here (its stage's rank): it still names the tensor "embed.weight", with the owner's values,
  // and the tie is known with its tensor.
  smp::GraphModel head_only = on_demand_model();
  head_only.set_build_seed(7);
  head_only.build(3);
  const auto head_named = parameters_by_name(head_only);
  REQUIRE(head_named.count("embed.weight"));
  CHECK(at::equal(head_named.at("embed.weight"), embed));
  const auto head_ties = head_only.ties();
  REQUIRE(head_ties.size() == 1);
  CHECK(head_ties[0].nodes == std::vector<int>{0, 3});
  CHECK(head_ties[0].tensor.defined());
  // Neither built: the tie is still known, without a tensor.
  const auto unbuilt_ties = on_demand_model().ties();
  REQUIRE(unbuilt_ties.size() == 1);
  CHECK_FALSE(unbuilt_ties[0].tensor.defined());
}

TEST_CASE("nodes built on demand refuse what cannot work, naming it", "[graph][on_demand]") {
  smp::GraphModel model("x");
  model.add("embed", [] { return torch::nn::Linear(8, 16); }, {"x"});
  CHECK_THROWS_AS(model.add("head", [](const std::vector<at::Tensor>& shared) { return UsesWeight(shared[0]); },
                            {"embed"}, {"missing.weight"}),
                  smp::ConfigError);
  model.add("head", [](const std::vector<at::Tensor>& shared) { return UsesWeight(shared[0]); }, {"embed"},
            {"embed.scale"});
  CHECK_THROWS_WITH(model.materialize(1), Catch::Matchers::Contains("node \"embed\" has no such parameter"));
}

TEST_CASE("a tied parameter counts at its first and its last holder, and the signature lists it once", "[profile]") {
  smp::GraphModel model = on_demand_model();
  SECTION("built") { model.materialize(7); }
  SECTION("built on demand") {}
  const auto profiles = smp::profile_graph(model, at::randn({4, 8}), 0);
  const std::int64_t embed_bytes = 16 * 8 * 4;
  CHECK(profiles[0].parameter_bytes == embed_bytes);
  CHECK(profiles[3].parameter_bytes == embed_bytes);  // the head's stage holds a copy
  CHECK(profiles[0].parameter_shapes == "embed.weight:16,8,;");
  CHECK(profiles[3].parameter_shapes.empty());
}

TEST_CASE("identical nodes share one profile measurement, so identical blocks are cut evenly every time",
          "[profile][on_demand]") {
  // 16 identical blocks between a small first and last layer, on 4 stages: equal costs for equal blocks, whatever
  // the noise of one measurement, so every run cuts 4/4/4/4 (give or take one where the ends' costs land).
  auto make = [] {
    smp::GraphModel model("x");
    model.add("embed", [] { return torch::nn::Linear(8, 64); }, {"x"});
    std::string previous = "embed";
    for (int block = 0; block < 16; ++block) {
      const std::string name = "block" + std::to_string(block);
      model.add(name, [] { return torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::GELU(),
                                                        torch::nn::Linear(256, 64)); },
                {previous});
      previous = name;
    }
    model.add("head", [] { return torch::nn::Linear(64, 8); }, {previous});
    return model;
  };
  const auto config = smp::Config::from_json_text(R"({"partitions": 4, "microbatches": 4})", "test");
  std::vector<std::vector<std::size_t>> cuts;
  for (int run = 0; run < 3; ++run) {
    // Five repeats: the embedding and the head are timed on their own, and with three a loaded host once cut
    // 14/1/1/0 here (their least time still slowed, presumably).
    const auto profiles = smp::profile_graph(make(), at::randn({32, 8}), 5);
    for (int block = 1; block < 16; ++block) {
      CHECK(profiles[1 + block].forward_s == profiles[1].forward_s);
      CHECK(profiles[1 + block].backward_s == profiles[1].backward_s);
      CHECK(profiles[1 + block].parameter_bytes == profiles[1].parameter_bytes);
    }
    CHECK(profiles[0].forward_s != profiles[1].forward_s);  // another type of node: measured on its own
    const auto plan = smp::plan_stages(profiles, config);
    std::vector<std::size_t> blocks_per_stage;
    for (int stage = 0; stage < 4; ++stage) {
      std::size_t blocks = 0;
      for (int module : plan.modules_of_stage(stage)) blocks += plan.modules[module].name.rfind("block", 0) == 0;
      blocks_per_stage.push_back(blocks);
    }
    const auto [fewest, most] = std::minmax_element(blocks_per_stage.begin(), blocks_per_stage.end());
    CHECK(*most - *fewest <= 1);
    cuts.push_back(blocks_per_stage);
  }
  CHECK(cuts[0] == cuts[1]);
  CHECK(cuts[1] == cuts[2]);
}

TEST_CASE("the seed of a module path is stable across builds and processes", "[graph][on_demand]") {
  // Fixed values: a change here changes every model's initial weights (C++ nodes and Python's meta-built modules).
  CHECK(smp::module_seed(0, "block0") == smp::module_seed(0, "block0"));
  CHECK(smp::module_seed(0, "block0") != smp::module_seed(1, "block0"));
  CHECK(smp::module_seed(0, "block0") != smp::module_seed(0, "block1"));
  CHECK(smp::module_seed(3, "") < (1ULL << 63));
}
