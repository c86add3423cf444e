#include "smp/distributed_model.h"

#include "smp/checkpoint.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cmath>

#include <c10/util/StringUtil.h>

#include "smp/log.h"
#include "smp/timeline.h"
#include "smp/scheduler/simulator.h"
#include "autocast_scope.h"
#include "activation_checkpoint.h"
#include "smp/tp.h"

namespace smp {
namespace {

// Runs what is inside under autocast for `device`, restoring the previous state after (LibTorch has no public
// RAII guard for it).

// Dynamic loss scaling for fp16 (the usual schedule): start high, halve on an overflow (and skip that step),
// double after this many steps without one.
constexpr double kInitialLossScale = 65536.0;
constexpr int kLossScaleGrowthInterval = 2000;

sched::Schedule make_schedule(const Config& config) {
  sched::Schedule schedule;
  if (config.schedule_file.empty()) {
    schedule = sched::make_schedule(config.schedule_name(), config.partitions, config.microbatches,
                                    config.virtual_stages, config.active_microbatches);
  } else {
    std::ifstream file(config.schedule_file);
    if (!file) throw ConfigError(config.source + ": key \"schedule_file\": cannot open " + config.schedule_file);
    try {
      schedule = sched::read_csv(file);
    } catch (const sched::ScheduleError& error) {
      throw ConfigError(config.schedule_file + ": " + error.what());
    }
    if (schedule.num_ranks != config.partitions || schedule.num_stages != config.num_stages() ||
        schedule.num_microbatches != config.microbatches) {
      throw ConfigError(config.schedule_file + ": the schedule is for " + std::to_string(schedule.num_ranks) +
                        " ranks, " + std::to_string(schedule.num_stages) + " stages, " +
                        std::to_string(schedule.num_microbatches) + " microbatches; the config asks for " +
                        std::to_string(config.partitions) + ", " + std::to_string(config.num_stages()) + ", " +
                        std::to_string(config.microbatches));
    }
  }
  return schedule;
}

// Adds the transfers the model's stage graph needs (unless a schedule file brought its own) and validates the
// result against that graph: skip connections get their own sends and receives.
sched::Schedule lower_and_validate(sched::Schedule schedule, const sched::StageGraph& graph, const Config& config) {
  bool has_transfers = false;
  for (const auto& actions : schedule.ranks) {
    for (const auto& action : actions) has_transfers |= !sched::is_compute(action.kind);
  }
  try {
    if (!has_transfers) schedule = sched::lower_communication(schedule, graph);
    sched::validate(schedule, graph);
  } catch (const sched::ScheduleError& error) {
    throw ConfigError((config.schedule_file.empty() ? config.schedule_name() : config.schedule_file) +
                      ": invalid schedule: " + error.what());
  }
  return schedule;
}

}  // namespace

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, const torch::nn::Sequential& model,
                                   const at::Tensor& sample_input)
    : DistributedModel(std::move(runtime), GraphModel::from_sequential(model), sample_input) {}

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, GraphModel model, const at::Tensor& sample_input)
    : DistributedModel(std::move(runtime), std::move(model), ModelInputs{sample_input}) {}

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, GraphModel model, const ModelInputs& sample,
                                   const MaterializeNodes& materialize)
    : runtime_(std::move(runtime)),
      // More stages than nodes: cut finer along the module tree first.
      model_(model.expanded_to(static_cast<std::size_t>(runtime_->config().num_stages()))) {
  const Config& config = runtime_->config();
  if (config.fp16) loss_scale_ = kInitialLossScale;
  if (model_.nodes().empty()) throw ConfigError("the model has no modules; nothing to train");
  if (sample.size() != model_.input_names().size()) {
    throw ModelError("the sample has " + std::to_string(sample.size()) + " inputs, the model takes " +
                     std::to_string(model_.input_names().size()));
  }
  auto schedule = make_schedule(config);
  model_.set_build_seed(static_cast<std::uint64_t>(config.seed));
  exchange_ = "model" + std::to_string(runtime_->next_exchange()) + "/";
  if (runtime_->rank() == 0) {
    // Measured once every rank has built what it builds before this (a Python model's capture): the profile must
    // not share the cores with them.
    for (int rank = 1; rank < runtime_->world_size(); ++rank) runtime_->fetch(exchange_ + "ready/" + std::to_string(rank));
    // One stage has nothing to balance: the untimed rounds still check that the model takes the sample.
    // What a stage's activations cost depends on how many microbatches the schedule keeps in flight on its rank
    // (under 1F1B, p - rank); a rank's virtual stages share its count.
    // On its compute actions alone: a schedule file's own transfers may follow skips the chain does not have (the
    // model's stage graph is only known once the plan exists).
    sched::Schedule compute = schedule;
    for (auto& actions : compute.ranks) {
      actions.erase(std::remove_if(actions.begin(), actions.end(),
                                   [](const sched::Action& action) { return !sched::is_compute(action.kind); }),
                    actions.end());
    }
    const auto in_flight = sched::simulate(compute, sched::StageGraph::chain(schedule.num_stages),
                                           sched::SimulationCosts::uniform(schedule.num_stages))
                               .peak_in_flight;
    std::vector<double> copies(static_cast<std::size_t>(schedule.num_stages), 1.0);
    for (int stage = 0; stage < schedule.num_stages; ++stage) {
      const int rank = schedule.stage_to_rank.at(stage);
      const double stages_on_rank = static_cast<double>(schedule.stages_of_rank(rank).size());
      copies[stage] = std::max(1.0, std::ceil(in_flight.at(rank) / stages_on_rank));
    }
    // Profiled on this job's device (module by module, see profile_graph).
    ModelInputs on_device;
    for (const auto& input : sample) on_device.push_back(input.defined() ? input.to(runtime_->device()) : input);
    // Alone, while its tensor-parallel peers wait: the tp layers compute their shards without communicating.
    const tp::WithoutCollectives alone;
    auto profiles = profile_graph(model_, on_device, config.num_stages() > 1 ? 5 : 0);
    // Parameter names and shapes of the whole model, which only this rank sees whole (nodes built on demand are
    // built here one at a time): a checkpoint of another model is refused by it.
    std::string shapes;
    std::size_t count = 0;
    for (const auto& profile : profiles) {
      shapes += profile.parameter_shapes;
      count += static_cast<std::size_t>(std::count(profile.parameter_shapes.begin(), profile.parameter_shapes.end(), ';'));
    }
    model_signature_ = std::to_string(count) + " parameters, crc32 " + std::to_string(crc32(shapes.data(), shapes.size()));
    plan_ = plan_stages(std::move(profiles), config, copies, optimizer_state_shards());
    runtime_->publish(exchange_ + "model_signature", model_signature_);
    runtime_->publish(exchange_ + "stage_plan", plan_.to_json());
  } else {
    runtime_->publish(exchange_ + "ready/" + std::to_string(runtime_->rank()), "");
    model_signature_ = runtime_->fetch(exchange_ + "model_signature");
    plan_ = StagePlan::from_json(runtime_->fetch(exchange_ + "stage_plan"));
  }
  if (config.resume) adopt_checkpoint_partition();
  if (runtime_->rank() == 0) {
    log::info(plan_.report());
    if (config.shard_optimizer_state && runtime_->topology().data_parallel_degree() == 1) {
      log::warn("\"shard_optimizer_state\" has no effect with one data-parallel replica: the optimizer keeps all "
                "of its state");
    }
    if (!config.trace_dir.empty()) {
      std::filesystem::create_directories(config.trace_dir);
      write_file_atomically(config.trace_dir + "/partition.json", plan_.to_json());
    }
  }
  std::vector<int> local_nodes;
  for (std::size_t i = 0; i < model_.nodes().size(); ++i) {
    if (schedule.stage_to_rank[plan_.stage_of_module[i]] == runtime_->pp_rank()) local_nodes.push_back(static_cast<int>(i));
  }
  for (int node : local_nodes) model_.build(node);  // nodes built on demand: this rank's, and no other
  if (materialize) materialize(model_, local_nodes);
  build_stages(schedule);
  executor_ = std::make_unique<PipelineExecutor>(lower_and_validate(std::move(schedule), graph_, config), graph_,
                                                 runtime_->pipeline(), config.checkpointed_stages);
}

