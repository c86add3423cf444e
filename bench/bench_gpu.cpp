// GPU benchmark, one process on one GPU (scripts/device_gpu.sh runs it there; without a CUDA device it says so and
// exits 77). Prints one JSON line per measurement:
//   engine_overhead  time per schedule action that smp adds over plain LibTorch on a model too small to hide it
//   gpt_stage        achieved TFLOP/s of a GPT-style stage under smp vs the same model in plain LibTorch (fp32, bf16)
//   nccl_transfer    NCCL send/receive time vs bytes (the one-rank channel: a send to oneself through NCCL)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include "common/gpt.h"
#include "smp/comm/communicator.h"
#include "smp/main.h"
#include "step_timing.h"

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

void nccl_transfer() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto host = smp::comm::make_gloo_group(store, {0}, 0, "bench", "127.0.0.1", std::chrono::seconds(60), kGpu);
  auto group = smp::comm::make_nccl_group(store, host, kGpu);
  group->connect({{0, 0}});
  for (int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) {
    const at::Tensor source = at::randn({bytes / 4}, kGpu), target = at::empty({bytes / 4}, kGpu);
    const double seconds = median_seconds(3, 20, [&] {
      auto receive = group->irecv(target, 0, 0);
      auto send = group->isend(source, 0, 0);
      send->wait();
      receive->wait();
    });
    std::printf("{\"bench\": \"nccl_transfer\", \"bytes\": %lld, \"us\": %.1f, \"gb_per_s\": %.2f}\n",
                static_cast<long long>(bytes), seconds * 1e6, static_cast<double>(bytes) / seconds / 1e9);
    std::fflush(stdout);
  }
}

int run(int argc, char** argv) {
  (void)argc;
  (void)argv;
  if (torch::cuda::device_count() == 0) {
    std::printf("SKIPPED: bench_gpu needs a CUDA device (run it on a GPU machine: scripts/device_gpu.sh)\n");
    return 77;
  }
  smp_bench::print_engine_overhead(kGpu);
  gpt_stage(false);
  gpt_stage(true);
  nccl_transfer();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
