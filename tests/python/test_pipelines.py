"""smp.DistributedModel on small models (Sequential, GraphModel, traced, TorchScript) against plain PyTorch: every
step's loss, evaluation and outputs, and every parameter after training (pipeline_worker.py), in jobs of 1 to 4
processes; the API's errors (api_checks.py); schedules read from files."""

import json
import os
import signal
import subprocess
import time

import pytest

from jobs import assert_passed, smp_keys


def test_api_errors_and_shared_parameters(job):
    assert_passed(job(1, "api_checks.py"))


def test_sequential_2_stages_x_2_replicas_equals_pytorch(job):
    assert_passed(job(4, "pipeline_worker.py", "--model", "sequential", "--nan-step", "1", "--replica-share", "--smp",
                      smp_keys(partitions=2, microbatches=4, ddp=True, global_batch_size=16, nonfinite="skip")))


def test_graph_4_stages_with_skips_equals_pytorch(job):
    assert_passed(job(4, "pipeline_worker.py", "--model", "graph", "--smp",
                      smp_keys(partitions=4, microbatches=4, global_batch_size=8,
                               activation_checkpointing=["b1", "skip"])))


def test_traced_model_equals_pytorch(job):
    assert_passed(job(4, "pipeline_worker.py", "--model", "traced", "--optimizer", "adamw", "--rtol", "1e-3", "--smp",
                      smp_keys(partitions=2, microbatches=4, ddp=True, global_batch_size=16,
                               activation_checkpointing=["blocks.1"])))


def test_traced_bf16_matches_float32(job):
    assert_passed(job(2, "pipeline_worker.py", "--model", "traced", "--rtol", "0.03", "--smp",
                      smp_keys(partitions=2, microbatches=4, global_batch_size=8, bf16=True)))


def test_bf16_captured_model_computes_as_autocast(job):
    """A cast back to an autocast result's dtype (Qwen3's q_norm) stays bfloat16: equal to torch.autocast."""
    assert_passed(job(2, "autocast_capture_check.py"))


def test_channels_last_crosses_a_cut_as_it_is(job):
    """A channels_last activation arrives channels_last at the next stage, training equal to plain PyTorch."""
    assert_passed(job(2, "channels_last_check.py"))


def test_slow_rank_measured_gets_less_and_equals_pytorch(job):
    """Devices that differ: rank 1 emulates a device 6 times slower, the ranks measure their speeds, and the
    partition gives rank 1's stage fewer modules; training still equals plain PyTorch. (3 times slower was found
    equal under a loaded host: every one of rank 0's timed rounds shared its core with other tests' processes.)"""
    finished = job(2, "pipeline_worker.py", "--model", "sequential", "--smp",
                   smp_keys(partitions=2, microbatches=4, global_batch_size=8, memory_weight=0,
                            device_speeds="measure", emulated_slowdown=[1, 6]))
    assert_passed(finished)
    assert "device speeds measured, by rank: 1.000, 0." in finished.output, finished.output
    assert "on a device of speed 0." in finished.output, finished.output


def test_a_slow_rank_still_gets_parameters(job):
    """A device 20 times slower is given a Linear, not a lone ReLU (torch.optim refuses an empty parameter list);
    a model with too few modules with parameters leaves a rank none, which that rank says (empty_stage_check.py)."""
    assert_passed(job(2, "empty_stage_check.py"))


def test_a_failed_step_stops_every_rank_at_once(job):
    """A step that fails on one rank midway fails its peer at once, naming it, and both refuse later steps rather
    than pair later activations with earlier targets (failed_step_check.py)."""
    assert_passed(job(2, "failed_step_check.py"))


def test_a_failed_evaluation_frees_peers_blocked_sending_to_it(job):
    """The failed rank reads and drops what its peer still sends it, so that the peer, blocked on a large send,
    reaches the farewell at once rather than at the timeout (failed_step_check.py evaluate)."""
    assert_passed(job(2, "failed_step_check.py", "evaluate"))


@pytest.mark.parametrize("mistake", ["evaluate_alone", "own_batch", "own_targets", "own_shapes", "replica_batch", "experts_alone", "whole_batch",
                                     "replica_refused", "replica_skipped"])