void DistributedModel::build_stages(const sched::Schedule& schedule) {
  const Config& config = runtime_->config();
  const auto& nodes = model_.nodes();
  std::vector<std::string> names;
  for (const auto& node : nodes) names.push_back(node.name);
  checkpointed_nodes_ = checkpointed_modules(names, config);
  const auto stage_of = [&](const std::string& tensor) { return plan_.stage_of_module.at(model_.index_of(tensor)); };
  graph_.consumers.assign(static_cast<std::size_t>(config.num_stages()), {});
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const int consumer = plan_.stage_of_module[i];
    for (const auto& input : nodes[i].inputs) {
      if (model_.input_index(input) >= 0) continue;  // every rank has the batch
      const int producer = stage_of(input);
      if (producer == consumer) continue;
      auto& names = transfers_[{producer, consumer}];
      if (std::find(names.begin(), names.end(), input) == names.end()) names.push_back(input);
    }
  }
  // The loss reads every model output on the last stage: an output made earlier travels there like a skip.
  const int last_stage = config.num_stages() - 1;
  for (const auto& output : model_.output_names()) {
    const int producer = stage_of(output);
    if (producer == last_stage) continue;
    auto& names = transfers_[{producer, last_stage}];
    if (std::find(names.begin(), names.end(), output) == names.end()) names.push_back(output);
  }
  for (auto& [stages, names] : transfers_) {
    std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
      return model_.index_of(a) < model_.index_of(b);
    });
    graph_.consumers[stages.first].push_back(stages.second);
  }
  for (auto& consumers : graph_.consumers) std::sort(consumers.begin(), consumers.end());

  // Parameters: each local one once, under its model-wide name.
  std::set<const void*> local_tensors;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const int stage = plan_.stage_of_module[i];
    if (schedule.stage_to_rank[stage] != runtime_->pp_rank()) continue;
    auto& local = stages_[stage];
    local.nodes.push_back(static_cast<int>(i));
    for (const auto& parameter : nodes[i].module->parameters()) {
      local_tensors.insert(parameter.unsafeGetTensorImpl());
      if (std::none_of(local.parameters.begin(), local.parameters.end(),
                       [&](const at::Tensor& known) { return known.is_same(parameter); })) {
        local.parameters.push_back(parameter);
      }
    }
  }
  for (const auto& [name, parameter] : model_.named_parameters()) {
    if (local_tensors.count(parameter.unsafeGetTensorImpl())) {
      named_parameters_.emplace_back(name, parameter);
      trainable_at_build_.push_back(parameter.requires_grad());
    }
  }
  std::set<const void*> local_buffers;
  for (const auto& [stage, local] : stages_) {
    for (int node : local.nodes) {
      for (const auto& buffer : nodes[node].module->buffers()) local_buffers.insert(buffer.unsafeGetTensorImpl());
    }
  }
  for (const auto& [name, buffer] : model_.named_buffers()) {
    if (local_buffers.count(buffer.unsafeGetTensorImpl())) named_buffers_.emplace_back(name, buffer);
  }
  // Only this rank's modules go to its device (Module::to keeps the parameter tensors, so what was collected above
  // stays valid); the others stay where the caller built them.
  const c10::Device device = runtime_->device();
  for (const auto& [stage, local] : stages_) {
    for (int node : local.nodes) nodes[node].module->to(device);
  }

  for (auto& [stage, local] : stages_) {
    local.runs = plan_node_runs(model_, local.nodes, checkpointed_nodes_);
    if (local.runs.size() < local.nodes.size()) {
      log::info("stage " + std::to_string(stage) + " runs its " + std::to_string(local.nodes.size()) + " modules in " +
                std::to_string(local.runs.size()) + " calls per microbatch (consecutive captured modules as one)");
    }
  }

  if (runtime_->topology().data_parallel_degree() > 1 &&
      std::any_of(named_parameters_.begin(), named_parameters_.end(),
                  [](const auto& named) { return named.second.requires_grad(); })) {
    // A parameter's gradient is final after one backward pass per microbatch and local stage that uses it.
    std::vector<at::Tensor> parameters;
    std::vector<int> accumulations;
    for (const auto& [name, parameter] : named_parameters_) {
      if (!parameter.requires_grad()) continue;  // frozen: no gradient to average, and none to invent
      int users = 0;
      for (const auto& [stage, local] : stages_) {
        users += std::any_of(local.parameters.begin(), local.parameters.end(),
                             [&](const at::Tensor& known) { return known.is_same(parameter); });
      }
      parameters.push_back(parameter);
      accumulations.push_back(users * config.microbatches);
    }
    // PyTorch DDP's default bucket size: large enough that per-call latency does not dominate, small enough that
    // the first bucket is ready early in the last backward pass.
    constexpr std::int64_t kBucketBytes = 25 << 20;
    if (config.shard_optimizer_state) {
      std::vector<int> owners;
      for (int owner : optimizer_shard_owners(runtime_->topology().data_parallel_degree())) {
        if (owner >= 0) owners.push_back(owner);  // the trainable ones, in the order of `parameters`
      }
      shards_ = std::make_unique<OptimizerShards>(parameters, owners, runtime_->data_parallel(), kBucketBytes);
    }
    reducer_ = std::make_unique<GradientReducer>(std::move(parameters), std::move(accumulations),
                                                 runtime_->data_parallel(), kBucketBytes);
  }

  // Tied parameters whose holders sit on several ranks: every holder keeps a copy and their gradients are summed
  // over exactly those ranks of this replica before the optimizer step, so the copies never drift.
  std::set<const void*> counted_elsewhere;
  for (const auto& tie : model_.ties()) {
    std::set<int> holder_ranks;
    for (int node : tie.nodes) holder_ranks.insert(schedule.stage_to_rank[plan_.stage_of_module[node]]);
    const int first_holder = schedule.stage_to_rank[plan_.stage_of_module[tie.nodes.front()]];
    const at::Tensor& parameter = tie.tensor;
    if (first_holder != runtime_->pp_rank()) counted_elsewhere.insert(parameter.unsafeGetTensorImpl());
    // Frozen copies need no sum (every rank sees the same requires_grad, so all skip the group alike).
    if (holder_ranks.size() < 2 || !holder_ranks.count(runtime_->pp_rank()) || !parameter.requires_grad()) continue;
    std::vector<int> members;
    // Under this model's prefix: a second model of the same job must not meet this group's rendezvous keys.
    std::string name = exchange_ + "tied/" + tie.parameter + "/";
    for (int pp : holder_ranks) {
      members.push_back(runtime_->topology().rank_of({pp, runtime_->dp_rank(), runtime_->tp_rank()}));
      name += std::to_string(members.back()) + ",";
    }
    tied_.push_back({parameter, runtime_->make_group(members, name)});
  }
  // A parameter every tensor-parallel rank holds whole is counted by tp rank 0; shards by each.
  std::set<const void*> shards;
  for (const auto& [stage, local] : stages_) {
    for (int node : local.nodes) {
      for (const auto& layout : tp::shard_layouts_in(*nodes[node].module)) shards.insert(layout.shard.unsafeGetTensorImpl());
    }
  }
  for (const auto& [name, parameter] : named_parameters_) {
    const void* impl = parameter.unsafeGetTensorImpl();
    if (counted_elsewhere.count(impl) || (runtime_->tp_rank() != 0 && !shards.count(impl))) continue;
    norm_parameters_.push_back(parameter);
  }
}

