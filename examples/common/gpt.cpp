#include "gpt.h"

#include <cmath>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "smp/config.h"
#include "smp/tp.h"

namespace smp::examples {
namespace {

bool sharded(const tp::Group& group) { return group && group->size() > 1; }

// Sequence parallelism: the blocks take and return this rank's slice of the sequence; their norms see only it.
bool sequence_split(const GptOptions& options, const tp::Group& group) { return sharded(group) && options.sequence_parallel; }

std::vector<at::Tensor> norm_parameters(const torch::nn::LayerNorm& norm) { return norm->parameters(); }

// Every module below draws the whole model's weights from the generator in the same order whatever the
// tensor-parallel degree, and keeps its shards: the shards of any degree are the one-process model's weights.
class TokenEmbeddingImpl : public torch::nn::Module {
 public:
  TokenEmbeddingImpl(const GptOptions& options, const tp::Group& group)
      : group_(group), sequence_parallel_(sequence_split(options, group)) {
    torch::nn::Embedding tokens(options.vocab_size, options.d_model);
    positions_ = register_module("positions", torch::nn::Embedding(options.context, options.d_model));
    {
      // GPT-2's small initialisation: the token matrix doubles as the output projection, and N(0, 1) entries
      // would start the logits far from uniform.
      c10::NoGradGuard no_grad;
      tokens->weight.normal_(0.0, 0.02);
      positions_->weight.normal_(0.0, 0.02);
    }
    if (sharded(group)) {
      sharded_tokens_ = register_module("tokens", tp::VocabParallelEmbedding(tokens->weight, group));
    } else {
      tokens_ = register_module("tokens", tokens);
    }
  }

  at::Tensor forward(const at::Tensor& token_ids) {
    const auto length = token_ids.size(1);
    if (length > positions_->weight.size(0)) {
      throw ConfigError("sequence of " + std::to_string(length) + " tokens exceeds the model's context of " +
                        std::to_string(positions_->weight.size(0)));
    }
    const auto positions = at::arange(length, token_ids.options().dtype(at::kLong));
    const at::Tensor rows = tokens_ ? tokens_->forward(token_ids) : sharded_tokens_->forward(token_ids);
    const at::Tensor embedded = rows + positions_->forward(positions).unsqueeze(0);
    return sequence_parallel_ ? tp::scatter_sequence(embedded, group_) : embedded;
  }

 private:
  tp::Group group_;
  bool sequence_parallel_;
  torch::nn::Embedding tokens_{nullptr};
  tp::VocabParallelEmbedding sharded_tokens_{nullptr};  // the vocabulary's rows split over the group
  torch::nn::Embedding positions_{nullptr};
};
TORCH_MODULE(TokenEmbedding);

// A transformer block is two nodes, each with its residual: attention, then the MLP. The partitioner can then cut
// between them, where whole blocks would leave stages unbalanced (six blocks on four stages).
class AttentionResidualImpl : public torch::nn::Module, public tp::SequenceParallel {
 public:
  AttentionResidualImpl(const GptOptions& options, const tp::Group& group)
      : sequence_parallel_(sequence_split(options, group)),
        heads_(options.heads / (sharded(group) ? group->size() : 1)),
        head_size_(options.d_model / options.heads),
        attention_norm_(register_module("attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})))) {
    torch::nn::Linear qkv(options.d_model, 3 * options.d_model), projection(options.d_model, options.d_model);
    if (!sharded(group)) {
      qkv_ = register_module("qkv", qkv);
      projection_ = register_module("projection", projection);
      return;
    }
    if (options.heads % group->size() != 0) {
      throw ConfigError("model.heads " + std::to_string(options.heads) + " does not divide by \"tensor_parallel_degree\" " +
                        std::to_string(group->size()));
    }
    // The heads split: each rank's query, key and value rows for its heads (qkv's rows are 3 blocks of heads).
    sharded_qkv_ = register_module("qkv", tp::ColumnParallelLinear(qkv, group, false, 3, sequence_parallel_));
    sharded_projection_ = register_module("projection", tp::RowParallelLinear(projection, group, true, sequence_parallel_));
  }

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor normed = attention_norm_->forward(x);
    at::Tensor qkv = qkv_ ? qkv_->forward(normed) : sharded_qkv_->forward(normed);  // the whole sequence
    const auto batch = qkv.size(0), length = qkv.size(1);
    qkv = qkv.view({batch, length, 3, heads_, head_size_});
    qkv = qkv.permute({2, 0, 3, 1, 4});  // [3, B, heads, T, head_dim]
    auto attended = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                     /*is_causal=*/true);
    attended = attended.transpose(1, 2).reshape({batch, length, heads_ * head_size_});
    return x + (projection_ ? projection_->forward(attended) : sharded_projection_->forward(attended));
  }

