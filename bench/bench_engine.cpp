// The engine's own cost on the CPU, against plain LibTorch (bench_gpu measures the same on a GPU). Prints one JSON line
// each: the time per schedule action smp adds (eight one-layer stages in one process), and a small GPT stage's speed.

#include "smp/main.h"
#include "step_timing.h"

namespace {

int run(int, char**) {
  const c10::Device cpu(c10::kCPU);
  smp_bench::print_engine_overhead(cpu);
  // vocabulary 256, context 128, d_model 256, 4 heads, 4 layers: 3.3M parameters
  const smp::examples::GptOptions options{256, 128, 256, 4, 4};
  smp_bench::print_gpt_stage(cpu, options, /*batch=*/8, /*bf16=*/false, /*warmup=*/2, /*measured=*/9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
