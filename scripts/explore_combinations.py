#!/usr/bin/env python3
"""Trains random combinations of the config's features against single-process training, beyond the fixed cases of
the test suite: pipeline schedules, virtual stages, replicas and placement, activation checkpointing, optimizer
state sharding, in-flight caps, bf16/fp16, clipping, gradient accumulation and the test models (the C++
training_worker, which compares every step's loss, gradient norm, parameters and evaluation with plain LibTorch).

  python3 scripts/explore_combinations.py [--seed S] [--runs N] [--build DIR]

Prints one line per run: CLEAN (matched), REFUSED (a clear refusal of an impossible partition) or FAIL, with the
config and flags to repeat it; exits 1 when any run failed. Seeded, so a failure can be run again. A development
tool (a few minutes for 40 runs on 2 cores), not part of ctest.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

MODELS = ["mlp", "residual", "branch", "tied", "nested", "gpt", "long_residual", "frozen"]
PIPELINES = ["simple", "interleaved", "zero_bubble", "zero_bubble_h2"]


def combination(rng):
    model = rng.choice(MODELS)
    pp = rng.choice([1, 2, 2, 3, 4])
    dp = rng.choice([1, 2, 2]) if pp <= 2 else 1
    microbatches = rng.randint(1, 8)
    pipeline = rng.choice(PIPELINES)
    config = {"partitions": pp, "microbatches": microbatches, "pipeline": pipeline, "ddp": dp > 1,
              "placement_strategy": rng.choice(["cluster", "spread"]),
              "global_batch_size": dp * microbatches * rng.choice([1, 2, 3]), "seed": rng.randint(1, 100),
              "comm_timeout_s": 60, "device": "cpu"}
    if pipeline == "interleaved" and rng.random() < 0.5:
        config["virtual_stages"] = rng.choice([2, 3])
    draw = rng.random()
    if draw < 0.2:
        config["activation_checkpointing"] = True
    elif draw < 0.35:
        config["activation_checkpointing"] = [0]
    if dp > 1 and rng.random() < 0.4:
        config["shard_optimizer_state"] = True
    if pipeline != "simple" and rng.random() < 0.2:
        config["active_microbatches"] = rng.randint(config.get("virtual_stages", 1), 4)
    precision = rng.random()
    if precision < 0.15:
        config["bf16"] = True
    elif precision < 0.28:
        config["fp16"] = True
    optimizer = rng.choice(["sgd", "adamw"])
    flags = ["--model", model, "--steps", "3"]
    if rng.random() < 0.3:
        flags += ["--clip", "0.5"]
    if rng.random() < 0.2 and model != "gpt":
        flags += ["--accumulate", "1"]
        config["global_batch_size"] = dp * microbatches * 2 * rng.choice([1, 2])
    if config.get("bf16") or config.get("fp16"):
        # Against float32 LibTorch; Adam would turn half-precision rounding into steps of the learning rate's size.
        flags += ["--optimizer", "sgd", "--rtol", "2e-2"]
    else:
        flags += ["--optimizer", optimizer] + (["--rtol", "1e-3"] if optimizer == "adamw" else [])
    return config, flags, pp * dp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    args = parser.parse_args()
    smprun = os.path.join(args.build, "bin", "smprun")
    worker = os.path.join(args.build, "bin", "training_worker")
    for tool in (smprun, worker):
        if not os.access(tool, os.X_OK):
            raise SystemExit(f"{tool} not found: build first (scripts/test.sh, or cmake --build {args.build})")
    rng = random.Random(args.seed)
    failed = 0
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="smp_explore_") as directory:
        for run in range(args.runs):
            config, flags, processes = combination(rng)
            path = os.path.join(directory, f"run{run}.json")
            with open(path, "w") as file:
                json.dump(config, file)
            started = time.time()
            result = subprocess.run([smprun, "-n", str(processes), "--timeout", "200", "--", worker, "--config", path]
                                    + flags, capture_output=True, text=True, env=environment)
            output = result.stdout + result.stderr
            clean = len(re.findall(r"rank \d+ stage \d+: \d+ parameters checked, 0 mismatches", output))
            if result.returncode == 0 and clean == processes:
                verdict = "CLEAN"
            elif "cannot split" in output:
                verdict = "REFUSED"
            else:
                verdict = "FAIL"
                failed += 1
            print(f"{verdict:7} {time.time() - started:5.1f}s {json.dumps(config)} {' '.join(flags)}", flush=True)
            if verdict == "FAIL":
                for line in [line for line in output.splitlines() if "error" in line or "differ" in line][:6]:
                    print("   ", line[:300], flush=True)
    print(f"{args.runs} runs, {failed} failed (seed {args.seed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
