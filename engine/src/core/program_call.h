#pragma once
// Which of the program's shared calls (train_step, evaluate) a rank is in. Every rank must make the same calls in the
// same order, and the ranks of a replica must pass the same batch; a rank that skips a call (an `if rank == 0:`
// around evaluate) or draws a batch of its own would otherwise pair its tensors with another call's or batch's and
// train on wrong data without an error. Each transfer between stages carries the call's id and the batch's shapes
// (comm::TransferStamp); the step's closing all-reduce compares every rank's call and batch values.

#include <algorithm>
#include <cstdint>
#include <string>

namespace smp {

struct ProgramCall {
  std::int64_t step = 0;        // train_steps completed before this call
  std::int64_t evaluation = 0;  // 0: train_step number `step`; k > 0: the k-th evaluate after `step` train_steps

  // Exact in a double (the step's all-reduce carries it): evaluations saturate below 2^20, steps stay below 2^33.
  static constexpr std::int64_t kEvaluationsPerStep = std::int64_t{1} << 20;
  std::int64_t id() const { return step * kEvaluationsPerStep + std::min(evaluation, kEvaluationsPerStep - 1); }
  static ProgramCall from_id(std::int64_t id) { return {id / kEvaluationsPerStep, id % kEvaluationsPerStep}; }

  std::string describe() const {
    if (evaluation == 0) return "train_step " + std::to_string(step);
    if (step == 0) return "evaluate " + std::to_string(evaluation) + " before any train_step";
    // Numbered as train_step calls are (from 0): the one just completed, not the count of them.
    return "evaluate " + std::to_string(evaluation) + " after train_step " + std::to_string(step - 1);
  }
};

// What to do about it, said once: the error messages end with it.
inline const char* const kSameCallsEverywhere =
    "every rank must call train_step and evaluate alike, in the same order, and the ranks of a replica with the same "
    "batch (did a rank skip or add a call, draw a batch of its own, or refuse a call its peers took? A call refused "
    "on some ranks alone, such as a replica's own share failing a check, counts there and cannot be skipped: check "
    "the shares before train_step on every rank, or pass the global batch)";

}  // namespace smp
