// Launched by test_tensor_parallel under smprun: a small transformer (vocabulary-parallel embedding with a padding id,
// attention with the heads split, a column/row-parallel MLP, a gathered column layer feeding a scattered row layer, a
// stretch split along a dimension and gathered for computation whole on every rank, a column-parallel output layer
// and the vocabulary-parallel cross entropy) trained on every rank of one
// tensor-parallel group, against the same model whole, trained the plain LibTorch way in this process from the same
// weights on the same batches. Prints "rank R: N tensors checked, M mismatches" and exits 0 only when the losses
// and every shard agree.

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include "smp/config.h"
#include "smp/main.h"
#include "smp/runtime.h"
#include "smp/tp.h"

namespace {

constexpr int64_t kVocabulary = 32, kWidth = 16, kHeads = 4, kLength = 6, kBatch = 4, kPadding = 3;

// The model whole, as single-process LibTorch runs it.
struct Whole : torch::nn::Module {
  torch::nn::Embedding embed{
      register_module("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocabulary, kWidth).padding_idx(kPadding)))};
  torch::nn::LayerNorm norm1{register_module("norm1", torch::nn::LayerNorm(std::vector<int64_t>{kWidth}))};
  torch::nn::Linear query{register_module("query", torch::nn::Linear(kWidth, kWidth))};
  torch::nn::Linear key{register_module("key", torch::nn::Linear(kWidth, kWidth))};
  torch::nn::Linear value{register_module("value", torch::nn::Linear(kWidth, kWidth))};
  torch::nn::Linear projection{register_module("projection", torch::nn::Linear(kWidth, kWidth))};
  torch::nn::LayerNorm norm2{register_module("norm2", torch::nn::LayerNorm(std::vector<int64_t>{kWidth}))};
  torch::nn::Linear expand{register_module("expand", torch::nn::Linear(kWidth, 4 * kWidth))};
  torch::nn::Linear contract{register_module("contract", torch::nn::Linear(4 * kWidth, kWidth))};
  torch::nn::Linear widen{register_module("widen", torch::nn::Linear(kWidth, 2 * kWidth))};
  torch::nn::Linear narrow{register_module("narrow", torch::nn::Linear(2 * kWidth, kWidth))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kWidth, kVocabulary).bias(false)))};

  at::Tensor loss(const at::Tensor& ids, const at::Tensor& targets) {
    at::Tensor h = embed(ids);
    const auto heads = [&](torch::nn::Linear& linear, const at::Tensor& x) {
      return linear(x).view({kBatch, kLength, kHeads, kWidth / kHeads}).transpose(1, 2);
    };
    const at::Tensor x = norm1(h);
    const at::Tensor attended =
        at::scaled_dot_product_attention(heads(query, x), heads(key, x), heads(value, x), {}, 0.0, true);
    h = h + projection(attended.transpose(1, 2).reshape({kBatch, kLength, kWidth}));
    h = h + contract(at::gelu(expand(norm2(h))));
    h = h + narrow(at::tanh(widen(h)));
    h = h + at::tanh(h);
    return at::cross_entropy_loss(head(h).reshape({-1, kVocabulary}), targets.reshape({-1}));
  }
};

// The same model as this rank's shards.
struct Sharded : torch::nn::Module {
  explicit Sharded(const smp::tp::Group& group)
      : group(group),
        embed(register_module("embed", smp::tp::VocabParallelEmbedding(kVocabulary, kWidth, group, kPadding))),
        norm1(register_module("norm1", torch::nn::LayerNorm(std::vector<int64_t>{kWidth}))),
        attention(register_module("attention", smp::tp::SelfAttention(kWidth, kHeads, group))),
        norm2(register_module("norm2", torch::nn::LayerNorm(std::vector<int64_t>{kWidth}))),
        expand(register_module("expand", smp::tp::ColumnParallelLinear(kWidth, 4 * kWidth, group))),
        contract(register_module("contract", smp::tp::RowParallelLinear(4 * kWidth, kWidth, group))),
        widen(register_module("widen", smp::tp::ColumnParallelLinear(kWidth, 2 * kWidth, group, true, true))),
        narrow(register_module("narrow", smp::tp::RowParallelLinear(2 * kWidth, kWidth, group, true, false))),
        head(register_module("head", smp::tp::ColumnParallelLinear(kWidth, kVocabulary, group, false))) {}

