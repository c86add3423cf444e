#include "smp/tp.h"

#include <utility>

#include <ATen/ATen.h>

#include "smp/collectives.h"
#include "smp/config.h"

namespace smp::tp {

namespace {

// The share of `size` on each of the group's ranks; ConfigError naming the layer when it does not divide.
int64_t per_rank(int64_t size, const Group& group, const std::string& layer, const std::string& what) {
  const int ranks = group->size();
  if (size % ranks != 0) {
    throw ConfigError(layer + ": " + what + " " + std::to_string(size) + " does not divide by \"tensor_parallel_degree\" " +
                      std::to_string(ranks));
  }
  return size / ranks;
}

// A whole embedding's weight, drawn as torch::nn::Embedding draws it: normal, the padding row zero.
at::Tensor drawn_embedding(int64_t vocabulary, int64_t dimension, int64_t padding_idx) {
  at::Tensor weight = at::randn({vocabulary, dimension});
  if (padding_idx >= 0) weight[padding_idx].zero_();
  return weight;
}

}  // namespace

std::vector<ShardLayout> shard_layouts_in(torch::nn::Module& module) {
  std::vector<ShardLayout> layouts;
  for (const auto& child : module.modules()) {
    if (const auto* sharded = dynamic_cast<const Sharded*>(child.get())) {
      for (auto& layout : sharded->shard_layouts()) layouts.push_back(std::move(layout));
    }
  }
  return layouts;
}

std::vector<at::Tensor> sequence_parallel_parameters_in(torch::nn::Module& module) {
  std::vector<at::Tensor> parameters;
  for (const auto& child : module.modules()) {
    if (const auto* marked = dynamic_cast<const SequenceParallel*>(child.get())) {
      for (auto& parameter : marked->sequence_parallel_parameters()) parameters.push_back(std::move(parameter));
    }
  }
  return parameters;
}

at::Tensor shard_of(const at::Tensor& whole, int64_t dim, const Group& group, int64_t blocks) {
  return shard_of(whole, dim, group->rank(), group->size(), blocks);
}

at::Tensor shard_of(const at::Tensor& whole, int64_t dim, int64_t rank, int64_t degree, int64_t blocks) {
  dim = dim < 0 ? dim + whole.dim() : dim;
  const int64_t size = whole.size(dim);
  if (blocks < 1 || size % blocks != 0 || (size / blocks) % degree != 0) {
    throw ConfigError("dimension " + std::to_string(dim) + " of size " + std::to_string(size) + " in " +
                      std::to_string(blocks) + " block(s) does not divide by \"tensor_parallel_degree\" " +
                      std::to_string(degree));
  }
  const at::Tensor blocked = whole.unflatten(dim, {blocks, size / blocks});
  const at::Tensor shard = blocked.chunk(degree, dim + 1)[static_cast<std::size_t>(rank)];
  return shard.flatten(dim, dim + 1).clone(at::MemoryFormat::Contiguous);  // its own storage, never a view of `whole`
}

at::Tensor whole_of(const std::vector<at::Tensor>& shards, int64_t dim, int64_t blocks) {
  std::vector<at::Tensor> blocked;
  for (const auto& shard : shards) {
    const int64_t d = dim < 0 ? dim + shard.dim() : dim;
    blocked.push_back(shard.unflatten(d, {blocks, shard.size(d) / blocks}));
  }
  const int64_t d = dim < 0 ? dim + shards.front().dim() : dim;
  return at::cat(blocked, d + 1).flatten(d, d + 1);
}

at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                  const Group& group, const ColumnParallelOptions& options) {
  using Input = ColumnParallelOptions::Input;
  const at::Tensor whole = options.input == Input::whole            ? copy_to_shards(input, group)
                           : options.input == Input::sequence_slice ? gather_sequence(input, group)
                                                                     : input;
  at::Tensor output;
  if (!options.transposed) {
    output = at::linear(whole, weight, bias);
  } else if (bias.defined()) {  // as Conv1D computes, so that a sharded Hugging Face model rounds as its whole one
    std::vector<c10::SymInt> shape = whole.sym_sizes().vec();
    shape.back() = -1;
    output = at::addmm(bias, whole.reshape_symint({-1, whole.sym_size(-1)}), weight).view_symint(shape);
  } else {
    output = at::matmul(whole, weight);
  }
  return options.gather_output ? gather_last_dim(output, group) : output;
}

