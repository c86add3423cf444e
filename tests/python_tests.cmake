# The Python package's tests are pytest tests (tests/python/test_*.py): each launches its job under smprun (one
# intra-op thread per process, a free port picked by smprun, a time limit) and asserts on the failures its ranks
# report, against plain PyTorch training. ctest runs each as one pytest test, under the name it always had.
if(NOT SMP_PYTHON_PACKAGE_DIR)
  return()
endif()

# The jobs' ranks start as forks of one interpreter that imported torch, transformers and smp once
# (tests/python/warm_pool.py): ctest starts it before the first Python test it runs and stops it after the last, in any
# selection of tests. Named after this build, so that two builds' runs never share one.
string(SHA1 smp_build_hash "${CMAKE_BINARY_DIR}")
string(SUBSTRING "${smp_build_hash}" 0 12 smp_warm_pool)
# The jobs keep their exports in a capture cache (smp/_capture_cache.py) emptied before and after each ctest run: a
# model captured again on the same sample (another layout of the same test model, a resumed job) reads its export back
# instead of exporting again, and every capture the run asks for is still exported once, by today's code.
set(smp_capture_cache "${CMAKE_CURRENT_BINARY_DIR}/capture-cache")
set(smp_python_environment
    "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1;SMP_SMPRUN=$<TARGET_FILE:smprun>;SMP_CAPTURE_CACHE=${smp_capture_cache}")
foreach(action start stop)
  add_test(NAME python_warm_pool_${action}
           COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/warm_pool.py ${action} ${smp_warm_pool})
  set_tests_properties(python_warm_pool_${action} PROPERTIES
    TIMEOUT 150 LABELS "python;quick" ENVIRONMENT "${smp_python_environment}")
endforeach()
set_tests_properties(python_warm_pool_start PROPERTIES FIXTURES_SETUP smp_warm_pool)
set_tests_properties(python_warm_pool_stop PROPERTIES FIXTURES_CLEANUP smp_warm_pool)
foreach(moment before after)
  add_test(NAME python_capture_cache_empty_${moment} COMMAND ${CMAKE_COMMAND} -E rm -rf ${smp_capture_cache})
  set_tests_properties(python_capture_cache_empty_${moment} PROPERTIES LABELS "python;quick")
endforeach()
set_tests_properties(python_capture_cache_empty_before PROPERTIES FIXTURES_SETUP smp_warm_pool)
set_tests_properties(python_capture_cache_empty_after PROPERTIES FIXTURES_CLEANUP smp_warm_pool)

