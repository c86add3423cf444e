#pragma once
// Tensor-parallel layers (Megatron-LM's): each rank of a tensor-parallel group (Runtime::tensor_parallel_group())
// holds one shard of every such layer's weights and computes its share; the collectives in their forward and
// backward make the result what the whole layer computes. Shards split along the output features (column) or input
// features (row) of a linear layer, the heads of attention, or the rows of an embedding (the vocabulary).
//
//   auto group = runtime->tensor_parallel_group();
//   ColumnParallelLinear expand(d, 4 * d, group);   // y_i = x W_i^T: the input whole, the output sharded
//   RowParallelLinear contract(4 * d, d, group);    // y = sum_i x_i W_i^T: the input sharded, the output whole
//   auto y = contract(at::gelu(expand(x)));         // two collectives per MLP: all-reduces in backward and forward
//
// Every rank of the group runs the same inputs (they are replicated) and gets the same outputs; a loss computed from
// them is the same on every rank, and each rank's backward fills its own shards' gradients.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "smp/collectives.h"
#include "smp/comm/communicator.h"

namespace smp::tp {

using Group = std::shared_ptr<comm::Communicator>;

// The collectives, each paired with the one its gradient takes (autograd functions), for layers of one's own. They are
// the dispatcher's operators torch.ops.smp.tp_NAME(input, group=0) (tp_collectives.cpp), which Python's smp.tp calls
// and a torch.export capture keeps as nodes; they count their bytes, report to the CollectiveObserver and skip
// communication under WithoutCollectives. A group of one rank passes the input on.
// the input whole on every rank, about to be used by sharded weights: identity forward, gradients summed backward.
at::Tensor copy_to_shards(const at::Tensor& input, const Group& group);
// partial sums of every rank added up: all-reduce forward, identity backward.
at::Tensor reduce_from_shards(const at::Tensor& input, const Group& group);
// the shards of the last dimension put together: all-gather forward, this rank's slice of the gradient backward.
at::Tensor gather_last_dim(const at::Tensor& input, const Group& group);
// this rank's slice of the last dimension: slice forward, all-gather backward.
at::Tensor scatter_last_dim(const at::Tensor& input, const Group& group);

// Sequence parallelism (Megatron's): between a row layer and the next column layer, activations are split along the
// sequence (dimension 1) over the group, so that norms, dropout and residual adds hold and compute 1/tp of them.
constexpr int64_t kSequenceDim = 1;
// this rank's slice of the sequence: slice forward, all-gather backward (where the split begins).
at::Tensor scatter_sequence(const at::Tensor& input, const Group& group);
// the slices put together: all-gather forward, reduce-scatter backward (before a column layer, in place of
// copy_to_shards). for_whole: before computation that is whole on every rank (where the split ends), whose gradient
// every rank holds whole: this rank's slice of it backward.
at::Tensor gather_sequence(const at::Tensor& input, const Group& group, bool for_whole = false);
// partial sums added up and split: reduce-scatter forward, all-gather backward (after a row layer, in place of
// reduce_from_shards).
at::Tensor reduce_scatter_sequence(const at::Tensor& input, const Group& group);

// The operators name groups by number: 0 is the process's tensor-parallel group (the Runtime sets it, anew for each
// layout it adopts), others are registered on first use. Groups are held weakly.
void use_as_process_group(const Group& group);
Group process_group();  // null before a runtime set one

// While one lives, the process's group is a stand-in of `degree` ranks, this process its rank 0, that moves nothing
// (a transfer on it throws): the planner shards, captures and profiles a model at a degree the job has not adopted,
// its collectives skipped (WithoutCollectives) and counted. The group before it comes back after.
class ProfiledDegree {
 public:
  explicit ProfiledDegree(int degree);
  ~ProfiledDegree();
  ProfiledDegree(const ProfiledDegree&) = delete;
  ProfiledDegree& operator=(const ProfiledDegree&) = delete;

