"""Capture and partition time of an unmodified Hugging Face Llama (32 layers, small width, random weights) on 4
pipeline stages: run under smprun -n 4, each rank builds the model and smp.DistributedModel captures it with
torch.export, groups it into nodes, and rank 0 profiles and partitions. Prints one JSON line (rank 0): the seconds
of each phase (capture alone, timed again on rank 0 after the job's construction; the whole construction as a user
sees it), node count and the partition's slowest/mean estimate.

  smprun -n 4 -- python bench/bench_capture.py [--layers 32] [--hidden 256]
"""

import argparse
import copy
import json
import re
import time

import torch

import smp
from smp import _export_capture
from smp._graph import GraphModel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sequence", type=int, default=64)
    args = parser.parse_args()
    import transformers as hf

    torch.set_num_threads(1)
    runtime = smp.init({"partitions": 4, "microbatches": 4, "global_batch_size": 8, "device": "cpu"})
    config = hf.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                            max_position_embeddings=args.sequence, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    started = time.perf_counter()
    net = hf.LlamaForCausalLM(config)
    built_s = time.perf_counter() - started
    ids = torch.randint(0, config.vocab_size, (2, args.sequence))
    sample = {"input_ids": ids, "labels": ids}

    # Captured again below on its own: the job's model keeps this rank's tensors alone once built.
    alone = copy.deepcopy(net) if runtime.rank == 0 else None
    started = time.perf_counter()
    model = smp.DistributedModel(net, sample)
    construction_s = time.perf_counter() - started
    if runtime.rank != 0:
        return
    started = time.perf_counter()
    graph, _, _, _ = _export_capture.capture(alone, (), dict(sample, use_cache=False), 4, [], GraphModel)
    capture_s = time.perf_counter() - started
    report = model.partition_report()
    imbalance = float(re.search(r"slowest/mean = ([\d.]+)", report)[1])
    print(json.dumps({"layers": args.layers, "hidden": args.hidden,
                      "parameters": sum(p.numel() for p in net.parameters()),
                      "model_build_s": round(built_s, 3), "capture_s": round(capture_s, 3),
                      "distributed_model_s": round(construction_s, 3),
                      "rank0_capture_in_job_s": round(model._seconds["capture"], 3),
                      "rank0_profile_partition_build_s": round(model._seconds["engine"], 3),
                      "nodes": len(graph.node_names()),
                      "imbalance": imbalance}))


if __name__ == "__main__":
    main()
