"""Unmodified Hugging Face and torchvision models (small configs, random weights), captured whole with torch.export,
against plain PyTorch on the same microbatches: every step's loss, evaluation (eval mode, outputs kept) and every
parameter within 1e-5 relative (real_models.py). Several models per job, so that process start-up and imports are
paid once. Built on the meta device, each rank makes only its own stages real, against the model made real in one
process by smp.materialize with the same seed."""

from jobs import assert_passed, smp_keys

BASIC = "gpt2,llama,bert,resnet,vit"
MOE = "mixtral,olmoe,qwen3_moe,deepseek_v3"  # mixtures of experts, with their load-balancing loss


def test_real_models_2_stages_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--models", f"gpt2,llama,bert,t5,opt,resnet,vit,{MOE}", "--smp",
                      smp_keys(partitions=2, microbatches=2, global_batch_size=4)))


def test_real_models_4_stages_equal_pytorch(job):
    """A tied matrix on the first and last of four stages (GPT-2), a padding mask through every stage (BERT), router
    logits from every stage to the load-balancing loss on the last (Mixtral)."""
    assert_passed(job(4, "real_models.py", "--models", "gpt2,bert,vit,mixtral,deepseek_v3", "--smp",
                      smp_keys(partitions=4, microbatches=4, global_batch_size=8)))


def test_real_models_2x2_equal_pytorch(job):
    """A loss function on the outputs; batch norm statistics per replica (ResNet); a sequence length per step under
    1F1B; a last step of 11 samples, split unevenly (replicas of 6 and 5, microbatches of 3, 3 and 3, 2), each
    counted by its size; evaluations of 5 (microbatches of 2, 1 and 1, 1: the capture, on 2, takes 1), 3 (a replica
    of 1 sample runs 1 microbatch) and 1 (a replica of none runs none)."""
    assert_passed(job(4, "real_models.py", "--models", "gpt2,bert,resnet,olmoe,qwen3_moe", "--loss", "fn",
                      "--lengths", "12,24,30", "--short-last", "11", "--eval-samples", "5,3,1", "--smp",
                      smp_keys(partitions=2, microbatches=2, ddp=True, global_batch_size=8)))


def test_real_models_interleaved_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--models", "llama,vit,mixtral", "--lengths", "16,40,8", "--smp",
                      smp_keys(partitions=2, virtual_stages=2, pipeline="interleaved", microbatches=4,
                               global_batch_size=8)))


def test_real_models_zb_v_equal_pytorch(job):
    """The V schedules put the model's first and last stages (embeddings and head, a tied GPT-2 matrix) on rank 0;
    every step another sequence length, the last a smaller batch (as an epoch's last: 9 samples, microbatches of 3, 2,
    2 and 2), with the capture of step 0."""
    assert_passed(job(2, "real_models.py", "--models", "gpt2,t5,resnet", "--lengths", "16,30,8", "--short-last", "9",
                      "--smp", smp_keys(partitions=2, pipeline="zb_v", microbatches=4, global_batch_size=12)))


def test_real_models_dualpipe_v_equal_pytorch(job):
    """Changing lengths; every stage recomputed in backward, its routers counting each token once."""
    assert_passed(job(2, "real_models.py", "--models", "llama,mixtral", "--lengths", "16,40,8,64,33", "--short-last",
                      "8", "--smp", smp_keys(partitions=2, pipeline="dualpipe_v", microbatches=4, global_batch_size=12,
                                             activation_checkpointing=True)))


def test_changing_lengths_equal_pytorch(job):
    """A decoder, an encoder-decoder and a mixture of experts on lengths 16, 40, 8, 64, 33 and a short last batch
    that splits unevenly (3 samples: microbatches of 2 and 1, where the capture on 4 samples' microbatches of 2 takes
    1), under ZB-H1 (its split backward on every shape)."""
    assert_passed(job(2, "real_models.py", "--models", "llama,t5,mixtral", "--lengths", "16,40,8,64,33",
                      "--short-last", "3", "--smp", smp_keys(partitions=2, pipeline="zb_h1", microbatches=2,
                                                              global_batch_size=8)))


def test_module_graphs_4_stages_equal_pytorch(job):
    """Module names that are not identifiers (RegNet's "block4-1"); cuts across DenseNet-121's dense blocks, each
    crossed by more tensors than a transfer header describes. One step: DenseNet's batch norms over two samples turn
    summation order into 1e-5 relative differences after two."""
    assert_passed(job(4, "real_models.py", "--models", "regnet,densenet", "--steps", "1", "--smp",
                      smp_keys(partitions=4, microbatches=4, global_batch_size=8)))


def test_real_models_bf16_matches_float32(job):
    assert_passed(job(2, "real_models.py", "--models", "llama,vit", "--rtol", "0.03", "--smp",
                      smp_keys(partitions=2, microbatches=2, global_batch_size=4, bf16=True)))


def test_more_model_families_equal_pytorch(job):
    assert_passed(job(2, "real_models.py", "--steps", "2", "--models",
                      "mistral,qwen2,phi,gpt_neox,bloom,falcon,roberta,distilbert,bart,mobilenet,efficientnet,convnext,"
                      "swin", "--smp", smp_keys(partitions=2, microbatches=2, global_batch_size=4)))


def test_meta_models_2_stages_equal_materialized(job):
    assert_passed(job(2, "real_models.py", "--meta", "--models", f"{BASIC},mixtral,deepseek_v3", "--smp",
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


def test_too_long_for_the_model_is_refused_before_any_communication(job):
    """BERT's position table holds 40: a step of length 48 is a ConfigError on every rank, naming the input and the
    range the capture allows, before a stage sends anything (no rank waits for another)."""
    result = job(2, "real_models.py", "--models", "bert", "--lengths", "16,48", "--smp",
                 smp_keys(partitions=2, microbatches=2, global_batch_size=4))
    assert result.returncode != 0, result.output
    refusal = "input 'input_ids' gives microbatches of shape (2, 48); the captured model takes 1 to 40"
    assert result.stderr.count(refusal) == 2 and "CommError" not in result.stderr, result.output