 private:
  Group before_;
  Group stand_in_;
};
int64_t group_handle(const Group& group);

// The layers' computation, for modules of either language (C++'s below, Python's smp.tp): the collectives around a
// matrix product, over `group`.
struct ColumnParallelOptions {
  enum class Input {
    whole,             // the same on every rank: copy_to_shards (its gradients summed backward)
    sequence_slice,    // this rank's slice of the sequence (sequence parallelism): gather_sequence first
    already_gathered,  // gathered by the caller, once for several layers (query, key and value): as it is
  };
  Input input = Input::whole;
  bool gather_output = false;  // the output whole (all-gathered) instead of this rank's features
  bool transposed = false;     // the weight stored [in, out] (Hugging Face's Conv1D) rather than [out, in]
};
at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                  const Group& group, const ColumnParallelOptions& options = {});
struct RowParallelOptions {
  bool input_is_parallel = true;   // false: the input is whole, each rank takes its slice of the last dimension
  bool sequence_parallel = false;  // the output split along the sequence (reduce-scatter), the bias added to it
  bool transposed = false;
};
// The bias is whole on every rank, added once after the sum.
at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                               const Group& group, const RowParallelOptions& options = {});
// This rank's rows [first_id, first_id + rows) of the vocabulary looked up, the others zero, summed over the group.
// padding_idx (a whole-vocabulary id, -1 for none): its row, if this rank's, takes no gradient.
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t first_id,
                                    const Group& group, int64_t padding_idx = -1);

// A module whose parameters are whole on every rank of the group but see only this rank's part of the sequence (a
// norm under sequence parallelism): their gradients are partial, summed over the group once per step by
// DistributedModel.
class SequenceParallel {
 public:
  virtual ~SequenceParallel() = default;
  virtual std::vector<at::Tensor> sequence_parallel_parameters() const = 0;
};
std::vector<at::Tensor> sequence_parallel_parameters_in(torch::nn::Module& module);

// This rank's shard of a whole tensor along `dim` (a weight made whole in one process, for loading or checking).
// With `blocks` > 1 the dimension holds that many blocks one after the other (a fused query/key/value projection's
// output features: 3), and the shard is this rank's part of each block, in block order.
at::Tensor shard_of(const at::Tensor& whole, int64_t dim, const Group& group, int64_t blocks = 1);
// The same for tensor-parallel rank `rank` of `degree` (offline, without a group: checkpoints, Python's smp.tp).
// ConfigError when the dimension's blocks do not divide by the degree.
at::Tensor shard_of(const at::Tensor& whole, int64_t dim, int64_t rank, int64_t degree, int64_t blocks = 1);

// The whole tensor of which `shards` are every rank's (in rank order) shard_of(whole, dim, ·, blocks): what an export
// of a tensor-parallel checkpoint writes.
at::Tensor whole_of(const std::vector<at::Tensor>& shards, int64_t dim, int64_t blocks = 1);

// Where a sharded parameter's shard sits in the whole tensor (as shard_of cut it).
struct ShardLayout {
  at::Tensor shard;
  int64_t dim = 0;
  int64_t blocks = 1;
};

// A module holding shards: which of its own parameters are shards (the others are whole on every rank of the
// group). Gradient norms count a shard on every rank, a whole parameter once per group; checks and exports cut the
// whole model's tensor with the layout.
class Sharded {
 public:
  virtual ~Sharded() = default;
  virtual std::vector<ShardLayout> shard_layouts() const = 0;
};

// The layouts of every shard in `module` and its submodules.
std::vector<ShardLayout> shard_layouts_in(torch::nn::Module& module);


