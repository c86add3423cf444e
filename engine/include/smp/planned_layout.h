#pragma once
// "auto" layout keys in a C++ program: the layout chosen when DistributedModel is given the model.

#include <functional>
#include <memory>
#include <optional>

#include "smp/executor.h"
#include "smp/graph_model.h"
#include "smp/layout_plan.h"
#include "smp/stage_plan.h"
#include "smp/runtime.h"

namespace smp {

// Collective over the world (every rank calls it at once): the links between the ranks, measured as a transfer's
// latency (half the round trip of 1 KiB between ranks 2k and 2k + 1, the median of 10 rounds after 2 untimed) and the
// all-reduce's bandwidth in ring terms (4 MiB against a scalar: each rank sends 2 (n - 1) / n of the bytes; the median
// of 9 rounds after 2 untimed); and on a CPU host with more ranks than cores, the processors they share (and, for a
// job planning tensor or expert parallelism, a collective's cost right after computing). The planner's costs.
PlanningCosts measured_planning_costs(Runtime& runtime);

// profile_graph's SplitBackwardTimer as the zero-bubble schedules run it (smp::WeightPass): the planner's profile.
SplitBackwardTimer split_backward_timer();

// The planner's profile: `model` profiled alone (its collectives skipped and counted), the zero-bubble split timed,
// scaled to a pass of the whole model, on `device`, on `sample` and on it twice over (its batched inputs
// concatenated): two sizes tell a stage call's fixed cost from its cost per sample (ModelProfile::at). One size when
// no input is batched, or when the model fails on twice its sample (a warning says why).
ModelProfile profile_for_planning(const GraphModel& model, const ModelInputs& sample, c10::Device device);

// On the rank that planned: train_step `step` (counted from 0) took `seconds`; after steps 2 to 5 (the first warms up), logs their
// median beside the plan's prediction. Nothing where no layout was planned.
void log_step_against_plan(Runtime& runtime, long long step, double seconds);

// A job with "auto" layout keys that resumes ("resume": true, a complete checkpoint in checkpoint_dir): the config it
// trains under keeps the layout the checkpoint was saved with, which a resume needs (its stages, schedule,
// microbatches, tensor- and expert-parallel degrees, and an "auto" job's planned cut, which also decides how finely a
// captured model is cut), with as many replicas as the world holds; the microbatches fewer where the global batch no
// longer splits into them. Planning would choose among layouts the checkpoint refuses. nullopt: nothing to resume.
// ConfigError when this world cannot hold the checkpoint's layout.
std::optional<std::string> resumed_layout(const Config& given, int world_size);

// When the runtime's config has "auto" layout keys: rank 0 profiles `model` on `sample`, one microbatch
// (profile_for_planning, on the job's device), plans (plan_layouts, keep_what_the_config_fixes) and chooses
// (choose_layout), every rank adopts the chosen config (Runtime::adopt_layout) before the model is cut. Returns the
// runtime. Rank 0's failure reaches every rank as a ConfigError naming it.
// Without tensor parallelism ("auto" tensor_parallel_degree, or a degree above 1, is a ConfigError naming the
// builder's form below).
std::shared_ptr<Runtime> with_planned_layout(std::shared_ptr<Runtime> runtime, const GraphModel& model,
                                             const ModelInputs& sample);

// A model whose smp::tp layers are built over `group`: with "tensor_parallel_degree": "auto" every degree dividing
// the world is planned, the model built for each as its tensor-parallel rank 0 over a stand-in group
// (tp::ProfiledDegree) and profiled alone; a degree the builder refuses (a ConfigError: heads that do not divide) is
// left out, saying why. A fixed degree is planned alone. The caller builds the model anew over the chosen layout's
// group (DistributedModel's builder constructor).
using ModelBuilder = std::function<GraphModel(const std::shared_ptr<comm::Communicator>& group)>;
std::shared_ptr<Runtime> with_planned_layout(std::shared_ptr<Runtime> runtime, const ModelBuilder& build,
                                             const ModelInputs& sample);

}  // namespace smp
