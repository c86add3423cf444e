#pragma once
// "auto" layout keys in a C++ program: the layout chosen when DistributedModel is given the model.

#include <memory>

#include "smp/executor.h"
#include "smp/graph_model.h"
#include "smp/runtime.h"

namespace smp {

// When the runtime's config has "auto" layout keys: rank 0 profiles `model` on `sample` (one microbatch), plans
// (plan_layouts) and chooses (choose_layout), every rank adopts the chosen config (Runtime::adopt_layout) before the
// model is cut. Returns the runtime. Rank 0's failure reaches every rank as a ConfigError naming it.
std::shared_ptr<Runtime> with_planned_layout(std::shared_ptr<Runtime> runtime, const GraphModel& model,
                                             const ModelInputs& sample);

}  // namespace smp
