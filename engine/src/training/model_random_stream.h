#pragma once
// The random numbers a model's modules draw in train_step and evaluate (dropout, stochastic depth, a router's
// jitter) come from a stream of the engine's own, swapped into the default generators for the length of the call.
// The program's own draws between calls (augmentation, a DataLoader's shuffle) then advance alike on every rank,
// whatever stages it runs: ranks of one replica drew as many numbers as their own modules took from the one
// stream, and the next batch the program drew differed between them.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "model/random_state.h"

namespace smp {

class ModelRandomStream {
 public:
  // Seeded by the program's seed and the rank's stage-rank and replica: the tensor-parallel ranks of a stage draw
  // alike, as the activations they all hold whole need (a dropout after a row-parallel layer).
  ModelRandomStream(c10::Device device, std::uint64_t program_seed, int pp_rank, int dp_rank)
      : device_(device), state_(RandomState::seeded(device, mixed(program_seed, pp_rank, dp_rank))) {}

  // While it lives, the default generators draw the model's stream; the program's comes back after. Nested
  // entries (a call inside a call) change nothing.
  class Entered {
   public:
    explicit Entered(ModelRandomStream& stream) : stream_(stream) {
      if (stream_.depth_++ > 0) return;
      program_ = RandomState::capture(stream_.device_);
      stream_.state_.restore();
    }
    ~Entered() {
      if (--stream_.depth_ > 0) return;
      stream_.state_ = RandomState::capture(stream_.device_);
      program_.restore();
    }
    Entered(const Entered&) = delete;
    Entered& operator=(const Entered&) = delete;

   private:
    ModelRandomStream& stream_;
    RandomState program_;
  };

  // For checkpoints: the CPU generator's state, then the GPU's on a GPU job.
  std::vector<at::Tensor> states() const { return state_.states(); }
  // False, keeping its own, for states of another kind of job (saved on a CPU, resumed on a GPU).
  bool take_states(const std::vector<at::Tensor>& states) { return state_.take_states(states); }

 private:
  // splitmix64's finalizer over the three: neighbouring stages and replicas get unrelated streams.
  static std::uint64_t mixed(std::uint64_t seed, int pp_rank, int dp_rank) {
    std::uint64_t value = seed ^ (static_cast<std::uint64_t>(pp_rank) << 32) ^ static_cast<std::uint64_t>(dp_rank);
    value += 0x9e3779b97f4a7c15ULL;
    value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ULL;
    value = (value ^ (value >> 27)) * 0x94d049bb133111ebULL;
    return value ^ (value >> 31);
  }

  c10::Device device_;
  RandomState state_;
  int depth_ = 0;
};

}  // namespace smp
