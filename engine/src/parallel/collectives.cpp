#include "smp/collectives.h"

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>

#include <ATen/ATen.h>

#include "smp/comm/laned_communicator.h"
#include "smp/config.h"
#include "core/program_call.h"

namespace smp {

namespace {

// Process-wide, not per thread: on a GPU, autograd runs backward functions (a tensor-parallel gradient's all-reduce)
// in its own device thread, which a thread-local flag would not reach, so rank 0 profiling alone waited in NCCL for
// peers that were waiting for its profile (seen on an H200, tp 2 x pp 2). Only rank 0's profiling sets it, while
// nothing else of the process communicates.
std::atomic<bool> collectives_off{false};
std::array<std::atomic<int64_t>, 4> bytes_moved{};  // by CollectiveCounter
std::mutex observer_mutex;
CollectiveObserver::Report observer;  // under observer_mutex

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

void run_collective(const char* kind, int64_t bytes, CollectiveCounter counter, const std::function<void()>& run) {
  const double start = now_us();
  run();
  bytes_moved[static_cast<std::size_t>(counter)] += bytes;
  const std::lock_guard<std::mutex> lock(observer_mutex);
  if (observer) observer(kind, bytes, start, now_us(), comm::on_second_lane());
}

CollectiveBytes collective_bytes() {
  return {bytes_moved[0].load(), bytes_moved[1].load(), bytes_moved[2].load(), bytes_moved[3].load()};
}

CollectiveObserver::CollectiveObserver(Report report) {
  const std::lock_guard<std::mutex> lock(observer_mutex);
  observer = std::move(report);
}

CollectiveObserver::~CollectiveObserver() {
  const std::lock_guard<std::mutex> lock(observer_mutex);
  observer = nullptr;
}

bool without_collectives() { return collectives_off.load(); }

namespace {
std::atomic<int64_t> skipped_count{0}, skipped_ring_bytes{0};
}  // namespace

SkippedCollectives skipped_collectives() { return {skipped_count.load(), skipped_ring_bytes.load()}; }

void count_skipped_collective(int64_t ring_bytes) {
  skipped_count += 1;
  skipped_ring_bytes += ring_bytes;
}

namespace {
std::atomic<std::int64_t> program_call{-1};
}  // namespace

std::int64_t current_program_call() { return program_call.load(); }
std::string describe_program_call(std::int64_t id) {
  return id < 0 ? std::string("no train_step or evaluate") : ProgramCall::from_id(id).describe();
}
InProgramCall::InProgramCall(std::int64_t id) : before_(program_call.exchange(id)) {}
InProgramCall::~InProgramCall() { program_call.store(before_); }

WithoutCollectives::WithoutCollectives() : before_(collectives_off.exchange(true)) {}
WithoutCollectives::~WithoutCollectives() { collectives_off.store(before_); }

at::Tensor exchange_rows(const at::Tensor& input, const std::vector<int64_t>& output_rows,
                         const std::vector<int64_t>& input_rows, comm::Communicator& group, bool counted) {
  std::vector<int64_t> shape = input.sizes().vec();
  if (shape.empty()) throw ConfigError("all_to_all takes a tensor of at least one dimension (its rows)");
  shape[0] = 0;
  for (int64_t rows : output_rows) shape[0] += rows;
  at::Tensor output = at::empty(shape, input.options());
  const at::Tensor rows = input.contiguous();
  if (!counted) {
    group.all_to_all(output, rows, output_rows, input_rows);
    return output;
  }
  const int64_t row_bytes = rows.size(0) > 0 ? static_cast<int64_t>(rows.nbytes()) / rows.size(0) : 0;
  int64_t sent = 0;
  for (std::size_t peer = 0; peer < input_rows.size(); ++peer) {
    if (static_cast<int>(peer) != group.rank()) sent += input_rows[peer] * row_bytes;
  }
  run_collective("EP_ALL_TO_ALL", sent, CollectiveCounter::all_to_all_sent,
                 [&] { group.all_to_all(output, rows, output_rows, input_rows); });
  return output;
}

}  // namespace smp
