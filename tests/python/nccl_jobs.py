"""The Python package's jobs over NCCL, their ranks sharing this machine's one GPU, under smprun (SMP_SMPRUN), each
rank checking its losses and parameters against plain PyTorch: pipeline_worker.py's pipelines of 2 and 4 ranks, and
real_models.py's Hugging Face models with their experts spread over 2 ranks (NCCL's all-to-all) and with tensor
parallelism (all-gather, reduce-scatter and all-reduce inside the model) across 2 pipeline stages.

The GPU machine's `ctest -L gpu` runs this with the python that has torch (that machine has no pytest). Exits 77
(skipped) without a GPU, or where the loaded NCCL is older than 2.30 and so cannot put two ranks on one GPU.
"""

import ctypes
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

JOBS = [
    # (ranks, worker, worker arguments, smp config)
    (2, "pipeline_worker.py", ["--model", "graph", "--optimizer", "adamw", "--rtol", "1e-3"],
     {"partitions": 2, "microbatches": 4, "global_batch_size": 8, "pipeline": "interleaved"}),
    (4, "pipeline_worker.py", ["--model", "sequential", "--rtol", "1e-4"],
     {"partitions": 2, "microbatches": 4, "global_batch_size": 16, "ddp": True, "pipeline": "zero_bubble"}),
    (2, "real_models.py", ["--models", "mixtral,qwen3_moe", "--steps", "2", "--rtol", "1e-4"],
     {"partitions": 1, "ddp": True, "expert_parallel_degree": 2, "microbatches": 2, "global_batch_size": 8}),
    (4, "real_models.py", ["--models", "llama,olmoe", "--steps", "2", "--rtol", "1e-4"],
     {"partitions": 2, "tensor_parallel_degree": 2, "microbatches": 2, "global_batch_size": 4}),
]


def loaded_nccl_version():
    """The NCCL that torch's NCCL calls bind to (torch.cuda.nccl.version() is the one torch was built against)."""
    version = ctypes.c_int(0)
    ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(version))
    return version.value


def main():
    if not torch.cuda.is_available():
        print("skipped: torch sees no GPU", flush=True)
        return 77
    version = loaded_nccl_version()
    if version < 23000:
        print(f"skipped: NCCL {version} is loaded; several ranks share a GPU from 2.30 (23000) on", flush=True)
        return 77
    smprun = os.environ.get("SMP_SMPRUN")
    if not smprun:
        print("SMP_SMPRUN must name smprun", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    failed = 0
    for ranks, worker, arguments, keys in JOBS:
        config = json.dumps(dict({"seed": 3, "device": "cuda", "backend": "nccl"}, **keys))
        command = [smprun, "-n", str(ranks), "--timeout", "150", "--", sys.executable,
                   os.path.join(HERE, worker), *arguments, "--smp", config]
        print("$ " + " ".join(command), flush=True)
        try:
            status = subprocess.run(command, env=env, timeout=180).returncode
        except subprocess.TimeoutExpired:
            status = 124
        print(f"{worker}, {ranks} ranks: {'passed' if status == 0 else f'FAILED (status {status})'}", flush=True)
        failed += status != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
