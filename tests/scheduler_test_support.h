#pragma once
// Checks shared by the scheduler's test files.

#include <catch2/catch.hpp>

#include <sstream>

#include "smp/scheduler/schedule.h"

namespace smp::sched::testing {

inline Action F(int stage, int mb) { return {ActionKind::Forward, stage, mb}; }
inline Action B(int stage, int mb) { return {ActionKind::Backward, stage, mb}; }
inline Action I(int stage, int mb) { return {ActionKind::BackwardInput, stage, mb}; }
inline Action W(int stage, int mb) { return {ActionKind::BackwardWeight, stage, mb}; }

// Writing a schedule as CSV and reading it back gives the same schedule, which still validates.
inline void check_csv_round_trip(const Schedule& original, const StageGraph& graph) {
  std::stringstream csv;
  write_csv(original, csv);
  const Schedule read = read_csv(csv);
  CHECK(read.name == original.name);
  CHECK(read.num_ranks == original.num_ranks);
  CHECK(read.num_stages == original.num_stages);
  CHECK(read.num_microbatches == original.num_microbatches);
  CHECK(read.split_backward == original.split_backward);
  CHECK(read.forward_only == original.forward_only);
  CHECK(read.stage_to_rank == original.stage_to_rank);
  CHECK(read.ranks == original.ranks);
  REQUIRE_NOTHROW(validate(read, graph));
}

}  // namespace smp::sched::testing
