// The step as the user calls it: a batch checked and split into microbatches, the schedule run for training
// (gradients set aside across the step, non-finite values and the fp16 loss scale) or for evaluation alone.
#include "smp/distributed_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>

#include "smp/collectives.h"
#include "smp/log.h"
#include "smp/module_modes.h"
#include "smp/planned_layout.h"
#include "smp/timeline.h"
#include "core/program_call.h"
#include "training/gradient_sync.h"
#include "training/loss_scaler.h"
#include "training/model_random_stream.h"
#include "training/nonfinite_steps.h"
#include "smp/tp.h"

namespace smp {

namespace {

// Targets sample for sample with no input: a batch that lost or gained rows on one side, not a batch to split.
void check_targets_batched_with_an_input(const char* caller, const ModelInputs& inputs, const at::Tensor& targets,
                                         const std::vector<bool>& batched) {
  if (!targets.defined() || targets.dim() == 0 || std::any_of(batched.begin(), batched.end(), [](bool b) { return b; })) {
    return;
  }
  std::string sizes;
  for (const auto& input : inputs) sizes += (sizes.empty() ? "" : ", ") + (input.defined() ? c10::str(input.sizes()) : "None");
  throw ConfigError(std::string(caller) + ": " + std::to_string(targets.size(0)) + " targets, but no input has a first "
                    "dimension of that size (inputs " + sizes + ")");
}

}  // namespace

std::vector<bool> DistributedModel::batched_inputs(const ModelInputs& inputs, const at::Tensor& targets,
                                                   const char* caller) {
  std::optional<std::int64_t> batch;
  if (targets.defined() && targets.dim() > 0) batch = targets.size(0);
  for (const auto& input : inputs) {
    if (!batch && input.defined() && input.dim() > 0) batch = input.size(0);
  }
  std::vector<bool> batched;
  for (const auto& input : inputs) batched.push_back(batch && input.defined() && input.dim() > 0 && input.size(0) == *batch);
  check_targets_batched_with_an_input(caller, inputs, targets, batched);
  return batched;
}

MicrobatchData DistributedModel::microbatch_data(const char* caller, const ModelInputs& inputs,
                                                 const at::Tensor& targets, const OutputsLossFunction& loss,
                                                 const std::vector<bool>& given_batched, LossReduction reduction,
                                                 std::optional<std::int64_t> global_samples,
                                                 bool short_allowed) const {
  int microbatches = runtime_->config().microbatches;
  const auto& names = model_.input_names();
  if (inputs.size() != names.size()) {
    throw ConfigError(std::string(caller) + ": " + std::to_string(inputs.size()) + " inputs for a model of " +
                      std::to_string(names.size()));
  }
  if (!given_batched.empty() && given_batched.size() != inputs.size()) {
    throw ConfigError(std::string(caller) + ": " + std::to_string(given_batched.size()) + " batched flags for " +
                      std::to_string(inputs.size()) + " inputs");
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].is_meta()) {
      throw ConfigError(std::string(caller) + ": input '" + names[i] + "' is on the meta device, which holds no " +
                        "values: a model may be built there, its batches must be real tensors");
    }
  }
  if (targets.defined() && targets.is_meta()) {
    throw ConfigError(std::string(caller) + ": the targets are on the meta device, which holds no values");
  }
  const std::vector<bool> batched = given_batched.empty() ? batched_inputs(inputs, targets, caller) : given_batched;
  if (!given_batched.empty()) check_targets_batched_with_an_input(caller, inputs, targets, batched);
  std::optional<std::int64_t> batch;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (batched[i]) batch = inputs[i].size(0);
  }
  if (targets.defined() && targets.dim() > 0) batch = targets.size(0);
  const int replicas = runtime_->topology().data_parallel_degree();
  // Said of the global batch where it is known (told of it, or one replica's batch is all of it).
  if (!short_allowed && (global_samples || (batch && replicas == 1))) {
    runtime_->config().check_batch(static_cast<int>(global_samples.value_or(*batch)), replicas, true);
  }
  if (batch && short_allowed && *batch < microbatches) microbatches = static_cast<int>(*batch);
  if (!batch || *batch < microbatches) {
    throw ConfigError(std::string(caller) + ": the replica's batch of " +
                      (batch ? std::to_string(*batch) : std::string("no")) + " samples does not split into " +
                      std::to_string(microbatches) + " microbatches (each needs a sample at least)");
  }
  MicrobatchData data;
  const std::int64_t global = global_samples.value_or(*batch * replicas);
  data.uneven = microbatches > 0 && *batch % microbatches != 0;
  for (int m = 0; m < microbatches; ++m) {
    const std::int64_t rows = *batch / microbatches + (m < *batch % microbatches ? 1 : 0);
    // The replicas' gradients and losses are averaged: each microbatch counts `replicas` times its share.
    data.loss_weights.push_back(reduction == LossReduction::kSum
                                    ? static_cast<double>(replicas)
                                    : static_cast<double>(rows * replicas) / static_cast<double>(global));
  }
  data.loss = loss;
  if (microbatches == 0) return data;  // an evaluation's empty share: nothing to run
  const c10::Device device = runtime_->device();
  data.inputs.assign(static_cast<std::size_t>(microbatches), ModelInputs(inputs.size()));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor on_device = inputs[i].defined() ? inputs[i].to(device) : inputs[i];
    if (!batched[i]) {
      for (auto& microbatch : data.inputs) microbatch[i] = on_device;
      continue;
    }
    // Each microbatch a tensor of its own to autograd (a view shares its base's version counter): a forward writing
    // its input in place (x.mul_(2)) would otherwise spoil what the earlier microbatches saved for their backward.
    const auto chunks = on_device.tensor_split(microbatches);
    for (int m = 0; m < microbatches; ++m) {
      data.inputs[m][i] = chunks[m].requires_grad() ? chunks[m] : chunks[m].variable_data();
    }
  }
  if (targets.defined()) data.targets = (targets.dim() > 0 ? targets.to(device).tensor_split(microbatches)
                                                           : std::vector<at::Tensor>(microbatches, targets.to(device)));
  return data;
}

