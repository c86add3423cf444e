#!/usr/bin/env python3
"""Runs the benchmarks of bench/ and prints what they measured. Called by scripts/bench.sh after the build.

Every number printed is measured in this run; nothing is copied from elsewhere.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

BIN = sys.argv[1]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = int(os.environ.get("SMP_BENCH_STEPS", "10"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
MODEL = {"vocab_size": 256, "context": 64, "d_model": 128, "heads": 4, "layers": 8}


def run(command, timeout=600):
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"benchmark command failed: {' '.join(command)}\n{result.stdout}\n{result.stderr}")
    return result


def bench_pipeline(smp_keys, processes, trace_dir=None, model=MODEL, global_batch=32, optimizer="sgd"):
    keys = dict(smp_keys, seed=1, global_batch_size=global_batch)
    if trace_dir:
        keys.update(trace_dir=trace_dir, trace_step=STEPS - 1)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config:
        json.dump({"smp": keys, "model": model}, config)
    result = run([f"{BIN}/smprun", "-n", str(processes), "--no-prefix", "--", f"{BIN}/bench_pipeline",
                  "--config", config.name, "--steps", str(STEPS), "--optimizer", optimizer])
    os.unlink(config.name)
    line = next(l for l in result.stdout.splitlines() if l.startswith("{"))
    measured = json.loads(line)
    timeline = re.search(r"timeline of step \d+: bubble ([\d.]+) measured \(makespan ([\d.]+) ms\), ([\d.]+) simulated "
                         r"\(makespan ([\d.]+) ms\); receive waits ([\d.]+) ms over replica 0; transfer latency ([\d.]+) ms", result.stderr)
    if timeline:
        measured.update(bubble_measured=float(timeline[1]), makespan_measured_ms=float(timeline[2]),
                        bubble_simulated=float(timeline[3]), makespan_simulated_ms=float(timeline[4]),
                        receive_wait_ms=float(timeline[5]), latency_ms=float(timeline[6]))
    return measured


def section(title):
    print(f"\n== {title}")


section("pipeline efficiency: 2 stages (1 process, 1 thread each), m = 8, vs one process")
single = bench_pipeline({"partitions": 1, "microbatches": 1}, 1)
piped = bench_pipeline({"partitions": 2, "microbatches": 8, "pipeline": "interleaved"}, 2)
p, m = 2, 8
ratio = piped["samples_per_s"] / single["samples_per_s"]
ideal = m / (m + p - 1) * p
print(f"one process      {single['samples_per_s']:8.1f} samples/s (median step {single['median_step_s'] * 1e3:.1f} ms)")
print(f"2-stage pipeline {piped['samples_per_s']:8.1f} samples/s (median step {piped['median_step_s'] * 1e3:.1f} ms)")
print(f"throughput ratio {ratio:.3f}, ideal m/(m+p-1)*p = {ideal:.3f}, efficiency {ratio / ideal:.1%}")

section("schedules on CPU: 2 ranks, m = 8; a traced step vs the simulator fed with that step's action times and "
        "transfer latency")
print(f"{'schedule':<22}{'step ms':>9}{'traced ms':>11}{'sim ms':>9}{'traced/sim':>12}{'bubble':>8}{'sim':>7}{'formula':>9}{'recv wait ms':>14}{'latency ms':>12}"
      f"{'rank 0 sends held':>19}")
schedule_cases = [("gpipe", {"pipeline": "simple"}), ("1f1b", {"pipeline": "interleaved"}),
                  ("interleaved_1f1b v=2", {"pipeline": "interleaved", "virtual_stages": 2}),
                  ("zb_h1", {"pipeline": "zero_bubble"}), ("zb_h2", {"pipeline": "zero_bubble_h2"}),
                  ("zb_v", {"pipeline": "zb_v"}), ("dualpipe_v", {"pipeline": "dualpipe_v"})]
with tempfile.TemporaryDirectory() as traces:
    for name, keys in schedule_cases:
        r = bench_pipeline(dict({"partitions": 2, "microbatches": 8}, **keys), 2, trace_dir=traces)
        v = keys.get("virtual_stages", 2 if name in ("zb_v", "dualpipe_v") else 1)
        formula = (p - 1) / (v * m + p - 1) if name in ("gpipe", "1f1b", "interleaved_1f1b v=2") else float("nan")
        print(f"{name:<22}{r['median_step_s'] * 1e3:9.1f}{r['makespan_measured_ms']:11.1f}{r['makespan_simulated_ms']:9.1f}"
              f"{r['makespan_measured_ms'] / r['makespan_simulated_ms']:12.3f}{r['bubble_measured']:8.3f}"
              f"{r['bubble_simulated']:7.3f}{formula:9.3f}{r['receive_wait_ms']:14.1f}{r['latency_ms']:12.2f}"
              f"{r['rank0_peak_sends_held']:>11d} of {r['rank0_sends_posted']:<4d}")
print("(rank 0 sends held: the most sent tensors it kept at once; before sends were released on proven delivery, it "
      "kept every one posted until the step's end)")

section("activation checkpointing: peak resident memory of the largest process (GPipe, 2 stages, m = 8, "
        "256-token context, global batch 64)")
long_context = dict(MODEL, context=256)
plain = bench_pipeline({"partitions": 2, "microbatches": 8, "pipeline": "simple"}, 2, model=long_context, global_batch=64)
recomputed = bench_pipeline({"partitions": 2, "microbatches": 8, "pipeline": "simple", "activation_checkpointing": True},
                            2, model=long_context, global_batch=64)
blocks = [f"block{i}" for i in range(0, long_context["layers"], 2)]
every_other = bench_pipeline({"partitions": 2, "microbatches": 8, "pipeline": "simple",
                              "activation_checkpointing": blocks}, 2, model=long_context, global_batch=64)
print(f"{'without:':<40}{plain['peak_rss_mib']:.1f} MiB, step {plain['median_step_s'] * 1e3:.1f} ms")
for label, r in [("whole stages", recomputed), (f"modules {'/'.join(blocks)}", every_other)]:
    print(f"{label + ':':<40}{r['peak_rss_mib']:.1f} MiB, step {r['median_step_s'] * 1e3:.1f} ms "
          f"(saves {plain['peak_rss_mib'] - r['peak_rss_mib']:.1f} MiB, costs "
          f"{r['median_step_s'] / plain['median_step_s'] - 1:.1%} time)")

section("optimizer state sharding (ZeRO-1): GPT d_model 512, 8 blocks, AdamW; 2 stages x 2 replicas, m = 2; the "
        "largest rank")
big = dict(MODEL, d_model=512, heads=8)
whole = bench_pipeline({"partitions": 2, "ddp": True, "microbatches": 2}, 4, model=big, global_batch=8,
                       optimizer="adamw")
sharded = bench_pipeline({"partitions": 2, "ddp": True, "microbatches": 2, "shard_optimizer_state": True}, 4,
                         model=big, global_batch=8, optimizer="adamw")
for label, r in [("whole state on each replica:", whole), ("shard_optimizer_state:", sharded)]:
    print(f"{label:<30}optimizer state {r['optimizer_state_mib']:7.1f} MiB, peak RSS {r['peak_rss_mib']:7.1f} MiB, "
          f"train_step {r['median_step_s'] * 1e3:.1f} ms, with the optimizer step {r['median_iteration_s'] * 1e3:.1f} ms")
print(f"state {sharded['optimizer_state_mib'] / whole['optimizer_state_mib']:.3f} of unsharded (ideal 1/2), peak RSS "
      f"{whole['peak_rss_mib'] - sharded['peak_rss_mib']:.1f} MiB lower, iteration time "
      f"{sharded['median_iteration_s'] / whole['median_iteration_s'] - 1:+.1%} (each replica updates half the "
      f"parameters, then one broadcast of them)")

section("tensor parallelism: the GPT (d_model 128, 8 blocks), global batch 32, m = 8; 2 processes as tp 2, as 2 "
        "pipeline stages, as 2 replicas; 3 alternating rounds, medians")
layouts = [("tp 2", {"partitions": 1, "tensor_parallel_degree": 2}),
           ("tp 2 + sequence parallel", {"partitions": 1, "tensor_parallel_degree": 2, "sequence_parallel": True}),
           ("pp 2", {"partitions": 2}), ("dp 2", {"partitions": 1, "ddp": True})]
rounds = {label: [] for label, _ in layouts}
for _ in range(3):
    for label, keys in layouts:
        rounds[label].append(bench_pipeline(dict(keys, microbatches=8 if label != "dp 2" else 4), 2))
for label, _ in layouts:
    steps = sorted(r["median_iteration_s"] for r in rounds[label])
    print(f"{label:<25}iteration {steps[1] * 1e3:7.1f} ms (runs {', '.join(f'{t * 1e3:.1f}' for t in steps)})")
tp_run = rounds["tp 2"][0]
b, s_len, h, L, m_tp = 32 // 8, MODEL["context"], MODEL["d_model"], MODEL["layers"], 8
# Megatron without sequence parallelism: two all-reduces of [b, s, h] forward (attention and MLP outputs) and two
# backward (their inputs) per block; the embedding's forward and the output layer's backward one each; the
# vocabulary-parallel cross entropy two of [b, s] (the exponent sums, the target logits) and an all-gather of the
# row maxima.
theory_reduced = m_tp * 4 * (4 * L * b * s_len * h + 2 * b * s_len * h + 2 * b * s_len)
theory_gathered = m_tp * 4 * 2 * b * s_len
print(f"tp 2 bytes per step on rank 0: all-reduced {tp_run['tp_all_reduced_bytes_per_step'] / 2**20:.2f} MiB (theory "
      f"{theory_reduced / 2**20:.2f} MiB, ratio {tp_run['tp_all_reduced_bytes_per_step'] / theory_reduced:.3f}), "
      f"all-gathered {tp_run['tp_all_gathered_bytes_per_step'] / 1024:.1f} KiB (theory {theory_gathered / 1024:.1f} KiB); "
      f"per block per microbatch {4 * b * s_len * h * 4 / 2**10:.0f} KiB = 4 all-reduces of [b, s, h]")
sp_run = rounds["tp 2 + sequence parallel"][0]
# With sequence parallelism each block's all-reduces become an all-gather (before the column layers) and a
# reduce-scatter (after the row layers), forward and backward alike: per block 4 of each; the embedding's
# all-reduce stays, its scatter gathers backward; the head gathers forward and reduce-scatters backward; the loss
# as before. (The norms' gradients, summed once per step, go by the group's own all-reduce, not counted here.)
sp_theory = {"all_reduced": m_tp * 4 * (b * s_len * h + 2 * b * s_len),
             "all_gathered": m_tp * 4 * ((4 * L + 2) * b * s_len * h + 2 * b * s_len),
             "reduce_scattered": m_tp * 4 * (4 * L + 1) * b * s_len * h}
print("tp 2 + sequence parallel, bytes per step on rank 0 (whole tensors): " + ", ".join(
    f"{kind.replace('_', '-')} {sp_run[f'tp_{kind}_bytes_per_step'] / 2**20:.2f} MiB (theory "
    f"{sp_theory[kind] / 2**20:.2f}, ratio {sp_run[f'tp_{kind}_bytes_per_step'] / sp_theory[kind]:.3f})"
    for kind in sp_theory))

section("simulator: equal costs T_F = T_I = T_W = 1 (T_B = 2), zero latency")
def simulate(*args):
    out = run([f"{BIN}/smp_schedule", *args]).stdout
    return float(re.search(r"makespan ([\d.e+-]+), bubble fraction ([\d.]+)", out)[1]), \
        float(re.search(r"bubble fraction ([\d.]+)", out)[1])
for p_, m_ in [(4, 8), (8, 32), (16, 64)]:
    base = ["--ranks", str(p_), "--microbatches", str(m_)]
    one_f_one_b, one_bubble = simulate("--schedule", "1f1b", *base)
    zb1, zb1_bubble = simulate("--schedule", "zb_h1", *base)
    zb2, zb2_bubble = simulate("--schedule", "zb_h2", *base)
    work = 3 * m_
    print(f"p={p_:<3} m={m_:<4} 1F1B bubble time {one_f_one_b - work:6.1f} (fraction {one_bubble:.3f}, formula "
          f"{(p_ - 1) / (m_ + p_ - 1):.3f}); ZB-H1 {zb1 - work:6.1f} = {(zb1 - work) / (one_f_one_b - work):.3f} of 1F1B's "
          f"(paper: 1/3); ZB-H2 {zb2 - work:6.1f}")
start = time.perf_counter()
_, bubble = simulate("--schedule", "interleaved_1f1b", "--ranks", "128", "--microbatches", "1024", "--virtual-stages", "4")
elapsed = time.perf_counter() - start
print(f"interleaved p=128 m=1024 v=4: bubble {bubble:.5f} (formula {127 / (4 * 1024 + 127):.5f}); generate + lower + "
      f"validate + simulate in {elapsed:.2f} s (whole process)")

section("checkpoints: GPT d_model 512, 8 blocks, AdamW; 2 stages x 2 replicas; save (files + manifest) and resume")
with tempfile.TemporaryDirectory() as checkpoints:
    big = dict(MODEL, d_model=512, heads=8)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config:
        json.dump({"smp": {"partitions": 2, "ddp": True, "microbatches": 2, "global_batch_size": 8, "seed": 1,
                           "checkpoint_dir": checkpoints}, "model": big}, config)
    result = run([f"{BIN}/smprun", "-n", "4", "--no-prefix", "--", f"{BIN}/bench_checkpoint", "--config", config.name])
    os.unlink(config.name)
    r = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("{")))
    print(f"{r['bytes'] / 1e6:.1f} MB written in {r['save_s']:.3f} s ({r['save_mb_per_s']:.0f} MB/s, fsync included); "
          f"loaded in {r['load_s']:.3f} s ({r['load_mb_per_s']:.0f} MB/s, checksums verified); "
          f"a save pauses the step by {r['step_pause_s']:.3f} s (the copy of the state; the rest is written in the "
          f"background)")

section("the engine against plain LibTorch on the CPU: overhead per action (8 one-layer stages, 8 microbatches) and a GPT stage")
result = run([f"{BIN}/bench_engine"])
lines = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
r = next(l for l in lines if l["bench"] == "engine_overhead")
print(f"{r['overhead_us_per_action']:.1f} us per schedule action ({r['actions_per_step']} actions a step; "
      f"smp {r['smp_step_ms']:.3f} ms, plain {r['plain_step_ms']:.3f} ms a step, medians of alternating steps)")
r = next(l for l in lines if l["bench"] == "gpt_stage")
print(f"a GPT stage ({r['parameters'] / 1e6:.1f}M parameters, {r['tokens']:.0f} tokens, one stage, one microbatch): "
      f"smp {r['smp_step_ms']:.1f} ms, plain {r['plain_step_ms']:.1f} ms a step, ratio {r['ratio']:.3f}")
for r in (l for l in lines if l["bench"] == "split_backward"):
    print(f"zero-bubble split, a middle stage of {r['layers']} blocks (d {r['d_model']}, {r['batch']} x {r['context']} "
          f"tokens, 1 thread): B {r['b_ms']:.2f} ms, I {r['i_ms']:.2f} + W {r['w_ms']:.2f} ms = "
          f"{r['i_plus_w_over_b']:.3f} B (plain autograd's I alone {r['plain_i_ms']:.2f} ms)")

section("zero-bubble schedules where the bubble is large: 4 stages, m = 4 (4 processes on this host), GPT d 256, "
        "context 128, 8 blocks; 1F1B against ZB-H1 and ZB-V; 3 alternating rounds, medians")
bubble_model = dict(MODEL, d_model=256, context=128)
zero_bubble_cases = [("1f1b", {"pipeline": "interleaved"}), ("zb_h1", {"pipeline": "zero_bubble"}),
                     ("zb_v", {"pipeline": "zb_v", "virtual_stages": 2})]
zero_bubble_rounds = {name: [] for name, _ in zero_bubble_cases}
for _ in range(3):
    for name, keys in zero_bubble_cases:
        zero_bubble_rounds[name].append(
            bench_pipeline(dict({"partitions": 4, "microbatches": 4}, **keys), 4, model=bubble_model,
                           global_batch=16)["median_step_s"])
one_f_one_b_step = sorted(zero_bubble_rounds["1f1b"])[1]
for name, _ in zero_bubble_cases:
    step = sorted(zero_bubble_rounds[name])[1]
    print(f"{name:<6} {step * 1e3:8.1f} ms a step ({one_f_one_b_step / step:.3f} of 1F1B's speed; rounds "
          f"{', '.join(f'{t * 1e3:.1f}' for t in zero_bubble_rounds[name])})")

section("devices that differ: 2 stages (GPT d 128, 8 blocks, 1F1B, m 8), rank 1 emulating a device 2x slower "
        "(emulated_slowdown); the even partition against device_speeds \"measure\"; 3 alternating rounds, medians")
slow = {"partitions": 2, "microbatches": 8, "pipeline": "interleaved", "emulated_slowdown": [1, 2]}
rounds = {"even": [], "measured": []}
for _ in range(3):
    rounds["even"].append(bench_pipeline(slow, 2)["median_step_s"])
    rounds["measured"].append(bench_pipeline(dict(slow, device_speeds="measure"), 2)["median_step_s"])
even, measured = sorted(rounds["even"])[1], sorted(rounds["measured"])[1]
print(f"even split {even * 1e3:.1f} ms, in proportion to the measured speeds {measured * 1e3:.1f} ms a step: "
      f"{even / measured:.2f}x faster (ideal for a 1 : 0.5 pair, the model divisible at will: 1.5x)")

section("partitioner: ours vs the optimum (exact DP on chains, exhaustive on small DAGs) and the baselines")
result = run([f"{BIN}/bench_partition"], timeout=900)
lines = result.stdout.strip().splitlines()
print("\n".join(lines[-12:]))

PYTHON = os.path.join(os.path.expanduser(os.environ.get("SMP_VENV", "~/.cache/smp/venv")), "bin", "python")
CAPTURE_ENV = dict(ENV, PYTHONPATH=os.path.join(os.path.dirname(BIN), "python"))


def python_job(processes, script, *args):
    """The JSON lines a Python benchmark's ranks print, run under smprun with the package of this build."""
    result = subprocess.run([f"{BIN}/smprun", "-n", str(processes), "--no-prefix", "--", PYTHON,
                             f"{REPO}/bench/{script}", *args], capture_output=True, text=True, env=CAPTURE_ENV,
                            timeout=600)
    if result.returncode != 0:
        sys.exit(f"{script} failed:\n{result.stdout}\n{result.stderr}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


section("capturing an unmodified Hugging Face Llama (32 layers, d 256, 34M parameters) with torch.export, 4 stages")
r = python_job(4, "bench_capture.py")[0]
print(f"capture alone (export + nodes, one process): {r['capture_s']:.2f} s, {r['nodes']} nodes; "
      f"DistributedModel on 4 ranks sharing this machine's cores: {r['distributed_model_s']:.2f} s (rank 0: capture "
      f"{r['rank0_capture_in_job_s']:.2f} s while the others capture too, then profile, partition and stages "
      f"{r['rank0_profile_partition_build_s']:.2f} s); estimated slowest/mean stage {r['imbalance']:.3f}")

section("changing sequence lengths: a captured Hugging Face Llama (8 layers, d 256), 2 stages, m 4, captured with "
        "dynamic shapes and on the sample's alone, steps alternating")
r = python_job(2, "bench_shapes.py")[0]
print(f"capture: {r['capture_s']['dynamic']:.2f} s with dynamic shapes, {r['capture_s']['fixed']:.2f} s on the "
      f"sample's; step at the sample's length (64): {r['dynamic_ms']:.1f} ms against {r['fixed_ms']:.1f} ms "
      f"({r['dynamic_over_fixed']:.3f}x, medians of {r['rounds']})")
for length in r["first_step_ms"]:
    print(f"  length {length}: first step {r['first_step_ms'][length]:.1f} ms, steady {r['steady_ms'][length]:.1f} ms")

section("the zero-bubble split on the captured path: a Hugging Face Llama (8 layers) on 2 stages, m 8, 1F1B against "
        "ZB-H1 in alternating jobs; the last stage's I + W against its B (medians of a traced step's microbatches)")
for d_model, samples in ((256, 2), (256, 8), (512, 4)):
    runs = {"interleaved": [], "zero_bubble": []}
    for _ in range(2):
        for pipeline in runs:
            runs[pipeline].append(python_job(2, "bench_split.py", "--pipeline", pipeline, "--d-model", str(d_model),
                                             "--samples", str(samples))[0]["stages"]["1"])
    b = statistics.median(stage["B"] for stage in runs["interleaved"])
    i = statistics.median(stage["I"] for stage in runs["zero_bubble"])
    w = statistics.median(stage["W"] for stage in runs["zero_bubble"])
    per_job_b = ", ".join(f"{stage['B']:.1f}" for stage in runs["interleaved"])
    per_job_iw = ", ".join(f"{stage['I'] + stage['W']:.1f}" for stage in runs["zero_bubble"])
    print(f"d {d_model}, {samples * 64} tokens a microbatch: B {b:.2f} ms, I {i:.2f} + W {w:.2f} ms = "
          f"{(i + w) / b:.3f} B (per job: B {per_job_b}; I + W {per_job_iw})")

section("expert parallelism: a Mixtral-shaped Hugging Face model (8 experts, top-2, 4 layers, d 256) on 4 "
        "data-parallel processes, its experts divided over 2 replicas (ep 2) against replicated (ep 1); jobs alternating")
rounds = {1: [], 2: []}
for _ in range(2):
    for ep in (2, 1):
        rounds[ep].append(sorted(python_job(4, "bench_experts.py", "--ep", str(ep)), key=lambda r: r["rank"]))
for ep in (2, 1):
    steps = sorted(r["step_ms"] for ranks in rounds[ep] for r in ranks)
    last = rounds[ep][-1]
    print(f"ep {ep}: step {steps[len(steps) // 2]:.0f} ms (median over ranks and {len(rounds[ep])} jobs); per rank "
          f"experts {last[0]['expert_mib']:.1f} MiB + the rest {last[0]['dense_mib']:.1f} MiB, peak resident growth "
          + ", ".join(f"{r['peak_growth_mib']:.0f}" for r in last) + " MiB; all-to-all sent per step "
          + ", ".join(f"{r['all_to_all_mib_per_step']:.2f}" for r in last)
          + f" MiB against {last[0]['theory_mib_per_step']:.2f} MiB for tokens routed evenly")
ep2 = sorted(r["step_ms"] for ranks in rounds[2] for r in ranks)
ep1 = sorted(r["step_ms"] for ranks in rounds[1] for r in ranks)
print(f"ep 2 step / ep 1 step: {ep2[len(ep2) // 2] / ep1[len(ep1) // 2]:.3f}")

section("DualPipeV's pairs overlapped (overlap_forward_backward) against run one after the other: the same model, "
        "2 stages x 2 replicas, ep 2, 8 microbatches per replica; jobs alternating")
rounds = {True: [], False: []}
for _ in range(2):
    for overlap in (True, False):
        rounds[overlap].append(python_job(4, "bench_experts.py", "--ep", "2", "--dualpipe",
                                          *(["--overlap"] if overlap else [])))
medians = {}
for overlap in (True, False):
    steps = sorted(r["step_ms"] for ranks in rounds[overlap] for r in ranks)
    medians[overlap] = steps[len(steps) // 2]
    last = sorted(rounds[overlap][-1], key=lambda r: r["rank"])
    print(f"{'overlapped' if overlap else 'in sequence'}: step {medians[overlap]:.0f} ms (median over ranks and "
          f"{len(rounds[overlap])} jobs); forwards overlapped per rank "
          + ", ".join(str(r["forwards_overlapped"]) for r in last) + "; peak resident growth "
          + ", ".join(f"{r['peak_growth_mib']:.0f}" for r in last) + " MiB")
print(f"overlapped / in sequence: {medians[True] / medians[False]:.3f}")

section("smp.plan's predictions against measured steps: a Hugging Face Llama (8 layers, d 256), the example's GPT "
        "(8 blocks, d 256), torchvision's ResNet-18 (64 x 64 images) and a Mixtral-shaped mixture of experts (its "
        "expert-parallel degrees beside ep 1) planned for 4 processes, then each layout of a grid trained by a "
        "4-process job, and the choice confirmed against the fastest measured, trained again side by side")
for model in ("llama", "gpt", "resnet", "mixtral"):
    result = subprocess.run([PYTHON, f"{REPO}/bench/bench_plan.py", "--model", model], capture_output=True, text=True,
                            env=dict(CAPTURE_ENV, SMP_SMPRUN=f"{BIN}/smprun"), timeout=2700)
    if result.returncode != 0:
        sys.exit(f"bench_plan.py failed:\n{result.stdout}\n{result.stderr}")
    for line in result.stdout.splitlines():
        if not line.startswith("{"):
            print(line)
    r = json.loads(result.stdout.splitlines()[-1])
    print(f"{model} over {r['layouts']} layouts: median absolute error {r['median_abs_error'] * 100:.0f}%, rank "
          f"correlation {r['spearman']:.2f}; the planner's choice ({r['choice']}) measured "
          f"{r['choice_over_best_measured']:.2f}x the fastest measured ({r['best_measured']}), "
          + (f"{r['choice_over_best_confirmed']:.2f}x the fastest confirmed ({r['best_confirmed']}, "
             f"{r['confirm_rounds']} rounds side by side)" if "confirm_rounds" in r else "") + "; memory per rank "
          f"median error {r['memory_median_abs_error'] * 100:.0f}%")

section("memory: a GPT-2 of 0.78 GiB (16 layers, d 1024) built on the meta device, 4 stages (each rank makes its own real)")
for r in sorted(python_job(4, "bench_memory.py", "--layers", "16", "--width", "1024"), key=lambda r: r["rank"]):
    print(f"rank {r['rank']}: own parameters {r['own_parameters_mib']:.0f} MiB, peak resident growth "
          f"{r['peak_growth_mib']:.0f} MiB ({r['growth_over_own']:.2f}x; target 2.5x + 150 MiB = {r['limit_mib']:.0f} MiB)")
print("(the 2-billion-parameter run: smprun -n 4 -- python bench/bench_memory.py --layers 40 --width 2048)")

section("memory (C++): the example GPT (16 layers, d 1024, vocab 8192: 0.78 GiB) on 4 stages, its nodes built on "
        "demand, against building the whole model on every rank first")
for whole in (False, True):
    command = [f"{BIN}/smprun", "-n", "4", "--no-prefix", "--", f"{BIN}/bench_memory"] + (["--whole"] if whole else [])
    result = run(command)
    rows = sorted((json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")), key=lambda r: r["rank"])
    print(("whole model on every rank:" if whole else "built on demand:"))
    for r in rows:
        print(f"  rank {r['rank']}: own parameters {r['own_parameters_mib']:.0f} MiB, peak resident growth "
              f"{r['peak_growth_mib']:.0f} MiB ({r['growth_over_own']:.2f}x; target 2.5x + 150 MiB = "
              f"{r['limit_mib']:.0f} MiB), built in {r['build_s']:.1f} s")
print("(2 billion parameters: smprun -n 4 -- build/bin/bench_memory --layers 40 --width 2048)")

section("against torch.distributed.pipelining (the same GPT-style model, 1F1B, 2 processes x 1 thread; alternating runs)")
rounds = os.environ.get("SMP_BENCH_PEER_ROUNDS", "3")
result = subprocess.run([PYTHON, f"{REPO}/bench/bench_peers.py", BIN, "--rounds", rounds], capture_output=True, text=True,
                        env=CAPTURE_ENV, timeout=3600)
if result.returncode != 0:
    sys.exit(f"bench_peers failed:\n{result.stdout}\n{result.stderr}")
print(result.stdout.strip())
