// A DistributedModel's construction: the schedule and plan every rank agrees on, this rank's stages built from
// them, and running one of those stages; state adopted from elsewhere (load_rank_state does the loading); steps,
// gradients and the timeline have files of their own.
#include "smp/distributed_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "smp/checkpoint.h"
#include "smp/log.h"
#include "smp/timeline.h"
#include "smp/scheduler/simulator.h"
#include "pipeline/autocast_scope.h"
#include "pipeline/activation_checkpoint.h"
#include "training/loss_scaler.h"
#include "training/model_random_stream.h"
#include "training/gradient_sync.h"
#include "smp/device_speeds.h"
#include "smp/planned_layout.h"
#include "smp/tp.h"

namespace smp {
namespace {

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

// An adopted layout's pins name the modules of the model it was planned (or saved) for; another model of the job (a
// teacher of another architecture) keeps those it has, and is cut freely elsewhere, where the pins would name
// modules it lacks.
Config with_own_pins(const Config& config, const GraphModel& model, bool adopted) {
  if (!adopted) return config;
  Config own = config;
  for (auto pin = own.partition_overrides.begin(); pin != own.partition_overrides.end();) {
    const bool held = std::any_of(model.nodes().begin(), model.nodes().end(),
                                  [&](const GraphModel::Node& node) { return cut_from(node.name, pin->first); });
    pin = held ? std::next(pin) : own.partition_overrides.erase(pin);
  }
  return own;
}

std::vector<std::string> pinned_paths(const Config& config) {
  std::vector<std::string> paths;
  for (const auto& [path, stage] : config.partition_overrides) paths.push_back(path);
  return paths;
}

// The model's modules and what each reads, one per line: what every rank's copy of the model must agree on before
// rank 0's cut of it means anything to them.
std::string modules_listed(const GraphModel& model) {
  std::string listed;
  for (const auto& node : model.nodes()) {
    listed += node.name + " <-";
    for (const auto& input : node.inputs) listed += " " + input;
    listed += "\n";
  }
  return listed;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t end; (end = text.find('\n', start)) != std::string::npos; start = end + 1) {
    lines.push_back(text.substr(start, end - start));
  }
  return lines;
}

// The first line where two listings part, said as "X here, Y on rank R".
std::string first_difference(const std::string& mine, const std::string& theirs, int their_rank, const char* what) {
  const auto here = lines_of(mine), there = lines_of(theirs);
  for (std::size_t i = 0; i < std::max(here.size(), there.size()); ++i) {
    const std::string a = i < here.size() ? here[i] : "nothing", b = i < there.size() ? there[i] : "nothing";
    if (a != b) {
      return std::string(what) + " " + std::to_string(i) + " is " + a + " here, " + b + " on rank " +
             std::to_string(their_rank) + " (" + std::to_string(here.size()) + " " + what + "s here, " +
             std::to_string(there.size()) + " there)";
    }
  }
  return "";
}

}  // namespace

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, const torch::nn::Sequential& model,
                                   const at::Tensor& sample_input, Resume resume)
    : DistributedModel(std::move(runtime), GraphModel::from_sequential(model), sample_input, resume) {}

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, const ModelBuilder& build, const ModelInputs& sample,
                                   const MaterializeNodes& materialize, Resume resume)
    : DistributedModel(Planned{}, with_planned_layout(std::move(runtime), build, sample), build, sample, materialize,
                       resume) {}

DistributedModel::DistributedModel(Planned, std::shared_ptr<Runtime> planned, const ModelBuilder& build,
                                   const ModelInputs& sample, const MaterializeNodes& materialize, Resume resume)
    : DistributedModel(planned, build(planned->tensor_parallel_group()), sample, materialize, resume) {}

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, GraphModel model, const at::Tensor& sample_input,
                                   Resume resume)
    : DistributedModel(std::move(runtime), std::move(model), ModelInputs{sample_input}, {}, resume) {}