ModelInputs DistributedModel::inputs_by_name(const char* caller, const std::map<std::string, at::Tensor>& inputs) const {
  ModelInputs ordered;
  for (const auto& name : model_.input_names()) {
    const auto found = inputs.find(name);
    if (found == inputs.end()) throw ConfigError(std::string(caller) + ": no input \"" + name + "\" (the model's input)");
    ordered.push_back(found->second);
  }
  for (const auto& [name, tensor] : inputs) {
    if (model_.input_index(name) < 0) {
      throw ConfigError(std::string(caller) + ": input \"" + name + "\" is not one of the model's inputs");
    }
  }
  return ordered;
}

void DistributedModel::check_single_input(const char* caller, const at::Tensor& inputs, const at::Tensor& targets) const {
  // One input and its targets: both are the batch, sample for sample.
  // Evaluation takes a share too short for every microbatch (microbatch_data splits it into fewer).
  const int microbatches = std::string(caller) == "evaluate" ? 0 : runtime_->config().microbatches;
  auto check = [&](const at::Tensor& tensor, const char* what) {
    if (!tensor.defined() || tensor.dim() == 0 || tensor.size(0) < microbatches) {
      throw ConfigError(std::string(caller) + ": the replica's " + what + " batch of " +
                        (tensor.defined() && tensor.dim() > 0 ? std::to_string(tensor.size(0)) : std::string("no")) +
                        " samples does not split into " + std::to_string(microbatches) +
                        " microbatches (each needs a sample at least)");
    }
  };
  check(inputs, "input");
  // Inputs and targets that disagree say so before a count of targets that does not split hides it.
  if (targets.defined() && targets.dim() > 0 && inputs.size(0) != targets.size(0)) {
    throw ConfigError(std::string(caller) + ": " + std::to_string(inputs.size(0)) + " inputs but " +
                      std::to_string(targets.size(0)) + " targets");
  }
  check(targets, "target");
}

OutputsLossFunction DistributedModel::of_first_output(const LossFunction& loss) {
  return [loss](const std::vector<at::Tensor>& outputs, const at::Tensor& target) { return loss(outputs.front(), target); };
}

namespace {

// The modules in eval mode (dropout off, batch norm on its running statistics) for as long as it lives; each
// module of each tree gets its own mode back after (a batch norm the program froze stays frozen), the trees in reverse
// order, so that a module shared by two nodes ends as it began.
class EvaluationMode {
 public:
  explicit EvaluationMode(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
    for (const auto& module : modules) {
      if (auto* external = dynamic_cast<ExternalModes*>(module.get())) {
        restore_.push_back(external->enter_eval());
        continue;
      }
      // LibTorch's train(bool) sets a whole tree: each module's own flag goes back parent first (pre-order).
      std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> flags;
      for (const auto& each : module->modules()) flags.emplace_back(each, each->is_training());
      module->eval();
      restore_.push_back([flags] {
        for (const auto& [each, training] : flags) each->train(training);
      });
    }
  }
  ~EvaluationMode() {
    for (std::size_t i = restore_.size(); i-- > 0;) {
      try {
        restore_[i]();
      } catch (const std::exception& error) {
        log::warn(std::string("evaluation could not give a module its training mode back: ") + error.what());
      }
    }
  }
  EvaluationMode(const EvaluationMode&) = delete;
  EvaluationMode& operator=(const EvaluationMode&) = delete;

