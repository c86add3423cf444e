# Torch-free: the graph partition search builds and runs without LibTorch.
add_executable(test_graph_partition ${CMAKE_CURRENT_LIST_DIR}/test_graph_partition.cpp)
target_link_libraries(test_graph_partition PRIVATE smp_catch_main smp_partitioner_fixtures)
target_compile_options(test_graph_partition PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:-Wall -Wextra>)
catch_discover_tests(test_graph_partition PROPERTIES LABELS quick)