StageOutputs DistributedModel::run_stage(int stage, const ModelInputs& model_inputs,
                                         const TensorsByStage& from_producers) {
  std::map<std::string, at::Tensor> values;
  for (std::size_t i = 0; i < model_inputs.size(); ++i) values[model_.input_names()[i]] = model_inputs[i];
  for (const auto& [producer, tensors] : from_producers) {
    const auto& names = transfers_.at({producer, stage});
    for (std::size_t i = 0; i < names.size(); ++i) values[names[i]] = GraphModel::writable_input(tensors.at(i));
  }
  const auto& nodes = model_.nodes();
  const Config& config = runtime_->config();
  std::optional<AutocastSetting> precision;
  if (config.bf16 || config.fp16) {
    precision = AutocastSetting{runtime_->device().type(), config.bf16 ? at::kBFloat16 : at::kHalf};
  }
  std::optional<AutocastScope> autocast;
  if (precision) autocast.emplace(*precision);
  compute_runs(
      model_, stages_.at(stage).runs, values,
      [&](int node, const std::vector<at::Tensor>& arguments) {
        return checkpointed_nodes_[node] ? checkpointed_forward(nodes[node], arguments, precision, runtime_->device())
                                         : nodes[node].forward(arguments);
      },
      [&] { return "step " + std::to_string(step_) + ", stage " + std::to_string(stage); });
  StageOutputs outputs;
  for (const auto& consumer : graph_.consumers[stage]) {
    auto& sent = outputs.to_consumers[consumer];
    for (const auto& name : transfers_.at({stage, consumer})) sent.push_back(values.at(name));
  }
  if (stage == graph_.num_stages() - 1) {
    for (const auto& name : model_.output_names()) {
      at::Tensor output = values.at(name);
      // The loss is computed in float32 whatever precision the stages ran in.
      if (autocast && at::isFloatingType(output.scalar_type())) output = output.to(at::kFloat);
      outputs.model_outputs.push_back(std::move(output));
    }
  }
  return outputs;
}