 private:
  std::vector<std::function<void()>> restore_;
};

// What the ranks of a replica compare of their batches (they must be given the same): the shapes and dtypes, hashed
// (exact in a double), and of each tensor's values a strided sample of at most kSampled, summed with weights by
// position (a batch in another order differs too) and in magnitude (the tolerance's scale). Cheap whatever the batch
// (an image batch would otherwise be read whole, in double), and left on the batch's device until the step's end.
struct BatchFingerprint {
  std::int64_t shapes = 0;
  std::int64_t samples = 0;  // the replica's share: shares passed apart must match (ClosingSums::check_in_step)
  std::vector<at::Tensor> values;  // per tensor: (weighted sum, weighted magnitude), on its device; none unchecked
};

// Only then are a batch's values compared: a replica's ranks with each other, and the replicas to tell whether each
// was given the same batch (ClosingSums::replicas_given_alike).
bool batch_values_compared(const Topology& topology) { return topology.world_size() > 1; }

BatchFingerprint fingerprint(const ModelInputs& inputs, const at::Tensor& targets, const std::vector<bool>& batched,
                             bool values_compared) {
  constexpr std::int64_t kSampled = 1 << 16, kWeights = 13;
  BatchFingerprint print;
  for (std::size_t i = 0; i < inputs.size() && i < batched.size() && print.samples == 0; ++i) {
    if (batched[i] && inputs[i].defined()) print.samples = inputs[i].size(0);
  }
  if (print.samples == 0 && targets.defined() && targets.dim() > 0) print.samples = targets.size(0);
  std::uint64_t hash = 1469598103934665603ULL;  // FNV-1a
  const auto mix = [&hash](std::int64_t value) {
    hash ^= static_cast<std::uint64_t>(value);
    hash *= 1099511628211ULL;
  };
  std::vector<at::Tensor> tensors(inputs.begin(), inputs.end());
  tensors.push_back(targets);
  for (const at::Tensor& tensor : tensors) {
    mix(tensor.defined());
    if (!tensor.defined()) continue;
    mix(static_cast<std::int64_t>(tensor.scalar_type()));
    mix(tensor.dim());
    for (std::int64_t size : tensor.sizes()) mix(size);
    if (!values_compared || tensor.numel() == 0 || tensor.is_meta() || at::isComplexType(tensor.scalar_type())) {
      continue;
    }
    const std::int64_t count = tensor.numel();
    const at::Tensor sampled =
        tensor.detach().contiguous().view(-1).slice(0, 0, count, std::max<std::int64_t>(1, count / kSampled)).to(at::kDouble);
    const at::Tensor weights =
        at::arange(sampled.numel(), sampled.options()).remainder_(kWeights).add_(1);
    print.values.push_back(at::stack({(sampled * weights).sum(), (sampled.abs() * weights).sum()}));
  }
  print.shapes = static_cast<std::int64_t>(hash & ((std::uint64_t{1} << 52) - 1));
  return print;
}

// The closing all-reduce of every train_step and evaluate, over the world: slot 0 sums the last stages' losses
// (every rank learns the mean over replicas); per rank r, flags when its gradients are not finite, its program call,
// and its batch's fingerprint. Calls of one kind meet here (train_step n and m; evaluations), where no transfer
// between their ranks has (replicas of one stage); a train_step and an evaluate wait in different collectives.
class ClosingSums {
  enum Field {
    kNotFinite, kCall, kShapes, kSum, kMagnitude, kSamples,
    kWholeGiven, kWholeShapes, kWholeSum, kWholeMagnitude, kWholeSamples,  // the global batch shared out
    kFields
  };

 public:
  ClosingSums(const Topology& topology, int rank, std::int64_t call, BatchFingerprint batch,
              std::optional<BatchFingerprint> whole = std::nullopt)
      : topology_(topology),
        world_(topology.world_size()),
        rank_(rank),
        batch_(std::move(batch)),
        whole_(std::move(whole)),
        sums_(at::zeros({1 + kFields * world_}, at::kDouble)) {
    slot(kCall, rank) = static_cast<double>(call);
    slot(kShapes, rank) = static_cast<double>(batch_.shapes);
    slot(kSamples, rank) = static_cast<double>(batch_.samples);
    if (whole_) {
      slot(kWholeGiven, rank) = 1.0;
      slot(kWholeShapes, rank) = static_cast<double>(whole_->shapes);
      slot(kWholeSamples, rank) = static_cast<double>(whole_->samples);
    }
  }
  void add_loss(double loss) { data()[0] = loss; }
  void mark_not_finite(int rank) { slot(kNotFinite, rank) = 1.0; }
  // The step's sums to all-reduce, the batch's values read back now that its work is queued.
  at::Tensor& tensor() {
    for (const at::Tensor& values : batch_.values) {
      const at::Tensor here = values.cpu();
      slot(kSum, rank_) += here[0].item<double>();
      slot(kMagnitude, rank_) += here[1].item<double>();
    }
    batch_.values.clear();
    if (whole_) {
      for (const at::Tensor& values : whole_->values) {
        const at::Tensor here = values.cpu();
        slot(kWholeSum, rank_) += here[0].item<double>();
        slot(kWholeMagnitude, rank_) += here[1].item<double>();
      }
      whole_->values.clear();
    }
    return sums_;
  }

  double loss() const { return data()[0]; }
  bool finite_on(int rank) const { return slot(kNotFinite, rank) == 0.0; }

  // Every replica was given the same batch as the first: a C++ program that passed each replica the global batch
  // (not Runtime::replica_slice's share) trains every replica on all of it, each microbatch larger than planned.
  bool replicas_given_alike() const {
    if (topology_.data_parallel_degree() < 2) return false;
    for (int rank = 1; rank < world_; ++rank) {
      const auto at = topology_.coordinates_of(rank);
      if (at.dp_rank == 0) continue;
      const int first = topology_.rank_of({at.pp_rank, 0, at.tp_rank});
      if (slot(kShapes, rank) != slot(kShapes, first) || !same_batch_values(rank, first, kSum, kMagnitude)) {
        return false;
      }
    }
    return true;
  }