  at::Tensor loss(const at::Tensor& ids, const at::Tensor& targets) {
    at::Tensor h = embed(ids);
    h = h + attention(norm1(h));
    h = h + contract(at::gelu(expand(norm2(h))));
    h = h + narrow(at::tanh(widen(h)));  // gathered whole, then each rank's slice again
    // Split along the width (dimension 1 here, as sequence parallelism splits sequences), then gathered for what
    // follows whole on every rank: each rank's gradient is whole, and it keeps its slice.
    const at::Tensor split = smp::tp::scatter_sequence(h.transpose(1, 2).contiguous(), group);
    h = h + smp::tp::gather_sequence(at::tanh(split), group, /*for_whole=*/true).transpose(1, 2);
    return smp::tp::vocab_parallel_cross_entropy(head(h), targets, group);
  }

  smp::tp::Group group;
  smp::tp::VocabParallelEmbedding embed;
  torch::nn::LayerNorm norm1;
  smp::tp::SelfAttention attention;
  torch::nn::LayerNorm norm2;
  smp::tp::ColumnParallelLinear expand;
  smp::tp::RowParallelLinear contract;
  smp::tp::ColumnParallelLinear widen;
  smp::tp::RowParallelLinear narrow;
  smp::tp::ColumnParallelLinear head;
};

// Pairs (shard, the whole tensor it is a shard of, the dimension split; -1: replicated).
struct Pair {
  std::string name;
  at::Tensor shard, whole;
  int64_t dim;
};

std::vector<Pair> pairs(Sharded& s, Whole& w) {
  auto& a = *s.attention;
  return {{"embed.weight", s.embed->weight, w.embed->weight, 0},
          {"norm1.weight", s.norm1->weight, w.norm1->weight, -1},
          {"norm1.bias", s.norm1->bias, w.norm1->bias, -1},
          {"query.weight", a.query->weight, w.query->weight, 0},
          {"query.bias", a.query->bias, w.query->bias, 0},
          {"key.weight", a.key->weight, w.key->weight, 0},
          {"key.bias", a.key->bias, w.key->bias, 0},
          {"value.weight", a.value->weight, w.value->weight, 0},
          {"value.bias", a.value->bias, w.value->bias, 0},
          {"projection.weight", a.projection->weight, w.projection->weight, 1},
          {"projection.bias", a.projection->bias, w.projection->bias, -1},
          {"norm2.weight", s.norm2->weight, w.norm2->weight, -1},
          {"norm2.bias", s.norm2->bias, w.norm2->bias, -1},
          {"expand.weight", s.expand->weight, w.expand->weight, 0},
          {"expand.bias", s.expand->bias, w.expand->bias, 0},
          {"contract.weight", s.contract->weight, w.contract->weight, 1},
          {"contract.bias", s.contract->bias, w.contract->bias, -1},
          {"widen.weight", s.widen->weight, w.widen->weight, 0},
          {"widen.bias", s.widen->bias, w.widen->bias, 0},
          {"narrow.weight", s.narrow->weight, w.narrow->weight, 1},
          {"narrow.bias", s.narrow->bias, w.narrow->bias, -1},
          {"head.weight", s.head->weight, w.head->weight, 0}};
}

at::Tensor expected_shard(const Pair& pair, const smp::tp::Group& group) {
  return pair.dim < 0 ? pair.whole : smp::tp::shard_of(pair.whole, pair.dim, group);
}

