#include "smp/tp.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include "smp/collectives.h"
#include "smp/config.h"

namespace smp::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels with the autograd context to backward, which runs after forward has returned.
struct HeldGroup : torch::CustomClassHolder {
  explicit HeldGroup(Group held) : group(std::move(held)) {}
  Group group;
};
c10::IValue hold(const Group& group) { return c10::IValue::make_capsule(c10::make_intrusive<HeldGroup>(group)); }
Group held(const c10::IValue& value) { return c10::static_intrusive_pointer_cast<HeldGroup>(value.toCapsule())->group; }

at::Tensor summed(const at::Tensor& tensor, const Group& group) {
  at::Tensor sum = tensor.contiguous().clone();
  if (without_collectives()) return sum;
  run_collective("TP_ALL_REDUCE", static_cast<int64_t>(sum.nbytes()), CollectiveCounter::all_reduced,
                 [&] { group->all_reduce_sum(sum); });
  return sum;
}

void all_gathered(const at::Tensor& whole, const at::Tensor& shard, const Group& group) {
  run_collective("TP_ALL_GATHER", static_cast<int64_t>(whole.nbytes()), CollectiveCounter::all_gathered,
             [&] { group->all_gather(whole, shard); });
}


// The shards along `dim` of every rank put together (all-gather), and the sum over ranks of `whole` split along
// `dim`, this rank's part (reduce-scatter); the transports work along dimension 0.
at::Tensor gathered_along(const at::Tensor& shard, int64_t dim, const Group& group) {
  if (without_collectives()) return at::cat(std::vector<at::Tensor>(static_cast<std::size_t>(group->size()), shard), dim);
  const at::Tensor front = shard.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] *= group->size();
  at::Tensor whole = at::empty(sizes, front.options());
  all_gathered(whole, front, group);
  return whole.movedim(0, dim).contiguous();
}

at::Tensor reduce_scattered_along(const at::Tensor& whole, int64_t dim, const Group& group) {
  const int64_t width = whole.size(dim) / group->size();
  if (without_collectives()) return whole.narrow(dim, group->rank() * width, width).contiguous();
  const at::Tensor front = whole.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] = width;
  at::Tensor shard = at::empty(sizes, front.options());
  run_collective("TP_REDUCE_SCATTER", static_cast<int64_t>(front.nbytes()), CollectiveCounter::reduce_scattered,
             [&] { group->reduce_scatter_sum(shard, front); });
  return shard.movedim(0, dim).contiguous();
}

at::Tensor own_slice(const at::Tensor& whole, int64_t dim, const Group& group) {
  const int64_t width = whole.size(dim) / group->size();
  return whole.narrow(dim, group->rank() * width, width).contiguous();
}

at::Tensor gathered_last_dim(const at::Tensor& shard, const Group& group) {
  return gathered_along(shard, shard.dim() - 1, group);
}

at::Tensor own_slice_last_dim(const at::Tensor& whole, const Group& group) { return own_slice(whole, -1, group); }

constexpr int64_t kSequenceDim = 1;

// The sequence's length must divide by the group: each rank holds an equal slice.
void check_sequence(const at::Tensor& input, const Group& group) {
  if (input.dim() < 2 || input.size(kSequenceDim) % group->size() != 0) {
    const std::string length = input.dim() < 2 ? "no" : std::to_string(input.size(kSequenceDim));
    throw ConfigError("sequence parallelism: a sequence of " + length +
                      " positions does not split over \"tensor_parallel_degree\" " + std::to_string(group->size()) +
                      " (its length must divide by it)");
  }
}

at::Tensor unchanged(const at::Tensor& tensor, const Group&) { return tensor; }
at::Tensor own_sequence_slice(const at::Tensor& whole, const Group& group) {
  return own_slice(whole, kSequenceDim, group);
}
at::Tensor gathered_sequence(const at::Tensor& slice, const Group& group) {
  return gathered_along(slice, kSequenceDim, group);
}
at::Tensor reduce_scattered_sequence(const at::Tensor& whole, const Group& group) {
  return reduce_scattered_along(whole, kSequenceDim, group);
}

// A collective as an autograd function: Forward on the input and Backward on its gradient, over the same group.
using Transform = at::Tensor (*)(const at::Tensor&, const Group&);
template <Transform Forward, Transform Backward>
struct Collective : torch::autograd::Function<Collective<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, const Group& group) {
    context->saved_data["group"] = hold(group);
    return Forward(input, group);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    return {Backward(gradients[0], held(context->saved_data["group"])), at::Tensor()};
  }
};

using CopyToShards = Collective<unchanged, summed>;
using ReduceFromShards = Collective<summed, unchanged>;
using GatherLastDim = Collective<gathered_last_dim, own_slice_last_dim>;
using ScatterLastDim = Collective<own_slice_last_dim, gathered_last_dim>;
using ScatterSequence = Collective<own_sequence_slice, gathered_sequence>;
using GatherSequence = Collective<gathered_sequence, reduce_scattered_sequence>;
using ReduceScatterSequence = Collective<reduce_scattered_sequence, gathered_sequence>;