  // Throws, the same error on every rank, when some rank is in another call, a replica's ranks were given different
  // batches, or the replicas' shares differ in size.
  void check_in_step() const {
    std::map<std::int64_t, std::vector<int>> ranks_by_call;
    for (int rank = 0; rank < world_; ++rank) {
      ranks_by_call[static_cast<std::int64_t>(slot(kCall, rank))].push_back(rank);
    }
    if (ranks_by_call.size() > 1) {
      std::string groups;
      for (const auto& [call, ranks] : ranks_by_call) {
        groups += (groups.empty() ? "" : "; ") + std::string(ranks.size() == 1 ? "rank " : "ranks ");
        for (std::size_t i = 0; i < ranks.size(); ++i) groups += (i ? ", " : "") + std::to_string(ranks[i]);
        groups += " in " + ProgramCall::from_id(call).describe();
      }
      throw comm::CommError("the ranks are in different calls (" + groups + "): " + kSameCallsEverywhere);
    }
    std::map<int, int> first_of_replica;
    for (int rank = 0; rank < world_; ++rank) {
      const auto [first, inserted] = first_of_replica.emplace(topology_.coordinates_of(rank).dp_rank, rank);
      if (inserted) continue;
      const int other = first->second;
      const bool same_shapes = slot(kShapes, rank) == slot(kShapes, other);
      if (same_shapes && same_batch_values(rank, other, kSum, kMagnitude)) continue;
      throw comm::CommError("rank " + std::to_string(rank) + " was given a batch with other " +
                            (same_shapes ? "values" : "shapes") + " than rank " + std::to_string(other) +
                            ", in the same replica (" + ProgramCall::from_id(static_cast<std::int64_t>(slot(kCall, rank))).describe() +
                            "): " + kSameCallsEverywhere + "; a sampler per rank (DistributedSampler's defaults) "
                            "draws for every rank apart: give it the replicas, num_replicas=data_parallel_degree and "
                            "rank=dp_rank");
    }
    // Shares of one global batch may differ by a sample (one that does not split evenly): each counted by its size.
    if (shares_of_one_global_batch()) return;
    for (int rank = 1; rank < world_; ++rank) {
      if (slot(kSamples, rank) == slot(kSamples, 0)) continue;
      throw comm::CommError("rank " + std::to_string(rank) + "'s batch has " +
                            std::to_string(static_cast<std::int64_t>(slot(kSamples, rank))) + " samples, rank 0's " +
                            std::to_string(static_cast<std::int64_t>(slot(kSamples, 0))) +
                            ": each replica's share counts as the global batch's over replicas in the mean loss, "
                            "so shares passed apart must be the same size; to split a batch unevenly, pass the "
                            "global batch (Python: without replica_share; C++: next_call_takes_share_of before "
                            "the step)");
    }
  }

 private:
  // Ranks that took their replica's share of a global batch (Python's train_step without replica_share) must all
  // have been given the same one: replicas of another batch (a sampler seeded per rank) would each train on a share
  // of a different batch, silently. True when they were.
  bool shares_of_one_global_batch() const {
    int first = -1;
    for (int rank = 0; rank < world_; ++rank) {
      if (slot(kWholeGiven, rank) == 0.0) continue;
      if (first < 0) {
        first = rank;
        continue;
      }
      const bool same_shapes = slot(kWholeShapes, rank) == slot(kWholeShapes, first);
      if (same_shapes && same_batch_values(rank, first, kWholeSum, kWholeMagnitude)) continue;
      throw comm::CommError("rank " + std::to_string(rank) + " was given a global batch with other " +
                            (same_shapes ? "values" : "shapes") + " than rank " + std::to_string(first) + " (" +
                            ProgramCall::from_id(static_cast<std::int64_t>(slot(kCall, rank))).describe() +
                            "): every rank passes the same global batch and each replica takes its share of it; "
                            "draw it alike on every rank (the same seed), or pass each replica's own share with "
                            "replica_share=True");
    }
    if (first < 0) return false;
    for (int rank = 0; rank < world_; ++rank) {
      if (slot(kWholeGiven, rank) != 0.0) continue;
      throw comm::CommError("rank " + std::to_string(rank) + " passed its replica's share (replica_share=True) and rank " +
                            std::to_string(first) + " the global batch: every rank must pass the same kind");
    }
    // Each microbatch was weighed by its share of the global batch: the shares must be that batch's (a C++ program
    // told of the global batch that then passed it whole to every replica would count it replicas times).
    double shared = 0.0;
    for (int rank = 0; rank < world_; ++rank) {
      const auto at = topology_.coordinates_of(rank);
      if (at.pp_rank == 0 && at.tp_rank == 0) shared += slot(kSamples, rank);
    }
    if (shared != slot(kWholeSamples, first)) {
      throw comm::CommError("the replicas' shares hold " + std::to_string(static_cast<std::int64_t>(shared)) +
                            " samples in all, the global batch they were told of " +
                            std::to_string(static_cast<std::int64_t>(slot(kWholeSamples, first))) +
                            ": pass each replica its share (Runtime::replica_slice) of the global batch given to "
                            "next_call_takes_share_of");
    }
    return true;
  }

  // Equal up to a reduction's order; a batch holding NaN or Inf (a test of the non-finite handling) sums to NaN or
  // Inf alike on every rank.
  // Two ranks' fingerprint sums (weighted sum and magnitude, in those fields) agree.
  bool same_batch_values(int rank, int other, Field sum, Field magnitude) const {
    return same_values(slot(sum, rank), slot(sum, other), slot(magnitude, other)) &&
           same_values(slot(magnitude, rank), slot(magnitude, other), slot(magnitude, other));
  }

  static bool same_values(double a, double b, double magnitude) {
    if (!std::isfinite(a) || !std::isfinite(b)) return (std::isnan(a) && std::isnan(b)) || a == b;
    return std::abs(a - b) <= 1e-9 * (std::isfinite(magnitude) ? magnitude : 0.0);
  }

  double* data() { return sums_.data_ptr<double>(); }
  const double* data() const { return sums_.data_ptr<double>(); }
  double& slot(Field field, int rank) { return data()[1 + field * world_ + rank]; }
  double slot(Field field, int rank) const { return data()[1 + field * world_ + rank]; }