# smp_pytest(file test timeout [quick]): "quick" puts the test in the inner-loop tier too (ctest -L quick).
function(smp_pytest file test timeout)
  set(labels python ${ARGN})
  add_test(NAME python_${test}
           COMMAND ${SMP_PYTHON_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/python/${file}::test_${test})
  # COST orders a first run (no timings yet) under ctest --parallel: the long jobs first, the unit tests filling in
  # beside them at the end. The time limit is set in proportion to a test's length, so it serves.
  set_tests_properties(python_${test} PROPERTIES
    TIMEOUT ${timeout}
    COST ${timeout}
    LABELS "${labels}"
    FIXTURES_REQUIRED smp_warm_pool
    ENVIRONMENT "${smp_python_environment};SMP_WARM_POOL=${smp_warm_pool}")
endfunction()


smp_pytest(test_pipelines.py api_errors_and_shared_parameters 320 quick)
smp_pytest(test_pipelines.py sequential_2_stages_x_2_replicas_equals_pytorch 320 quick)
smp_pytest(test_pipelines.py graph_4_stages_with_skips_equals_pytorch 320)
smp_pytest(test_pipelines.py traced_model_equals_pytorch 320)
smp_pytest(test_pipelines.py traced_bf16_matches_float32 320)
smp_pytest(test_pipelines.py bf16_captured_model_computes_as_autocast 120)
smp_pytest(test_pipelines.py channels_last_crosses_a_cut_as_it_is 120)
smp_pytest(test_pipelines.py slow_rank_measured_gets_less_and_equals_pytorch 320 quick)
smp_pytest(test_pipelines.py a_slow_rank_still_gets_parameters 320)
smp_pytest(test_pipelines.py a_failed_step_stops_every_rank_at_once 320)
smp_pytest(test_pipelines.py a_failed_evaluation_frees_peers_blocked_sending_to_it 320)
smp_pytest(test_pipelines.py ranks_out_of_step_fail_at_once_saying_how 320)
smp_pytest(test_pipelines.py ranks_that_disagree_refuse_at_the_start 320)
smp_pytest(test_pipelines.py torchrun_launches_the_same_job 320)
smp_pytest(test_pipelines.py ctrl_c_ends_every_rank_as_keyboard_interrupt 320)
smp_pytest(test_pipelines.py model_draws_leave_the_programs_random_stream_alike_on_every_rank 320)
smp_pytest(test_pipelines.py module_patterns_equal_pytorch 320)
smp_pytest(test_pipelines.py replicas_keep_the_first_replicas_buffers 320)
smp_pytest(test_pipelines.py sync_batch_norm_pools_replicas_statistics 320)
smp_pytest(test_pipelines.py torchscript_sequential_equals_pytorch 320)
smp_pytest(test_pipelines.py torchscript_graph_interleaved_equals_pytorch 320)
smp_pytest(test_pipelines.py sharded_optimizer_state_equals_pytorch 320)
smp_pytest(test_pipelines.py schedule_file_contiguous_stages_with_skips 320)
smp_pytest(test_pipelines.py schedule_file_explicit_transfers_with_skips 320)
smp_pytest(test_pipelines.py interleaved_adamw_equals_pytorch 320)
smp_pytest(test_pipelines.py all_reduce_then_exit 320)

smp_pytest(test_jobs.py example_2x4_equals_one_process 520)
smp_pytest(test_jobs.py checkpoint_resume_equals_pytorch 520)
smp_pytest(test_jobs.py sharded_checkpoint_resume_equals_pytorch 520)
smp_pytest(test_jobs.py tensor_parallel_checkpoint_resume_equals_pytorch 520)
smp_pytest(test_jobs.py example_hf_causal_lm 320)
smp_pytest(test_jobs.py meta_checkpoint_resume_and_safetensors_export 520)
smp_pytest(test_jobs.py capture_cache_exports_once_and_reads_back 200 quick)

smp_pytest(test_real_models.py real_models_2_stages_equal_pytorch 320 quick)
smp_pytest(test_real_models.py real_models_4_stages_equal_pytorch 320)
smp_pytest(test_real_models.py real_models_2x2_equal_pytorch 320)
smp_pytest(test_real_models.py real_models_interleaved_equal_pytorch 320)
smp_pytest(test_real_models.py real_models_zb_v_equal_pytorch 320)
smp_pytest(test_real_models.py real_models_dualpipe_v_equal_pytorch 320)
smp_pytest(test_real_models.py real_models_bf16_matches_float32 320)
smp_pytest(test_real_models.py changing_lengths_equal_pytorch 320)
smp_pytest(test_real_models.py module_graphs_4_stages_equal_pytorch 320)
smp_pytest(test_real_models.py too_long_for_the_model_is_refused_before_any_communication 320)
smp_pytest(test_real_models.py more_model_families_equal_pytorch 320)
smp_pytest(test_real_models.py meta_models_2_stages_equal_materialized 320)
smp_pytest(test_real_models.py meta_models_4_stages_equal_materialized 320)
smp_pytest(test_real_models.py meta_models_2x2_equal_materialized 320)
smp_pytest(test_real_models.py pretrained_weights_per_stage 320)

smp_pytest(test_expert_parallel.py all_to_all_moves_rows_and_gradients 120)
smp_pytest(test_expert_parallel.py ep2_x_dp2_equal_pytorch 320)
smp_pytest(test_expert_parallel.py ep2_x_pp2_meta_equal_materialized 320)
smp_pytest(test_expert_parallel.py dualpipe_v_overlapped_pairs_equal_pytorch 320)
smp_pytest(test_planning.py plan_ranks_layouts_and_rejects_by_memory 200)
smp_pytest(test_planning.py auto_layout_fits_the_memory_limit_and_trains_equal_pytorch 320)
smp_pytest(test_planning.py auto_tensor_parallel_degree_shards_the_model_and_trains_equal_pytorch 200)
smp_pytest(test_planning.py auto_expert_parallel_degree_divides_the_experts_when_memory_asks 200)
smp_pytest(test_planning.py fixed_expert_and_tensor_parallel_degrees_beside_auto_keys_train_equal_pytorch 200)
smp_pytest(test_planning.py a_teacher_beside_a_planned_model_is_cut_freely 120)

smp_pytest(test_tensor_parallel.py tensor_parallel_layers_plans_and_errors 320)
smp_pytest(test_tensor_parallel.py tensor_parallel_real_models_equal_pytorch 320)
smp_pytest(test_tensor_parallel.py tensor_parallel_meta_models_with_replicas_equal_materialized 320)
smp_pytest(test_tensor_parallel.py tensor_parallel_bf16_matches_float32 320)
smp_pytest(test_tensor_parallel.py sequence_parallel_real_models_equal_pytorch 320)
# On a GPU (the device machine's `ctest -L gpu`): one process, its stages on the GPU, against plain PyTorch on the
# CPU. That machine's python has torch but no package registry (no pytest), so ctest runs the worker itself, which
# exits 77 without a GPU (skipped); test_pipelines.py has the same test for pytest.
add_test(NAME python_gpu_pipeline_equals_pytorch
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/pipeline_worker.py --model graph --optimizer adamw
                 --rtol 1e-3 --smp [[{"partitions": 1, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cuda", "activation_checkpointing": ["b1"]}]])
set_tests_properties(python_gpu_pipeline_equals_pytorch PROPERTIES
  TIMEOUT 300
  LABELS "python;gpu"
  SKIP_RETURN_CODE 77
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")
# Jobs of 2 and 4 ranks over NCCL on the one GPU (pipelines, experts spread, tp x pp; NCCL 2.30 or later; skipped before).
add_test(NAME python_gpu_nccl_jobs_equal_pytorch
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/nccl_jobs.py)
set_tests_properties(python_gpu_nccl_jobs_equal_pytorch PROPERTIES
  TIMEOUT 600
  LABELS "python;gpu"
  SKIP_RETURN_CODE 77
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1;SMP_SMPRUN=$<TARGET_FILE:smprun>")
