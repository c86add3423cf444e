"""smp.plan's predictions against measured steps: a model planned for 4 processes, then every layout of a grid
trained by a 4-process job on this machine (median step after warm-up). Reports, per layout, predicted and
measured step, and over the grid the median absolute error, the rank correlation (Spearman) and where the
planner's choice among the grid falls against the fastest measured.

  python bench/bench_plan.py --model llama|gpt2|gpt|resnet|mixtral [--steps 6] [--rounds 1] [--confirm 3]   (a driver: it
  launches the jobs with smprun; mixtral, a mixture of experts, is planned with "expert_parallel_degree": "auto")

Then the choice and the three fastest measured layouts are trained again side by side (--confirm rounds), and the
choice is also reported against the fastest of those: the least of a grid's noisy steps is lower than its layout's
typical step.

Inside the jobs: --predict (one process: smp.plan, the layouts as JSON) and --train CONFIG (one layout).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD, GLOBAL_BATCH, LENGTH = 4, 16, 64
IMAGE, CLASSES = 64, 10
sys.path.insert(0, os.path.join(HERE, "..", "examples", "python"))  # the example's GPT (hybrid_2x4)


def build(name):
    import transformers as hf
    torch.manual_seed(0)
    if name == "llama":
        config = hf.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=LENGTH)
        return hf.LlamaForCausalLM(config)
    if name == "mixtral":  # experts hold most of it: 8 of 512 features in each of 4 layers, 2 per token
        config = hf.MixtralConfig(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                  num_experts_per_tok=2, max_position_embeddings=LENGTH)
        return hf.MixtralForCausalLM(config)
    if name == "gpt2":
        config = hf.GPT2Config(vocab_size=1024, n_embd=256, n_layer=8, n_head=8, n_positions=LENGTH)
        return hf.GPT2LMHeadModel(config)
    if name == "gpt":  # the example's GPT (examples/python/hybrid_2x4.py), widened to the others' size
        from hybrid_2x4 import GPT
        return GPT(vocab_size=256, context=LENGTH, width=256, heads=8, layers=8)
    if name == "resnet":  # a CNN: torchvision's ResNet-18 on 64 x 64 images, 10 classes, batch norm in every block
        import torchvision
        return torchvision.models.resnet18(num_classes=CLASSES)
    raise SystemExit(f"unknown model {name}")


def batch(samples, generator, name="llama"):
    """(inputs, targets, loss): a language model's ids as inputs and labels (its own loss), or images and classes."""
    if name == "gpt":
        from hybrid_2x4 import next_byte_loss
        tokens = torch.randint(0, 256, (samples, LENGTH + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:], next_byte_loss
    if name == "resnet":
        images = torch.randn(samples, 3, IMAGE, IMAGE, generator=generator)
        return images, torch.randint(0, CLASSES, (samples,), generator=generator), torch.nn.functional.cross_entropy
    ids = torch.randint(0, 1024, (samples, LENGTH), generator=generator)
    return {"input_ids": ids, "labels": ids}, None, None


def measure_link():
    """The links as an "auto" job measures them before it plans (Runtime._measured_planning_costs, every rank at
    once): the bandwidth of a 4 MiB all-reduce over a scalar one and the latency of a ping-pong between neighbours,
    medians of their rounds."""
    import smp
    # As a job that plans tensor parallelism: it also measures what a collective costs after computing.
    runtime = smp.init({"ddp": True, "tensor_parallel_degree": "auto", "global_batch_size": GLOBAL_BATCH})
    links = runtime._measured_planning_costs()
    print(json.dumps({"rank": runtime.rank, "gbps": links["bytes_per_s"] / 1e9, "latency_us": links["latency_s"] * 1e6,
                      "processors": links["shared_processors"],
                      "synchronization_us": links["synchronization_s"] * 1e6,
                      "synchronized_gbps": links["synchronized_bytes_per_s"] / 1e9}), flush=True)


def predict(name, link_gbps, latency_us, processors, synchronization_us, synchronized_gbps):
    import smp
    model = build(name)
    # A mixture of experts: every expert-parallel degree too.
    smp.init({"global_batch_size": GLOBAL_BATCH, **({"expert_parallel_degree": "auto"} if name == "mixtral" else {})})
    # Tensor parallelism where the model has a plan (the Hugging Face decoders' own): every degree of the world; for
    # the mixture of experts tp 2, with and without the experts divided.
    degrees = ([1, 2] if name == "mixtral" else [1, 2, 4]) if smp.tp.builtin_plan(model) else [1]
    def plan(**routing):
        return smp.plan(model, batch(2, torch.Generator().manual_seed(1), name)[0], world_size=WORLD,
                        link_gbps=link_gbps, latency_us=latency_us, shared_cores=processors or None,
                        tensor_parallel_degrees=degrees, synchronization_us=synchronization_us,
                        synchronized_gbps=synchronized_gbps, **routing)
    found = plan()
    if name == "mixtral":  # beside the routing counted on the sample, what even routing would have predicted
        even = {row["layout"]: row for row in found.with_routing("even").layouts}
        for row in found.layouts:
            row["step_ms_even"] = even[row["layout"]]["step_ms"]
            row["memory_mib_even"] = even[row["layout"]]["memory_mib"]
    print(json.dumps({"layouts": found.layouts, "report": found.report}), flush=True)


def train(name, keys, steps):
    import smp
    from smp import _smp
    runtime = smp.init({**json.loads(keys), "global_batch_size": GLOBAL_BATCH})
    data = torch.Generator().manual_seed(1)
    sample = batch(GLOBAL_BATCH // runtime.data_parallel_degree // runtime.config.microbatches, data, name)[0]
    model = smp.DistributedModel(build(name), sample)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer = smp.DistributedOptimizer(adamw)
    times = []
    routed = []  # per step: {router path: tokens per expert} of this rank's tokens

    def step():
        optimizer.zero_grad()
        inputs, targets, loss = batch(GLOBAL_BATCH, data, name)
        result = model.train_step(inputs, targets, loss)
        routed.append({path: counts.cpu().tolist() for path, counts in result.tokens_per_expert.items()})
        optimizer.step()

    for index in range(steps + 2):
        started = time.perf_counter()
        step()
        if index >= 2:
            times.append(time.perf_counter() - started)
    # Memory after the timing (counting slows allocation): what the rank holds between steps (parameters and the
    # optimizer's state, counted from its tensors) plus the most a step allocates on top (gradients, activations,
    # temporaries), against the planner's prediction for this pipeline rank.
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for state in adamw.state.values() for t in state.values()
                if torch.is_tensor(t))
    optimizer.zero_grad(set_to_none=True)
    meter = _smp.CpuTensorMeter()
    meter.reset_peak()
    before = meter.live_bytes
    step()
    optimizer.zero_grad(set_to_none=True)
    peak_mib = (held + meter.peak_bytes - before) / 2**20
    del meter
    # The job's cut, "first..last" per stage as the plan gives its own: the plan's pins, and where a module called
    # twice sits on a boundary (unpinnable), the job's own profile.
    stages = [first if first == last else f"{first}..{last}"
              for first, last in re.findall(r"stage \d+: modules (\S+)\.\.(\S+) \(", model.partition_report())]
    print(json.dumps({"rank": runtime.rank, "pp_rank": runtime.pp_rank, "step_ms": statistics.median(times) * 1e3,
                      "peak_mib": peak_mib, "stages": stages,
                      "exchange": [runtime.pp_rank, runtime.tp_rank,
                                   runtime.dp_rank // max(1, runtime.config.expert_parallel_degree)],
                      "microbatches": runtime.config.microbatches, "routed": routed}), flush=True)


def job(processes, *args):
    smprun = os.environ.get("SMP_SMPRUN", os.path.join(HERE, "..", "build", "bin", "smprun"))
    # The package built beside the launcher, as bench_peers.py gives its jobs (this process may have found smp on
    # a PYTHONPATH of its own, or not at all).
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(smprun))), "python")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([smprun, "-n", str(processes), "--no-prefix", "--timeout", "300", "--", sys.executable,
                             os.path.abspath(__file__), *args], capture_output=True, text=True, timeout=400, env=env)
    if result.returncode != 0:
        sys.exit(f"bench_plan {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def experts_grid(layouts):
    """A mixture of experts: each expert-parallel degree beside its ep 1 twin, one stage and two (1F1B, a
    microbatch per stage), ZeRO-1 once with one stage, tp 2 with and without ep 2; and four stages without
    replicas."""
    wanted = {"pp 1 x dp 4, gpipe, m 1", "pp 1 x dp 4, ep 2, gpipe, m 1", "pp 1 x dp 4, ep 4, gpipe, m 1",
              "pp 1 x dp 4, gpipe, m 1, ZeRO-1", "pp 1 x dp 4, ep 4, gpipe, m 1, ZeRO-1",
              "pp 2 x dp 2, 1f1b, m 2", "pp 2 x dp 2, ep 2, 1f1b, m 2", "pp 4 x dp 1, 1f1b, m 4",
              "tp 2 x pp 1 x dp 2, gpipe, m 1", "tp 2 x pp 1 x dp 2, ep 2, gpipe, m 1"}
    return [layout for layout in layouts if layout["rejected"] is None and layout["layout"] in wanted]


def grid(layouts):
    """Each pipeline depth with each schedule at 2 microbatches per stage (and 1 per stage), recompute once, ZeRO-1
    once; with tensor parallelism GPipe and 1F1B alone: the layouts a person would try, from the planner's list
    (the fitting ones, with their predictions)."""
    chosen = []
    for layout in layouts:
        if layout["rejected"] is not None:
            continue
        keys = json.loads(layout["config"])
        stages = keys["partitions"] * keys["virtual_stages"]
        if keys["activation_checkpointing"] or keys["shard_optimizer_state"]:
            continue
        if keys["tensor_parallel_degree"] > 1 and keys["pipeline"] not in ("gpipe", "1f1b"):
            continue
        if keys["partitions"] == 1 and keys["microbatches"] not in (1, 2):
            continue
        if keys["partitions"] > 1 and keys["microbatches"] not in (stages, 2 * stages):
            continue
        chosen.append(layout)
    for extra in ("recompute", "ZeRO-1"):
        match = [l for l in layouts if l["rejected"] is None and l["layout"].endswith(extra)
                 and l["layout"].startswith("pp 2 x dp 2, 1f1b, m 4")]
        chosen += match[:1]
    return chosen


def spearman(xs, ys):
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        rank = [0.0] * len(values)
        for position, index in enumerate(order):
            rank[index] = float(position)
        return rank
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    covariance = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return covariance / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def drive(name, steps, rounds=1, confirm_rounds=3):
    measured = job(WORLD, "--measure-link")
    link = statistics.median(r["gbps"] for r in measured)
    latency = statistics.median(r["latency_us"] for r in measured)
    processors = measured[0]["processors"]
    synchronization = measured[0]["synchronization_us"]
    synchronized_gbps = measured[0]["synchronized_gbps"]
    print(f"links between the {WORLD} processes, as an auto job measures them: {link:.2f} GB/s, latency "
          f"{latency:.0f} us; the {WORLD} ranks computing at once had {processors:.2f} processors, a collective after "
          f"computing {synchronization:.0f} us + {synchronized_gbps:.2f} GB/s", flush=True)
    planned = job(1, "--model", name, "--predict", "--link-gbps", str(link), "--latency-us", str(latency),
                  "--processors", str(processors), "--synchronization-us", str(synchronization),
                  "--synchronized-gbps", str(synchronized_gbps))[0]
    rows = []
    cuts_differ = 0
    layouts = (experts_grid if name == "mixtral" else grid)(planned["layouts"])
    # Every layout once per round, the order reversed every other round, so that the host's drift over the run falls
    # on every layout alike; a layout's step is the median of its rounds' (each the ranks' median).
    jobs = [[] for _ in layouts]
    # The first job after a while runs slow (its files and the host's caches cold: GPT-2's first layout took 506.9
    # ms in the grid, 386 to 399 in three later jobs): one untimed job first.
    job(WORLD, "--model", name, "--train", layouts[0]["config"], "--steps", "1")
    for round_index in range(rounds):
        order = list(range(len(layouts)))
        for index in (order if round_index % 2 == 0 else reversed(order)):
            jobs[index].append(job(WORLD, "--model", name, "--train", layouts[index]["config"], "--steps", str(steps)))
            if rounds > 1:
                print(f"  round {round_index + 1}: {layouts[index]['layout']:<44} "
                      f"{statistics.median(r['step_ms'] for r in jobs[index][-1]):8.1f} ms", flush=True)
    for layout, rounds_of in zip(layouts, jobs):
        ranks = rounds_of[0]  # memory, cut and routing from the first round
        measured = statistics.median(statistics.median(r["step_ms"] for r in ranks) for ranks in rounds_of)
        # Per pipeline rank, its fullest replica's measured memory against the prediction.
        memory = {}
        for r in ranks:
            memory[r["pp_rank"]] = max(memory.get(r["pp_rank"], 0.0), r["peak_mib"])
        memory_errors = [(layout["memory_mib"][pp] - mib) / mib for pp, mib in memory.items()]
        rows.append((layout, measured, memory_errors))
        print(f"  {layout['layout']:<44} predicted {layout['step_ms']:8.1f} ms  measured {measured:8.1f} ms  "
              f"({(layout['step_ms'] - measured) / measured * 100:+.0f}%); memory per pipeline rank predicted "
              f"{', '.join(f'{m:.1f}' for m in layout['memory_mib'])} MiB, measured "
              f"{', '.join(f'{memory[pp]:.1f}' for pp in sorted(memory))} MiB", flush=True)
        ep = json.loads(layout["config"])["expert_parallel_degree"]
        if "step_ms_even" in layout and ep > 1:
            # What the job's routers chose: per step and expert-parallel group, its members' tokens together (a
            # step's microbatches summed), each layer's busiest rank against its even share.
            from smp import _routing
            exchanges = {}
            for r in ranks:
                for step_index, counted in enumerate(r["routed"]):
                    for path, counts in counted.items():
                        key = (tuple(r["exchange"]), step_index, path)
                        exchanges[key] = [a + b for a, b in zip(exchanges.get(key, [0] * len(counts)), counts)]
            busiest = statistics.mean(_routing.busiest_share(counts, ep) for counts in exchanges.values())
            print(f"    even routing predicted {layout['step_ms_even']:8.1f} ms "
                  f"({(layout['step_ms_even'] - measured) / measured * 100:+.0f}%), memory "
                  f"{', '.join(f'{m:.1f}' for m in layout['memory_mib_even'])} MiB; in the job the busiest rank got "
                  f"{busiest:.2f}x its even share of rows (mean over steps, groups and layers, "
                  f"{ranks[0]['microbatches']} microbatches a step)", flush=True)
        if ranks[0]["stages"] != layout["stages"]:
            print(f"    the job cut elsewhere: planned {', '.join(layout['stages'])}; job {', '.join(ranks[0]['stages'])}",
                  flush=True)
        cuts_differ += ranks[0]["stages"] != layout["stages"]
    predicted = [layout["step_ms"] for layout, _, _ in rows]
    measured = [m for _, m, _ in rows]
    memory_errors = sorted(abs(e) for _, _, errors in rows for e in errors)
    errors = sorted(abs(p - m) / m for p, m in zip(predicted, measured))
    divided = [(layout, m) for layout, m, _ in rows
               if "step_ms_even" in layout and json.loads(layout["config"])["expert_parallel_degree"] > 1]
    routing = {"experts_divided_abs_error": statistics.median(abs(l["step_ms"] - m) / m for l, m in divided),
               "experts_divided_abs_error_even_routing":
                   statistics.median(abs(l["step_ms_even"] - m) / m for l, m in divided)} if divided else {}
    choice = min(range(len(rows)), key=lambda i: predicted[i])
    confirmed = confirm(name, [layout for layout, _, _ in rows], measured, choice, steps, confirm_rounds)
    print(json.dumps({"model": name, "layouts": len(rows), "rounds": rounds, "link_gbps": link, "latency_us": latency,
                      "processors": processors, "synchronization_us": synchronization,
                      "synchronized_gbps": synchronized_gbps,
                      "median_abs_error": statistics.median(errors),
                      "memory_median_abs_error": statistics.median(memory_errors),
                      "memory_worst_abs_error": memory_errors[-1],
                      "spearman": spearman(predicted, measured),
                      "choice": rows[choice][0]["layout"],
                      "choice_over_best_measured": measured[choice] / min(measured),
                      "best_measured": rows[measured.index(min(measured))][0]["layout"],
                      "jobs_cut_elsewhere": cuts_differ, **confirmed, **routing}), flush=True)


def confirm(name, layouts, measured, choice, steps, rounds):
    """The grid's fastest measured is the least of many noisy steps, so it sits below its layout's typical step
    (the winner's curse), and the choice's ratio to it leans above 1 even when the choice is right. Confirmation
    trains the choice and the three fastest measured others again, side by side: `rounds` rounds, each order the
    last rotated by one, each layout's step the median of its rounds; the choice against the fastest of those."""
    if rounds < 1:
        return {}
    others = sorted((i for i in range(len(layouts)) if i != choice), key=lambda i: measured[i])[:3]
    contenders = [choice] + others
    steps_of = {i: [] for i in contenders}
    for round_index in range(rounds):
        # Each round rotated by one: over as many rounds as contenders, each layout runs once in every position.
        shift = round_index % len(contenders)
        for index in contenders[shift:] + contenders[:shift]:
            ranks = job(WORLD, "--model", name, "--train", layouts[index]["config"], "--steps", str(steps))
            steps_of[index].append(statistics.median(r["step_ms"] for r in ranks))
    typical = {i: statistics.median(times) for i, times in steps_of.items()}
    for i in contenders:
        print(f"  confirmed {'(choice) ' if i == choice else ''}{layouts[i]['layout']:<44} "
              f"{typical[i]:8.1f} ms over {rounds} rounds ({', '.join(f'{t:.1f}' for t in steps_of[i])}; "
              f"in the grid {measured[i]:.1f})", flush=True)
    fastest = min(typical, key=typical.get)
    return {"choice_over_best_confirmed": typical[choice] / typical[fastest],
            "best_confirmed": layouts[fastest]["layout"], "confirm_rounds": rounds}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama")
    parser.add_argument("--predict", action="store_true")
    parser.add_argument("--train")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="train every layout this many times, alternating")
    parser.add_argument("--confirm", type=int, default=3,
                        help="train the choice and the three fastest measured this many more times each (0: not)")
    parser.add_argument("--measure-link", action="store_true")
    parser.add_argument("--link-gbps", type=float)
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--processors", type=float, default=0.0)
    parser.add_argument("--synchronization-us", type=float, default=0.0)
    parser.add_argument("--synchronized-gbps", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.measure_link:
        measure_link()
    elif args.predict:
        predict(args.model, args.link_gbps, args.latency_us, args.processors, args.synchronization_us,
                args.synchronized_gbps)
    elif args.train:
        train(args.model, args.train, args.steps)
    else:
        drive(args.model, args.steps, args.rounds, args.confirm)


if __name__ == "__main__":
    main()
