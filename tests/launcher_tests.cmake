# smprun (launcher/): unit tests of its parsing and setup, and end-to-end runs of the real binary.
add_executable(test_launcher ${CMAKE_CURRENT_LIST_DIR}/test_launcher.cpp)
target_link_libraries(test_launcher PRIVATE smp_catch_main smp_test_paths smp_launcher)
target_compile_options(test_launcher PRIVATE -Wall -Wextra)
add_dependencies(test_launcher smprun)
catch_discover_tests(test_launcher PROPERTIES LABELS quick)
