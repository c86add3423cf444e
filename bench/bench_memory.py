"""Memory of a model built on the meta device: each rank makes real only its own stages. Run under smprun with one
process per pipeline stage; each rank prints one JSON line with its peak resident memory growth (from just after
smp.init to after the last step) against the bytes of the parameters it holds.

  smprun -n 4 -- python bench/bench_memory.py --layers 16 --width 1024      # a 0.8 GB (float32) GPT-2 on 4 stages
  smprun -n 4 -- python bench/bench_memory.py --layers 40 --width 2048      # 2 B parameters: 8 GB a copy

The model is an unmodified Hugging Face GPT-2 (random weights from smp's per-module seeding, nothing downloaded);
SGD without momentum, a small batch (activations stay small next to the weights).
"""

import argparse
import json
import resource
import time

import torch

import smp


def resident_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_resident_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    # The library and its GPT-2 code are imported before the baseline: what a process pays once, whatever the model.
    import transformers as hf
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401

    torch.set_num_threads(1)
    runtime = smp.init({"partitions": smp_partitions(), "microbatches": 4, "global_batch_size": 4, "seed": 1,
                        "device": "cpu"})
    torch.manual_seed(0)  # GPT-2's dropout draws from it
    baseline = resident_bytes()
    config = hf.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=args.vocab,
                           n_positions=args.sequence, bos_token_id=0, eos_token_id=0)
    started = time.perf_counter()
    with torch.device("meta"):
        net = hf.GPT2LMHeadModel(config)
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    ids = torch.randint(0, args.vocab, (4, args.sequence), generator=torch.Generator().manual_seed(0))
    model = smp.DistributedModel(net, {"input_ids": ids[:1], "labels": ids[:1]}, init_fn=net._init_weights)
    built_s = time.perf_counter() - started
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    own_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = []
    for _ in range(args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = model.train_step({"input_ids": ids, "labels": ids}).loss
        optimizer.step()
        steps.append(time.perf_counter() - started)
    growth = peak_resident_bytes() - baseline
    print(json.dumps({"rank": runtime.rank, "model_gib": round(model_bytes / 2**30, 3),
                      "own_parameters_mib": round(own_bytes / 2**20, 1),
                      "peak_growth_mib": round(growth / 2**20, 1),
                      "growth_over_own": round(growth / max(own_bytes, 1), 2),
                      "limit_mib": round((2.5 * own_bytes + 150 * 2**20) / 2**20, 1),
                      "build_s": round(built_s, 2), "step_s": [round(s, 2) for s in steps], "loss": loss}),
          flush=True)


def smp_partitions():
    import os
    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    main()