  const Topology& topology_;
  int world_;
  int rank_;
  BatchFingerprint batch_;
  std::optional<BatchFingerprint> whole_;
  at::Tensor sums_;
};

// The fingerprint of the global batch a call was told it takes its share of, taken once (the call compares it
// across replicas); none without replicas to compare.
std::optional<BatchFingerprint> take_fingerprint(std::optional<GlobalBatch>& given, const Topology& topology) {
  std::optional<GlobalBatch> batch = std::move(given);
  given.reset();
  if (!batch || topology.data_parallel_degree() < 2) return std::nullopt;
  return fingerprint(batch->inputs, batch->targets,
                     batch->batched.empty() ? DistributedModel::batched_inputs(batch->inputs, batch->targets)
                                             : batch->batched,
                     true);
}

std::optional<std::int64_t> samples_of(const std::optional<BatchFingerprint>& global_batch) {
  if (!global_batch) return std::nullopt;
  return global_batch->samples;
}

}  // namespace

void DistributedModel::next_call_takes_share_of(const ModelInputs& inputs, const at::Tensor& targets,
                                                const std::vector<bool>& batched) {
  global_batch_ = GlobalBatch{inputs, targets, batched};
}

StepOutput DistributedModel::evaluate(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss,
                                     bool keep_outputs) {
  RefusedCallCounts refused(*this, /*train_step=*/false);
  check_single_input("evaluate", inputs, targets);
  refused.dismiss();  // the call below counts itself
  return evaluate(ModelInputs{inputs}, targets, of_first_output(loss), keep_outputs);
}

StepOutput DistributedModel::evaluate(const std::map<std::string, at::Tensor>& inputs, const at::Tensor& targets,
                                     const OutputsLossFunction& loss, bool keep_outputs) {
  RefusedCallCounts refused(*this, /*train_step=*/false);
  ModelInputs ordered = inputs_by_name("evaluate", inputs);
  refused.dismiss();  // the call below counts itself
  return evaluate(ordered, targets, loss, keep_outputs);
}

StepOutput DistributedModel::train_step(const std::map<std::string, at::Tensor>& inputs, const at::Tensor& targets,
                                       const OutputsLossFunction& loss, bool keep_outputs) {
  RefusedCallCounts refused(*this, /*train_step=*/true);
  ModelInputs ordered = inputs_by_name("train_step", inputs);
  refused.dismiss();  // the call below counts itself
  return train_step(ordered, targets, loss, keep_outputs);
}

StepOutput DistributedModel::evaluate(const ModelInputs& inputs, const at::Tensor& targets,
                                     const OutputsLossFunction& loss, bool keep_outputs,
                                     const std::vector<bool>& batched, LossReduction reduction) {
  const auto start = std::chrono::steady_clock::now();
  // Taken first: a call that fails before its closing sums must not leave it to the next.
  std::optional<BatchFingerprint> global_batch = take_fingerprint(global_batch_, runtime_->topology());
  runtime_->refuse_after_leaving("evaluate");
  RefusedCallCounts refused(*this, /*train_step=*/false);
  warn_if_not_resumed();
  MicrobatchData data = microbatch_data("evaluate", inputs, targets, loss, batched, reduction,
                                        samples_of(global_batch), /*short_allowed=*/true);
  data.keep_outputs = keep_outputs;
  const int microbatches = static_cast<int>(data.inputs.size());
  const Topology& topology = runtime_->topology();
  const int filled = topology.data_parallel_degree() * runtime_->config().microbatches;
  // Decided on the global batch where the call was told of it, so that every replica decides alike.
  const bool short_batch = global_batch ? global_batch->samples < filled
                                        : microbatches < runtime_->config().microbatches;
  if (short_batch && topology.expert_parallel_degree() > 1) {
    // The replicas of an expert-parallel group exchange tokens in every microbatch: each must run them all.
    throw ConfigError("evaluate: a batch of fewer than " + std::to_string(filled) + " samples (replicas x " +
                      "microbatches) leaves a replica fewer microbatches, and expert parallelism's exchanges need "
                      "every replica of a group in each: give at least " + std::to_string(filled) +
                      " samples (pad the last batch, its padding's labels -100)");
  }
  if (short_batch && !runtime_->config().schedule_file.empty()) {
    throw ConfigError("evaluate: a batch of fewer than " + std::to_string(filled) + " samples (replicas x "
                      "microbatches) leaves a replica fewer microbatches than \"schedule_file\" " +
                      runtime_->config().schedule_file + " is for: give at least " + std::to_string(filled) +
                      " samples");
  }
  at::NoGradGuard no_graphs;
  std::vector<std::shared_ptr<torch::nn::Module>> local_modules;
  for (const auto& [stage, local] : stages_) {
    for (int node : local.nodes) local_modules.push_back(model_.nodes()[node].module);
  }
  const EvaluationMode evaluation_mode(local_modules);
  StepOutput output;
  refused.dismiss();  // from here the call is under way: ++ below
  ++evaluations_since_step_;
  BatchFingerprint batch = fingerprint(inputs, targets, batched.empty() ? batched_inputs(inputs, targets) : batched,
                                       batch_values_compared(runtime_->topology()));
  data.stamp = {ProgramCall{step_, evaluations_since_step_}.id(), batch.shapes};
  const InProgramCall in_call(data.stamp.call);
  const ModelRandomStream::Entered model_draws(*random_stream_);
  ClosingSums sums(runtime_->topology(), runtime_->rank(), data.stamp.call, std::move(batch),
                   std::move(global_batch));
  try {
    runtime_->with_peers(ProgramCall{step_, evaluations_since_step_}.describe(), [&] {
      // A replica given no samples (a batch shorter than the replicas) runs nothing; it meets the others in the sums.
      // Made here: a first evaluator connects its channels, which is communication with the peers.
      const ExecutorStats stats =
          microbatches > 0 ? evaluator(microbatches).run(stage_callbacks(), data) : ExecutorStats{};
      if (stats.has_loss && counts_loss()) sums.add_loss(stats.loss_sum);
      output.sends_posted = stats.sends_posted;
      output.all_outputs = stats.outputs;
      if (!stats.outputs.empty()) output.outputs = stats.outputs.front();
      output.sends_released_early = stats.sends_released_early;
      output.peak_sends_held = stats.peak_sends_held;
      runtime_->world().all_reduce_sum(sums.tensor());
      sums.check_in_step();
    });
  } catch (const comm::CommError& error) {
    throw comm::CommError(ProgramCall{step_, evaluations_since_step_}.describe() + ", stage-rank " +
                          std::to_string(runtime_->pp_rank()) + ": " + error.what());
  }
  output.loss = sums.loss() / runtime_->topology().data_parallel_degree();
  output.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return output;
}

