#include "smp/distributed_model.h"

#include <chrono>

#include <ATen/ATen.h>

#include "smp/log.h"

namespace smp {
namespace {

sched::Schedule make_schedule(const Config& config) {
  sched::Schedule compute = config.pipeline == PipelineKind::Simple
                                ? sched::make_gpipe(config.partitions, config.microbatches)
                                : sched::make_1f1b(config.partitions, config.microbatches, config.active_microbatches);
  const auto graph = sched::StageGraph::chain(config.partitions);
  sched::Schedule lowered = sched::lower_communication(compute, graph);
  sched::validate(lowered, graph);
  return lowered;
}

}  // namespace

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, torch::nn::Sequential model,
                                   const at::Tensor& sample_input)
    : runtime_(std::move(runtime)) {
  const Config& config = runtime_->config();
  if (model->size() == 0) throw ConfigError("the model is an empty Sequential; nothing to train");
  if (runtime_->rank() == 0) {
    plan_ = plan_chain(profile_chain(*model, sample_input), config);
    log::info(plan_.report());
    runtime_->publish("stage_plan", plan_.to_json());
  } else {
    plan_ = StagePlan::from_json(runtime_->fetch("stage_plan"));
  }

  const auto children = model->named_children();
  std::size_t index = 0;
  for (auto& module : *model) {
    const auto& name = children[index].key();
    if (plan_.stage_of_module[index++] != stage()) continue;
    stage_modules_->push_back(name, module);
    for (const auto& parameter : module.ptr()->named_parameters()) {
      named_parameters_.emplace_back(name + "." + parameter.key(), parameter.value());
    }
  }
  executor_ = std::make_unique<PipelineExecutor>(make_schedule(config), sched::StageGraph::chain(config.partitions),
                                                 runtime_->pipeline());
}

std::vector<at::Tensor> DistributedModel::parameters() const {
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : named_parameters_) tensors.push_back(tensor);
  return tensors;
}

StepOutput DistributedModel::train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss) {
  const auto start = std::chrono::steady_clock::now();
  const Config& config = runtime_->config();
  const int microbatches = config.microbatches;
  auto check = [&](const at::Tensor& tensor, const char* what) {
    if (!tensor.defined() || tensor.dim() == 0 || tensor.size(0) % microbatches != 0 || tensor.size(0) == 0) {
      throw ConfigError(std::string("train_step: the replica's ") + what + " batch of " +
                        (tensor.defined() && tensor.dim() > 0 ? std::to_string(tensor.size(0)) : std::string("no")) +
                        " samples does not split into " + std::to_string(microbatches) + " microbatches");
    }
  };
  check(inputs, "input");
  check(targets, "target");
  if (inputs.size(0) != targets.size(0)) {
    throw ConfigError("train_step: " + std::to_string(inputs.size(0)) + " inputs but " +
                      std::to_string(targets.size(0)) + " targets");
  }
  MicrobatchData data;
  data.inputs = inputs.chunk(microbatches);
  data.targets = targets.chunk(microbatches);
  data.loss = loss;

  ExecutorStats stats;
  at::Tensor loss_total;
  try {
    stats = executor_->run([this](int, const std::vector<at::Tensor>& stage_inputs) {
      return std::vector<at::Tensor>{stage_modules_->forward(stage_inputs.at(0))};
    }, data);
    average_gradients_over_replicas();
    // Only last-stage ranks hold a loss; one world all-reduce gives every rank the mean over replicas.
    loss_total = at::full({1}, stats.has_loss ? stats.loss_sum : 0.0, at::kDouble);
    runtime_->world().all_reduce_sum(loss_total);
  } catch (const comm::CommError& error) {
    throw comm::CommError("step " + std::to_string(step_) + ", stage " + std::to_string(stage()) + ": " + error.what());
  }
  ++step_;
  StepOutput output;
  output.loss = loss_total.item<double>() / runtime_->topology().data_parallel_degree();
  output.peak_stashed_microbatches = stats.peak_stashed_microbatches;
  output.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return output;
}

void DistributedModel::average_gradients_over_replicas() {
  const int replicas = runtime_->topology().data_parallel_degree();
  if (replicas == 1 || named_parameters_.empty()) return;
  // One flat buffer, one all-reduce: on Gloo the per-call latency dominates for the many small tensors of a stage.
  std::vector<at::Tensor> grads;
  for (auto& [name, parameter] : named_parameters_) {
    if (!parameter.grad().defined()) parameter.mutable_grad() = at::zeros_like(parameter);
    grads.push_back(parameter.grad().reshape({-1}));
  }
  at::Tensor flat = at::cat(grads);
  runtime_->data_parallel().all_reduce_sum(flat);
  flat.div_(replicas);
  int64_t offset = 0;
  for (auto& [name, parameter] : named_parameters_) {
    const int64_t count = parameter.numel();
    parameter.mutable_grad().copy_(flat.narrow(0, offset, count).view_as(parameter));
    offset += count;
  }
}

}  // namespace smp
