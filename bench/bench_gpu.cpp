// GPU benchmark, one process on one GPU (scripts/device_gpu.sh runs it there; without a CUDA device it says so and
// exits 77). Prints one JSON line per measurement:
//   engine_overhead  time per schedule action that smp adds over plain LibTorch on a model too small to hide it
//   gpt_stage        achieved TFLOP/s of a GPT-style stage under smp vs the same model in plain LibTorch (fp32, bf16)
//   nccl_transfer    NCCL send/receive time vs bytes (the one-rank channel: a send to oneself through NCCL), and the
//                    same transfer through NCCL called directly: per transfer alone (us) and posted back to back
//                    (issue_us). `bench_gpu nccl` runs only this.
//   nccl_all_reduce  an all-reduce on smp's one-rank group against NCCL's own on a blocking and on a non-blocking
//                    communicator: what the group's communicator (created non-blocking) costs per collective.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include "common/gpt.h"
#include "smp/comm/communicator.h"
#include "smp/main.h"
#include "step_timing.h"

#ifdef SMP_BENCH_RAW_NCCL
#include <nccl.h>
#endif

namespace {

const c10::Device kGpu(c10::kCUDA, 0);

double median_seconds(int warmup, int measured, const std::function<void()>& step) {
  std::vector<double> times;
  for (int i = 0; i < warmup + measured; ++i) {
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    step();
    torch::cuda::synchronize();
    if (i >= warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void gpt_stage(bool bf16) {
  // vocabulary 8192, context 1024, d_model 1024, 16 heads, 8 layers: 110M parameters
  const smp::examples::GptOptions options{8192, 1024, 1024, 16, 8};
  smp_bench::print_gpt_stage(kGpu, options, /*batch=*/8, bf16, /*warmup=*/3, /*measured=*/15);
}

// One transfer's latency: posted on an idle GPU, then waited for on the host (the device synchronized before and
// after, as the older numbers were taken). Issue cost: 100 transfers posted back to back, one synchronize at the
// end, per transfer: what a pipeline pays when transfers overlap compute.
struct TransferTimes {
  double latency_s;
  double issue_s;
};

TransferTimes time_transfers(const std::function<void()>& transfer) {
  constexpr int kBackToBack = 100;
  const double latency = median_seconds(5, 50, transfer);
  const double batch = median_seconds(2, 9, [&] {
    for (int i = 0; i < kBackToBack; ++i) transfer();
  });
  return {latency, batch / kBackToBack};
}

#ifdef SMP_BENCH_RAW_NCCL
// NCCL's own send to itself, on a one-rank communicator: blocking as NCCL makes it by default, or non-blocking as
// smp's are (so that a dead peer can be timed out).
class RawNcclSelf {
 public:
  explicit RawNcclSelf(bool blocking) {
    ncclUniqueId id;
    check(ncclGetUniqueId(&id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    check(ncclCommInitRankConfig(&comm_, 1, id, 0, &config));
    wait_ready();
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0).stream();
  }
  ~RawNcclSelf() { ncclCommDestroy(comm_); }
  void all_reduce(const at::Tensor& tensor) {
    check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), ncclFloat32, ncclSum, comm_, stream_));
    wait_ready();
    C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void transfer(const at::Tensor& source, const at::Tensor& target) {
    check(ncclGroupStart());
    check(ncclSend(source.data_ptr(), source.numel(), ncclFloat32, 0, comm_, stream_));
    check(ncclRecv(target.data_ptr(), target.numel(), ncclFloat32, 0, comm_, stream_));
    check(ncclGroupEnd());
    wait_ready();
  }

 private:
  static void check(ncclResult_t result) {
    if (result != ncclSuccess && result != ncclInProgress) {
      throw std::runtime_error(std::string("NCCL: ") + ncclGetErrorString(result));
    }
  }
  void wait_ready() {
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) check(ncclCommGetAsyncError(comm_, &state));
    check(state);
  }
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
};
#endif

void nccl_transfer() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto host = smp::comm::make_gloo_group(store, {0}, 0, "bench", "127.0.0.1", std::chrono::seconds(60), kGpu);
  auto group = smp::comm::make_nccl_group(store, host, kGpu);
  group->connect({{0, 0}});
#ifdef SMP_BENCH_RAW_NCCL
  RawNcclSelf blocking(true), non_blocking(false);
#endif
  for (int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) {
    const at::Tensor source = at::randn({bytes / 4}, kGpu), target = at::empty({bytes / 4}, kGpu);
    const auto smp_times = time_transfers([&] {
      auto receive = group->irecv(target, 0, 0);
      auto send = group->isend(source, 0, 0);
      send->wait();
      receive->wait();
    });
    group->synchronize();
    std::printf("{\"bench\": \"nccl_transfer\", \"bytes\": %lld, \"us\": %.1f, \"gb_per_s\": %.2f, \"issue_us\": %.2f",
                static_cast<long long>(bytes), smp_times.latency_s * 1e6,
                static_cast<double>(bytes) / smp_times.latency_s / 1e9, smp_times.issue_s * 1e6);
#ifdef SMP_BENCH_RAW_NCCL
    const auto raw = time_transfers([&] { blocking.transfer(source, target); });
    const auto raw_non_blocking = time_transfers([&] { non_blocking.transfer(source, target); });
    std::printf(", \"raw_nccl_us\": %.1f, \"raw_nccl_issue_us\": %.2f, \"raw_nonblocking_us\": %.1f, "
                "\"raw_nonblocking_issue_us\": %.2f, \"smp_over_raw_us\": %.1f",
                raw.latency_s * 1e6, raw.issue_s * 1e6, raw_non_blocking.latency_s * 1e6,
                raw_non_blocking.issue_s * 1e6, (smp_times.latency_s - raw.latency_s) * 1e6);
#endif
    std::printf("}\n");
    std::fflush(stdout);
  }
}

void nccl_all_reduce() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto host = smp::comm::make_gloo_group(store, {0}, 0, "bench_all_reduce", "127.0.0.1", std::chrono::seconds(60), kGpu);
  auto group = smp::comm::make_nccl_group(store, host, kGpu);
#ifdef SMP_BENCH_RAW_NCCL
  RawNcclSelf blocking(true), non_blocking(false);
#endif
  for (int64_t bytes = 4 << 10; bytes <= (16 << 20); bytes *= 16) {
    const at::Tensor tensor = at::randn({bytes / 4}, kGpu);
    const double smp_s = median_seconds(5, 50, [&] { group->iall_reduce_sum(tensor)->wait(); });
    std::printf("{\"bench\": \"nccl_all_reduce\", \"bytes\": %lld, \"us\": %.1f", static_cast<long long>(bytes),
                smp_s * 1e6);
#ifdef SMP_BENCH_RAW_NCCL
    const double raw_s = median_seconds(5, 50, [&] { blocking.all_reduce(tensor); });
    const double raw_non_blocking_s = median_seconds(5, 50, [&] { non_blocking.all_reduce(tensor); });
    std::printf(", \"raw_nccl_us\": %.1f, \"raw_nonblocking_us\": %.1f", raw_s * 1e6, raw_non_blocking_s * 1e6);
#endif
    std::printf("}\n");
    std::fflush(stdout);
  }
}

int run(int argc, char** argv) {
  if (torch::cuda::device_count() == 0) {
    std::printf("SKIPPED: bench_gpu needs a CUDA device (run it on a GPU machine: scripts/device_gpu.sh)\n");
    return 77;
  }
  if (argc > 1 && std::string(argv[1]) == "nccl") {
    nccl_transfer();
    nccl_all_reduce();
    return 0;
  }
  smp_bench::print_engine_overhead(kGpu);
  gpt_stage(false);
  gpt_stage(true);
  nccl_transfer();
  nccl_all_reduce();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