// all_gather and reduce_scatter_sum against what they mean.
int check_collectives(smp::comm::Communicator& group) {
  const int n = group.size(), r = group.rank();
  const at::Tensor shard = at::full({2, 3}, static_cast<float>(r + 1));
  at::Tensor whole = at::empty({2 * n, 3});
  group.all_gather(whole, shard);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) mismatches += !at::equal(whole.narrow(0, 2 * i, 2), at::full({2, 3}, float(i + 1)));
  const at::Tensor contributions = at::arange(2 * n * 3, at::kFloat).view({2 * n, 3}) * (r + 1);
  at::Tensor mine = at::empty({2, 3});
  group.reduce_scatter_sum(mine, contributions);
  const double factor = n * (n + 1) / 2.0;
  mismatches += !at::allclose(mine, at::arange(2 * n * 3, at::kFloat).view({2 * n, 3}).narrow(0, 2 * r, 2) * factor);
  try {
    group.all_gather(at::empty({3, 3}), shard);
    ++mismatches;  // a whole tensor of the wrong size must be refused
  } catch (const smp::comm::CommError&) {
  }
  return mismatches;
}

// The operators' shapes without data (what a torch.export capture sees) and their refusals.
int check_operator_shapes(const smp::tp::Group& group) {
  const int64_t n = group->size();
  const at::Tensor meta = at::empty({2, 4 * n, 3}, at::device(at::kMeta));
  int mismatches = 0;
  mismatches += smp::tp::gather_last_dim(meta, group).sizes() != at::IntArrayRef({2, 4 * n, 3 * n});
  mismatches += smp::tp::scatter_sequence(meta, group).sizes() != at::IntArrayRef({2, 4, 3});
  mismatches += smp::tp::gather_sequence(meta, group, true).sizes() != at::IntArrayRef({2, 4 * n * n, 3});
  mismatches += smp::tp::reduce_from_shards(meta, group).sizes() != meta.sizes();
  try {
    smp::tp::reduce_scatter_sequence(at::empty({2, 4 * n + 1, 3}, at::device(at::kMeta)), group);
    ++mismatches;  // a sequence that does not split must be refused
  } catch (const smp::ConfigError& error) {
    mismatches += std::string(error.what()).find("does not split") == std::string::npos;
  }
  return mismatches;
}

int run(int argc, char** argv) {
  std::string config_path;
  int steps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--config") config_path = argv[i + 1];
    if (flag == "--steps") steps = std::stoi(argv[i + 1]);
  }
  auto runtime = smp::Runtime::init(smp::Config::from_file(config_path));
  const auto group = runtime->tensor_parallel_group();
  int mismatches = check_collectives(*group) + check_operator_shapes(group);

  at::manual_seed(runtime->config().seed);
  auto whole = std::make_shared<Whole>();
  auto sharded = std::make_shared<Sharded>(group);
  {
    at::NoGradGuard no_grad;
    for (auto& pair : pairs(*sharded, *whole)) pair.shard.copy_(expected_shard(pair, group));
  }
  torch::optim::SGD whole_optimizer(whole->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD sharded_optimizer(sharded->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < steps; ++step) {
    at::manual_seed(1000 + step);  // the same batch on every rank of the group
    const at::Tensor tokens = at::randint(kVocabulary, {kBatch, kLength + 1}, at::kLong);
    const at::Tensor ids = tokens.narrow(1, 0, kLength), targets = tokens.narrow(1, 1, kLength);
    whole_optimizer.zero_grad();
    sharded_optimizer.zero_grad();
    const at::Tensor expected = whole->loss(ids, targets);
    const at::Tensor loss = sharded->loss(ids, targets);
    expected.backward();
    loss.backward();
    whole_optimizer.step();
    sharded_optimizer.step();
    if (std::abs(loss.item<double>() - expected.item<double>()) > 1e-5) {
      std::printf("rank %d step %d: loss %.8f, whole model %.8f\n", runtime->rank(), step, loss.item<double>(),
                  expected.item<double>());
      ++mismatches;
    }
    if (runtime->rank() == 0) std::printf("step %d loss %.6f\n", step, loss.item<double>());
  }
  const auto all = pairs(*sharded, *whole);
  for (const auto& pair : all) {
    if (!at::allclose(pair.shard, expected_shard(pair, group), 1e-5, 1e-6)) {
      std::printf("rank %d: %s differs from the whole model's shard by %g\n", runtime->rank(), pair.name.c_str(),
                  (pair.shard - expected_shard(pair, group)).abs().max().item<double>());
      ++mismatches;
    }
  }
  std::printf("rank %d: %zu tensors checked, %d mismatches\n", runtime->rank(), all.size(), mismatches);
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
