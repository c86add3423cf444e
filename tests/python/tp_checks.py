"""Tensor parallelism from Python on one group of two ranks (smprun -n 2, "tensor_parallel_degree" 2): smp.tp's layers
in a model of one's own against the whole model trained in the same process, the bytes a captured Llama's
collectives move against Megatron's count, a whole state_dict loaded into shards, and the errors of bad plans.
Exits 0 when every check holds."""

import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

import smp
import report

failures = []
VOCAB, D, SEQUENCE = 64, 16, 8


def expect_error(what, error_type, needle, action):
    report.expect_error(failures, what, error_type, needle, action)


def close(what, got, want, rtol=1e-5):
    difference = (got - want).abs().max().item()
    if difference > 1e-6 + rtol * want.abs().max().item():
        failures.append(f"{what} differs by {difference:.3g}")


def own_layers(microbatches):
    """A model written with smp.tp's layers (cut from whole layers drawn here), trained with the vocabulary-parallel
    loss on its sharded logits, against the whole model with plain PyTorch on the same microbatches."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Embedding(VOCAB, D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D),
                          nn.Linear(D, VOCAB))
    reference = copy.deepcopy(whole)
    sharded = nn.Sequential(smp.tp.VocabParallelEmbedding(whole[0]), smp.tp.ColumnParallelLinear(whole[1]), nn.GELU(),
                            smp.tp.RowParallelLinear(whole[3]), smp.tp.ColumnParallelLinear(whole[4]))
    data = torch.Generator().manual_seed(1)
    model = smp.DistributedModel(sharded, torch.randint(0, VOCAB, (2, SEQUENCE), generator=data))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (4, SEQUENCE), generator=data)
        targets = torch.randint(0, VOCAB, (4, SEQUENCE), generator=data)
        targets[0, :2] = -100  # padding, out of the mean as in F.cross_entropy
        optimizer.zero_grad()
        loss = model.train_step(tokens, targets, smp.tp.vocab_parallel_cross_entropy).loss
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = 0.0
        for piece, target in zip(tokens.chunk(microbatches), targets.chunk(microbatches)):
            value = F.cross_entropy(reference(piece).flatten(0, 1), target.flatten())
            (value / microbatches).backward()
            expected += value.item() / microbatches
        reference_optimizer.step()
        if abs(loss - expected) > 1e-5 * max(1.0, abs(expected)):
            failures.append(f"own layers step {step}: loss {loss} != {expected}")
    plain = dict(reference.named_parameters())
    shards = 0
    for path, parameter in model.named_parameters():
        close(f"own layers: {path}", parameter.detach(), smp.tp.local_part(parameter, plain[path].detach()))
        shards += hasattr(parameter, "_smp_shard")
    if shards != 6:  # the embedding, two column layers' weights and biases, the row weight (its bias is whole)
        failures.append(f"own layers: {shards} shards, expected 6")


def llama(**changes):
    import transformers as hf
    keys = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(hf.LlamaConfig(**dict(keys, **changes)))


def bytes_of_a_captured_llama(microbatches):
    """Megatron's count: per block and microbatch two all-reduces of [batch, sequence, hidden] forward (attention's
    and the MLP's output projections) and two backward (one per block input that column layers read: query, key and
    value share one, gate and up another), and the gathered head's input one backward; the logits gathered
    forward."""
    net = llama()
    batch = 4
    ids = torch.randint(1, VOCAB, (batch, SEQUENCE), generator=torch.Generator().manual_seed(2))
    model = smp.DistributedModel(net, {"input_ids": ids[:batch // microbatches], "labels": ids[:batch // microbatches]})
    before = smp.tp.collective_bytes()
    model.train_step({"input_ids": ids, "labels": ids})
    after = smp.tp.collective_bytes()
    activation = batch * SEQUENCE * 32 * 4  # float32 bytes of [b, s, h] over the step's microbatches
    expected = {"all_reduced": (4 * 2 + 1) * activation, "all_gathered": batch * SEQUENCE * VOCAB * 4}
    got = {kind: after[kind] - before[kind] for kind in after}
    if got != expected:
        failures.append(f"captured Llama: collectives moved {got} bytes, Megatron's count is {expected}")

    # A whole model's state_dict: each rank copies its part of every shard.
    other = llama(initializer_range=0.5).state_dict()
    model.load_state_dict(other)
    for path, parameter in model.named_parameters():
        close(f"load_state_dict: {path}", parameter.detach(), smp.tp.local_part(parameter, other[path]))


def bad_plans():
    expect_error("a style smp does not know", smp.ConfigError, "style 'diagonal'",
                 lambda: smp.DistributedModel(llama(), {"input_ids": torch.ones(1, 4, dtype=torch.long)},
                                              tp_plan={"model.layers.*.mlp.up_proj": "diagonal"}))
    expect_error("a pattern matching no module", smp.ConfigError, "'model.layers.*.mlp.upproj' matches no module",
                 lambda: smp.DistributedModel(llama(), {"input_ids": torch.ones(1, 4, dtype=torch.long)},
                                              tp_plan={"model.layers.*.mlp.upproj": "colwise"}))
    expect_error("a column style on a norm", smp.ConfigError, "'model.norm' is a LlamaRMSNorm",
                 lambda: smp.DistributedModel(llama(), {"input_ids": torch.ones(1, 4, dtype=torch.long)},
                                              tp_plan={"model.norm": "colwise"}))
    expect_error("heads that do not divide", smp.ConfigError, "3 heads do not divide by \"tensor_parallel_degree\" 2",
                 lambda: smp.DistributedModel(llama(hidden_size=24, num_attention_heads=3, num_key_value_heads=3),
                                              {"input_ids": torch.ones(1, 4, dtype=torch.long)}))
    expect_error("key/value heads that do not divide", smp.ConfigError, "1 key/value heads (num_key_value_heads) do",
                 lambda: smp.DistributedModel(llama(num_key_value_heads=1),
                                              {"input_ids": torch.ones(1, 4, dtype=torch.long)}))
    expect_error("a vocabulary that does not divide", smp.ConfigError, "pad_to_multiple_of=2",
                 lambda: smp.DistributedModel(llama(vocab_size=127), {"input_ids": torch.ones(1, 4, dtype=torch.long)}))

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).relu()

    expect_error("a model without a plan", smp.ConfigError, "Plain has no tensor-parallel plan",
                 lambda: smp.DistributedModel(Plain(), torch.zeros(2, 4)))
    expect_error("a sequence that does not split", smp.ConfigError,
                 "a sequence of 7 positions does not split over \"tensor_parallel_degree\" 2",
                 lambda: smp.tp.scatter_sequence(torch.zeros(1, 7, 4)))

    import transformers as hf
    gpt2 = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB,
                                               bos_token_id=0, eos_token_id=0))
    expect_error("a tied head sharded alone", smp.ConfigError, "'lm_head' shares its weight with 'transformer.wte'",
                 lambda: smp.DistributedModel(gpt2, {"input_ids": torch.ones(1, 4, dtype=torch.long)},
                                              tp_plan={"lm_head": "colwise_gather_output"}))

    def mixtral(intermediate):
        return hf.MixtralForCausalLM(hf.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=intermediate,
                                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                      num_local_experts=4, num_experts_per_tok=2))
    expect_error("experts whose features do not divide", smp.ConfigError,
                 "the experts' intermediate features 5 do not divide by \"tensor_parallel_degree\" 2",
                 lambda: smp.DistributedModel(mixtral(5), {"input_ids": torch.ones(1, 4, dtype=torch.long)}))
    expect_error("sequence parallelism over split experts", smp.ConfigError,
                 "\"sequence_parallel\" with the experts of 'model.layers.0.mlp.experts' split",
                 lambda: smp.tp.sequence_parallel_plan(mixtral(8), smp.tp.builtin_plan(mixtral(8))))


def main():
    torch.set_num_threads(1)
    runtime = smp.init({"tensor_parallel_degree": 2, "partitions": 1, "microbatches": 2, "seed": 3, "device": "cpu"})
    if runtime.tensor_parallel_degree != 2 or smp.tp.rank() != runtime.rank:
        failures.append(f"rank {runtime.rank}: tp rank {smp.tp.rank()} of {runtime.tensor_parallel_degree}")
    own_layers(2)
    bytes_of_a_captured_llama(2)
    bad_plans()
    sys.exit(report.finish(failures))


if __name__ == "__main__":
    main()