at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                               const Group& group, const RowParallelOptions& options) {
  const at::Tensor shard = options.input_is_parallel ? input : scatter_last_dim(input, group);
  const at::Tensor partial = options.transposed ? at::matmul(shard, weight) : at::linear(shard, weight);
  const at::Tensor output =
      options.sequence_parallel ? reduce_scatter_sequence(partial, group) : reduce_from_shards(partial, group);
  return bias.defined() ? output + bias : output;
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t first_id,
                                    const Group& group, int64_t padding_idx) {
  const int64_t rows = weight.size(0);
  const int64_t local_padding = padding_idx >= first_id && padding_idx < first_id + rows ? padding_idx - first_id : -1;
  const at::Tensor elsewhere = (ids < first_id) | (ids >= first_id + rows);
  const at::Tensor found = at::embedding(weight, (ids - first_id).masked_fill(elsewhere, 0), local_padding);
  return reduce_from_shards(found.masked_fill(elsewhere.unsqueeze(-1), 0.0), group);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, Group group, bool bias,
                                                   bool gather_output)
    : ColumnParallelLinearImpl(torch::nn::Linear(torch::nn::LinearOptions(in_features, out_features).bias(bias)),
                               std::move(group), gather_output) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& whole, Group group, bool gather_output,
                                                   int64_t blocks, bool sequence_parallel)
    : group_(std::move(group)), gather_output_(gather_output), blocks_(blocks), sequence_parallel_(sequence_parallel) {
  per_rank(whole->weight.size(0) / blocks, group_, "ColumnParallelLinear", "output features");
  const at::NoGradGuard no_grad;
  weight = register_parameter("weight", shard_of(whole->weight, 0, group_, blocks));
  if (whole->bias.defined()) bias = register_parameter("bias", shard_of(whole->bias, 0, group_, blocks));
}

std::vector<ShardLayout> ColumnParallelLinearImpl::shard_layouts() const {
  std::vector<ShardLayout> layouts{{weight, 0, blocks_}};
  if (bias.defined()) layouts.push_back({bias, 0, blocks_});
  return layouts;
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  using Input = ColumnParallelOptions::Input;
  return column_parallel_linear(input, weight, bias, group_,
                                {.input = sequence_parallel_ ? Input::sequence_slice : Input::whole,
                                 .gather_output = gather_output_});
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in_features, int64_t out_features, Group group, bool bias,
                                             bool input_is_parallel)
    : RowParallelLinearImpl(torch::nn::Linear(torch::nn::LinearOptions(in_features, out_features).bias(bias)),
                            std::move(group), input_is_parallel) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& whole, Group group, bool input_is_parallel,
                                             bool sequence_parallel)
    : group_(std::move(group)), input_is_parallel_(input_is_parallel), sequence_parallel_(sequence_parallel) {
  per_rank(whole->weight.size(1), group_, "RowParallelLinear", "input features");
  const at::NoGradGuard no_grad;
  weight = register_parameter("weight", shard_of(whole->weight, 1, group_));
  if (whole->bias.defined()) bias = register_parameter("bias", whole->bias.detach().clone());
}

std::vector<ShardLayout> RowParallelLinearImpl::shard_layouts() const { return {{weight, 1, 1}}; }

