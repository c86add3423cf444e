// A stage's nodes as calls: consecutive nodes fused where the model says so, checkpointed ones alone, and the
// values and errors the same as node by node.

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "catch_torch.h"
#include "smp/errors.h"
#include "smp/graph_model.h"
#include "smp/stage_program.h"

namespace {

// x -> a -> b -> c -> d, and a fuser that records the runs it is given and computes each node by node in one call,
// as a generated function would.
smp::GraphModel chain(std::vector<std::vector<int>>* fused_calls) {
  smp::GraphModel model("x");
  model.add("a", torch::nn::Linear(4, 4), {"x"});
  model.add("b", torch::nn::Linear(4, 4), {"a"});
  model.add("c", torch::nn::Linear(4, 4), {"b"});
  model.add("d", torch::nn::Linear(4, 4), {"c"});
  const std::vector<smp::GraphModel::Node> nodes = model.nodes();
  model.set_run_fuser([fused_calls, nodes](const std::vector<int>& run, const std::vector<std::string>& inputs) {
    fused_calls->push_back(run);
    return smp::GraphModel::RunForward([run, inputs, nodes](const std::vector<at::Tensor>& values) {
      std::map<std::string, at::Tensor> known;
      for (std::size_t i = 0; i < inputs.size(); ++i) known[inputs[i]] = values[i];
      std::vector<at::Tensor> outputs;
      for (int node : run) {
        std::vector<at::Tensor> arguments;
        for (const auto& input : nodes[node].inputs) arguments.push_back(known.at(input));
        outputs.push_back(known[nodes[node].name] = nodes[node].forward(arguments));
      }
      return outputs;
    });
  });
  return model;
}

}  // namespace

TEST_CASE("consecutive nodes become one call, split around nodes that must run alone", "[stage_program]") {
  std::vector<std::vector<int>> fused_calls;
  smp::GraphModel model = chain(&fused_calls);
  const auto runs = smp::plan_node_runs(model, {0, 1, 2, 3}, {false, false, true, false});
  REQUIRE(runs.size() == 3);
  CHECK(runs[0].nodes == std::vector<int>{0, 1});
  CHECK(runs[0].inputs == std::vector<std::string>{"x"});
  CHECK(bool(runs[0].forward));
  CHECK(runs[1].nodes == std::vector<int>{2});  // checkpointed: alone
  CHECK_FALSE(runs[1].forward);
  CHECK(runs[2].nodes == std::vector<int>{3});  // a run of one is no fused call
  CHECK(fused_calls == std::vector<std::vector<int>>{{0, 1}});

  // Without a fuser, or when it declines, every node is a call of its own.
  smp::GraphModel plain("x");
  plain.add("a", torch::nn::Linear(4, 4), {"x"});
  plain.add("b", torch::nn::Linear(4, 4), {"a"});
  CHECK(smp::plan_node_runs(plain, {0, 1}, {false, false}).size() == 2);
  plain.set_run_fuser([](const std::vector<int>&, const std::vector<std::string>&) {
    return smp::GraphModel::RunForward();
  });
  CHECK(smp::plan_node_runs(plain, {0, 1}, {false, false}).size() == 2);
}

TEST_CASE("a fused run computes what the nodes compute one by one, and its failure names the run",
          "[stage_program]") {
  std::vector<std::vector<int>> fused_calls;
  smp::GraphModel model = chain(&fused_calls);
  const auto alone_node = [&](int node, const std::vector<at::Tensor>& arguments) {
    return model.nodes()[node].forward(arguments);
  };
  const auto where = [] { return std::string("step 1, stage 0"); };
  const at::Tensor x = at::randn({2, 4});
  std::map<std::string, at::Tensor> fused{{"x", x}};
  smp::compute_runs(model, smp::plan_node_runs(model, {0, 1, 2, 3}, {false, false, false, false}), fused,
                    alone_node, where);
  std::map<std::string, at::Tensor> apart{{"x", x}};
  smp::compute_runs(model, smp::plan_node_runs(model, {0, 1, 2, 3}, {true, true, true, true}), apart, alone_node,
                    where);
  for (const char* name : {"a", "b", "c", "d"}) CHECK(at::equal(fused.at(name), apart.at(name)));

  std::map<std::string, at::Tensor> wrong{{"x", at::randn({2, 5})}};
  const auto runs = smp::plan_node_runs(model, {0, 1, 2, 3}, {false, false, false, false});
  CHECK_THROWS_AS(smp::compute_runs(model, runs, wrong, alone_node, where), smp::ModelError);
  CHECK_THROWS_WITH(smp::compute_runs(model, runs, wrong, alone_node, where),
                    Catch::Contains("step 1, stage 0, modules \"a\" to \"d\" (run as one) (input [2, 5]): "));
}