  std::vector<at::Tensor> sequence_parallel_parameters() const override {
    return sequence_parallel_ ? norm_parameters(attention_norm_) : std::vector<at::Tensor>{};
  }

 private:
  bool sequence_parallel_;
  int64_t heads_;  // this rank's
  int64_t head_size_;
  torch::nn::LayerNorm attention_norm_;
  torch::nn::Linear qkv_{nullptr}, projection_{nullptr};
  tp::ColumnParallelLinear sharded_qkv_{nullptr};
  tp::RowParallelLinear sharded_projection_{nullptr};
};
TORCH_MODULE(AttentionResidual);

class MlpResidualImpl : public torch::nn::Module, public tp::SequenceParallel {
 public:
  MlpResidualImpl(const GptOptions& options, const tp::Group& group)
      : sequence_parallel_(sequence_split(options, group)),
        mlp_norm_(register_module("mlp_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})))) {
    torch::nn::Linear expand(options.d_model, 4 * options.d_model), contract(4 * options.d_model, options.d_model);
    if (sharded(group)) {
      sharded_expand_ = register_module("expand", tp::ColumnParallelLinear(expand, group, false, 1, sequence_parallel_));
      sharded_contract_ = register_module("contract", tp::RowParallelLinear(contract, group, true, sequence_parallel_));
    } else {
      expand_ = register_module("expand", expand);
      contract_ = register_module("contract", contract);
    }
  }

  at::Tensor forward(const at::Tensor& h) {
    const at::Tensor normed = mlp_norm_->forward(h);
    if (expand_) return h + contract_->forward(at::gelu(expand_->forward(normed)));
    return h + sharded_contract_->forward(at::gelu(sharded_expand_->forward(normed)));
  }

  std::vector<at::Tensor> sequence_parallel_parameters() const override {
    return sequence_parallel_ ? norm_parameters(mlp_norm_) : std::vector<at::Tensor>{};
  }

 private:
  bool sequence_parallel_;
  torch::nn::LayerNorm mlp_norm_;
  torch::nn::Linear expand_{nullptr}, contract_{nullptr};
  tp::ColumnParallelLinear sharded_expand_{nullptr};
  tp::RowParallelLinear sharded_contract_{nullptr};
};
TORCH_MODULE(MlpResidual);

// Under tensor parallelism its output weight is this rank's rows of the vocabulary (the embedding's shard when tied),
// and it returns this rank's logits: gpt_loss_for's loss never gathers them.
class LanguageModelHeadImpl : public torch::nn::Module, public tp::Sharded, public tp::SequenceParallel {
 public:
  // `tied_weight`, when defined, is the token embedding matrix [vocab, d_model] (or its shard), used as the output
  // projection.
  LanguageModelHeadImpl(const GptOptions& options, const at::Tensor& tied_weight, const tp::Group& group)
      : norm_(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})))),
        group_(group),
        sequence_parallel_(sequence_split(options, group)) {
    if (tied_weight.defined()) {
      output_weight_ = register_parameter("output_weight", tied_weight);
      return;
    }
    at::Tensor whole = torch::nn::Linear(torch::nn::LinearOptions(options.d_model, options.vocab_size).bias(false))
                           ->weight.detach();
    output_weight_ = register_parameter("output_weight", sharded(group) ? tp::shard_of(whole, 0, group) : whole);
  }

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor normed = norm_->forward(x);
    if (!sharded(group_)) return at::linear(normed, output_weight_);
    return at::linear(sequence_parallel_ ? tp::gather_sequence(normed, group_) : tp::copy_to_shards(normed, group_),
                      output_weight_);
  }

  std::vector<tp::ShardLayout> shard_layouts() const override {
    if (!sharded(group_)) return {};
    return {{output_weight_, 0, 1}};
  }

  std::vector<at::Tensor> sequence_parallel_parameters() const override {
    return sequence_parallel_ ? norm_parameters(norm_) : std::vector<at::Tensor>{};
  }

 private:
  torch::nn::LayerNorm norm_;
  tp::Group group_;
  bool sequence_parallel_;
  at::Tensor output_weight_;
};
TORCH_MODULE(LanguageModelHead);

}  // namespace