void DistributedModel::sum_tied_gradients() {
  for (auto& tied : tied_) {
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

void DistributedModel::adopt_checkpoint_partition() {
  const Config& config = runtime_->config();
  // Rank 0 chooses, so that every rank resumes from the same checkpoint even if another is being written.
  if (runtime_->rank() == 0) {
    std::vector<std::string> skipped;
    const auto found = find_latest_checkpoint(config.checkpoint_dir, &skipped);
    for (const auto& reason : skipped) log::warn("skipping checkpoint: " + reason);
    if (!found) log::info("no complete checkpoint in " + config.checkpoint_dir + "; starting from step 0");
    runtime_->publish(exchange_ + "resume_from", found ? found->directory : "");
  }
  const std::string directory = runtime_->fetch(exchange_ + "resume_from");
  if (directory.empty()) return;
  // Rank 0 verified every file; each rank checks its own again as Checkpointer::resume loads it.
  auto manifest = read_manifest(directory);
  if (manifest.partitions != config.partitions || manifest.virtual_stages != config.virtual_stages) {
    throw CheckpointError(directory + " was saved with " + std::to_string(manifest.partitions) + " partitions x " +
                          std::to_string(manifest.virtual_stages) + " virtual stages, this job has " +
                          std::to_string(config.partitions) + " x " + std::to_string(config.virtual_stages) +
                          "; export it (smp_checkpoint export) and load it with DistributedModel::load_parameters");
  }
  if (manifest.model_signature != model_signature_) {
    throw CheckpointError(directory + " holds another model (" + manifest.model_signature + "; this model: " +
                          model_signature_ + ")");
  }
  std::vector<std::string> names;
  for (const auto& node : model_.nodes()) names.push_back(node.name);
  if (names != manifest.module_names) throw CheckpointError(directory + ": the model's modules differ from the checkpoint's");
  plan_.stage_of_module = manifest.stage_of_module;
  resumed_from_ = FoundCheckpoint{directory, std::move(manifest)};
}

void DistributedModel::load_state(const TensorSource& source) {
  // Everything checked before anything is copied: a bad file leaves the model as it was.
  const auto check = [&](const std::string& name, const at::Tensor& tensor, const char* kind) {
    const auto shape = source.shape(name);
    if (!shape) {
      throw CheckpointError(source.description + ": no " + kind + " \"" + name + "\" (this rank's stages need it)");
    }
    if (*shape != tensor.sizes().vec()) {
      throw CheckpointError(source.file_of(name) + ": " + kind + " \"" + name + "\" has shape " + c10::str(*shape) +
                            ", the model has " + c10::str(tensor.sizes()));
    }
  };
  for (const auto& [name, parameter] : named_parameters_) check(name, parameter, "parameter");
  if (source.has_buffers) {
    for (const auto& [name, buffer] : named_buffers_) check(name, buffer, "buffer");
  }
  c10::NoGradGuard no_grad;
  for (auto& [name, parameter] : named_parameters_) parameter.copy_(source.read(name));
  if (source.has_buffers) {
    for (auto& [name, buffer] : named_buffers_) buffer.copy_(source.read(name));
  }
}

void DistributedModel::load_parameters(const std::string& path) { load_state(tensor_source(path)); }

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

}  // namespace

bool DistributedModel::local_gradients_finite() const {
  for (const auto& group : gradients_by_device_and_dtype(named_parameters_)) {
    if (!all_finite(group)) return false;
  }
  return true;
}

bool DistributedModel::unscale_gradients_checking_finite() {
  // fp16: one pass over the gradients both divides them by the loss scale and finds non-finite values (the fused
  // kernel of PyTorch's GradScaler), one host sync per group. It checks its input: dividing by a scale above 1
  // cannot overflow, and the scale is a power of two (it only ever doubles or halves), so multiplying by its inverse
  // equals dividing. A scale below 1 (many overflows in a row), or a dtype the kernel lacks on the GPU (bfloat16),
  // divides first and checks the result.
  bool finite = true;
  for (auto& gradients : gradients_by_device_and_dtype(named_parameters_)) {
    const at::ScalarType type = gradients.front().scalar_type();
    if (loss_scale_ > 1.0 && (type == at::kFloat || type == at::kDouble || type == at::kHalf)) {
      at::Tensor found = at::zeros({1}, at::TensorOptions(at::kFloat).device(gradients.front().device()));
      const at::Tensor inverse = at::full({1}, 1.0 / loss_scale_, found.options());
      at::_amp_foreach_non_finite_check_and_unscale_(gradients, found, inverse);
      finite = finite && found.item<float>() == 0.0f;
    } else {
      at::_foreach_div_(gradients, loss_scale_);
      finite = finite && all_finite(gradients);
    }
  }
  return finite;
}

void DistributedModel::resume_at(long long step) { step_ = step; }

void DistributedModel::restore_loss_scale(double scale, long long steps_since_change) {
  if (!runtime_->config().fp16) return;  // the scale only exists for fp16
  loss_scale_ = scale;
  good_steps_ = steps_since_change;
}

double DistributedModel::clip_grad_norm(double max_norm) {
  // On the parameters' device: the pipeline group reduces it there (NCCL on a GPU).
  at::Tensor squares = at::zeros({1}, at::TensorOptions(at::kDouble).device(runtime_->device()));
  for (const auto& parameter : norm_parameters_) {
    if (parameter.grad().defined()) squares += parameter.grad().to(at::kDouble).pow(2).sum();
  }
  // Replicas hold identical averaged gradients, so the pipeline groups of one replica see the whole model: each
  // shard on its rank, each parameter the tensor-parallel ranks all hold whole on tp rank 0 alone.
  runtime_->pipeline().all_reduce_sum(squares);
  if (runtime_->topology().tensor_parallel_degree() > 1) runtime_->tensor_parallel().all_reduce_sum(squares);
  const double norm = std::sqrt(squares.item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    for (const auto& [name, parameter] : named_parameters_) {
      if (parameter.grad().defined()) parameter.grad().mul_(scale);
    }
  }
  return norm;
}

void DistributedModel::zero_grad(bool set_to_none) {
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

int DistributedModel::optimizer_state_shards() const {
  // From the config, not from shards_: a rank without trainable parameters has none, yet its checkpoint files
  // must follow the same layout as every other rank's.
  return runtime_->config().shard_optimizer_state ? runtime_->topology().data_parallel_degree() : 1;
}

std::vector<int> DistributedModel::optimizer_shard_owners(int replicas) const {
  // The trainable parameters as the constructor found them, so that the owners stay those of the optimizer's
  // groups even if requires_grad changes later.
  std::vector<std::int64_t> bytes;
  std::vector<std::size_t> trainable;
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    if (!trainable_at_build_[i]) continue;
    bytes.push_back(static_cast<std::int64_t>(named_parameters_[i].second.nbytes()));
    trainable.push_back(i);
  }
  const std::vector<int> owner_of_trainable = assign_shard_owners(bytes, replicas);
  std::vector<int> owners(named_parameters_.size(), -1);
  for (std::size_t k = 0; k < trainable.size(); ++k) owners[trainable[k]] = owner_of_trainable[k];
  return owners;
}

void DistributedModel::share_updated_parameters() {
  if (shards_) shards_->share_updates();
}

std::vector<at::Tensor> DistributedModel::parameters() const {
  std::vector<at::Tensor> tensors;
  for (const auto& [name, tensor] : named_parameters_) tensors.push_back(tensor);
  return tensors;
}

std::map<int, int> DistributedModel::calls_per_microbatch() const {
  std::map<int, int> calls;
  for (const auto& [stage, local] : stages_) calls[stage] = static_cast<int>(local.runs.size());
  return calls;
}

std::vector<int> DistributedModel::stages() const {
  std::vector<int> owned;
  for (const auto& [stage, modules] : stages_) owned.push_back(stage);
  return owned;
}

std::vector<bool> DistributedModel::batched_inputs(const ModelInputs& inputs, const at::Tensor& targets) {
  std::optional<std::int64_t> batch;
  if (targets.defined() && targets.dim() > 0) batch = targets.size(0);
  for (const auto& input : inputs) {
    if (!batch && input.defined() && input.dim() > 0) batch = input.size(0);
  }
  std::vector<bool> batched;
  for (const auto& input : inputs) batched.push_back(batch && input.defined() && input.dim() > 0 && input.size(0) == *batch);
  return batched;
}

MicrobatchData DistributedModel::microbatch_data(const char* caller, const ModelInputs& inputs,
                                                 const at::Tensor& targets, const OutputsLossFunction& loss,
                                                 const std::vector<bool>& given_batched) const {
  const int microbatches = runtime_->config().microbatches;
  const auto& names = model_.input_names();
  if (inputs.size() != names.size()) {
    throw ConfigError(std::string(caller) + ": " + std::to_string(inputs.size()) + " inputs for a model of " +
                      std::to_string(names.size()));
  }
  if (!given_batched.empty() && given_batched.size() != inputs.size()) {
    throw ConfigError(std::string(caller) + ": " + std::to_string(given_batched.size()) + " batched flags for " +
                      std::to_string(inputs.size()) + " inputs");
  }
  const std::vector<bool> batched = given_batched.empty() ? batched_inputs(inputs, targets) : given_batched;
  std::optional<std::int64_t> batch;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (batched[i]) batch = inputs[i].size(0);
  }
  if (targets.defined() && targets.dim() > 0) batch = targets.size(0);
  if (!batch || *batch == 0 || *batch % microbatches != 0) {
    throw ConfigError(std::string(caller) + ": the replica's batch of " +
                      (batch ? std::to_string(*batch) : std::string("no")) + " samples does not split into " +
                      std::to_string(microbatches) + " microbatches");
  }
  if (targets.defined() && targets.dim() > 0 && std::none_of(batched.begin(), batched.end(), [](bool b) { return b; })) {
    std::string sizes;
    for (const auto& input : inputs) sizes += (sizes.empty() ? "" : ", ") + (input.defined() ? c10::str(input.sizes()) : "None");
    throw ConfigError(std::string(caller) + ": " + std::to_string(*batch) + " targets, but no input has a first "
                      "dimension of that size (inputs " + sizes + ")");
  }
  MicrobatchData data;
  const c10::Device device = runtime_->device();
  data.inputs.assign(static_cast<std::size_t>(microbatches), ModelInputs(inputs.size()));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor on_device = inputs[i].defined() ? inputs[i].to(device) : inputs[i];
    if (!batched[i]) {
      for (auto& microbatch : data.inputs) microbatch[i] = on_device;
      continue;
    }
    const auto chunks = on_device.chunk(microbatches);
    for (int m = 0; m < microbatches; ++m) data.inputs[m][i] = chunks[m];
  }
  if (targets.defined()) data.targets = (targets.dim() > 0 ? targets.to(device).chunk(microbatches)
                                                           : std::vector<at::Tensor>(microbatches, targets.to(device)));
  data.loss = loss;
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
  const int microbatches = runtime_->config().microbatches;
  auto check = [&](const at::Tensor& tensor, const char* what) {
    if (!tensor.defined() || tensor.dim() == 0 || tensor.size(0) % microbatches != 0 || tensor.size(0) == 0) {
      throw ConfigError(std::string(caller) + ": the replica's " + what + " batch of " +
                        (tensor.defined() && tensor.dim() > 0 ? std::to_string(tensor.size(0)) : std::string("no")) +
                        " samples does not split into " + std::to_string(microbatches) + " microbatches");
    }
  };
  check(inputs, "input");
  check(targets, "target");
  if (inputs.size(0) != targets.size(0)) {
    throw ConfigError(std::string(caller) + ": " + std::to_string(inputs.size(0)) + " inputs but " +
                      std::to_string(targets.size(0)) + " targets");
  }
}

