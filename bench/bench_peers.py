"""smp against torch.distributed.pipelining, side by side, on the CPU (or one GPU): the same GPT-style model (the C++ example's:
embedding, blocks as pre-norm attention and MLP residuals, an untied output layer), the same global batch,
microbatches and schedule (1F1B), 2 pipeline processes of one intra-op thread each. Engines:

  peer        torch.distributed.pipelining's Schedule1F1B over Gloo, the blocks split evenly by hand (embedding on
              the first stage, output layer on the last), as its users split models
  smp-python  smp.DistributedModel on the same nn.Module (captured, partitioned by profile)
  smp-cpp     build/bin/bench_pipeline: the C++ API on the C++ example's GPT of the same shape
  plain       one process running the same microbatches (the pipeline's ideal is m / (m + p - 1) x p of it)
  plain-pair  two such processes at once, each on its own (no communication): what one of them runs at while the
              other core is busy too. On a small shared machine that can be slower than `plain` alone (cores
              sharing caches, memory bandwidth or a host's physical core), which no pipeline can win back; the
              ratios against it say how much of the gap to the ideal is that

With --device cuda every process runs on the one GPU of the machine (LOCAL_RANK's where there are several): the
pipelines over NCCL (2.30 or later shares one GPU among processes; scripts/device_gpu.sh preloads it), every step
ending with the GPU's work done. The processes then share the GPU's SMs as on the CPU they share its cores:
plain-pair says what that costs.

Runs alternate (each engine once per round, each round starting one engine later, several rounds) and each
reports its median step over the measured steps; the raw transport latency is a torch.distributed send/recv
ping-pong of one activation microbatch between the same two processes, measured by the peer's job (the least of
the rounds' medians). Prints throughput ratios per config. Run by scripts/bench.sh; by hand:
python bench/bench_peers.py BUILD/bin [--rounds N] [--steps N] [--device cuda] [--only NAME].

A worker mode runs inside each job: python bench/bench_peers.py --worker ENGINE --config JSON.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

CONFIGS = {
    "d256 x 8 layers, seq 128, m 8": dict(width=256, layers=8, context=128, vocab=256, batch=32, microbatches=8),
    "d64 x 4 layers, seq 32, m 16": dict(width=64, layers=4, context=32, vocab=256, batch=32, microbatches=16),
    "d256 x 8, vocab 8192 (heavy output layer)": dict(width=256, layers=8, context=128, vocab=8192, batch=32,
                                                       microbatches=8),
}


class Embedding(torch.nn.Module):
    def __init__(self, vocab, context, width):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)

    def forward(self, tokens):
        return self.tokens(tokens) + self.positions(torch.arange(tokens.size(1), device=tokens.device))


class Attention(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.projection = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        qkv = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))


class Mlp(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.expand = torch.nn.Linear(width, 4 * width)
        self.contract = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.contract(F.gelu(self.expand(self.norm(x))))


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.attention = Attention(width, heads)
        self.mlp = Mlp(width)

    def forward(self, x):
        return self.mlp(self.attention(x))


class Head(torch.nn.Module):
    def __init__(self, width, vocab):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.output = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        return self.output(self.norm(x))


class Gpt(torch.nn.Module):
    def __init__(self, width, layers, context, vocab, **_):
        super().__init__()
        self.embed = Embedding(vocab, context, width)
        self.blocks = torch.nn.ModuleList([Block(width, max(1, width // 64)) for _ in range(layers)])
        self.head = Head(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def batch(config, step):
    data = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, config["vocab"], (config["batch"], config["context"] + 1), generator=data)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def device_of(config):
    if config["device"] == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def settle(device):
    """Waits for the device's queued work, so that a step's time includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The wall-clock span of the last timed_steps' measured steps (time.time()), for the GPU's busy fraction.
measured_window = (0.0, 0.0)


def timed_steps(step, warmup, steps, device=torch.device("cpu")):
    global measured_window
    times = []
    for index in range(warmup + steps):
        if index == warmup:
            window_start = time.time()
        started = time.perf_counter()
        step(index)
        settle(device)
        if index >= warmup:
            times.append(time.perf_counter() - started)
    measured_window = (window_start, time.time())
    return times


def report(engine, config, times, **extra):
    median = statistics.median(times)
    print(json.dumps({"engine": engine, "median_step_s": median, "samples_per_s": config["batch"] / median,
                      "spread": max(times) / min(times), "window": measured_window, **extra}), flush=True)


