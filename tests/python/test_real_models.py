"""Unmodified Hugging Face and torchvision models (small configs, random weights), captured whole with torch.export,
against plain PyTorch on the same microbatches: every step's loss, evaluation (eval mode, outputs kept) and every
parameter within 1e-5 relative (real_models.py). Several models per job, so that process start-up and imports are
paid once. Built on the meta device, each rank makes only its own stages real, against the model made real in one
process by smp.materialize with the same seed."""

from jobs import assert_passed, smp_keys

BASIC = "gpt2,llama,bert,resnet,vit"


def test_real_models_2_stages_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--models", "gpt2,llama,bert,t5,opt,resnet,vit", "--smp",
                      smp_keys(partitions=2, microbatches=2, global_batch_size=4)))


def test_real_models_4_stages_equal_pytorch(job):
    """A tied matrix on the first and last of four stages (GPT-2), a padding mask through every stage (BERT)."""
    assert_passed(job(4, "real_models.py", "--models", "gpt2,bert,vit", "--smp",
                      smp_keys(partitions=4, microbatches=4, global_batch_size=8)))


def test_real_models_2x2_equal_pytorch(job):
    """A loss function on the outputs; batch norm statistics per replica (ResNet)."""
    assert_passed(job(4, "real_models.py", "--models", "gpt2,bert,resnet", "--loss", "fn", "--smp",
                      smp_keys(partitions=2, microbatches=2, ddp=True, global_batch_size=8)))


def test_real_models_interleaved_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--models", "llama,vit", "--smp",
                      smp_keys(partitions=2, virtual_stages=2, pipeline="interleaved", microbatches=4,
                               global_batch_size=8)))


def test_real_models_zb_v_equal_pytorch(job):
    """The V schedules put the model's first and last stages (embeddings and head, a tied GPT-2 matrix) on rank 0."""
    assert_passed(job(2, "real_models.py", "--models", "gpt2,resnet", "--smp",
                      smp_keys(partitions=2, pipeline="zb_v", microbatches=4, global_batch_size=8)))


def test_real_models_dualpipe_v_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--models", "llama", "--smp",
                      smp_keys(partitions=2, pipeline="dualpipe_v", microbatches=4, global_batch_size=8)))


def test_real_models_bf16_matches_float32(job):
    assert_passed(job(2, "real_models.py", "--models", "llama,vit", "--rtol", "0.03", "--smp",
                      smp_keys(partitions=2, microbatches=2, global_batch_size=4, bf16=True)))


def test_more_model_families_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--steps", "2", "--models",
                      "mistral,qwen2,phi,gpt_neox,bloom,falcon,roberta,distilbert,bart,mobilenet,efficientnet,convnext,"
                      "swin", "--smp", smp_keys(partitions=2, microbatches=2, global_batch_size=4)))


def test_meta_models_2_stages_equal_materialized(job):
    assert_passed(job(2, "real_models.py", "--meta", "--models", BASIC, "--smp",
                      smp_keys(partitions=2, microbatches=2, global_batch_size=4)))


def test_meta_models_4_stages_equal_materialized(job):
    assert_passed(job(4, "real_models.py", "--meta", "--models", "gpt2,vit", "--smp",
                      smp_keys(partitions=4, microbatches=4, global_batch_size=8)))


def test_meta_models_2x2_equal_materialized(job):
    assert_passed(job(4, "real_models.py", "--meta", "--models", "gpt2,resnet", "--smp",
                      smp_keys(partitions=2, microbatches=2, ddp=True, global_batch_size=8)))


def test_pretrained_weights_per_stage(job):
    """Pretrained weights read per rank (safetensors whole and sharded, a torch.save state dict) into meta-built
    models equal from_pretrained in one process; bad files are refused naming the tensor and the file."""
    assert_passed(job(2, "pretrained_check.py"))
