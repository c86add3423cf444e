"""Expert parallelism against replicated experts: an unmodified Hugging Face Mixtral-shaped model (8 experts, top-2,
4 layers, d 256, random weights) trained by 4 data-parallel processes, its experts divided over blocks of
--ep replicas (1: every rank holds every expert). One job per layout (the config is the process's); run_benchmarks
alternates them. Each rank prints one JSON line:

- step_ms: median train_step + optimizer step;
- expert_mib / dense_mib: parameters this rank holds, the experts' and the rest;
- peak_growth_mib: peak resident memory over the start (before the model was built);
- all_to_all_mib_per_step: what this rank's all-to-alls sent to other ranks per step, beside theory_mib_per_step:
  tokens x top-k x hidden x 4 bytes x (ep - 1) / ep, twice each way (dispatch and combine, forward and backward),
  per experts layer of this rank, for tokens routed evenly;
- forwards_overlapped: in the last step (--overlap).

With --dualpipe, 2 stages (DualPipeV) x 2 replicas with ep 2, global batch 32 in 8 microbatches per replica, its
pairs overlapped with --overlap ("overlap_forward_backward": each pair's forward, and its all-to-alls, on a second
thread beside the other stage's backward) or run one after the other.

  smprun -n 4 -- python bench/bench_experts.py --ep 2 [--steps 8] [--dualpipe [--overlap]]
"""

import argparse
import json
import resource
import statistics
import time

import torch

import smp

LAYERS, HIDDEN, EXPERTS, TOP_K, LENGTH, GLOBAL_BATCH = 4, 256, 8, 2, 64, 16


def resident_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dualpipe", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    import transformers as hf

    torch.set_num_threads(1)
    global_batch = 2 * GLOBAL_BATCH if args.dualpipe else GLOBAL_BATCH
    layout = ({"partitions": 2, "microbatches": 8, "pipeline": "dualpipe_v", "overlap_forward_backward": args.overlap}
              if args.dualpipe else {"partitions": 1, "microbatches": 2})
    runtime = smp.init({**layout, "ddp": True, "expert_parallel_degree": args.ep, "global_batch_size": global_batch,
                        "device": "cpu"})
    config = hf.MixtralConfig(vocab_size=1024, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                              num_attention_heads=8, num_key_value_heads=4, num_local_experts=EXPERTS,
                              num_experts_per_tok=TOP_K, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                              pad_token_id=0)
    data = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(0, config.vocab_size, (global_batch, LENGTH), generator=data)
        return {"input_ids": ids, "labels": ids}

    start_mib = resident_mib()
    torch.manual_seed(0)
    sample = batch()
    model = smp.DistributedModel(hf.MixtralForCausalLM(config), {key: value[:2] for key, value in sample.items()})
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    expert_bytes = sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)
    dense_bytes = sum(p.nbytes for name, p in model.named_parameters() if ".experts." not in name)

    times = []
    sent_before = None
    for step in range(args.steps + 2):
        if step == 2:
            sent_before = smp.ep.bytes_sent()
        optimizer.zero_grad()
        started = time.perf_counter()
        result = model.train_step(batch())
        optimizer.step()
        if step >= 2:
            times.append((time.perf_counter() - started) * 1e3)
    sent = (smp.ep.bytes_sent() - sent_before) / args.steps
    tokens = global_batch // runtime.data_parallel_degree * LENGTH
    layers_here = len({name.split(".experts.")[0] for name, _ in model.named_parameters() if ".experts." in name})
    theory = 4 * layers_here * tokens * TOP_K * HIDDEN * 4 * (args.ep - 1) / args.ep
    print(json.dumps({
        "rank": runtime.rank, "ep": args.ep, "overlap": args.overlap, "step_ms": round(statistics.median(times), 1),
        "forwards_overlapped": result.forwards_overlapped,
        "expert_mib": round(expert_bytes / 2**20, 2), "dense_mib": round(dense_bytes / 2**20, 2),
        "peak_growth_mib": round(resident_mib() - start_mib, 1),
        "all_to_all_mib_per_step": round(sent / 2**20, 3), "theory_mib_per_step": round(theory / 2**20, 3)}),
        flush=True)


if __name__ == "__main__":
    main()
