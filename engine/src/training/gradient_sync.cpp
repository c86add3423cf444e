#include "training/gradient_sync.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <ATen/ATen.h>

#include "smp/expert_shards.h"
#include "smp/tp.h"

namespace smp {

GradientSync::GradientSync(Runtime& runtime, const GraphModel& model, const std::vector<LocalStage>& stages,
                           const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
                           const std::vector<int>& stage_of_node, const std::vector<int>& stage_rank,
                           const std::string& group_prefix)
    : runtime_(runtime), named_parameters_(named_parameters) {
  const Config& config = runtime_.config();
  const auto& nodes = model.nodes();
  // Expert shards (expert parallelism) are averaged over the replicas holding the same experts, the rest over all.
  std::set<const void*> experts;
  for (const auto& stage : stages) {
    for (int node : *stage.nodes) {
      for (const auto& parameter : expert_parameters_in(*nodes[node].module)) {
        experts.insert(parameter.unsafeGetTensorImpl());
      }
    }
  }
  for (const auto& [name, parameter] : named_parameters_) {
    if (!experts.count(parameter.unsafeGetTensorImpl())) continue;
    expert_parameters_.push_back(parameter);
    expert_impls_.insert(parameter.unsafeGetTensorImpl());
    expert_shard_names_.insert(name);
  }
  if (runtime_.topology().data_parallel_degree() > 1 &&
      std::any_of(named_parameters_.begin(), named_parameters_.end(),
                  [](const auto& named) { return named.second.requires_grad(); })) {
    // A parameter's gradient is final after one backward pass per microbatch and local stage that uses it.
    std::vector<at::Tensor> expert_shards;
    std::vector<int> accumulations, expert_accumulations;
    for (const auto& [name, parameter] : named_parameters_) {
      if (!parameter.requires_grad()) continue;  // frozen: no gradient to average, and none to invent
      int users = 0;
      for (const auto& stage : stages) {
        users += std::any_of(stage.parameters->begin(), stage.parameters->end(),
                             [&](const at::Tensor& known) { return known.is_same(parameter); });
      }
      const bool expert = experts.count(parameter.unsafeGetTensorImpl()) > 0;
      (expert ? expert_shards : replica_parameters_).push_back(parameter);
      (expert ? expert_accumulations : accumulations).push_back(users * config.microbatches);
    }
    if (!replica_parameters_.empty()) {
      reducer_ = std::make_unique<GradientReducer>(replica_parameters_, std::move(accumulations),
                                                   runtime_.data_parallel(), kBucketBytes);
    }
    if (!expert_shards.empty()) {
      expert_reducer_ = std::make_unique<GradientReducer>(std::move(expert_shards), std::move(expert_accumulations),
                                                          runtime_.expert_data_parallel(), kBucketBytes,
                                                          runtime_.topology().data_parallel_degree());
    }
  }

  // Tied parameters whose holders sit on several ranks: every holder keeps a copy and their gradients are summed
  // over exactly those ranks of this replica before the optimizer step, so the copies never drift.
  std::set<const void*> counted_elsewhere;
  for (const auto& tie : model.ties()) {
    std::set<int> holder_ranks;
    for (int node : tie.nodes) holder_ranks.insert(stage_rank[stage_of_node[node]]);
    const int first_holder = stage_rank[stage_of_node[tie.nodes.front()]];
    const at::Tensor& parameter = tie.tensor;
    if (first_holder != runtime_.pp_rank()) counted_elsewhere.insert(parameter.unsafeGetTensorImpl());
    if (holder_ranks.size() < 2 || !holder_ranks.count(runtime_.pp_rank())) continue;
    std::vector<int> members;
    // Under this model's prefix: a second model of the same job must not meet this group's rendezvous keys.
    std::string name = group_prefix + "tied/" + tie.parameter + "/";
    for (int pp : holder_ranks) {
      members.push_back(runtime_.topology().rank_of({pp, runtime_.dp_rank(), runtime_.tp_rank()}));
      name += std::to_string(members.back()) + ",";
    }
    // Frozen copies need no sum (every rank sees the same requires_grad, so all skip it alike), but a group still:
    // their copies start equal as trained ones do.
    tied_.push_back({parameter, runtime_.make_group(members, name), parameter.requires_grad()});
  }
  // A parameter every tensor-parallel rank holds whole is counted by tp rank 0; shards by each.
  std::map<const void*, std::pair<int64_t, int64_t>> shards;
  std::set<const void*> sequence_parallel;  // a module shared by two nodes lists its parameters twice
  for (const auto& stage : stages) {
    for (int node : *stage.nodes) {
      for (const auto& layout : tp::shard_layouts_in(*nodes[node].module)) {
        shards[layout.shard.unsafeGetTensorImpl()] = {layout.dim, layout.blocks};
      }
      for (auto& parameter : tp::sequence_parallel_parameters_in(*nodes[node].module)) {
        if (sequence_parallel.insert(parameter.unsafeGetTensorImpl()).second) {
          sequence_parallel_parameters_.push_back(std::move(parameter));
        }
      }
    }
  }
  for (const auto& [name, parameter] : named_parameters_) {
    const void* impl = parameter.unsafeGetTensorImpl();
    const auto shard = shards.find(impl);
    if (shard != shards.end()) shard_dims_[name] = shard->second;
    if (counted_elsewhere.count(impl) || (runtime_.tp_rank() != 0 && shard == shards.end())) continue;
    norm_parameters_.push_back(parameter);
  }
}

GradientSync::~GradientSync() = default;

void GradientSync::arm() {
  if (reducer_) reducer_->arm();
  if (expert_reducer_) expert_reducer_->arm();
}

std::pair<int, int> GradientSync::finish() {
  // Replicas first: it writes the mean back into .grad, and the tied sum (linear too) must come after.
  int buckets = 0, overlapped = 0;
  for (GradientReducer* reducer : {reducer_.get(), expert_reducer_.get()}) {
    if (!reducer) continue;
    buckets += reducer->buckets();
    overlapped += reducer->finish();
  }
  sum_tied();
  sum_sequence_parallel();
  return {buckets, overlapped};
}

void GradientSync::sum_sequence_parallel() {
  // Every rank of the tensor-parallel group ran the same stage on its slice of the sequence: the same parameters
  // have gradients on each. One all-reduce per dtype.
  std::map<at::ScalarType, std::vector<at::Tensor>> gradients;
  for (const auto& parameter : sequence_parallel_parameters_) {
    if (parameter.grad().defined()) gradients[parameter.grad().scalar_type()].push_back(parameter.grad());
  }
  for (auto& [dtype, group] : gradients) {
    std::vector<at::Tensor> flat;
    for (const auto& gradient : group) flat.push_back(gradient.reshape({-1}));
    at::Tensor sum = at::cat(flat);
    runtime_.tensor_parallel().all_reduce_sum(sum);
    int64_t offset = 0;
    for (auto& gradient : group) {
      gradient.copy_(sum.narrow(0, offset, gradient.numel()).view_as(gradient));
      offset += gradient.numel();
    }
  }
}

void GradientSync::share_tied_copies() {
  at::NoGradGuard no_grad;
  for (auto& tied : tied_) tied.holders->broadcast(tied.parameter.detach(), 0);
}

void GradientSync::sum_tied() {
  for (auto& tied : tied_) {
    if (!tied.trained) continue;
    // The copies' gradients and, last, how many holders had one: none leaves .grad undefined (the optimizer then
    // skips the parameter, as in plain training).
    const at::Tensor& parameter = tied.parameter;
    const bool has_gradient = parameter.grad().defined();
    const at::Tensor gradient =
        has_gradient ? parameter.grad().reshape({-1}) : at::zeros({parameter.numel()}, parameter.options());
    at::Tensor flat = at::cat({gradient, at::full({1}, has_gradient ? 1.0 : 0.0, parameter.options())});
    tied.holders->all_reduce_sum(flat);
    if (flat[-1].item<double>() == 0.0) {
      tied.parameter.mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor summed = flat.narrow(0, 0, parameter.numel()).view_as(parameter);
    if (has_gradient) {
      tied.parameter.mutable_grad().copy_(summed);
    } else {
      tied.parameter.mutable_grad() = summed.clone();
    }
  }
}

namespace {

// The gradients that .grad holds (a sparse one's values), grouped by device and dtype: the units of multi-tensor ops.
std::vector<std::vector<at::Tensor>> gradients_by_device_and_dtype(
    const std::vector<std::pair<std::string, at::Tensor>>& parameters) {
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& [name, parameter] : parameters) {
    const at::Tensor& gradient = parameter.grad();
    if (!gradient.defined()) continue;
    const at::Tensor values = gradient.is_sparse() ? gradient._values() : gradient;
    auto group = std::find_if(groups.begin(), groups.end(), [&](const std::vector<at::Tensor>& g) {
      return g.front().device() == values.device() && g.front().scalar_type() == values.scalar_type();
    });
    if (group == groups.end()) group = groups.insert(groups.end(), std::vector<at::Tensor>{});
    group->push_back(values);
  }
  return groups;
}

// Whether every element of these same-device, same-dtype tensors is finite: one multi-tensor reduction and one host
// wait, where a kernel and a host sync per parameter cost a GPT stage milliseconds per step on a GPU. The sum of the
// L1 norms is finite when every element is (a NaN or an infinity carries through |x| and every sum); half-precision
// values are summed in float32 and the norms in double. A float32 tensor whose |x| sum passes 3.4e38 would read as
// non-finite, far beyond anything a step that trains can produce.
bool all_finite(const std::vector<at::Tensor>& tensors) {
  const at::ScalarType type = tensors.front().scalar_type();
  const std::optional<at::ScalarType> accumulate =
      type == at::kHalf || type == at::kBFloat16 ? std::optional(at::kFloat) : std::nullopt;
  return std::isfinite(at::stack(at::_foreach_norm(tensors, 1, accumulate)).to(at::kDouble).sum().item<double>());
}

bool unscaled_finite(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters, double loss_scale) {
  // fp16: one pass over the gradients both divides them by the loss scale and finds non-finite values (the fused
  // kernel of PyTorch's GradScaler), one host sync per group. It checks its input: dividing by a scale above 1
  // cannot overflow, and the scale is a power of two (it only ever doubles or halves), so multiplying by its inverse
  // equals dividing. A scale below 1 (many overflows in a row), or a dtype the kernel lacks on the GPU (bfloat16),
  // divides first and checks the result.
  bool finite = true;
  for (auto& gradients : gradients_by_device_and_dtype(named_parameters)) {
    const at::ScalarType type = gradients.front().scalar_type();
    if (loss_scale > 1.0 && (type == at::kFloat || type == at::kDouble || type == at::kHalf)) {
      at::Tensor found = at::zeros({1}, at::TensorOptions(at::kFloat).device(gradients.front().device()));
      const at::Tensor inverse = at::full({1}, 1.0 / loss_scale, found.options());
      at::_amp_foreach_non_finite_check_and_unscale_(gradients, found, inverse);
      finite = finite && found.item<float>() == 0.0f;
    } else {
      at::_foreach_div_(gradients, loss_scale);
      finite = finite && all_finite(gradients);
    }
  }
  return finite;
}

}  // namespace

bool GradientSync::finite_unscaling(double loss_scale) {
  if (loss_scale != 1.0) return unscaled_finite(named_parameters_, loss_scale);
  for (const auto& group : gradients_by_device_and_dtype(named_parameters_)) {
    if (!all_finite(group)) return false;
  }
  return true;
}

double GradientSync::clip_norm(double max_norm) {
  // On the parameters' device: the pipeline group reduces it there (NCCL on a GPU).
  const auto options = at::TensorOptions(at::kDouble).device(runtime_.device());
  at::Tensor squares = at::zeros({1}, options);
  at::Tensor expert_squares = at::zeros({1}, options);
  for (const auto& parameter : norm_parameters_) {
    if (!parameter.grad().defined()) continue;
    (expert_impls_.count(parameter.unsafeGetTensorImpl()) ? expert_squares : squares) += parameter.grad().to(at::kDouble).pow(2).sum();
  }
  // Each rank of an expert-parallel group holds other experts (with the same averaged gradients as the replicas
  // holding the same ones): the group's shares together are the layer's.
  if (runtime_.topology().expert_parallel_degree() > 1) runtime_.expert_parallel().all_reduce_sum(expert_squares);
  squares += expert_squares;
  // Replicas hold identical averaged gradients, so the pipeline groups of one replica see the whole model: each
  // shard on its rank, each parameter the tensor-parallel ranks all hold whole on tp rank 0 alone.
  runtime_.pipeline().all_reduce_sum(squares);
  if (runtime_.topology().tensor_parallel_degree() > 1) runtime_.tensor_parallel().all_reduce_sum(squares);
  const double norm = std::sqrt(squares.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    for (const auto& [name, parameter] : named_parameters_) {
      if (parameter.grad().defined()) parameter.grad().mul_(scale);
    }
  }
  return norm;
}

void GradientSync::zero(bool set_to_none) {
  for (const auto& [name, parameter] : named_parameters_) {
    at::Tensor& gradient = parameter.mutable_grad();
    if (!gradient.defined()) continue;
    if (set_to_none) {
      gradient.reset();
    } else {
      gradient = gradient.detach();  // as torch.optim does: a gradient with history would keep its graph
      gradient.zero_();
    }
  }
}

}  // namespace smp
