#pragma once
// Which modules of a chain model run on which pipeline stage, and why: the profile behind the choice.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class SequentialImpl;
}

namespace smp {

struct Config;

struct ModuleProfile {
  std::string name;              // path in the model, e.g. "3" or "blocks.3"
  double forward_s = 0.0;        // median over repeats, on the trial microbatch
  double backward_s = 0.0;
  std::int64_t parameter_bytes = 0;
  std::int64_t output_bytes = 0;  // what crosses to the next module (and to the next stage if cut here)
};

struct StagePlan {
  std::vector<ModuleProfile> modules;
  std::vector<int> stage_of_module;  // non-decreasing, every stage non-empty
  int num_stages = 0;

  std::vector<int> modules_of_stage(int stage) const;
  double stage_time(int stage) const;
  // A table per stage: modules, parameters, estimated time, bytes sent on, and the imbalance.
  std::string report() const;
  std::string to_json() const;
  static StagePlan from_json(const std::string& text);
};

// Measures every module of `model` on `sample` (one microbatch of first-stage input): forward and backward
// time (median of `repeats`), parameter and output bytes.
std::vector<ModuleProfile> profile_chain(torch::nn::SequentialImpl& model, const at::Tensor& sample, int repeats = 3);

// Splits a profiled chain into config.num_stages() stages: balanced by forward + backward time when
// auto_partition is true, else every module on default_partition; partition_overrides pin modules in both
// modes. Throws ConfigError naming the modules when the request cannot be met.
StagePlan plan_chain(std::vector<ModuleProfile> modules, const Config& config);

}  // namespace smp
