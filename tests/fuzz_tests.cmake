# The libFuzzer harnesses in fuzz/ need clang, so scripts/fuzz.sh builds them as a project of their own (in
# $SMP_BUILD_FUZZ, default build-fuzz/) and runs each one for a bounded time; a crash fails this test.
add_test(NAME fuzz_config_and_checkpoint_reader COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz.sh 8)
set_tests_properties(fuzz_config_and_checkpoint_reader PROPERTIES TIMEOUT 600 COST 400 LABELS fuzz)
