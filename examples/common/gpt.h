#pragma once
// A small GPT-style decoder written as an smp::GraphModel chain (embedding, transformer blocks as their attention
// and MLP halves, head), so that smp can cut it into pipeline stages between any two of them.

#include <cstdint>
#include <functional>
#include <string>

#include "smp/graph_model.h"
#include "smp/tp.h"

namespace smp::examples {

struct GptOptions {
  int64_t vocab_size = 256;  // byte-level tokens
  int64_t context = 64;      // positions the model can see
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 6;
  bool tie_embeddings = true;  // the LM head reuses the token embedding matrix, as GPT-2 does
  // Under tensor parallelism: the activations between blocks split along the sequence (the config's
  // "sequence_parallel"; not a "model" key). The sequence's length must divide by the degree.
  bool sequence_parallel = false;
};

// Reads the "model" section of a config, given as JSON text (unknown keys and bad values are errors naming the key).
GptOptions gpt_options_from_section(const std::string& json_text, const std::string& source);

// Nodes: "embed", "block0.attention", "block0.mlp", .., "block{layers-1}.mlp", "head", a chain; with tie_embeddings
// the head's weight is the embedding's "embed.tokens.weight" (a parameter shared across whatever stages hold the
// two). Every node is built on demand (GraphModel::add with a factory): DistributedModel builds a rank's own
// nodes, from the config's seed; GraphModel::materialize(seed) builds the whole model with the same weights.
// With a `tensor_parallel` group of several ranks, the attention (heads split), the MLP, the token embedding and the
// output layer (vocabulary split) are smp::tp layers, holding this rank's shards of the same weights.
smp::GraphModel make_gpt(const GptOptions& options, const tp::Group& tensor_parallel = nullptr);

// Mean cross-entropy of logits [B, T, V] against targets [B, T].
at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets);
// The loss of make_gpt's logits made with `tensor_parallel`: gpt_loss, or with several ranks the vocabulary-parallel
// cross entropy of this rank's logits [B, T, V / tp].
std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> gpt_loss_for(const tp::Group& tensor_parallel);

}  // namespace smp::examples