OutputsLossFunction DistributedModel::of_first_output(const LossFunction& loss) {
  return [loss](const std::vector<at::Tensor>& outputs, const at::Tensor& target) { return loss(outputs.front(), target); };
}

StageCallbacks DistributedModel::stage_callbacks() {
  StageCallbacks callbacks;
  callbacks.forward = [this](int stage, const ModelInputs& model_inputs, const TensorsByStage& from_producers) {
    return run_stage(stage, model_inputs, from_producers);
  };
  callbacks.parameters = [this](int stage) { return stages_.at(stage).parameters; };
  callbacks.buffers = [this](int stage) {
    std::vector<at::Tensor> buffers;
    std::set<const void*> seen;  // a module shared by two nodes counts once
    for (int node : stages_.at(stage).nodes) {
      for (const auto& buffer : model_.nodes()[node].module->buffers()) {
        if (seen.insert(buffer.unsafeGetTensorImpl()).second) buffers.push_back(buffer);
      }
    }
    return buffers;
  };
  return callbacks;
}

namespace {

// The modules in eval mode (dropout off, batch norm on its running statistics) for as long as it lives; each
// gets its own mode back after, in reverse order, so that a module shared by two nodes ends as it began.
class EvaluationMode {
 public:
  explicit EvaluationMode(std::vector<std::shared_ptr<torch::nn::Module>> modules) : modules_(std::move(modules)) {
    for (const auto& module : modules_) {
      was_training_.push_back(module->is_training());
      module->eval();
    }
  }
  ~EvaluationMode() {
    for (std::size_t i = modules_.size(); i-- > 0;) modules_[i]->train(was_training_[i]);
  }
  EvaluationMode(const EvaluationMode&) = delete;
  EvaluationMode& operator=(const EvaluationMode&) = delete;

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<bool> was_training_;
};

}  // namespace

