"""A Llama-shaped model of about 1B parameters in bf16 mixed precision: 2 pipeline stages in 2 processes sharing one
GPU over NCCL, the model built on the meta device and each stage's weights loaded from a safetensors checkpoint
written first (DistributedModel.load_pretrained), against one process training the same model from the same file
(from_pretrained). Prints each one's tokens/s (median step), the peak GPU memory of every process while training,
and both losses step by step (they must agree within bf16's tolerance).

  python bench/bench_llama_gpu.py BUILD/bin [--size 1b|tiny] [--device cuda|cpu] [--steps N] [--warmup N]

scripts/device_gpu.sh runs it on the GPU machine (NCCL 2.30 or later preloaded, so that the two ranks share the
GPU); `--size tiny --device cpu` checks the whole flow on a CPU in a minute. A worker mode runs inside each job:
python bench/bench_llama_gpu.py --worker smp|plain --checkpoint DIR ...
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SIZES = {
    # Llama-3.2-1B's blocks with a 32k vocabulary and an untied output layer: 1.1B parameters.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, sequence=1024),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, sequence=32),
}
BATCH, MICROBATCHES = 8, 4


def llama_config(size):
    import transformers as hf
    shape = {key: value for key, value in SIZES[size].items() if key != "sequence"}
    return hf.LlamaConfig(**shape, max_position_embeddings=SIZES[size]["sequence"], attention_dropout=0.0,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)


def batch(size, step):
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, SIZES[size]["vocab_size"], (BATCH, SIZES[size]["sequence"]), generator=generator)


def device_of(name):
    if name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def settle(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def timed(step, args, device):
    """Runs the steps; returns (times of the measured ones, every step's loss)."""
    times, losses = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        losses.append(step(index))
        settle(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    return times, losses


def report(engine, args, times, losses, device, **extra):
    median = statistics.median(times)
    tokens = BATCH * SIZES[args.size]["sequence"]
    print(json.dumps({"engine": engine, "rank": int(os.environ.get("RANK", "0")), "median_step_s": median,
                      "tokens_per_s": tokens / median, "peak_training_gib": peak_gib(device), "losses": losses,
                      **extra}), flush=True)


def worker_plain(args):
    import transformers as hf
    device = device_of(args.device)
    model = hf.LlamaForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loaded_gib = peak_gib(device)

    def step(index):
        ids = batch(args.size, index).to(device)
        optimizer.zero_grad()
        total = 0.0
        for chunk in ids.chunk(MICROBATCHES):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=chunk, labels=chunk).loss
            (loss / MICROBATCHES).backward()
            total += loss.item() / MICROBATCHES
        optimizer.step()
        return total

    times, losses = timed(step, args, device)
    report("plain", args, times, losses, device, parameters=sum(p.numel() for p in model.parameters()),
           peak_loading_gib=loaded_gib)


def worker_smp(args):
    import transformers as hf
    import smp
    device = device_of(args.device)
    runtime = smp.init({"partitions": 2, "microbatches": MICROBATCHES, "global_batch_size": BATCH, "bf16": True,
                        "device": args.device, "pipeline": "interleaved", "seed": 0})
    with torch.device("meta"):
        net = hf.LlamaForCausalLM(llama_config(args.size))
    sample = batch(args.size, 0)[:BATCH // MICROBATCHES]
    started = time.perf_counter()
    model = smp.DistributedModel(net, {"input_ids": sample, "labels": sample}, init_fn=net._init_weights)
    model.load_pretrained(args.checkpoint)
    built_s = time.perf_counter() - started
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))
    loaded_gib = peak_gib(device)

    def step(index):
        ids = batch(args.size, index)
        optimizer.zero_grad()
        loss = model.train_step({"input_ids": ids, "labels": ids}).loss
        optimizer.step()
        return loss

    times, losses = timed(step, args, device)
    report("smp", args, times, losses, device, parameters=sum(p.numel() for _, p in model.named_parameters()),
           peak_loading_gib=loaded_gib, build_and_load_s=built_s, rank_of=runtime.rank)


def run_job(command, env, timeout):
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"bench_llama_gpu: {' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bin", nargs="?")
    parser.add_argument("--worker", choices=["smp", "plain"])
    parser.add_argument("--checkpoint")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        (worker_smp if args.worker == "smp" else worker_plain)(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no GPU", flush=True)
        return 77

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(args.bin)),
                                                                         "python"))
    common = ["--size", args.size, "--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps)]
    this = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as checkpoint:
        import transformers as hf
        started = time.perf_counter()
        torch.manual_seed(0)
        # Written in bf16 (half the file): both engines load the same rounded weights into float32 parameters.
        hf.LlamaForCausalLM(llama_config(args.size)).to(torch.bfloat16).save_pretrained(checkpoint)
        print(f"checkpoint written in {time.perf_counter() - started:.1f} s", flush=True)
        common += ["--checkpoint", checkpoint]
        plain = run_job([sys.executable, this, "--worker", "plain"] + common, env, args.timeout)[0]
        ranks = run_job([f"{args.bin}/smprun", "-n", "2", "--no-prefix", "--timeout", str(args.timeout), "--",
                         sys.executable, this, "--worker", "smp"] + common, env, args.timeout + 30)
    ranks.sort(key=lambda line: line["rank"])
    first = ranks[0]
    print(f"\nLlama-shaped {args.size} ({plain['parameters'] / 1e6:.1f}M parameters), bf16 autocast, AdamW, "
          f"{BATCH} x {SIZES[args.size]['sequence']} tokens in {MICROBATCHES} microbatches, on {args.device}:")
    print(f"  one process      {plain['tokens_per_s']:9.0f} tokens/s, peak {plain['peak_training_gib']:.2f} GiB "
          f"training ({plain['peak_loading_gib']:.2f} GiB loading)")
    print(f"  smp, 2 stages    {first['tokens_per_s']:9.0f} tokens/s ({first['tokens_per_s'] / plain['tokens_per_s']:.3f}"
          f" x one process; built and loaded in {first['build_and_load_s']:.1f} s)")
    for line in ranks:
        print(f"    rank {line['rank']}: {line['parameters'] / 1e6:.1f}M parameters, peak {line['peak_training_gib']:.2f}"
              f" GiB training ({line['peak_training_gib'] / max(plain['peak_training_gib'], 1e-9):.3f} of one process's)"
              f", {line['peak_loading_gib']:.2f} GiB loading")
    worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(first["losses"], plain["losses"]))
    print(f"  losses, smp: {', '.join(f'{v:.4f}' for v in first['losses'])}")
    print(f"  losses, one process: {', '.join(f'{v:.4f}' for v in plain['losses'])} (largest relative difference "
          f"{worst:.2e})")
    if worst > 0.02:
        print("  FAILED: the losses differ by more than bf16's 2%", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