DistributedModel::DistributedModel(std::shared_ptr<Runtime> runtime, GraphModel model, const ModelInputs& sample,
                                   const MaterializeNodes& materialize, Resume resume)
    : runtime_(with_planned_layout(std::move(runtime), model, sample)),
      // More stages than nodes: cut finer along the module tree first, and as deep as partition_overrides name.
      model_(model.expanded_to(static_cast<std::size_t>(runtime_->config().num_stages()))
                 .expanded_to_paths(pinned_paths(runtime_->config()))) {
  const Config& config = runtime_->config();
  loss_scaler_ = std::make_unique<LossScaler>(config.fp16);
  if (model_.nodes().empty()) throw ConfigError("the model has no modules; nothing to train");
  if (sample.size() != model_.input_names().size()) {
    throw ModelError("the sample has " + std::to_string(sample.size()) + " inputs, the model takes " +
                     std::to_string(model_.input_names().size()));
  }
  for (std::size_t i = 0; i < sample.size(); ++i) {
    // A replica's batch split into more microbatches than it has samples: profiled, it would plan empty stages.
    if (sample[i].defined() && sample[i].dim() > 0 && sample[i].size(0) == 0) {
      throw ConfigError("the sample's input \"" + model_.input_names()[i] + "\" has no rows: the sample is one "
                        "microbatch (a replica's batch over \"microbatches\", " + std::to_string(config.microbatches) +
                        "), of at least 1 sample");
    }
  }
  auto schedule = make_schedule(config);
  {
    // On every rank before rank 0 profiles: a name the model lacks is refused alike everywhere, not by rank 0 alone
    // while the others wait for its plan.
    std::vector<std::string> names;
    for (const auto& node : model_.nodes()) names.push_back(node.name);
    checkpointed_modules(names, config);
  }
  model_.set_build_seed(static_cast<std::uint64_t>(config.seed));
  const auto model_number = runtime_->next_exchange();
  exchange_ = "model" + std::to_string(model_number) + "/";
  const std::vector<double> speeds = device_speeds(*runtime_, exchange_);
  // Rank 0's, so that ranks seeded apart still draw alike where they must (tensor-parallel ranks of a stage).
  std::uint64_t program_seed = at::detail::getDefaultCPUGenerator().current_seed();
  // Rank 0 profiles and cuts; its failure (a model that fails on the sample, a cut that cannot be made) reaches the
  // others as what it is (from_rank0), not as a wait for a key it never published.
  // The model a plan was made for: its memory was judged by the planner's predicted peak (below).
  const bool planned = runtime_->take_planned_model();
  if (runtime_->rank() != 0) runtime_->publish(exchange_ + "ready/" + std::to_string(runtime_->rank()), "");
  const std::string stage_plan = runtime_->from_rank0(exchange_ + "stage_plan", [&] {
    // Measured once every rank has built what it builds before this (a Python model's capture): the profile must
    // not share the cores with them.
    for (int rank = 1; rank < runtime_->world_size(); ++rank) runtime_->fetch(exchange_ + "ready/" + std::to_string(rank));
    // One stage has nothing to balance: the untimed rounds still check that the model takes the sample.
    const std::vector<double> copies = activation_copies(schedule);
    // Profiled on this job's device (module by module, see profile_graph).
    ModelInputs on_device;
    for (const auto& input : sample) on_device.push_back(input.defined() ? input.to(runtime_->device()) : input);
    // Alone, while its tensor-parallel peers wait: the tp layers compute their shards without communicating.
    const WithoutCollectives alone;
    // In the precision the stages compute in: a model captured under autocast casts as autocast does.
    std::optional<AutocastScope> autocast;
    if (const auto precision = stage_precision(config, runtime_->device())) autocast.emplace(*precision);
    auto profiles = profile_graph(model_, on_device, config.num_stages() > 1 ? 5 : 0);
    autocast.reset();
    // Parameter names and shapes of the whole model, which only this rank sees whole (nodes built on demand are
    // built here one at a time): a checkpoint of another model is refused by it.
    std::string shapes;
    std::size_t count = 0;
    for (const auto& profile : profiles) {
      shapes += profile.parameter_shapes;
      count += static_cast<std::size_t>(std::count(profile.parameter_shapes.begin(), profile.parameter_shapes.end(), ';'));
    }
    model_signature_ = std::to_string(count) + " parameters, crc32 " + std::to_string(crc32(shapes.data(), shapes.size()));
    model_parameters_ = shapes;
    const StageDevices devices = stage_devices(config, runtime_->topology(), schedule.stage_to_rank, speeds);
    if (config.measure_device_speeds) {
      std::string measured;
      for (double speed : speeds) measured += (measured.empty() ? "" : ", ") + std::to_string(speed).substr(0, 5);
      log::info("device speeds measured, by rank: " + measured);
    }
    // The planned model's layout was judged by the planner's per-rank peak, which may fit where the search's
    // cruder count does not: the job builds what it chose.
    plan_ = plan_stages(std::move(profiles), with_own_pins(config, model_, runtime_->layout_adopted()), copies,
                        optimizer_state_shards(), &devices, planned ? MemoryLimit::kGuides : MemoryLimit::kRefuses);
    if (!plan_.memory_limit_unmet.empty()) {
      log::info("the partition search found no cut within memory_limit_mb by its own count (" +
                plan_.memory_limit_unmet + "); the planner's prediction for this layout fits, so it is cut without it");
    }
    runtime_->publish(exchange_ + "program_seed", std::to_string(at::detail::getDefaultCPUGenerator().current_seed()));
    runtime_->publish(exchange_ + "model_signature", model_signature_);
    runtime_->publish(exchange_ + "modules", modules_listed(model_));
    return plan_.to_json();
  });
  if (runtime_->rank() != 0) {
    model_signature_ = runtime_->fetch(exchange_ + "model_signature");
    program_seed = std::stoull(runtime_->fetch(exchange_ + "program_seed"));
    check_same_modules(runtime_->fetch(exchange_ + "modules"));
    plan_ = StagePlan::from_json(stage_plan);
  }
  never_resumes_ = resume == Resume::kNever;
  if (config.resume && !never_resumes_) {
    std::vector<std::string> names;
    for (const auto& node : model_.nodes()) names.push_back(node.name);
    resumed_from_ = checkpoint_to_resume(*runtime_, exchange_ + "resume_from", names, model_signature_,
                                         model_parameters_);
    if (resumed_from_) {
      if (runtime_->rank() == 0 && plan_.stage_of_module != resumed_from_->manifest.stage_of_module) {
        log::info("resuming from " + resumed_from_->directory + " keeps the cut it was saved with; this job's " +
                  "config and profile (partition_overrides, device speeds, memory, timings) would cut it otherwise " +
                  "(for another cut: smp_checkpoint export, then load_parameters in a fresh job)");
      }
      plan_.stage_of_module = resumed_from_->manifest.stage_of_module;
    }
  }
  if (runtime_->rank() == 0) {
    log::info(plan_.report());
    if (config.shard_optimizer_state && runtime_->topology().data_parallel_degree() == 1) {
      log::warn("\"shard_optimizer_state\" has no effect with one data-parallel replica: the optimizer keeps all "
                "of its state");
    }
    if (config.sequence_parallel && runtime_->topology().tensor_parallel_degree() == 1) {
      log::warn("\"sequence_parallel\" has no effect with \"tensor_parallel_degree\" 1: every rank holds whole "
                "sequences");
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
  check_replicas_alike();
  // Replicas start from the first's weights, as torch's DistributedDataParallel makes them: a model initialized
  // under another seed per rank would otherwise train apart, each replica averaging gradients of other weights.
  share_first_replica_parameters();
  share_first_replica_buffers();
  gradients_->share_tied_copies();
  // The job's models each their own stream (a teacher's dropout and a student's are not the same draws).
  random_stream_offset_ = 0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(model_number);
  seed_random_stream(program_seed);
  executor_ = std::make_unique<PipelineExecutor>(lower_and_validate(std::move(schedule), graph_, config), graph_,
                                                 runtime_->pipeline(), config.checkpointed_stages,
                                                 config.overlap_forward_backward);
}

void DistributedModel::seed_random_stream(std::uint64_t seed) {
  random_stream_ = std::make_unique<ModelRandomStream>(runtime_->device(), seed + random_stream_offset_,
                                                       runtime_->pp_rank(), runtime_->dp_rank());
}

void DistributedModel::check_same_modules(const std::string& rank0_modules) const {
  const std::string mine = modules_listed(model_);
  if (mine == rank0_modules) return;
  throw ModelError("rank " + std::to_string(runtime_->rank()) + "'s model differs from rank 0's: " +
                   first_difference(mine, rank0_modules, 0, "module") +
                   "; every rank must build the same model (the same config and code)");
}

void DistributedModel::check_replicas_alike() {
  const Topology& topology = runtime_->topology();
  if (topology.data_parallel_degree() < 2) return;
  const auto here = topology.coordinates_of(runtime_->rank());
  std::string parameters;
  for (const auto& [name, parameter] : named_parameters_) {
    parameters += name + " " + c10::toString(parameter.scalar_type()) + " " + c10::str(parameter.sizes()) + "\n";
  }
  const std::string key = exchange_ + "replica_parameters/" + std::to_string(here.pp_rank) + "/" +
                          std::to_string(here.tp_rank);
  const int first = topology.data_parallel_group(here.pp_rank, here.tp_rank).front();
  if (runtime_->rank() == first) {
    runtime_->publish(key, parameters);
    return;
  }
  const std::string theirs = runtime_->fetch(key);
  if (theirs == parameters) return;
  throw ModelError("rank " + std::to_string(runtime_->rank()) + " holds other parameters than rank " +
                   std::to_string(first) + ", a replica of the same stage: " +
                   first_difference(parameters, theirs, first, "parameter") +
                   "; every rank must build the same model (the same config and code)");
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
  if (named_parameters_.empty() && !model_.named_parameters().empty()) {
    // An optimizer over this rank's parameters steps nothing (LibTorch takes an empty list; torch.optim does not).
    std::string held;
    for (const auto& [stage, local] : stages_) held += (held.empty() ? "" : ", ") + std::to_string(stage);
    log::warn("rank " + std::to_string(runtime_->rank()) + " holds no parameters (its stages " + held + " have none): "
              "pin a module with parameters to its stage in \"partition_overrides\", or use fewer \"partitions\"");
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

  std::vector<GradientSync::LocalStage> local;
  for (const auto& [stage, held] : stages_) local.push_back({&held.nodes, &held.parameters});
  gradients_ = std::make_unique<GradientSync>(*runtime_, model_, local, named_parameters_, plan_.stage_of_module,
                                              schedule.stage_to_rank, exchange_);
  if (const int shares = runtime_->topology().expert_parallel_degree(); shares > 1) {
    // A rank whose stages hold no experts is fine; a model that holds none anywhere would train with nothing
    // divided, which the config did not ask for.
    at::Tensor holders = at::full({1}, gradients_->has_expert_shards() ? 1.0 : 0.0, at::kDouble);
    runtime_->world().all_reduce_sum(holders);
    if (holders.item<double>() == 0.0) {
      throw ConfigError(config.source + ": \"expert_parallel_degree\" " + std::to_string(shares) +
                        ", but the model holds no experts to divide (expert parallelism divides the experts modules "
                        "of a captured Python mixture-of-experts model); set it to 1");
    }
  }
  if (config.shard_optimizer_state && runtime_->topology().data_parallel_degree() > 1 &&
      std::any_of(named_parameters_.begin(), named_parameters_.end(),
                  [](const auto& named) { return named.second.requires_grad(); })) {
    make_optimizer_shards();
  }
}

DistributedModel::~DistributedModel() = default;

double DistributedModel::loss_scale() const { return loss_scaler_->scale(); }

long long DistributedModel::steps_since_scale_change() const { return loss_scaler_->steps_since_change(); }

void DistributedModel::restore_loss_scale(double scale, long long steps_since_change) {
  loss_scaler_->restore(scale, steps_since_change);
}

void DistributedModel::resume_at(long long step) {
  step_ = step;
  evaluations_since_step_ = 0;
}

PipelineExecutor& DistributedModel::evaluator(int microbatches) {
  auto& made = evaluators_[microbatches];
  if (made) return *made;
  const Config& config = runtime_->config();
  sched::Schedule forward;
  if (microbatches == config.microbatches) {
    // The training schedule's forwards in their order: its transfers, channels and tags serve as they are.
    forward = sched::forward_only(executor_->schedule());
  } else {
    if (!config.schedule_file.empty()) {
      throw ConfigError("evaluate: a replica's share of " + std::to_string(microbatches) + " samples is fewer than " +
                        "the " + std::to_string(config.microbatches) + " microbatches of \"schedule_file\" " +
                        config.schedule_file + ", which is for those alone: give each replica that many samples");
    }
    Config fewer = config;
    fewer.microbatches = microbatches;
    fewer.active_microbatches = 0;
    forward = sched::forward_only(lower_and_validate(make_schedule(fewer), graph_, fewer));
  }
  sched::validate(forward, graph_);
  made = std::make_unique<PipelineExecutor>(std::move(forward), graph_, runtime_->pipeline());
  return *made;
}

void DistributedModel::count_refused_call(bool train_step) {
  if (train_step) {
    ++step_;
    evaluations_since_step_ = 0;
  } else {
    ++evaluations_since_step_;
  }
}

std::vector<std::string> DistributedModel::frozen_parameter_names() const {
  std::vector<std::string> names;
  for (std::size_t i = 0; i < named_parameters_.size(); ++i) {
    if (!trainable_at_build_[i]) names.push_back(named_parameters_[i].first);
  }
  return names;
}

void DistributedModel::load_state(const TensorSource& source, const std::set<std::string>& left_in_place) {
  const Topology& topology = runtime_->topology();
  NamedTensors loaded;
  for (const auto& entry : named_parameters_) {
    if (!left_in_place.count(entry.first)) loaded.push_back(entry);
  }
  load_rank_state(source, loaded, named_buffers_,
                  {shard_dims(), runtime_->tp_rank(), topology.tensor_parallel_degree(), expert_shard_names(),
                   runtime_->ep_rank(), topology.expert_parallel_degree()});
}

void DistributedModel::load_parameters(const std::string& path) { load_state(tensor_source(path)); }

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
  const std::optional<AutocastSetting> precision = stage_precision(config, runtime_->device());
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

StageCallbacks DistributedModel::stage_callbacks() {
  StageCallbacks callbacks;
  callbacks.forward = [this](int stage, const ModelInputs& model_inputs, const TensorsByStage& from_producers) {
    return run_stage(stage, model_inputs, from_producers);
  };
  callbacks.parameters = [this](int stage) { return stages_.at(stage).parameters; };
  if (const auto& slowdown = runtime_->config().emulated_slowdown; !slowdown.empty()) {
    callbacks.emulated_slowdown = slowdown.at(static_cast<std::size_t>(runtime_->rank()));
  }
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

}  // namespace smp