StepOutput DistributedModel::evaluate(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss,
                                     bool keep_outputs) {
  check_single_input("evaluate", inputs, targets);
  return evaluate(ModelInputs{inputs}, targets, of_first_output(loss), keep_outputs);
}

StepOutput DistributedModel::evaluate(const std::map<std::string, at::Tensor>& inputs, const at::Tensor& targets,
                                     const OutputsLossFunction& loss, bool keep_outputs) {
  return evaluate(inputs_by_name("evaluate", inputs), targets, loss, keep_outputs);
}

StepOutput DistributedModel::train_step(const std::map<std::string, at::Tensor>& inputs, const at::Tensor& targets,
                                       const OutputsLossFunction& loss, bool keep_outputs) {
  return train_step(inputs_by_name("train_step", inputs), targets, loss, keep_outputs);
}

StepOutput DistributedModel::evaluate(const ModelInputs& inputs, const at::Tensor& targets,
                                     const OutputsLossFunction& loss, bool keep_outputs,
                                     const std::vector<bool>& batched) {
  const auto start = std::chrono::steady_clock::now();
  MicrobatchData data = microbatch_data("evaluate", inputs, targets, loss, batched);
  data.keep_outputs = keep_outputs;
  if (!evaluator_) {
    // The training schedule's forwards in their order: its transfers, channels and tags serve as they are.
    sched::Schedule forward = sched::forward_only(executor_->schedule());
    sched::validate(forward, graph_);
    evaluator_ = std::make_unique<PipelineExecutor>(std::move(forward), graph_, runtime_->pipeline());
  }
  at::NoGradGuard no_graphs;
  std::vector<std::shared_ptr<torch::nn::Module>> local_modules;
  for (const auto& [stage, local] : stages_) {
    for (int node : local.nodes) local_modules.push_back(model_.nodes()[node].module);
  }
  const EvaluationMode evaluation_mode(std::move(local_modules));
  StepOutput output;
  at::Tensor loss_total = at::zeros({1}, at::kDouble);
  try {
    const ExecutorStats stats = evaluator_->run(stage_callbacks(), data);
    if (stats.has_loss && counts_loss()) loss_total[0] = stats.loss_sum;
    output.sends_posted = stats.sends_posted;
    output.all_outputs = stats.outputs;
    if (!stats.outputs.empty()) output.outputs = stats.outputs.front();
    output.sends_released_early = stats.sends_released_early;
    output.peak_sends_held = stats.peak_sends_held;
    runtime_->world().all_reduce_sum(loss_total);  // the last stages' losses, summed over replicas
  } catch (const comm::CommError& error) {
    throw comm::CommError("evaluation after step " + std::to_string(step_) + ", stage-rank " +
                          std::to_string(runtime_->pp_rank()) + ": " + error.what());
  }
  output.loss = loss_total[0].item<double>() / runtime_->topology().data_parallel_degree();
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

}  // namespace