def test_ranks_out_of_step_fail_at_once_saying_how(job, mistake):
    """A rank that evaluates alone, or draws a batch of its own, or a replica given another global batch, makes every
    rank fail at that step, saying which call or batch differs, where it used to pair another call's activations with
    its own, or train each replica on a share of another batch (out_of_step_check.py)."""
    assert_passed(job(2, "out_of_step_check.py", mistake))


@pytest.mark.parametrize("mistake, said", [
    ("own_config", 'rank 1\'s config differs from rank 0\'s: "microbatches" 4 here, 2 on rank 0'),
    ("own_model", "rank 1's model differs from rank 0's: module 3 is 3 <- 2 here, nothing on rank 0"),
    ("replica_model", "rank 1 holds other parameters than rank 0, a replica of the same stage: parameter 0 is "
                      "0.weight Float [48, 16] here, 0.weight Float [32, 16] on rank 0")])
def test_ranks_that_disagree_refuse_at_the_start(job, mistake, said):
    """A rank reading another config, or building another model (where it segfaulted, or aborted in Gloo), refuses
    before any step, naming the key, module or parameter (out_of_step_check.py)."""
    finished = job(2, "out_of_step_check.py", mistake)
    assert finished.returncode != 0 and said in finished.output, finished.output


def test_torchrun_launches_the_same_job(job):
    """Under torchrun, whose agent already hosts a store on MASTER_PORT, the ranks join that store (every rank once
    failed, the port in use) and train as under smprun."""
    assert_passed(job(2, "pipeline_worker.py", "--model", "sequential", "--smp",
                      smp_keys(partitions=2, microbatches=2, global_batch_size=4, comm_timeout_s=60), by="torchrun"))


def test_module_patterns_equal_pytorch(job):
    """Patterns that once trained differently from PyTorch without an error: a Sequential reusing a module, a buffer
    written twice in place, a counter in a module cut into its children (module_patterns_check.py)."""
    result = job(2, "module_patterns_check.py")
    assert_passed(result)
    # The rank whose stage is frozen says how to build its optimizer (the trainable parameters alone are none there);
    # the frozen teacher, which no rank trains, says nothing.
    hints = [line for line in result.stderr.splitlines() if "trains none of its parameters" in line]
    assert len(hints) == 1 and hints[0].startswith("[rank 0]"), result.output[-3000:]


def test_replicas_keep_the_first_replicas_buffers(job):
    """Batch norm's running statistics, updated by each replica from its share, are replica 0's on every replica
    after each step, as under torch DDP (replica_buffers_check.py)."""
    finished = job(2, "replica_buffers_check.py")
    assert_passed(finished)
    # Only where they were (step 3), not at step 0, where each replica took its own share (its values compared too
    # where a replica is one rank).
    assert finished.stderr.count("every replica was given the same batch") == 1, finished.output
    assert "step 3: every replica was given the same batch" in finished.stderr, finished.output


def test_sync_batch_norm_pools_replicas_statistics(job):
    """SyncBatchNorm over 2 stages x 2 replicas normalizes each microbatch over both replicas' rows, in training and
    in its gradient, as one process would the pooled microbatch: losses, parameters, running statistics and
    evaluation equal (sync_batch_norm_check.py); under ZB-H1 with every stage recomputed too."""
    assert_passed(job(4, "sync_batch_norm_check.py"))
    assert_passed(job(4, "sync_batch_norm_check.py", json.dumps({"pipeline": "zb_h1", "activation_checkpointing": True})))


def test_torchscript_sequential_equals_pytorch(job):
    assert_passed(job(2, "pipeline_worker.py", "--model", "sequential", "--script", "--smp",
                      smp_keys(partitions=2, microbatches=4, global_batch_size=8)))


def test_torchscript_graph_interleaved_equals_pytorch(job):
    assert_passed(job(4, "pipeline_worker.py", "--model", "graph", "--script", "--smp",
                      smp_keys(partitions=2, virtual_stages=2, pipeline="interleaved", microbatches=4, ddp=True,
                               global_batch_size=16)))