class GpuBusy:
    """nvidia-smi's utilization.gpu (the share of each sample period in which a kernel ran) sampled every 100 ms
    while a job runs; busy(window) averages the samples inside a worker's measured steps. Without nvidia-smi,
    busy() is None."""

    def __enter__(self):
        try:
            self.sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu",
                                             "--format=csv,noheader,nounits", "-lms", "100"],
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.sampler = None
        self.samples = []
        return self

    def __exit__(self, *error):
        if self.sampler is None:
            return
        self.sampler.terminate()
        output, _ = self.sampler.communicate()
        import datetime
        for line in output.splitlines():
            try:
                stamp, percent = (part.strip() for part in line.split(","))
                when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((when, float(percent)))
            except ValueError:
                continue  # a line cut off by terminate()

    def busy(self, window):
        inside = [percent for when, percent in self.samples if window[0] <= when <= window[1]]
        return statistics.mean(inside) / 100 if inside else None


def worker_peer(config, warmup, steps):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    device = device_of(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Gpt(**config).to(device)
    # The raw transport: one activation microbatch there and back, between the same two processes.
    activation = torch.zeros(config["batch"] // config["microbatches"], config["context"], config["width"],
                             device=device)
    trips = []
    for _ in range(50):
        started = time.perf_counter()
        if rank == 0:
            dist.send(activation, 1)
            dist.recv(activation, 1)
        else:
            dist.recv(activation, 0)
            dist.send(activation, 0)
        settle(device)
        trips.append(time.perf_counter() - started)
    one_way_s = statistics.median(trips[10:]) / 2
    # An even split by hand: half the blocks each, the embedding first, the output layer last.
    half = config["layers"] // 2
    if rank == 0:
        stage_module = torch.nn.Sequential(model.embed, *model.blocks[:half])
    else:
        stage_module = torch.nn.Sequential(*model.blocks[half:], model.head)
    stage = PipelineStage(stage_module, rank, world, device)
    schedule = Schedule1F1B(stage, config["microbatches"], loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=1e-3)

    def step(index):
        inputs, targets = batch(config, index)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs.to(device))
        else:
            schedule.step(target=targets.to(device), losses=[])
        optimizer.step()

    times = timed_steps(step, warmup, steps, device)
    if rank == 0:
        report("peer", config, times, one_way_latency_ms=one_way_s * 1e3,
               activation_kib=activation.numel() * 4 / 1024)
    dist.destroy_process_group()