StepOutput DistributedModel::train_step(const at::Tensor& inputs, const at::Tensor& targets, const LossFunction& loss,
                                       bool keep_outputs) {
  check_single_input("train_step", inputs, targets);
  return train_step(ModelInputs{inputs}, targets, of_first_output(loss), keep_outputs);
}

StepOutput DistributedModel::train_step(const ModelInputs& inputs, const at::Tensor& targets,
                                       const OutputsLossFunction& loss, bool keep_outputs,
                                       const std::vector<bool>& batched) {
  const auto start = std::chrono::steady_clock::now();
  const Config& config = runtime_->config();
  MicrobatchData data = microbatch_data("train_step", inputs, targets, loss, batched);
  data.keep_outputs = keep_outputs;
  data.loss_scale = loss_scale_;
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
  at::Tensor loss_total;
  try {
    if (reducer_) reducer_->arm();
    // A traced step's timeline shows the tensor-parallel collectives inside the compute that ran them.
    const bool traced = !config.trace_dir.empty() && step_ == config.trace_step;
    std::vector<TimelineEvent> collectives;
    std::optional<tp::CollectiveObserver> observer;  // reports one collective at a time, from any thread
    if (traced && runtime_->topology().tensor_parallel_degree() > 1) {
      observer.emplace([&](const char* kind, std::int64_t, double start_us, double end_us) {
        collectives.push_back({kind, 0, 0, start_us, end_us, -1});
      });
    }
    stats = executor_->run(callbacks, data);
    observer.reset();
    for (auto& collective : collectives) {
      for (const auto& event : stats.events) {
        if (event.start_us <= collective.start_us && collective.start_us <= event.end_us) {
          collective.stage = event.stage;
          collective.microbatch = event.microbatch;
        }
      }
      stats.events.push_back(std::move(collective));
    }
    // Replicas first: it writes the mean back into .grad, and the tied sum (linear too) must come after.
    if (reducer_) {
      output.gradient_buckets = reducer_->buckets();
      output.buckets_overlapped = reducer_->finish();
    }
    sum_tied_gradients();
    const bool gradients_finite = loss_scale_ != 1.0 ? unscale_gradients_checking_finite() : local_gradients_finite();
    // One world all-reduce: slot 0 sums the last stages' losses (every rank learns the mean over replicas),
    // slot 1 + r is set by rank r when its gradients are not finite.
    loss_total = at::zeros({1 + runtime_->world_size()}, at::kDouble);
    loss_total[0] = stats.has_loss && counts_loss() ? stats.loss_sum : 0.0;
    if (!gradients_finite) loss_total[1 + runtime_->rank()] = 1.0;
    runtime_->world().all_reduce_sum(loss_total);
    if (!config.trace_dir.empty() && step_ == config.trace_step) write_timeline(stats.events);
  } catch (const comm::CommError& error) {
    throw comm::CommError("step " + std::to_string(step_) + ", stage-rank " + std::to_string(runtime_->pp_rank()) +
                          ": " + error.what());
  }
  output.loss = loss_total[0].item<double>() / runtime_->topology().data_parallel_degree();
  std::string bad_ranks;
  for (int rank = 0; rank < runtime_->world_size(); ++rank) {
    if (loss_total[1 + rank].item<double>() != 0.0) {
      const auto where = runtime_->topology().coordinates_of(rank);
      bad_ranks += (bad_ranks.empty() ? "" : ", ") + std::string("rank ") + std::to_string(rank) + " (stage-rank " +
                   std::to_string(where.pp_rank) + ")";
    }
  }
  last_step_skipped_ = false;
  if (config.fp16 && std::isfinite(output.loss) && !bad_ranks.empty()) {
    // An fp16 overflow under a too large loss scale, not a broken model: skip the step, lower the scale.
    loss_scale_ /= 2.0;
    good_steps_ = 0;
    if (runtime_->rank() == 0) {
      char scale[32];
      std::snprintf(scale, sizeof scale, "%g", loss_scale_);
      log::info("step " + std::to_string(step_) + ": fp16 gradients overflowed; skipping the step, loss scale now " +
                scale);
    }
    for (auto& [name, parameter] : named_parameters_) {
      if (parameter.grad().defined()) parameter.mutable_grad().zero_();
    }
    last_step_skipped_ = true;
    output.skipped = true;
  } else if (!std::isfinite(output.loss) || !bad_ranks.empty()) {
    const std::string what = "step " + std::to_string(step_) + ": " +
                             (!std::isfinite(output.loss) ? "the loss is " + std::to_string(output.loss) : std::string()) +
                             (!std::isfinite(output.loss) && !bad_ranks.empty() ? "; " : "") +
                             (bad_ranks.empty() ? "" : "non-finite gradients on " + bad_ranks);
    if (!config.skip_nonfinite_steps) throw NonFiniteError(what + " (set \"nonfinite\": \"skip\" to skip such steps)");
    if (runtime_->rank() == 0) log::warn(what + "; skipping the step");
    for (auto& [name, parameter] : named_parameters_) {
      if (parameter.grad().defined()) parameter.mutable_grad().zero_();
    }
    last_step_skipped_ = true;
    output.skipped = true;
  }
  if (config.fp16 && !output.skipped && ++good_steps_ % kLossScaleGrowthInterval == 0) loss_scale_ *= 2.0;
  earlier.add_this_step();
  ++step_;
  output.peak_stashed_microbatches = stats.peak_stashed_microbatches;
  output.sends_released_early = stats.sends_released_early;
  output.all_outputs = stats.outputs;
  if (!stats.outputs.empty()) output.outputs = stats.outputs.front();
  output.sends_posted = stats.sends_posted;
  output.peak_sends_held = stats.peak_sends_held;
  output.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return output;
}

