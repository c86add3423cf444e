// The Catch2 main every test program links (compiled once: it is slow to compile on 2 cores). A program that cannot
// run here defines smp_test_skip_reason() to say why; main then exits 77, which ctest reports as skipped.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

__attribute__((weak)) const char* smp_test_skip_reason() { return nullptr; }

int main(int argc, char** argv) {
  if (const char* reason = smp_test_skip_reason()) {
    std::printf("SKIPPED: %s\n", reason);
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