GptOptions gpt_options_from_section(const std::string& json_text, const std::string& source) {
  GptOptions options;
  const auto section = nlohmann::json::parse(json_text.empty() ? "{}" : json_text);
  if (section.is_null()) return options;
  if (!section.is_object()) throw ConfigError(source + ": key \"model\": expected an object");
  if (section.contains("tie_embeddings")) {
    if (!section["tie_embeddings"].is_boolean()) {
      throw ConfigError(source + ": key \"model.tie_embeddings\": expected true or false");
    }
    options.tie_embeddings = section["tie_embeddings"].get<bool>();
  }
  const std::pair<const char*, int64_t*> keys[] = {{"vocab_size", &options.vocab_size}, {"context", &options.context},
                                                   {"d_model", &options.d_model},       {"heads", &options.heads},
                                                   {"layers", &options.layers}};
  for (auto it = section.begin(); it != section.end(); ++it) {
    bool known = it.key() == "tie_embeddings";
    for (const auto& [name, target] : keys) {
      if (it.key() != name) continue;
      known = true;
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 1 || it.value().get<int64_t>() > (1 << 20)) {
        throw ConfigError(source + ": key \"model." + it.key() + "\": expected an integer in [1, 1048576], got " +
                          it.value().dump());
      }
      *target = it.value().get<int64_t>();
    }
    if (!known) throw ConfigError(source + ": unknown key \"model." + it.key() + "\"");
  }
  if (options.d_model % options.heads != 0) {
    throw ConfigError(source + ": key \"model.heads\": " + std::to_string(options.heads) + " does not divide d_model " +
                      std::to_string(options.d_model));
  }
  return options;
}

smp::GraphModel make_gpt(const GptOptions& options, const tp::Group& tensor_parallel) {
  if (sharded(tensor_parallel) && options.vocab_size % tensor_parallel->size() != 0) {
    throw ConfigError("model.vocab_size " + std::to_string(options.vocab_size) +
                      " does not divide by \"tensor_parallel_degree\" " + std::to_string(tensor_parallel->size()));
  }
  // Every node is built on demand: a rank builds only the nodes of its own stages.
  const tp::Group group = tensor_parallel;
  smp::GraphModel model("tokens");
  model.add("embed", [options, group] { return TokenEmbedding(options, group); }, {"tokens"});
  std::string previous = "embed";
  for (int64_t layer = 0; layer < options.layers; ++layer) {
    const std::string block = "block" + std::to_string(layer);
    model.add(block + ".attention", [options, group] { return AttentionResidual(options, group); }, {previous});
    model.add(block + ".mlp", [options, group] { return MlpResidual(options, group); }, {block + ".attention"});
    previous = block + ".mlp";
  }
  if (options.tie_embeddings) {
    model.add("head",
              [options, group](const std::vector<at::Tensor>& shared) { return LanguageModelHead(options, shared[0], group); },
              {previous}, {"embed.tokens.weight"});
  } else {
    model.add("head", [options, group] { return LanguageModelHead(options, at::Tensor(), group); }, {previous});
  }
  return model;
}

at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> gpt_loss_for(const tp::Group& tensor_parallel) {
  if (!sharded(tensor_parallel)) return gpt_loss;
  return [tensor_parallel](const at::Tensor& logits, const at::Tensor& targets) {
    return tp::vocab_parallel_cross_entropy(logits, targets, tensor_parallel);
  };
}

}  // namespace smp::examples