void DistributedModel::write_timeline(const std::vector<TimelineEvent>& events) {
  RankTimeline mine{runtime_->rank(), runtime_->pp_rank(), runtime_->dp_rank(), events, runtime_->tp_rank()};
  const std::string key = exchange_ + "timeline/" + std::to_string(step_) + "/";
  runtime_->publish(key + std::to_string(runtime_->rank()), mine.to_json());
  if (runtime_->rank() != 0) return;
  std::vector<RankTimeline> ranks;
  for (int rank = 0; rank < runtime_->world_size(); ++rank) {
    ranks.push_back(RankTimeline::from_json(runtime_->fetch(key + std::to_string(rank))));
  }

  // Simulate the same schedule with the durations this step measured (replica 0), to compare bubbles.
  const auto& schedule = executor_->schedule();
  std::map<std::string, std::vector<std::pair<double, int>>> totals;  // kind -> per stage (sum, count)
  for (const auto& rank : ranks) {
    if (rank.dp_rank != 0) continue;
    for (const auto& event : rank.events) {
      auto& per_stage = totals[event.kind];
      per_stage.resize(static_cast<std::size_t>(schedule.num_stages));
      per_stage[event.stage].first += (event.end_us - event.start_us) * 1e-6;
      per_stage[event.stage].second += 1;
    }
  }
  auto mean = [&](const char* kind, int stage) {
    const auto found = totals.find(kind);
    if (found == totals.end() || found->second[stage].second == 0) return 0.0;
    return found->second[stage].first / found->second[stage].second;
  };
  // The simulator's sends take no time, but posting one costs the sender (the header, a contiguous copy):
  // charge it to the compute that the send follows.
  sched::SimulationCosts costs;
  for (int stage = 0; stage < schedule.num_stages; ++stage) {
    const double send_forward = mean("SEND_F", stage), send_backward = mean("SEND_B", stage);
    costs.stages.push_back({mean("F", stage) + send_forward, mean("B", stage) + send_backward,
                            mean("I", stage) + send_backward, mean("W", stage)});
  }
  const auto measured = summarize(ranks, 0);
  costs.p2p.latency_s = measured.transfer_latency_us * 1e-6;
  const auto simulated = sched::simulate(schedule, graph_, costs);

  const std::string& dir = runtime_->config().trace_dir;
  std::filesystem::create_directories(dir);
  const std::string stem = dir + "/step" + std::to_string(step_);
  write_file_atomically(stem + "_trace.json", to_chrome_trace(ranks));
  char title[256];
  std::snprintf(title, sizeof title, "%s, %d stages on %d ranks, %d microbatches, step %lld: bubble %.3f measured, %.3f simulated",
                schedule.name.c_str(), schedule.num_stages, schedule.num_ranks, schedule.num_microbatches, step_,
                measured.bubble_fraction, simulated.bubble_fraction);
  write_file_atomically(stem + "_pipeline.svg", to_svg(ranks, title));
  char line[512];
  std::snprintf(line, sizeof line,
                "timeline of step %lld: bubble %.3f measured (makespan %.2f ms), %.3f simulated (makespan %.2f ms); "
                "receive waits %.2f ms over replica 0; transfer latency %.3f ms; wrote %s_trace.json and "
                "%s_pipeline.svg",
                step_, measured.bubble_fraction, measured.makespan_us / 1e3, simulated.bubble_fraction,
                simulated.makespan * 1e3, measured.receive_wait_us / 1e3, measured.transfer_latency_us / 1e3,
                stem.c_str(), stem.c_str());
  log::info(line);
}

}  // namespace smp
