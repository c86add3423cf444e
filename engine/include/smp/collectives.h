#pragma once
// Collectives inside a stage's compute (tensor parallelism's all-reduces and gathers, expert parallelism's
// all-to-all): the bytes each kind moved, an observer that a traced step's timeline listens through, and the switch
// that rank 0's profiling runs under, alone, with its peers elsewhere.

#include <cstdint>
#include <string>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp/comm/communicator.h"

namespace smp {

// Bytes this process's in-compute collectives moved since it started: the payload of each all-reduce, the whole
// tensor of each all-gather and reduce-scatter, and the rows each all-to-all sent to other ranks.
struct CollectiveBytes {
  int64_t all_reduced = 0;
  int64_t all_gathered = 0;
  int64_t reduce_scattered = 0;
  int64_t all_to_all_sent = 0;
};
CollectiveBytes collective_bytes();
enum class CollectiveCounter { all_reduced, all_gathered, reduce_scattered, all_to_all_sent };

// Runs one collective: counts its bytes and reports it to the observer, if any.
void run_collective(const char* kind, int64_t bytes, CollectiveCounter counter, const std::function<void()>& run);

// While one lives, every in-compute collective of this process is reported to it, one at a time, from whatever
// thread ran it (backward may run on autograd's): its kind ("TP_ALL_REDUCE", "TP_ALL_GATHER", "TP_REDUCE_SCATTER",
// "EP_ALL_TO_ALL"), bytes, wall-clock start and end in microseconds since the epoch, and whether the thread was on
// the second lane (the forward of an overlapped pair). A traced step's timeline shows them inside the forwards and
// backwards.
class CollectiveObserver {
 public:
  using Report = std::function<void(const char* kind, int64_t bytes, double start_us, double end_us, bool second_lane)>;
  explicit CollectiveObserver(Report report);
  ~CollectiveObserver();
  CollectiveObserver(const CollectiveObserver&) = delete;
  CollectiveObserver& operator=(const CollectiveObserver&) = delete;
};

// The collectives skip communication (an all-reduce passes its input on, an all-gather repeats this rank's shard,
// an experts layer runs its own experts on every token) while one lives, in any thread of the process (backward may
// run in autograd's device threads): rank 0 profiles nodes alone, at their shards' cost, with its peers elsewhere.
bool without_collectives();  // whether one lives

// The collectives skipped while a WithoutCollectives lived, counted since the process started: what a profile
// prices them by for a tensor-parallel layout (the planner). ring_bytes is what a ring moves per rank times
// n / (n - 1) for a group of n: twice an all-reduce's payload, an all-gather's or reduce-scatter's whole tensor.
struct SkippedCollectives {
  int64_t count = 0;
  int64_t ring_bytes = 0;
};
SkippedCollectives skipped_collectives();
void count_skipped_collective(int64_t ring_bytes);
class WithoutCollectives {
 public:
  WithoutCollectives();
  ~WithoutCollectives();
  WithoutCollectives(const WithoutCollectives&) = delete;
  WithoutCollectives& operator=(const WithoutCollectives&) = delete;

 private:
  bool before_;
};

// The program call (ProgramCall::id: which train_step, which evaluate after it) this process runs, -1 outside one:
// a collective whose ranks may be in different calls (expert parallelism's exchange, where a train_step's backward
// would meet an evaluate's forward and Gloo abort on their sizes) sends it beside its counts and compares.
std::int64_t current_program_call();
std::string describe_program_call(std::int64_t id);
class InProgramCall {
 public:
  explicit InProgramCall(std::int64_t id);
  ~InProgramCall();
  InProgramCall(const InProgramCall&) = delete;
  InProgramCall& operator=(const InProgramCall&) = delete;

 private:
  std::int64_t before_;
};

// Expert parallelism's exchange: input_rows[r] consecutive rows of `input` to group rank r, output_rows[r] rows
// from each (a new tensor, in rank order), counted as "EP_ALL_TO_ALL" with the rows sent to other ranks unless
// `counted` is false (control values: an experts layer's counts).
at::Tensor exchange_rows(const at::Tensor& input, const std::vector<int64_t>& output_rows,
                         const std::vector<int64_t>& input_rows, comm::Communicator& group, bool counted = true);

}  // namespace smp