namespace {

// The gradients in .grad before a step, taken out of the parameters for the step's length. add_this_step() puts
// them back with the step's gradients added; a step that fails (an exception) leaves them as they were.
class EarlierGradients {
 public:
  explicit EarlierGradients(const std::vector<std::pair<std::string, at::Tensor>>& parameters) {
    for (const auto& [name, parameter] : parameters) {
      held_.emplace_back(parameter, parameter.grad());
      if (parameter.grad().defined()) held_.back().first.mutable_grad() = at::Tensor();
    }
  }
  void add_this_step() {
    for (auto& [parameter, earlier] : held_) {
      if (!earlier.defined()) continue;
      at::Tensor& gradient = parameter.mutable_grad();
      gradient = gradient.defined() ? earlier.add_(gradient) : earlier;
    }
    held_.clear();
  }
  ~EarlierGradients() {
    for (auto& [parameter, earlier] : held_) parameter.mutable_grad() = earlier;
  }
  EarlierGradients(const EarlierGradients&) = delete;
  EarlierGradients& operator=(const EarlierGradients&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> held_;  // (parameter, its gradient before the step)
};

// The parameters of other ranks' nodes, which this rank keeps (a C++ model is built whole on every rank) but whose
// nodes it never runs: a gradient reaching one during this rank's step means a node of its stages computed with a
// tensor another node registers (a head holding the embedding's matrix as a plain member, a LibTorch tie), whose
// copy here the optimizer never steps: it would train otherwise than one process, silently. Set aside before the
// step (gradients a program left from training the model before wrapping it), put back after.
class ForeignGradients {
 public:
  ForeignGradients(const GraphModel& model, const std::vector<int>& local_nodes,
                   const std::vector<std::pair<std::string, at::Tensor>>& own) {
    std::set<const void*> owned;
    for (const auto& [name, parameter] : own) owned.insert(parameter.unsafeGetTensorImpl());
    std::set<int> local(local_nodes.begin(), local_nodes.end());
    for (std::size_t i = 0; i < model.nodes().size(); ++i) {
      const auto& node = model.nodes()[i];
      if (local.count(static_cast<int>(i)) || !node.built()) continue;
      for (const auto& item : node.module->named_parameters()) {
        const at::Tensor& parameter = item.value();
        if (owned.count(parameter.unsafeGetTensorImpl()) || !parameter.requires_grad() || parameter.is_meta()) continue;
        watched_.push_back({node.parameter_name(item.key()), parameter, parameter.grad()});
        if (parameter.grad().defined()) watched_.back().parameter.mutable_grad() = at::Tensor();
      }
    }
  }
  // Throws ModelError naming the first that took a gradient.
  void check() const {
    for (const auto& watched : watched_) {
      if (!watched.parameter.grad().defined()) continue;
      throw ModelError("a node of this rank's stages computed with '" + watched.name + "', a tensor its node holds "
                       "on another stage's rank: this rank's copy of it is never updated, so training would part "
                       "from one process's silently. A tensor two nodes use must be registered in both (a tied "
                       "weight: GraphModel's shared parameters, README: tied weights), not held as a plain member");
    }
  }
  ~ForeignGradients() {
    for (auto& watched : watched_) watched.parameter.mutable_grad() = watched.earlier;
  }
  ForeignGradients(const ForeignGradients&) = delete;
  ForeignGradients& operator=(const ForeignGradients&) = delete;

 private:
  struct Watched {
    std::string name;
    at::Tensor parameter, earlier;
  };
  std::vector<Watched> watched_;
};

}  // namespace

StepOutput DistributedModel::train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss,
                                       bool keep_outputs) {
  RefusedCallCounts refused(*this, /*train_step=*/true);
  check_single_input("train_step", inputs, targets);
  refused.dismiss();  // the call below counts itself
  return train_step(ModelInputs{inputs}, targets, of_first_output(loss), keep_outputs);
}

