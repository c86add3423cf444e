# The Python package: each test runs a script under smprun (one intra-op thread per process, a free port picked
# by smprun, a time limit) and passes when every rank exits 0, i.e. matched plain PyTorch training.
if(NOT SMP_PYTHON_PACKAGE_DIR)
  return()
endif()

function(smp_python_test name processes script)
  add_test(NAME ${name}
           COMMAND $<TARGET_FILE:smprun> -n ${processes} --timeout 240 --
                   ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/python/${script} ${ARGN})
  set_tests_properties(${name} PROPERTIES
    TIMEOUT 300
    LABELS python
    ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")
endfunction()

smp_python_test(python_api_errors_and_shared_parameters 1 api_checks.py)
smp_python_test(python_sequential_2_stages_x_2_replicas_equals_pytorch 4 pipeline_worker.py --model sequential --nan-step 1
                --replica-share
                --smp [[{"partitions": 2, "microbatches": 4, "ddp": true, "global_batch_size": 16, "seed": 3, "device": "cpu", "nonfinite": "skip"}]])
smp_python_test(python_graph_4_stages_with_skips_equals_pytorch 4 pipeline_worker.py --model graph
                --smp [[{"partitions": 4, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu", "activation_checkpointing": ["b1", "skip"]}]])
smp_python_test(python_traced_model_equals_pytorch 4 pipeline_worker.py --model traced --optimizer adamw --rtol 1e-3
                --smp [[{"partitions": 2, "microbatches": 4, "ddp": true, "global_batch_size": 16, "seed": 3, "device": "cpu", "activation_checkpointing": ["blocks.1"]}]])
smp_python_test(python_traced_bf16_matches_float32 2 pipeline_worker.py --model traced --rtol 0.03
                --smp [[{"partitions": 2, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu", "bf16": true}]])
smp_python_test(python_torchscript_sequential_equals_pytorch 2 pipeline_worker.py --model sequential --script
                --smp [[{"partitions": 2, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
smp_python_test(python_torchscript_graph_interleaved_equals_pytorch 4 pipeline_worker.py --model graph --script
                --smp [[{"partitions": 2, "virtual_stages": 2, "pipeline": "interleaved", "microbatches": 4, "ddp": true, "global_batch_size": 16, "seed": 3, "device": "cpu"}]])
smp_python_test(python_sharded_optimizer_state_equals_pytorch 4 pipeline_worker.py --model graph --optimizer adamw --rtol 1e-3 --clip 0.5 --steps 4
                --smp [[{"partitions": 2, "microbatches": 4, "ddp": true, "global_batch_size": 16, "seed": 3, "device": "cpu", "shard_optimizer_state": true}]])
smp_python_test(python_schedule_file_contiguous_stages_with_skips 3 schedule_file_evaluate.py contiguous)
smp_python_test(python_schedule_file_explicit_transfers_with_skips 4 schedule_file_evaluate.py explicit)
smp_python_test(python_interleaved_adamw_equals_pytorch 4 pipeline_worker.py --model graph --optimizer adamw --rtol 1e-3
                --smp [[{"partitions": 2, "virtual_stages": 2, "pipeline": "interleaved", "microbatches": 4, "ddp": true, "global_batch_size": 16, "seed": 3, "device": "cpu"}]])

# On a GPU (the device machine's `ctest -L gpu`): one process, its stages on the GPU, against plain PyTorch on the
# CPU. Without a GPU the script exits 77 and ctest reports it skipped.
add_test(NAME python_gpu_pipeline_equals_pytorch
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/pipeline_worker.py --model graph --optimizer adamw
                 --rtol 1e-3 --smp [[{"partitions": 1, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cuda", "activation_checkpointing": ["b1"]}]])
set_tests_properties(python_gpu_pipeline_equals_pytorch PROPERTIES
  TIMEOUT 300
  LABELS "python;gpu"
  SKIP_RETURN_CODE 77
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")

# Jobs that all-reduce a Python tensor as their last act end cleanly (the checking script launches them).
add_test(NAME python_all_reduce_then_exit
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/exit_check.py $<TARGET_FILE:smprun>
                 ${SMP_PYTHON_EXECUTABLE})
set_tests_properties(python_all_reduce_then_exit PROPERTIES
  TIMEOUT 300
  LABELS python
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")

# The Python example as the 2x4 job against one process (the checking script launches both).
add_test(NAME python_example_2x4_equals_one_process
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/example_check.py $<TARGET_FILE:smprun>
                 ${SMP_PYTHON_EXECUTABLE} ${PROJECT_SOURCE_DIR}/examples/python/hybrid_2x4.py
                 ${PROJECT_SOURCE_DIR}/examples/hybrid_2x4.json)
set_tests_properties(python_example_2x4_equals_one_process PROPERTIES
  TIMEOUT 500
  LABELS python
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")

# smp.Checkpointer: save every step, resume in a second job, both against plain PyTorch.
add_test(NAME python_checkpoint_resume_equals_pytorch
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/checkpoint_check.py $<TARGET_FILE:smprun>
                 ${SMP_PYTHON_EXECUTABLE})
set_tests_properties(python_checkpoint_resume_equals_pytorch PROPERTIES
  TIMEOUT 400
  LABELS python
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")
# The same with two replicas sharding the optimizer state: a shard file per replica, each loaded by its owner.
add_test(NAME python_sharded_checkpoint_resume_equals_pytorch
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/checkpoint_check.py $<TARGET_FILE:smprun>
                 ${SMP_PYTHON_EXECUTABLE} --sharded)
set_tests_properties(python_sharded_checkpoint_resume_equals_pytorch PROPERTIES
  TIMEOUT 400
  LABELS python
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")

# Unmodified Hugging Face and torchvision models (small configs, random weights), captured whole with torch.export,
# against plain PyTorch on the same microbatches: every step's loss, evaluation (eval mode, outputs kept) and every
# parameter within 1e-5 relative. Several models per job, so that process start-up and imports are paid once.
smp_python_test(python_real_models_2_stages_equal_pytorch 2 real_models.py --models gpt2,llama,bert,t5,opt,resnet,vit
                --smp [[{"partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": 3, "device": "cpu"}]])
smp_python_test(python_real_models_4_stages_equal_pytorch 4 real_models.py --models gpt2,llama,bert,resnet,vit
                --smp [[{"partitions": 4, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
smp_python_test(python_real_models_2x2_equal_pytorch 4 real_models.py --models gpt2,llama,bert,resnet,vit --loss fn
                --smp [[{"partitions": 2, "microbatches": 2, "ddp": true, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
smp_python_test(python_real_models_interleaved_equal_pytorch 2 real_models.py --models llama,vit
                --smp [[{"partitions": 2, "virtual_stages": 2, "pipeline": "interleaved", "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
# The V schedules: the model's first and last stages (embeddings and head, a tied GPT-2 matrix) on rank 0.
smp_python_test(python_real_models_zb_v_equal_pytorch 2 real_models.py --models gpt2,resnet
                --smp [[{"partitions": 2, "pipeline": "zb_v", "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
smp_python_test(python_real_models_dualpipe_v_equal_pytorch 2 real_models.py --models llama
                --smp [[{"partitions": 2, "pipeline": "dualpipe_v", "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
# The README's bring-your-own-model example runs as written (2 stages x 2 replicas).
add_test(NAME python_example_hf_causal_lm
         COMMAND $<TARGET_FILE:smprun> -n 4 --timeout 240 -- ${SMP_PYTHON_EXECUTABLE}
                 ${PROJECT_SOURCE_DIR}/examples/python/hf_causal_lm.py --replicas 2 --steps 3)
set_tests_properties(python_example_hf_causal_lm PROPERTIES
  TIMEOUT 300
  LABELS python
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")
smp_python_test(python_real_models_bf16_matches_float32 2 real_models.py --models llama,vit --rtol 0.03
                --smp [[{"partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": 3, "device": "cpu", "bf16": true}]])
smp_python_test(python_more_model_families_equal_pytorch 2 real_models.py --steps 2
                --models mistral,qwen2,phi,gpt_neox,bloom,falcon,roberta,distilbert,bart,mobilenet,efficientnet,convnext,swin
                --smp [[{"partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": 3, "device": "cpu"}]])

# Models built on the meta device: each rank makes real only its own stages, against plain PyTorch training the same
# model made real in one process by smp.materialize (the same seed).
smp_python_test(python_meta_models_2_stages_equal_materialized 2 real_models.py --meta --models gpt2,llama,bert,resnet,vit
                --smp [[{"partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": 3, "device": "cpu"}]])
smp_python_test(python_meta_models_4_stages_equal_materialized 4 real_models.py --meta --models gpt2,vit
                --smp [[{"partitions": 4, "microbatches": 4, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
smp_python_test(python_meta_models_2x2_equal_materialized 4 real_models.py --meta --models gpt2,llama,resnet
                --smp [[{"partitions": 2, "microbatches": 2, "ddp": true, "global_batch_size": 8, "seed": 3, "device": "cpu"}]])
# Pretrained weights read per rank (safetensors whole and sharded, a torch.save state dict) into meta-built models.
smp_python_test(python_pretrained_weights_per_stage 2 pretrained_check.py)

# Meta-built models through checkpoints and exports: resume equals uninterrupted training (batch norm statistics
# included), the safetensors export loads with from_pretrained and into a job of another partitioning.
add_test(NAME python_meta_checkpoint_resume_and_safetensors_export
         COMMAND ${SMP_PYTHON_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/python/export_check.py $<TARGET_FILE:smprun>
                 ${SMP_PYTHON_EXECUTABLE})
set_tests_properties(python_meta_checkpoint_resume_and_safetensors_export PROPERTIES
  TIMEOUT 500
  LABELS python
  ENVIRONMENT "PYTHONPATH=${SMP_PYTHON_PACKAGE_DIR};OMP_NUM_THREADS=1;PYTHONUNBUFFERED=1")
