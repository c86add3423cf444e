# catch_discover_tests hands each name to ctest as a CMake list item: a ';' in a name splits it, and ctest then runs
# a part that matches no test case, which passes without running anything.
file(GLOB smp_catch_sources ${CMAKE_CURRENT_LIST_DIR}/*.cpp)
foreach(source IN LISTS smp_catch_sources)
  file(STRINGS ${source} names_with_semicolons REGEX "TEST_CASE\\(\"[^\"]*;")
  if(names_with_semicolons)
    message(FATAL_ERROR "${source}: a TEST_CASE name holds ';', which ctest would split and never run; use ','")
  endif()
endforeach()

# Torch-free unit tests: config validation, topology, chain partition search, timeline formatting.
add_executable(test_core
  ${CMAKE_CURRENT_LIST_DIR}/test_config.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_topology.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_chain_split.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_timeline.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_checkpoint_manifest.cpp)
target_link_libraries(test_core PRIVATE smp_catch_main smp_test_paths smp::core smp::partitioner)
target_compile_options(test_core PRIVATE -Wall -Wextra)
catch_discover_tests(test_core PROPERTIES LABELS quick)

# Engine pieces that run in one process with LibTorch and no communication: split backward, profiling.
add_executable(test_engine_in_process ${CMAKE_CURRENT_LIST_DIR}/test_engine_in_process.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_graph_on_demand.cpp ${CMAKE_CURRENT_LIST_DIR}/test_stage_program.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_profile.cpp)
target_link_libraries(test_engine_in_process PRIVATE smp_catch_main smp::engine)
target_include_directories(test_engine_in_process PRIVATE ${PROJECT_SOURCE_DIR}/engine/src)
target_compile_options(test_engine_in_process PRIVATE -Wall -Wextra)
target_precompile_headers(test_engine_in_process REUSE_FROM smp_engine)
catch_discover_tests(test_engine_in_process PROPERTIES LABELS quick)

# The program every multi-process test launches: trains under smp and checks itself against single-process
# LibTorch training of the same model on the same global batches.
add_executable(training_worker ${CMAKE_CURRENT_LIST_DIR}/training_worker.cpp
  ${CMAKE_CURRENT_LIST_DIR}/warm_worker/server.cpp)
target_link_libraries(training_worker PRIVATE smp_examples_common)
target_compile_options(training_worker PRIVATE -Wall -Wextra)
target_precompile_headers(training_worker REUSE_FROM smp_engine)
set_target_properties(training_worker PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)

# The tensor-parallel layers against the whole model, on every rank of one group (test_tensor_parallel).
add_executable(tp_worker ${CMAKE_CURRENT_LIST_DIR}/tp_worker.cpp)
target_link_libraries(tp_worker PRIVATE smp::engine)
target_compile_options(tp_worker PRIVATE -Wall -Wextra)
target_precompile_headers(tp_worker REUSE_FROM smp_engine)
set_target_properties(tp_worker PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)

# The ranks of training_worker's jobs start as forks of one process that loaded LibTorch once (warm_worker/server.h):
# ctest starts it before the first multi-process test it runs and stops it after the last. warm_rank, which the
# launcher starts in a rank's place, runs the program itself where no server answers. Named after this build.
add_executable(warm_rank ${CMAKE_CURRENT_LIST_DIR}/warm_worker/warm_rank.cpp)
target_compile_options(warm_rank PRIVATE -Wall -Wextra)
set_target_properties(warm_rank PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
string(SHA1 smp_build_hash "${CMAKE_BINARY_DIR}")
string(SUBSTRING "${smp_build_hash}" 0 12 smp_warm_worker)
foreach(action start stop)
  add_test(NAME warm_worker_${action} COMMAND training_worker --warm-${action} ${smp_warm_worker})
  set_tests_properties(warm_worker_${action} PROPERTIES TIMEOUT 60 ENVIRONMENT OMP_NUM_THREADS=1)
endforeach()
set_tests_properties(warm_worker_start PROPERTIES FIXTURES_SETUP smp_warm_worker)
set_tests_properties(warm_worker_stop PROPERTIES FIXTURES_CLEANUP smp_warm_worker)

# Multi-process tests: Catch2 programs that launch the real binaries under smprun.
function(smp_multiprocess_test name)
  add_executable(${name} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/${name}.cpp)
  target_link_libraries(${name} PRIVATE smp_catch_main smp_test_paths)
  target_compile_options(${name} PRIVATE -Wall -Wextra)
  add_dependencies(${name} smprun training_worker warm_rank tp_worker hybrid_2x4 smp_schedule smp_checkpoint)
  catch_discover_tests(${name} PROPERTIES TIMEOUT 600 COST 100  # before the unit tests (python_tests.cmake)
                       FIXTURES_REQUIRED smp_warm_worker ENVIRONMENT SMP_WARM_WORKER=${smp_warm_worker})
endfunction()
smp_multiprocess_test(test_training)
smp_multiprocess_test(test_faults)
smp_multiprocess_test(test_tensor_parallel)

# GPU tests (label gpu): one program that skips itself (smp_test_skip_reason: exit 77) where no CUDA device is
# visible; ctest lists it as skipped. scripts/device_gpu.sh runs them on a GPU machine.
add_executable(test_gpu ${CMAKE_CURRENT_LIST_DIR}/test_gpu.cpp)
target_link_libraries(test_gpu PRIVATE smp_catch_main smp_test_paths smp::comm smp::engine)
target_compile_options(test_gpu PRIVATE -Wall -Wextra)
target_precompile_headers(test_gpu REUSE_FROM smp_engine)
add_dependencies(test_gpu smprun training_worker hybrid_2x4)
add_test(NAME gpu_tests COMMAND test_gpu)
set_tests_properties(gpu_tests PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 900)


# Two hosts in network namespaces (root only; skipped with a message otherwise).
add_test(NAME two_hosts_in_network_namespaces
  COMMAND ${CMAKE_CURRENT_LIST_DIR}/netns_two_hosts.sh ${CMAKE_BINARY_DIR}/bin ${PROJECT_SOURCE_DIR}/examples/hybrid_2x4.json)
set_tests_properties(two_hosts_in_network_namespaces PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)

# A benchmark run small, so that it cannot rot unseen between long benchmark runs.
add_test(NAME bench_checkpoint_runs COMMAND ${CMAKE_CURRENT_LIST_DIR}/bench_checkpoint_smoke.sh ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(bench_checkpoint_runs PROPERTIES TIMEOUT 180 LABELS quick)