StepOutput DistributedModel::train_step(const ModelInputs& inputs, const at::Tensor& targets,
                                       const OutputsLossFunction& loss, bool keep_outputs,
                                       const std::vector<bool>& batched, LossReduction reduction) {
  auto start = std::chrono::steady_clock::now();
  std::optional<BatchFingerprint> global_batch = take_fingerprint(global_batch_, runtime_->topology());
  runtime_->refuse_after_leaving("train_step");
  RefusedCallCounts refused(*this, /*train_step=*/true);
  warn_if_not_resumed();
  const Config& config = runtime_->config();
  MicrobatchData data = microbatch_data("train_step", inputs, targets, loss, batched, reduction,
                                        samples_of(global_batch));
  data.keep_outputs = keep_outputs;
  data.loss_scale = loss_scaler_->scale();
  BatchFingerprint batch = fingerprint(inputs, targets, batched.empty() ? batched_inputs(inputs, targets) : batched,
                                       batch_values_compared(runtime_->topology()));
  data.stamp = {ProgramCall{step_, 0}.id(), batch.shapes};
  const InProgramCall in_call(data.stamp.call);
  const c10::Device device = runtime_->device();

  StageCallbacks callbacks = stage_callbacks();
  if (device.is_cuda() && !config.trace_dir.empty() && step_ == config.trace_step) {
    // The compute stream alone, never the whole device: that would also wait for NCCL sends still queued on their
    // channels' streams for a receiver, which may itself be waiting here for one of ours (no timeout can end that).
    callbacks.synchronize = [device] {
      const c10::impl::VirtualGuardImpl guard(device.type());
      guard.synchronizeStream(guard.getStream(device));
    };
  }

  // Until the step has succeeded, it counts as dropped: an optimizer step after a step that threw is not taken.
  last_step_skipped_ = true;
  // Gradients cleared however it was done (torch's zero_grad on the wrapper, .grad = None, .grad.zero_()) hold no
  // dropped step: only those the engine left as they were since do.
  const bool dropped_before = gradients_dropped_ && gradients_left_as_they_were();
  gradients_dropped_ = true;
  // Which parameters are averaged over replicas and summed over tied copies was fixed when the model was built.
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    if (named_parameters_[i].second.requires_grad() != trainable_at_build_[i]) {
      throw ModelError("parameter " + named_parameters_[i].first + " was " +
                       (trainable_at_build_[i] ? "frozen" : "unfrozen") +
                       " after the DistributedModel was built; set requires_grad before building it");
    }
  }
  // Gradients left by earlier steps (accumulation over several train_steps) are set aside: what a step does to
  // its gradients (the replicas' mean, a tied weight's sum over its holders, the fp16 unscale, the finite check,
  // a dropped step's zeroing) must touch this step's alone.
  EarlierGradients earlier(named_parameters_);

  ExecutorStats stats;
  StepOutput output;
  const ModelRandomStream::Entered model_draws(*random_stream_);
  ClosingSums sums(runtime_->topology(), runtime_->rank(), data.stamp.call, std::move(batch),
                   std::move(global_batch));
  std::optional<ForeignGradients> foreign;  // the first step's: which tensors a model's nodes read does not change
  if (!checked_foreign_gradients_) {
    std::vector<int> local_nodes;
    for (const auto& [stage, local] : stages_) local_nodes.insert(local_nodes.end(), local.nodes.begin(), local.nodes.end());
    foreign.emplace(model_, local_nodes, named_parameters_);
  }
  refused.dismiss();  // from here a failure is shared with the peers (with_peers), and a success counts below
  try {
    runtime_->with_peers("step " + std::to_string(step_), [&] {
      gradients_->arm();
      // A traced step's timeline shows the tensor- and expert-parallel collectives inside the compute that ran them.
      const bool traced = !config.trace_dir.empty() && step_ == config.trace_step;
      std::vector<TimelineEvent> collectives;
      std::optional<CollectiveObserver> observer;  // reports one collective at a time, from any thread
      if (traced && (runtime_->topology().tensor_parallel_degree() > 1 || gradients_->has_expert_shards())) {
        observer.emplace([&](const char* kind, std::int64_t, double start_us, double end_us, bool second_lane) {
          collectives.push_back({kind, 0, 0, start_us, end_us, -1, second_lane});
        });
      }
      stats = executor_->run(callbacks, data);
      observer.reset();
      if (foreign) {
        foreign->check();
        checked_foreign_gradients_ = true;
      }
      for (auto& collective : collectives) {
        for (const auto& event : stats.events) {
          // An overlapped pair's forward and backward run at once: each collective belongs to its own thread's.
          if (event.start_us <= collective.start_us && collective.start_us <= event.end_us &&
              event.second_lane == collective.second_lane) {
            collective.stage = event.stage;
            collective.microbatch = event.microbatch;
          }
        }
        stats.events.push_back(std::move(collective));
      }
      std::tie(output.gradient_buckets, output.buckets_overlapped) = gradients_->finish();
      const bool gradients_finite = gradients_->finite_unscaling(loss_scaler_->scale());
      if (stats.has_loss && counts_loss()) sums.add_loss(stats.loss_sum);
      if (!gradients_finite) sums.mark_not_finite(runtime_->rank());
      runtime_->world().all_reduce_sum(sums.tensor());
      sums.check_in_step();
      if (!said_replicas_alike_ && sums.replicas_given_alike()) {
        said_replicas_alike_ = true;
        if (runtime_->rank() == 0) {
          log::warn("step " + std::to_string(step_) + ": every replica was given the same batch; train_step takes "
                    "this replica's share of the global batch (Runtime::replica_slice, or in Python the global "
                    "batch itself), so each replica trained on all of it");
        }
      }
      share_first_replica_buffers();
    });
  } catch (const comm::CommError& error) {
    throw comm::CommError("step " + std::to_string(step_) + ", stage-rank " + std::to_string(runtime_->pp_rank()) +
                          ": " + error.what());
  }
  if (!config.trace_dir.empty() && step_ == config.trace_step) {
    // Writing the trace is not the step's: a planned layout's measured step would count it.
    const auto writing = std::chrono::steady_clock::now();
    write_timeline(stats.events);
    start += std::chrono::steady_clock::now() - writing;
  }
  output.loss = sums.loss() / runtime_->topology().data_parallel_degree();
  std::string bad_ranks;
  for (int rank = 0; rank < runtime_->world_size(); ++rank) {
    if (!sums.finite_on(rank)) {
      const auto where = runtime_->topology().coordinates_of(rank);
      bad_ranks += (bad_ranks.empty() ? "" : ", ") + std::string("rank ") + std::to_string(rank) + " (stage-rank " +
                   std::to_string(where.pp_rank) + ")";
    }
  }
  output.skipped = skips_step(config, step_, output.loss, bad_ranks, *loss_scaler_, runtime_->rank() == 0);
  if (output.skipped) {
    for (auto& [name, parameter] : named_parameters_) {
      if (parameter.grad().defined()) parameter.mutable_grad().zero_();
    }
  }
  last_step_skipped_ = output.skipped;
  gradients_dropped_ = dropped_before || output.skipped;
  earlier.add_this_step();
  remember_gradients_left();  // as the step leaves them, earlier steps' added back
  ++step_;
  evaluations_since_step_ = 0;
  output.peak_stashed_microbatches = stats.peak_stashed_microbatches;
  output.sends_released_early = stats.sends_released_early;
  output.forwards_overlapped = stats.forwards_overlapped;
  output.all_outputs = stats.outputs;
  if (!stats.outputs.empty()) output.outputs = stats.outputs.front();
  output.sends_posted = stats.sends_posted;
  output.peak_sends_held = stats.peak_sends_held;
  output.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_step_against_plan(*runtime_, step_ - 1, output.seconds);
  return output;
}

