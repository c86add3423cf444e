#include "gpt.h"

#include <cmath>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "smp/config.h"

namespace smp::examples {
namespace {

class TokenEmbeddingImpl : public torch::nn::Module {
 public:
  explicit TokenEmbeddingImpl(const GptOptions& options)
      : tokens_(register_module("tokens", torch::nn::Embedding(options.vocab_size, options.d_model))),
        positions_(register_module("positions", torch::nn::Embedding(options.context, options.d_model))) {
    // GPT-2's small initialisation: the token matrix doubles as the output projection, and N(0, 1) entries
    // would start the logits far from uniform.
    c10::NoGradGuard no_grad;
    tokens_->weight.normal_(0.0, 0.02);
    positions_->weight.normal_(0.0, 0.02);
  }

  const at::Tensor& token_weight() const { return tokens_->weight; }

  at::Tensor forward(const at::Tensor& token_ids) {
    const auto length = token_ids.size(1);
    if (length > positions_->weight.size(0)) {
      throw ConfigError("sequence of " + std::to_string(length) + " tokens exceeds the model's context of " +
                        std::to_string(positions_->weight.size(0)));
    }
    const auto positions = at::arange(length, token_ids.options().dtype(at::kLong));
    return tokens_->forward(token_ids) + positions_->forward(positions).unsqueeze(0);
  }

 private:
  torch::nn::Embedding tokens_;
  torch::nn::Embedding positions_;
};
TORCH_MODULE(TokenEmbedding);

// A transformer block is two nodes, each with its residual: attention, then the MLP. The partitioner can then cut
// between them, where whole blocks would leave stages unbalanced (six blocks on four stages).
class AttentionResidualImpl : public torch::nn::Module {
 public:
  explicit AttentionResidualImpl(const GptOptions& options)
      : heads_(options.heads),
        attention_norm_(register_module("attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})))),
        qkv_(register_module("qkv", torch::nn::Linear(options.d_model, 3 * options.d_model))),
        projection_(register_module("projection", torch::nn::Linear(options.d_model, options.d_model))) {}

  at::Tensor forward(const at::Tensor& x) {
    const auto batch = x.size(0), length = x.size(1), width = x.size(2);
    auto qkv = qkv_->forward(attention_norm_->forward(x)).view({batch, length, 3, heads_, width / heads_});
    qkv = qkv.permute({2, 0, 3, 1, 4});  // [3, B, heads, T, head_dim]
    auto attended = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                     /*is_causal=*/true);
    return x + projection_->forward(attended.transpose(1, 2).reshape({batch, length, width}));
  }

 private:
  int64_t heads_;
  torch::nn::LayerNorm attention_norm_;
  torch::nn::Linear qkv_, projection_;
};
TORCH_MODULE(AttentionResidual);

class MlpResidualImpl : public torch::nn::Module {
 public:
  explicit MlpResidualImpl(const GptOptions& options)
      : mlp_norm_(register_module("mlp_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})))),
        expand_(register_module("expand", torch::nn::Linear(options.d_model, 4 * options.d_model))),
        contract_(register_module("contract", torch::nn::Linear(4 * options.d_model, options.d_model))) {}

  at::Tensor forward(const at::Tensor& h) {
    return h + contract_->forward(at::gelu(expand_->forward(mlp_norm_->forward(h))));
  }

 private:
  torch::nn::LayerNorm mlp_norm_;
  torch::nn::Linear expand_, contract_;
};
TORCH_MODULE(MlpResidual);

class LanguageModelHeadImpl : public torch::nn::Module {
 public:
  // `tied_weight`, when defined, is the token embedding matrix [vocab, d_model], used as the output projection.
  LanguageModelHeadImpl(const GptOptions& options, const at::Tensor& tied_weight)
      : norm_(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})))) {
    output_weight_ = tied_weight.defined()
                         ? register_parameter("output_weight", tied_weight)
                         : register_parameter("output_weight", torch::nn::Linear(torch::nn::LinearOptions(
                                                                   options.d_model, options.vocab_size).bias(false))
                                                                   ->weight.detach());
  }

  at::Tensor forward(const at::Tensor& x) { return at::linear(norm_->forward(x), output_weight_); }

 private:
  torch::nn::LayerNorm norm_;
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

smp::GraphModel make_gpt(const GptOptions& options) {
  // Every node is built on demand: a rank builds only the nodes of its own stages.
  smp::GraphModel model("tokens");
  model.add("embed", [options] { return TokenEmbedding(options); }, {"tokens"});
  std::string previous = "embed";
  for (int64_t layer = 0; layer < options.layers; ++layer) {
    const std::string block = "block" + std::to_string(layer);
    model.add(block + ".attention", [options] { return AttentionResidual(options); }, {previous});
    model.add(block + ".mlp", [options] { return MlpResidual(options); }, {block + ".attention"});
    previous = block + ".mlp";
  }
  if (options.tie_embeddings) {
    model.add("head", [options](const std::vector<at::Tensor>& shared) { return LanguageModelHead(options, shared[0]); },
              {previous}, {"embed.tokens.weight"});
  } else {
    model.add("head", [options] { return LanguageModelHead(options, at::Tensor()); }, {previous});
  }
  return model;
}

at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

}  // namespace smp::examples