std::vector<at::Tensor> RowParallelLinearImpl::sequence_parallel_parameters() const {
  if (sequence_parallel_ && bias.defined()) return {bias};
  return {};
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  return row_parallel_linear(input, weight, bias, group_,
                             {.input_is_parallel = input_is_parallel_, .sequence_parallel = sequence_parallel_});
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocabulary, int64_t dimension, Group group,
                                                       int64_t padding_idx)
    : VocabParallelEmbeddingImpl(drawn_embedding(vocabulary, dimension, padding_idx), std::move(group), padding_idx) {}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const at::Tensor& whole_weight, Group group,
                                                       int64_t padding_idx)
    : group_(std::move(group)), padding_idx_(padding_idx) {
  const int64_t local = per_rank(whole_weight.size(0), group_, "VocabParallelEmbedding", "vocabulary");
  first_id_ = group_->rank() * local;
  const at::NoGradGuard no_grad;
  weight = register_parameter("weight", shard_of(whole_weight, 0, group_));
}

std::vector<ShardLayout> VocabParallelEmbeddingImpl::shard_layouts() const { return {{weight, 0, 1}}; }

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  return vocab_parallel_embedding(ids, weight, first_id_, group_, padding_idx_);
}

SelfAttentionImpl::SelfAttentionImpl(int64_t d_model, int64_t heads, Group group) {
  if (heads <= 0 || d_model % heads != 0) {
    throw ConfigError("SelfAttention: d_model " + std::to_string(d_model) + " is not a multiple of " +
                      std::to_string(heads) + " heads");
  }
  local_heads_ = per_rank(heads, group, "SelfAttention", "heads");
  query = register_module("query", ColumnParallelLinear(d_model, d_model, group));
  key = register_module("key", ColumnParallelLinear(d_model, d_model, group));
  value = register_module("value", ColumnParallelLinear(d_model, d_model, group));
  projection = register_module("projection", RowParallelLinear(d_model, d_model, std::move(group)));
}

at::Tensor SelfAttentionImpl::forward(const at::Tensor& input) {
  const int64_t batch = input.size(0), length = input.size(1);
  const int64_t head_size = query->weight.size(0) / local_heads_;
  // One gradient all-reduce for the three projections' shared input, not one each.
  const Group& group = projection->group();
  const at::Tensor shared = copy_to_shards(input, group);
  const auto heads = [&](const ColumnParallelLinear& linear) {
    return at::linear(shared, linear->weight, linear->bias).view({batch, length, local_heads_, head_size}).transpose(1, 2);
  };
  const at::Tensor attended =
      at::scaled_dot_product_attention(heads(query), heads(key), heads(value), {}, 0.0, /*is_causal=*/true);
  return projection(attended.transpose(1, 2).reshape({batch, length, local_heads_ * head_size}));
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const Group& group,
                                        int64_t ignore_index) {
  const int64_t ranks = group->size();
  const int64_t local = logits.size(-1);
  const int64_t first_id = group->rank() * local;
  const at::Tensor rows = logits.reshape({-1, local}).to(at::isReducedFloatingType(logits.scalar_type())
                                                             ? at::kFloat : logits.scalar_type());
  const at::Tensor ids = targets.reshape({-1});
  // The largest logit over the whole vocabulary, for a stable exponent; it cancels out, so it takes no gradient.
  const at::Tensor local_max = std::get<0>(rows.detach().max(-1)).contiguous();
  const at::Tensor maxima = gather_last_dim(local_max, group);  // every rank's, one after the other
  const at::Tensor shifted = rows - std::get<0>(maxima.view({ranks, -1}).max(0)).unsqueeze(1);
  const at::Tensor sum_exp = reduce_from_shards(shifted.exp().sum(-1), group);
  const at::Tensor elsewhere = (ids < first_id) | (ids >= first_id + local);
  const at::Tensor picked =
      shifted.gather(1, (ids - first_id).masked_fill(elsewhere, 0).unsqueeze(1)).squeeze(1).masked_fill(elsewhere, 0.0);
  const at::Tensor counted = (ids != ignore_index).to(rows.scalar_type());
  return ((sum_exp.log() - reduce_from_shards(picked, group)) * counted).sum() / counted.sum();
}

}  // namespace smp::tp
