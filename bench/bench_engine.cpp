// The engine's own cost on the CPU: the time per schedule action that smp adds over plain LibTorch, eight one-layer
// stages in one process (bench_gpu measures the same on a GPU). Prints one JSON line.

#include "smp/main.h"
#include "step_timing.h"

namespace {

int run(int, char**) {
  smp_bench::print_engine_overhead(c10::Device(c10::kCPU));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return smp::guarded_main(argc, argv, run); }
