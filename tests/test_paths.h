#pragma once
// Where the built programs and the checkout's files are. Defined in a source file the build generates
// (tests/CMakeLists.txt), not passed as -D flags: the test sources then compile alike in every checkout, and a
// clean clone takes them from ccache.

namespace smp_test::paths {

extern const char* const smprun;
extern const char* const training_worker;
extern const char* const warm_rank;
extern const char* const tp_worker;
extern const char* const smp_schedule;
extern const char* const smp_checkpoint;
extern const char* const example;         // hybrid_2x4
extern const char* const example_config;  // examples/hybrid_2x4.json
extern const char* const readme;

}  // namespace smp_test::paths