def worker_smp(config, warmup, steps, trace_dir):
    import smp
    keys = {"partitions": 2, "microbatches": config["microbatches"], "pipeline": "interleaved",
            "global_batch_size": config["batch"], "seed": 0, "device": config["device"]}
    if trace_dir:
        keys.update(trace_dir=trace_dir, trace_step=warmup + steps - 1)
    runtime = smp.init(keys)
    torch.manual_seed(0)
    net = Gpt(**config)
    inputs, _ = batch(config, 0)
    model = smp.DistributedModel(net, inputs[:config["batch"] // config["microbatches"]])
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    def step(index):
        inputs, targets = batch(config, index)
        optimizer.zero_grad()
        model.train_step(inputs, targets, loss_fn)
        optimizer.step()

    times = timed_steps(step, warmup, steps, device_of(config))
    if runtime.rank == 0:
        report("smp-python", config, times)


def worker_plain(config, warmup, steps):
    device = device_of(config)
    torch.manual_seed(0)
    model = Gpt(**config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    microbatches = config["microbatches"]

    def step(index):
        inputs, targets = batch(config, index)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        for chunk, target in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            (loss_fn(model(chunk), target) / microbatches).backward()
        optimizer.step()

    report("plain", config, timed_steps(step, warmup, steps, device))


def run_job(command, env, timeout=900):
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"bench_peers: {' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bin", nargs="?")
    parser.add_argument("--worker")
    parser.add_argument("--config")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trace-dir")
    parser.add_argument("--only", help="a substring of one config's name")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        config = json.loads(args.config)
        if args.worker == "peer":
            worker_peer(config, args.warmup, args.steps)
        elif args.worker == "smp-python":
            worker_smp(config, args.warmup, args.steps, args.trace_dir)
        else:
            worker_plain(config, args.warmup, args.steps)
        return 0

    binaries = args.bin
    python = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(os.path.dirname(binaries), "python"))
    if args.device == "cuda":  # the peer's two ranks on one GPU (smp's runtime sets this itself)
        env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    smprun = [f"{binaries}/smprun", "-n", "2", "--no-prefix", "--timeout", "600", "--"]
    this = os.path.abspath(__file__)
    for name, config in CONFIGS.items():
        if args.only and args.only not in name:
            continue
        config = dict(config, device=args.device)
        results = {engine: [] for engine in ("peer", "smp-python", "smp-cpp", "plain", "plain-pair")}
        latencies, spreads = [], {engine: [] for engine in results}
        busy = {engine: [] for engine in results}  # the GPU's, over rank 0's measured steps
        timeline = {}
        engines = list(results)
        for round_index in range(args.rounds):
            # Each round starts one engine later, so that no engine always runs first (or last) in a round while the
            # machine drifts.
            shift = round_index % len(engines)
            for engine in engines[shift:] + engines[:shift]:
                common = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
                if engine == "smp-cpp":
                    model = {"vocab_size": config["vocab"], "context": config["context"], "d_model": config["width"],
                             "heads": max(1, config["width"] // 64), "layers": config["layers"],
                             "tie_embeddings": False}
                    keys = {"partitions": 2, "microbatches": config["microbatches"], "pipeline": "interleaved",
                            "global_batch_size": config["batch"], "seed": 0, "device": args.device}
                    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
                        json.dump({"smp": keys, "model": model}, file)
                    result = run_job(smprun + [f"{binaries}/bench_pipeline", "--config", file.name, "--warmup",
                                               str(args.warmup), "--steps", str(args.steps)], env)
                    os.unlink(file.name)
                    line = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("{")))
                    results[engine].append(line["iteration_samples_per_s"])  # with the optimizer step, as the others
                    spreads[engine].append(line["spread"])
                    continue
                worker = "plain" if engine == "plain-pair" else engine
                command = [python, this, "--worker", worker, "--config", json.dumps(config)] + common
                with tempfile.TemporaryDirectory() as traces:
                    traced = engine == "smp-python" and round_index == args.rounds - 1
                    if traced:
                        command += ["--trace-dir", traces]
                    with GpuBusy() if args.device == "cuda" else contextlib.nullcontext() as gpu:
                        result = run_job(command if engine == "plain" else smprun + command, env)
                lines = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
                line = lines[0]
                if gpu is not None and gpu.busy(line["window"]) is not None:
                    busy[engine].append(gpu.busy(line["window"]))
                results[engine].append(statistics.mean(each["samples_per_s"] for each in lines))
                spreads[engine].append(max(each["spread"] for each in lines))
                if engine == "peer":
                    latencies.append(line["one_way_latency_ms"])
                    activation_kib = line["activation_kib"]
                if traced:
                    import re
                    found = re.search(r"transfer latency ([\d.]+) ms", result.stderr)
                    if found:
                        timeline["latency_ms"] = float(found[1])
                    found = re.search(r"receive waits ([\d.]+) ms", result.stderr)
                    if found:
                        timeline["receive_waits_ms"] = float(found[1])
        median = {engine: statistics.median(values) for engine, values in results.items()}
        p, m = 2, config["microbatches"]
        ideal = m / (m + p - 1) * p
        print(f"\n{name} on {args.device} ({args.rounds} alternating rounds, medians; samples/s):")
        for engine, value in median.items():
            print(f"  {engine:<11}{value:9.1f}  (runs: {', '.join(f'{v:.1f}' for v in results[engine])}; "
                  f"step spread max/min {max(spreads[engine]):.2f})")
        print(f"  smp-cpp / peer {median['smp-cpp'] / median['peer']:.3f}, smp-python / peer "
              f"{median['smp-python'] / median['peer']:.3f}; of the ideal {ideal:.3f} x plain: smp-cpp "
              f"{median['smp-cpp'] / median['plain'] / ideal:.3f}, smp-python "
              f"{median['smp-python'] / median['plain'] / ideal:.3f}, peer {median['peer'] / median['plain'] / ideal:.3f}")
        if any(busy.values()):
            print("  GPU busy during the measured steps (nvidia-smi utilization.gpu, mean over rank 0's steps): " +
                  ", ".join(f"{engine} {statistics.median(values):.2f}" for engine, values in busy.items() if values))
        shared = median["plain-pair"] / median["plain"]
        print(f"  one process with the other core busy runs at {shared:.3f} of plain alone; of the ideal against that: "
              f"smp-cpp {median['smp-cpp'] / median['plain-pair'] / ideal:.3f}, smp-python "
              f"{median['smp-python'] / median['plain-pair'] / ideal:.3f}, peer "
              f"{median['peer'] / median['plain-pair'] / ideal:.3f}")
        # The least over rounds: a round's ping-pong sometimes takes about 1 ms a trip instead of 0.1 to 0.2 (seen
        # here on 2 vCPUs, as if both processes waited on one), which is the scheduler, not the transport.
        raw_latency = min(latencies)
        print(f"  raw transport one-way latency ({activation_kib:.0f} KiB, torch.distributed ping-pong, least of the "
              f"rounds' medians): {raw_latency * 1e3:.0f} us (rounds: {', '.join(f'{v * 1e3:.0f}' for v in latencies)}); "
              f"smp-python's traced transfer latency: "
              f"{timeline.get('latency_ms', float('nan')) * 1e3:.0f} us "
              f"({timeline.get('latency_ms', float('nan')) / raw_latency:.2f}x), receive waits "
              f"{timeline.get('receive_waits_ms', float('nan')):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