// The share of `size` on each of the group's ranks; ConfigError naming the layer when it does not divide.
int64_t per_rank(int64_t size, const Group& group, const std::string& layer, const std::string& what) {
  const int ranks = group->size();
  if (size % ranks != 0) {
    throw ConfigError(layer + ": " + what + " " + std::to_string(size) + " does not divide by \"tensor_parallel_degree\" " +
                      std::to_string(ranks));
  }
  return size / ranks;
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

at::Tensor all_reduced(const at::Tensor& input, const Group& group) {
  return group->size() == 1 ? input.clone() : summed(input, group);
}
at::Tensor all_gathered(const at::Tensor& shard, int64_t dim, const Group& group) {
  return group->size() == 1 ? shard.clone() : gathered_along(shard, c10::maybe_wrap_dim(dim, shard.dim()), group);
}
at::Tensor reduce_scattered(const at::Tensor& whole, int64_t dim, const Group& group) {
  if (group->size() == 1) return whole.clone();
  dim = c10::maybe_wrap_dim(dim, whole.dim());
  if (whole.size(dim) % group->size() != 0) {
    throw ConfigError("reduce-scatter: dimension " + std::to_string(dim) + " of size " +
                      std::to_string(whole.size(dim)) + " does not split over \"tensor_parallel_degree\" " + std::to_string(group->size()));
  }
  return reduce_scattered_along(whole, dim, group);
}

at::Tensor scatter_sequence(const at::Tensor& input, const Group& group) {
  if (group->size() == 1) return input;
  check_sequence(input, group);
  return ScatterSequence::apply(input, group);
}
at::Tensor gather_sequence(const at::Tensor& input, const Group& group) {
  return group->size() == 1 ? input : GatherSequence::apply(input, group);
}
at::Tensor reduce_scatter_sequence(const at::Tensor& input, const Group& group) {
  if (group->size() == 1) return input;
  check_sequence(input, group);
  return ReduceScatterSequence::apply(input, group);
}

at::Tensor copy_to_shards(const at::Tensor& input, const Group& group) {
  return group->size() == 1 ? input : CopyToShards::apply(input, group);
}
at::Tensor reduce_from_shards(const at::Tensor& input, const Group& group) {
  return group->size() == 1 ? input : ReduceFromShards::apply(input, group);
}
at::Tensor gather_last_dim(const at::Tensor& input, const Group& group) {
  return group->size() == 1 ? input : GatherLastDim::apply(input, group);
}
at::Tensor scatter_last_dim(const at::Tensor& input, const Group& group) {
  return group->size() == 1 ? input : ScatterLastDim::apply(input, group);
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
  const at::Tensor whole = sequence_parallel_ ? gather_sequence(input, group_) : copy_to_shards(input, group_);
  const at::Tensor output = at::linear(whole, weight, bias);
  return gather_output_ ? gather_last_dim(output, group_) : output;
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
  const at::Tensor shard = input_is_parallel_ ? input : scatter_last_dim(input, group_);
  // The bias is added once, after the partial products are summed.
  const at::Tensor partial = at::linear(shard, weight);
  const at::Tensor output =
      sequence_parallel_ ? reduce_scatter_sequence(partial, group_) : reduce_from_shards(partial, group_);
  return bias.defined() ? output + bias : output;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocabulary, int64_t dimension, Group group)
    : VocabParallelEmbeddingImpl(at::randn({vocabulary, dimension}), std::move(group)) {}  // as torch::nn::Embedding

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const at::Tensor& whole_weight, Group group)
    : group_(std::move(group)) {
  const int64_t local = per_rank(whole_weight.size(0), group_, "VocabParallelEmbedding", "vocabulary");
  first_id_ = group_->rank() * local;
  const at::NoGradGuard no_grad;
  weight = register_parameter("weight", shard_of(whole_weight, 0, group_));
}

std::vector<ShardLayout> VocabParallelEmbeddingImpl::shard_layouts() const { return {{weight, 0, 1}}; }

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const at::Tensor elsewhere = (ids < first_id_) | (ids >= first_id_ + weight.size(0));
  const at::Tensor rows = at::embedding(weight, (ids - first_id_).masked_fill(elsewhere, 0));
  return reduce_from_shards(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), group_);
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
  const int64_t local = logits.size(-1);
  const int64_t first_id = group->rank() * local;
  const at::Tensor rows = logits.reshape({-1, local}).to(at::isReducedFloatingType(logits.scalar_type())
                                                             ? at::kFloat : logits.scalar_type());
  const at::Tensor ids = targets.reshape({-1});
  // The largest logit over the whole vocabulary, for a stable exponent; it cancels out, so it takes no gradient.
  const at::Tensor local_max = std::get<0>(rows.detach().max(-1)).contiguous();
  at::Tensor maxima = at::empty({group->size() * local_max.size(0)}, local_max.options());
  if (group->size() == 1 || without_collectives()) {
    maxima = local_max.repeat({group->size()});
  } else {
    all_gathered(maxima, local_max, group);
  }
  const at::Tensor shifted = rows - std::get<0>(maxima.view({group->size(), -1}).max(0)).unsqueeze(1);
  const at::Tensor sum_exp = reduce_from_shards(shifted.exp().sum(-1), group);
  const at::Tensor elsewhere = (ids < first_id) | (ids >= first_id + local);
  const at::Tensor picked =
      shifted.gather(1, (ids - first_id).masked_fill(elsewhere, 0).unsqueeze(1)).squeeze(1).masked_fill(elsewhere, 0.0);
  const at::Tensor counted = (ids != ignore_index).to(rows.scalar_type());
  return ((sum_exp.log() - reduce_from_shards(picked, group)) * counted).sum() / counted.sum();
}

}  // namespace smp::tp
