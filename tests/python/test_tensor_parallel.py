"""Tensor parallelism from Python: unmodified Hugging Face models sharded by their built-in plans (Llama's own, a
mixture of experts' with its experts split, smp's for GPT-2 and BERT) under tp x pp and tp x dp, against plain
PyTorch on the whole model (real_models.py: every loss, evaluation, and every shard against its part of the whole
parameter, 1e-5 relative); smp.tp's layers, the bytes moved against Megatron's count and bad plans (tp_checks.py)."""

from jobs import assert_passed, smp_keys


def test_tensor_parallel_layers_plans_and_errors(job):
    assert_passed(job(2, "tp_checks.py"))


def test_tensor_parallel_real_models_equal_pytorch(job):
    assert_passed(job(4, "real_models.py", "--models", "llama,gpt2,bert,olmoe", "--smp",
                      smp_keys(tensor_parallel_degree=2, partitions=2, microbatches=2, global_batch_size=4)))


def test_tensor_parallel_meta_models_with_replicas_equal_materialized(job):
    """Built on the meta device, each shard is cut from its whole layer made real with the whole model's seed; a
    mixture of experts' stacked experts split along their features, its per-head norms' gradients summed (Qwen3)."""
    assert_passed(job(4, "real_models.py", "--meta", "--models", "llama,gpt2,qwen3_moe", "--smp",
                      smp_keys(tensor_parallel_degree=2, partitions=1, ddp=True, shard_optimizer_state=True,
                               microbatches=2, global_batch_size=8)))


def test_tensor_parallel_bf16_matches_float32(job):
    assert_passed(job(4, "real_models.py", "--models", "llama", "--rtol", "0.03", "--smp",
                      smp_keys(tensor_parallel_degree=2, partitions=2, microbatches=2, global_batch_size=4,
                               bf16=True)))


def test_sequence_parallel_real_models_equal_pytorch(job):
    """Megatron's sequence parallelism added to the plans: the blocks' activations and norms on slices of the
    sequence, split at the first block and gathered at the final norm."""
    assert_passed(job(4, "real_models.py", "--models", "llama,gpt2", "--smp",
                      smp_keys(tensor_parallel_degree=2, sequence_parallel=True, partitions=2, microbatches=2,
                               global_batch_size=4)))