void DistributedModel::warn_if_not_resumed() {
  if (!resumed_from_ || state_resumed_ || said_not_resumed_) return;
  said_not_resumed_ = true;
  if (runtime_->rank() != 0) return;
  log::warn("\"resume\" took the cut of " + resumed_from_->directory + ", but nothing loaded its state " +
            "(Checkpointer::resume(), smp.Checkpointer.resume()): the model runs from its fresh weights");
}

void DistributedModel::remember_gradients_left() {
  left_gradients_.clear();
  if (!gradients_dropped_) return;
  for (const auto& [name, parameter] : named_parameters_) {
    const at::Tensor& gradient = parameter.grad();
    left_gradients_.emplace_back(gradient.defined() ? gradient.unsafeGetTensorImpl() : nullptr,
                                 gradient.defined() ? gradient._version() : 0);
  }
}

bool DistributedModel::gradients_left_as_they_were() const {
  const auto defined = [](const auto& named) { return named.second.grad().defined(); };
  // A step that threw left no record: the gradients its peers kept count as its own.
  if (left_gradients_.size() != named_parameters_.size()) {
    return std::any_of(named_parameters_.begin(), named_parameters_.end(), defined);
  }
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    const at::Tensor& gradient = named_parameters_[i].second.grad();
    if (gradient.defined() && gradient.unsafeGetTensorImpl() == left_gradients_[i].first &&
        gradient._version() == left_gradients_[i].second) {
      return true;
    }
  }
  return false;
}

void DistributedModel::share_first_replica_buffers() {
  const Topology& topology = runtime_->topology();
  if (topology.data_parallel_degree() < 2 || topology.expert_parallel_degree() > 1) return;
  share_first_replicas(named_buffers_, runtime_->data_parallel());
}

void DistributedModel::share_first_replica_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> dense, experts;
  for (const auto& named : named_parameters_) (expert_shard_names().count(named.first) ? experts : dense).push_back(named);
  if (runtime_->data_parallel().size() > 1) share_first_replicas(dense, runtime_->data_parallel());
  if (runtime_->expert_data_parallel().size() > 1) share_first_replicas(experts, runtime_->expert_data_parallel());
}

void DistributedModel::share_first_replicas(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                            comm::Communicator& replicas) {
  if (tensors.empty()) return;
  // One broadcast per dtype and device, not one per buffer (a ResNet has three per batch norm).
  std::map<std::pair<c10::ScalarType, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& [name, buffer] : tensors) {
    if (buffer.defined() && buffer.numel() > 0) groups[{buffer.scalar_type(), buffer.device().str()}].push_back(buffer);
  }
  // Packed in pieces of at most kPiece bytes: a model's parameters packed whole would hold a second copy of them.
  constexpr std::int64_t kPiece = std::int64_t{64} << 20;
  at::NoGradGuard no_grad;
  for (auto& [key, buffers] : groups) {
    for (std::size_t first = 0; first < buffers.size();) {
      std::size_t end = first;
      std::int64_t bytes = 0;
      std::vector<at::Tensor> flat;
      while (end < buffers.size() && (end == first || bytes + buffers[end].nbytes() <= kPiece)) {
        flat.push_back(buffers[end].detach().reshape(-1));
        bytes += static_cast<std::int64_t>(buffers[end].nbytes());
        ++end;
      }
      if (end == first + 1 && buffers[first].is_contiguous()) {  // alone: received in place
        replicas.broadcast(buffers[first].detach(), 0);
        first = end;
        continue;
      }
      at::Tensor packed = at::cat(flat);
      replicas.broadcast(packed, 0);
      std::int64_t offset = 0;
      for (std::size_t i = first; i < end; ++i) {
        buffers[i].detach().copy_(packed.narrow(0, offset, buffers[i].numel()).view(buffers[i].sizes()));
        offset += buffers[i].numel();
      }
      first = end;
    }
  }
}

}  // namespace smp
