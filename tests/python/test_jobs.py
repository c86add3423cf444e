"""Whole jobs as users run them: the examples against one process, checkpoints resumed in a second job, exports
loaded by plain PyTorch and transformers. The checking scripts launch their jobs themselves."""

import os

from jobs import REPO, assert_passed


def test_example_2x4_equals_one_process(job, smprun, python):
    """examples/python/hybrid_2x4.py as the 2x4 job and as one process: the same losses and accuracy."""
    finished = job(0, "example_check.py", smprun, python,
                   os.path.join(REPO, "examples", "python", "hybrid_2x4.py"),
                   os.path.join(REPO, "examples", "hybrid_2x4.json"), timeout=440)
    assert finished.returncode == 0, finished.error


def test_example_hf_causal_lm(job):
    """The README's bring-your-own-model example runs as written (2 stages x 2 replicas), a step of each length, and
    with a mixture of experts counts every routed token."""
    example = os.path.join(REPO, "examples", "python", "hf_causal_lm.py")
    finished = job(4, example, "--replicas", "2", "--steps", "3", "--moe")
    assert finished.returncode == 0, finished.output
    # Rank 0 runs stage 0 of replica 0: its first router saw its 8 samples x 24 tokens x top-2 at step 2.
    assert "step 2 length 24" in finished.stdout and "tokens per expert" in finished.stdout, finished.output
    counts = finished.stdout.split("step 2 length 24")[1].split("[")[1].split("]")[0]
    assert sum(int(count) for count in counts.split(",")) == 8 * 24 * 2, finished.output


def test_checkpoint_resume_equals_pytorch(job, smprun, python):
    """smp.Checkpointer saves every step; a second job resumes; both against plain PyTorch."""
    finished = job(0, "checkpoint_check.py", smprun, python, timeout=340)
    assert finished.returncode == 0, finished.error


def test_sharded_checkpoint_resume_equals_pytorch(job, smprun, python):
    """The same with two replicas sharding the optimizer state: a shard file per replica, each loaded by its owner."""
    finished = job(0, "checkpoint_check.py", smprun, python, "--sharded", timeout=340)
    assert finished.returncode == 0, finished.error


def test_tensor_parallel_checkpoint_resume_equals_pytorch(job, smprun, python):
    """The same with each stage split over two tensor-parallel ranks: a file per shard, the export whole."""
    finished = job(0, "checkpoint_check.py", smprun, python, "--tp", timeout=340)
    assert finished.returncode == 0, finished.error


def test_meta_checkpoint_resume_and_safetensors_export(job, smprun, python):
    """Meta-built models resume equal to uninterrupted training (batch norm statistics included); the safetensors
    export loads with from_pretrained and into a job of another partitioning."""
    assert_passed(job(0, "export_check.py", smprun, python, timeout=440))


def test_capture_cache_exports_once_and_reads_back(job, tmp_path):
    """SMP_CAPTURE_CACHE: the ranks of a job export a model once between them; an identical model is read back and
    trains alike; another sample, config or edited model class is exported again; a damaged entry is exported again
    and replaced; without the variable nothing is kept (capture_cache_check.py)."""
    assert_passed(job(2, "capture_cache_check.py", str(tmp_path)))