def test_sharded_optimizer_state_equals_pytorch(job):
    assert_passed(job(4, "pipeline_worker.py", "--model", "graph", "--optimizer", "adamw", "--rtol", "1e-3",
                      "--clip", "0.5", "--steps", "4", "--smp",
                      smp_keys(partitions=2, microbatches=4, ddp=True, global_batch_size=16,
                               shard_optimizer_state=True)))


def test_interleaved_adamw_equals_pytorch(job):
    assert_passed(job(4, "pipeline_worker.py", "--model", "graph", "--optimizer", "adamw", "--rtol", "1e-3", "--smp",
                      smp_keys(partitions=2, virtual_stages=2, pipeline="interleaved", microbatches=4, ddp=True,
                               global_batch_size=16)))


def test_schedule_file_contiguous_stages_with_skips(job):
    assert_passed(job(3, "schedule_file_evaluate.py", "contiguous"))


def test_schedule_file_explicit_transfers_with_skips(job):
    assert_passed(job(4, "schedule_file_evaluate.py", "explicit"))


def test_gpu_pipeline_equals_pytorch(job):
    """One process, its stages on the GPU, against plain PyTorch on the CPU (the device machine's `ctest -L gpu`)."""
    finished = job(0, "pipeline_worker.py", "--model", "graph", "--optimizer", "adamw", "--rtol", "1e-3", "--smp",
                   smp_keys(partitions=1, microbatches=4, global_batch_size=8, device="cuda",
                            activation_checkpointing=["b1"]))
    if finished.returncode == 77:
        pytest.skip("no GPU")
    assert_passed(finished)


def test_all_reduce_then_exit(job, smprun, python):
    """Jobs that all-reduce a Python tensor as their last act end cleanly (exit_check.py launches six: the old
    fault, in 9 of 20 jobs, would let all six pass 3% of the time)."""
    finished = job(0, "exit_check.py", smprun, python)
    assert finished.returncode == 0, finished.error


CTRL_C_SCRIPT = """
import pathlib, sys, torch, torch.nn as nn, torch.nn.functional as F, smp
runtime = smp.init({"partitions": 2, "microbatches": 2, "device": "cpu"})
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)), torch.zeros(2, 64))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(10**9):
    optimizer.zero_grad()
    model.train_step(torch.randn(4, 64), torch.randint(0, 4, (4,)), F.cross_entropy)
    optimizer.step()
    if step == 2:
        pathlib.Path(sys.argv[1], str(runtime.rank)).touch()
"""


def test_ctrl_c_ends_every_rank_as_keyboard_interrupt(tmp_path, smprun, python):
    """SIGINT to smprun (Ctrl-C) reaches every rank in the middle of training: each ends with KeyboardInterrupt, as
    plain PyTorch does, whichever was inside a module and whichever waited on a peer (that one used to surface the
    peer's leaving as a CommError, and Python, raising the pending interrupt while printing it, lost its stderr)."""
    command = [smprun, "-n", "2", "--timeout", "120", "--", python, "-c", CTRL_C_SCRIPT, str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as launched:
        deadline = time.monotonic() + 120
        while not all((tmp_path / str(rank)).exists() for rank in (0, 1)):
            assert launched.poll() is None and time.monotonic() < deadline, launched.communicate()
            time.sleep(0.1)
        launched.send_signal(signal.SIGINT)
        stdout, stderr = launched.communicate(timeout=60)
    said = f"{stdout[-2000:]}\n{stderr[-4000:]}"
    assert launched.returncode == 128 + signal.SIGINT, said
    for rank in (0, 1):
        last = [line for line in stderr.splitlines() if line.startswith(f"[rank {rank}]")][-1]
        assert last == f"[rank {rank}] KeyboardInterrupt", said
    assert "lost sys.stderr" not in stderr and "CommError" not in stderr, said


def test_model_draws_leave_the_programs_random_stream_alike_on_every_rank(job, smprun, python):
    assert_passed(job(0, "random_stream_check.py", smprun, python))
