#pragma once
// The state of the default random generators that dropout and every other random kernel draw from: the CPU's, and
// the GPU's when the work runs on one. Captured and put back so that a forward run again (activation
// checkpointing's recompute) draws the same numbers, and so that work done on the side (profiling, recomputing)
// leaves the sequence the rest of training sees as it was.

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Device.h>

namespace smp {

class RandomState {
 public:
  RandomState() = default;
  static RandomState capture(c10::Device device) {
    RandomState state;
    state.add(at::detail::getDefaultCPUGenerator());
    if (device.is_cuda()) state.add(at::globalContext().defaultGenerator(device));
    return state;
  }
  void restore() const {
    for (const auto& [generator, saved] : saved_) {
      at::Generator handle = generator;  // set_state is not const on the handle; it shares the generator
      std::lock_guard<std::mutex> lock(handle.mutex());
      handle.set_state(saved);
    }
  }
  bool empty() const { return saved_.empty(); }

  // The states the default generators would have once seeded with `seed` (each with it, the CPU's and the GPU's);
  // the generators keep their own.
  static RandomState seeded(c10::Device device, std::uint64_t seed) {
    const RandomState current = capture(device);
    for (const auto& [generator, state] : current.saved_) {
      at::Generator handle = generator;
      std::lock_guard<std::mutex> lock(handle.mutex());
      handle.set_current_seed(seed);
    }
    RandomState result = capture(device);
    current.restore();
    return result;
  }
  // The CPU generator's state, then the GPU's where there is one.
  std::vector<at::Tensor> states() const {
    std::vector<at::Tensor> states;
    for (const auto& [generator, state] : saved_) states.push_back(state);
    return states;
  }
  // The same generators with these states (from states(), of a job with as many generators); false if they differ.
  bool take_states(const std::vector<at::Tensor>& states) {
    if (states.size() != saved_.size()) return false;
    for (std::size_t i = 0; i < states.size(); ++i) saved_[i].second = states[i];
    return true;
  }

 private:
  void add(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    saved_.emplace_back(generator, generator.get_state());
  }
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

}  // namespace smp
