"""The zero-bubble split on the captured path: an unmodified Hugging Face Llama (8 layers, random weights) on 2
pipeline stages, m 8, one step traced. Each stage's median F, and B (1F1B) or I and W (ZB-H1) per microbatch, from
the timeline rank 0 writes: run it once per schedule and compare a stage's I + W with its B. The last stage is the
one that splits (the first's input, token ids, needs no gradient: its W is the whole backward, its I nothing).
Rank 0 prints one JSON line. run_benchmarks.py alternates the schedules and sizes:

  smprun -n 2 -- python bench/bench_split.py --pipeline zero_bubble --d-model 256 --samples 8
"""

import argparse
import collections
import json
import os
import shutil
import statistics
import tempfile

import torch

import smp

LENGTH, MICROBATCHES, TRACED_STEP = 64, 8, 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", required=True, help="interleaved (1F1B) or zero_bubble (ZB-H1)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8, help=f"per microbatch, of {LENGTH} tokens each")
    args = parser.parse_args()
    import transformers as hf

    torch.set_num_threads(1)
    global_batch = args.samples * MICROBATCHES
    # One directory for the job, the same on every rank (the config must agree): the ranks' parent is the launcher
    # (smprun, which starts them itself). A failed job leaves it behind in the temporary directory.
    traces = os.path.join(tempfile.gettempdir(), f"smp-bench-split-{os.getppid()}")
    runtime = smp.init({"partitions": 2, "microbatches": MICROBATCHES, "pipeline": args.pipeline,
                        "global_batch_size": global_batch, "device": "cpu", "trace_dir": traces,
                        "trace_step": TRACED_STEP})
    torch.manual_seed(0)
    # Llama's MLP: 8/3 of the width, rounded up to 16.
    config = hf.LlamaConfig(vocab_size=1024, hidden_size=args.d_model,
                            intermediate_size=(args.d_model * 8 // 3 + 15) // 16 * 16, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=LENGTH)
    data = torch.Generator().manual_seed(1)

    def batch(samples):
        ids = torch.randint(0, config.vocab_size, (samples, LENGTH), generator=data)
        return {"input_ids": ids, "labels": ids}

    model = smp.DistributedModel(hf.LlamaForCausalLM(config), batch(args.samples))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    for _ in range(TRACED_STEP + 1):  # steps count from 0
        optimizer.zero_grad()
        model.train_step(batch(global_batch))
        optimizer.step()
    if runtime.rank != 0:
        return
    with open(os.path.join(traces, f"step{TRACED_STEP}_trace.json")) as trace:
        events = json.load(trace)["traceEvents"]
    shutil.rmtree(traces, ignore_errors=True)
    durations = collections.defaultdict(list)  # (stage, action kind) -> ms per microbatch
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "compute":
            durations[(event["args"]["stage"], event["name"].rstrip("0123456789"))].append(event["dur"] / 1e3)
    stages = collections.defaultdict(dict)
    for (stage, kind), ms in durations.items():
        stages[stage][kind] = round(statistics.median(ms), 3)
    print(json.dumps({"bench": "split_captured", "pipeline": args.pipeline, "d_model": args.d_model,
                      "tokens_per_microbatch": args.samples * LENGTH, "stages": stages}), flush=True)


if __name__ == "__main__":
    main()
