# Torch-free: builds and runs without LibTorch.
add_executable(test_scheduler
  ${CMAKE_CURRENT_LIST_DIR}/test_scheduler.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_scheduler_generators.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_simulator.cpp
)
target_link_libraries(test_scheduler PRIVATE smp_catch_main smp::scheduler)
target_compile_options(test_scheduler PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:-Wall -Wextra>)
catch_discover_tests(test_scheduler PROPERTIES LABELS quick)
