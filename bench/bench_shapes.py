"""What changing sequence lengths cost a captured model: an unmodified Hugging Face Llama (8 layers, d 256, random
weights) on 2 pipeline stages, captured twice in the same job, once with dynamic shapes (smp's default) and once on
the sample's shapes alone (dynamic_shapes="none"). Steps alternate between the two
models so that the machine's drift hits both alike. Prints one JSON line (rank 0):

- capture_s: DistributedModel's capture of each (export and nodes);
- fixed_ms / dynamic_ms: median step at the sample's length (64) of each model;
- first_step_ms: the dynamic model's first step at each new length, beside steady_ms, its median at that length
  once seen (nothing is captured again: the difference is the allocator's and autograd's first use of a shape).

  smprun -n 2 -- python bench/bench_shapes.py [--rounds 7]
"""

import argparse
import json
import statistics
import time

import torch

import smp

SAMPLE_LENGTH = 64
NEW_LENGTHS = (40, 96, 128)


def build(config, sample, dynamic):
    import transformers as hf
    torch.manual_seed(0)
    net = hf.LlamaForCausalLM(config)
    model = smp.DistributedModel(net, sample, dynamic_shapes=None if dynamic else "none")
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    return model, optimizer


def step(model, optimizer, batch):
    optimizer.zero_grad()
    started = time.perf_counter()
    model.train_step(batch)
    optimizer.step()
    return (time.perf_counter() - started) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import transformers as hf

    torch.set_num_threads(1)
    runtime = smp.init({"partitions": 2, "microbatches": 4, "global_batch_size": 8, "device": "cpu"})
    config = hf.LlamaConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=2048, max_position_embeddings=256, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0)
    data = torch.Generator().manual_seed(1)

    def batch(length):
        ids = torch.randint(0, config.vocab_size, (8, length), generator=data)
        return {"input_ids": ids, "labels": ids}

    sample = {"input_ids": batch(SAMPLE_LENGTH)["input_ids"][:2], "labels": batch(SAMPLE_LENGTH)["labels"][:2]}
    fixed, fixed_optimizer = build(config, sample, dynamic=False)
    dynamic, dynamic_optimizer = build(config, sample, dynamic=True)

    for _ in range(2):  # warm-up at the sample's length
        step(fixed, fixed_optimizer, batch(SAMPLE_LENGTH))
        step(dynamic, dynamic_optimizer, batch(SAMPLE_LENGTH))
    first = {length: step(dynamic, dynamic_optimizer, batch(length)) for length in NEW_LENGTHS}
    fixed_ms, dynamic_ms, steady = [], [], {length: [] for length in NEW_LENGTHS}
    for _ in range(args.rounds):
        fixed_ms.append(step(fixed, fixed_optimizer, batch(SAMPLE_LENGTH)))
        dynamic_ms.append(step(dynamic, dynamic_optimizer, batch(SAMPLE_LENGTH)))
        for length in NEW_LENGTHS:
            steady[length].append(step(dynamic, dynamic_optimizer, batch(length)))
    if runtime.rank != 0:
        return
    print(json.dumps({
        "capture_s": {"fixed": round(fixed._seconds["capture"], 3), "dynamic": round(dynamic._seconds["capture"], 3)},
        "fixed_ms": round(statistics.median(fixed_ms), 2), "dynamic_ms": round(statistics.median(dynamic_ms), 2),
        "dynamic_over_fixed": round(statistics.median(dynamic_ms) / statistics.median(fixed_ms), 3),
        "first_step_ms": {length: round(ms, 2) for length, ms in first.items()},
        "steady_ms": {length: round(statistics.median(ms), 2) for length, ms in steady.items()},
        "rounds": args.rounds}))


if __name__ == "__main__":
    main()
