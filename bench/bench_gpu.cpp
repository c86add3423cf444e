// GPU benchmark, one process on one GPU (scripts/device_gpu.sh runs it there; without a CUDA device it says so and
// exits 77). Prints one JSON line per measurement:
//   engine_overhead  time per schedule action that smp adds over plain LibTorch on a model too small to hide it
//   gpt_stage        achieved TFLOP/s of a GPT-style stage under smp vs the same model in plain LibTorch (fp32, bf16)
//   nccl_transfer    NCCL send/receive time vs bytes (the one-rank channel: a send to oneself through NCCL), and the
//                    same transfer through NCCL called directly: per transfer alone (us) and posted back to back
//                    (issue_us). `bench_gpu nccl` runs only this.
//   nccl_all_reduce  an all-reduce on smp's group against NCCL's own on a blocking and on a non-blocking
//                    communicator of the same ranks: what the group's communicator (created non-blocking) costs per
//                    collective. One rank here; `smprun -n N -- bench_gpu collectives` runs it over N processes
//                    (sharing one GPU needs NCCL 2.30 or later), where NCCL launches a kernel for each.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include "common/gpt.h"
#include "smp/comm/communicator.h"
#include "smp/comm/launch_info.h"
#include "smp/config.h"
#include "smp/runtime.h"
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
// NCCL called directly: blocking as NCCL makes communicators by default, or non-blocking as smp creates its groups'
// (so that a dead peer can be timed out). One rank (sends to itself) unless an id, size and rank are given.
class RawNccl {
 public:
  explicit RawNccl(bool blocking) : RawNccl(blocking, unique_id(), 1, 0, kGpu) {}
  RawNccl(bool blocking, const ncclUniqueId& id, int size, int rank, c10::Device device) {
    c10::cuda::CUDAGuard guard(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    check(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
    wait_ready();
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()).stream();
  }
  ~RawNccl() { ncclCommDestroy(comm_); }
  static ncclUniqueId unique_id() {
    ncclUniqueId id;
    check(ncclGetUniqueId(&id));
    return id;
  }
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
  RawNccl blocking(true), non_blocking(false);
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

// `group` and the raw communicators span the same ranks; every rank runs this, and rank 0 prints.
void nccl_all_reduce(smp::comm::Communicator& group, const std::function<std::string(const std::string&)>& share_id) {
  const c10::Device device = group.device();
#ifdef SMP_BENCH_RAW_NCCL
  auto raw = [&](bool blocking, const std::string& name) {
    ncclUniqueId id{};
    std::string bytes = group.rank() == 0 ? std::string(RawNccl::unique_id().internal, sizeof(id.internal)) : "";
    bytes = share_id(name + "|" + bytes);
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
    return std::make_unique<RawNccl>(blocking, id, group.size(), group.rank(), device);
  };
  const auto blocking = raw(true, "blocking");
  const auto non_blocking = raw(false, "non_blocking");
#endif
  for (int64_t bytes = 4 << 10; bytes <= (16 << 20); bytes *= 16) {
    const at::Tensor tensor = at::randn({bytes / 4}, device);
    const double smp_s = median_seconds(5, 50, [&] { group.iall_reduce_sum(tensor)->wait(); });
    if (group.rank() == 0) {
      std::printf("{\"bench\": \"nccl_all_reduce\", \"ranks\": %d, \"bytes\": %lld, \"us\": %.1f", group.size(),
                  static_cast<long long>(bytes), smp_s * 1e6);
    }
#ifdef SMP_BENCH_RAW_NCCL
    const double raw_s = median_seconds(5, 50, [&] { blocking->all_reduce(tensor); });
    const double raw_non_blocking_s = median_seconds(5, 50, [&] { non_blocking->all_reduce(tensor); });
    if (group.rank() == 0) {
      std::printf(", \"raw_nccl_us\": %.1f, \"raw_nonblocking_us\": %.1f", raw_s * 1e6, raw_non_blocking_s * 1e6);
    }
#endif
    if (group.rank() == 0) {
      std::printf("}\n");
      std::fflush(stdout);
    }
  }
}

void nccl_all_reduce_one_rank() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto host = smp::comm::make_gloo_group(store, {0}, 0, "bench_all_reduce", "127.0.0.1", std::chrono::seconds(60), kGpu);
  auto group = smp::comm::make_nccl_group(store, host, kGpu);
  nccl_all_reduce(*group, [](const std::string& value) { return value.substr(value.find('|') + 1); });
}

// Under a launcher: the job's ranks as one data-parallel group over NCCL, ids shared through the job's store.
void nccl_collectives() {
  const int world = smp::comm::LaunchInfo::from_environment().world_size;
  const auto runtime = smp::Runtime::init(smp::Config::from_json_text(
      R"({"partitions": 1, "ddp": true, "microbatches": 1, "device": "cuda", "backend": "nccl", "global_batch_size": )" +
          std::to_string(world) + "}",
      "bench_gpu collectives"));
  nccl_all_reduce(runtime->data_parallel(), [&](const std::string& value) {
    const std::string name = "bench_gpu/" + value.substr(0, value.find('|'));
    if (runtime->rank() == 0) runtime->publish(name, value.substr(value.find('|') + 1));
    return runtime->rank() == 0 ? value.substr(value.find('|') + 1) : runtime->fetch(name);
  });
}

int run(int argc, char** argv) {
  if (torch::cuda::device_count() == 0) {
    std::printf("SKIPPED: bench_gpu needs a CUDA device (run it on a GPU machine: scripts/device_gpu.sh)\n");
    return 77;
  }
  if (argc > 1 && std::string(argv[1]) == "nccl") {
    nccl_transfer();
    nccl_all_reduce_one_rank();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "collectives") {
    nccl_collectives();
    return 0;
  }
  smp_bench::print_engine_overhead(kGpu);
  gpt_stage(false);
  gpt_stage(true);
  nccl_transfer();
  nccl_all_reduce_one_rank();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