// y = x A^T + b with A's rows (output features) split: the output's last dimension is sharded unless gather_output.
// Initialized as torch::nn::Linear initializes the whole layer, from the same random numbers, and cut: the shards
// of every degree put together are the layer a one-process model draws.
class ColumnParallelLinearImpl : public torch::nn::Module, public Sharded {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, Group group, bool bias = true,
                           bool gather_output = false);
  // This rank's shard of `whole`; `blocks`: its output features are that many blocks to shard each (shard_of).
  // sequence_parallel: the input is this rank's slice of the sequence, gathered first (gather_sequence).
  ColumnParallelLinearImpl(const torch::nn::Linear& whole, Group group, bool gather_output = false, int64_t blocks = 1,
                           bool sequence_parallel = false);
  at::Tensor forward(const at::Tensor& input);
  std::vector<ShardLayout> shard_layouts() const override;
  at::Tensor weight;  // [out_features / tp, in_features]
  at::Tensor bias;    // [out_features / tp], or undefined

 private:
  Group group_;
  bool gather_output_;
  int64_t blocks_ = 1;
  bool sequence_parallel_ = false;
};
TORCH_MODULE(ColumnParallelLinear);

// y = x A^T + b with A's columns (input features) split: takes the input sharded along its last dimension (a column
// layer's output) unless input_is_parallel is false; the output is whole. The bias is whole on every rank.
class RowParallelLinearImpl : public torch::nn::Module, public Sharded, public SequenceParallel {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, Group group, bool bias = true,
                        bool input_is_parallel = true);
  // sequence_parallel: the output is this rank's slice of the sequence (reduce_scatter_sequence), the bias added to it.
  RowParallelLinearImpl(const torch::nn::Linear& whole, Group group, bool input_is_parallel = true,
                        bool sequence_parallel = false);
  at::Tensor forward(const at::Tensor& input);
  std::vector<ShardLayout> shard_layouts() const override;
  // Under sequence parallelism the bias is added to this rank's slice of the sequence only.
  std::vector<at::Tensor> sequence_parallel_parameters() const override;
  const Group& group() const { return group_; }
  at::Tensor weight;  // [out_features, in_features / tp]
  at::Tensor bias;    // [out_features], or undefined

 private:
  Group group_;
  bool input_is_parallel_;
  bool sequence_parallel_ = false;
};
TORCH_MODULE(RowParallelLinear);

// An embedding whose rows (the vocabulary) are split: each rank looks up the ids in its range, and the rows are
// summed over the group.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public Sharded {
 public:
  VocabParallelEmbeddingImpl(int64_t vocabulary, int64_t dimension, Group group, int64_t padding_idx = -1);
  // This rank's rows of `whole_weight` [vocabulary, dimension]. padding_idx: an id whose row takes no gradient.
  VocabParallelEmbeddingImpl(const at::Tensor& whole_weight, Group group, int64_t padding_idx = -1);
  at::Tensor forward(const at::Tensor& ids);
  std::vector<ShardLayout> shard_layouts() const override;
  at::Tensor weight;  // [vocabulary / tp, dimension]: ids [first_id, first_id + vocabulary / tp)

 private:
  Group group_;
  int64_t first_id_;
  int64_t padding_idx_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Causal self-attention with the heads split: query, key and value column-parallel (heads / tp heads each), the
// output projection row-parallel.
class SelfAttentionImpl : public torch::nn::Module {
 public:
  SelfAttentionImpl(int64_t d_model, int64_t heads, Group group);
  at::Tensor forward(const at::Tensor& input);  // [batch, sequence, d_model]
  ColumnParallelLinear query{nullptr}, key{nullptr}, value{nullptr};
  RowParallelLinear projection{nullptr};

 private:
  int64_t local_heads_;
};
TORCH_MODULE(SelfAttention);


// The mean cross entropy of logits sharded along the vocabulary (a column-parallel output layer's, not gathered)
// against whole targets: the same value on every rank, and each rank's gradient for its own logits, without ever
// gathering the logits. `logits` [..., vocabulary / tp], `targets` [...] of ids over the whole vocabulary.
// Targets equal to `ignore_index` (padding) are left out of the mean, as F.cross_entropy leaves them. Half-precision
// logits are taken in float32. smp.tp.vocab_parallel_cross_entropy is this function.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const Group& group,
                                        int64_t ignore_index = -100);

}  // namespace smp::tp
