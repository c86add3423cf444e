"""Two pipeline stages whose ranks fall out of step, as programs do by mistake: both ranks must raise at once, saying
how (not pair one call's activations with another's, nor wait for the timeout).

  evaluate_alone: rank 0 evaluates after the first step while rank 1 goes on training (`if rank == 0:`).
  own_batch:      rank 1 draws a batch of its own, of the same shapes (an unseeded sampler).

Exits 0 only then."""

import sys
import time

import torch

import report
import smp

runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 4, "pipeline": "1f1b",
                    "comm_timeout_s": 120, "device": "cpu"})
mistake = sys.argv[1]
torch.manual_seed(0)
inputs, targets = torch.randn(4, 16), torch.randn(4, 8)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
model = smp.DistributedModel(net, inputs[:2])
loss = torch.nn.functional.mse_loss
model.train_step(inputs, targets, loss)

start = time.monotonic()
error = None
try:
    if mistake == "evaluate_alone" and runtime.rank == 0:
        model.evaluate(inputs, targets, loss)
    own = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    model.train_step(own if mistake == "own_batch" and runtime.rank == 1 else inputs, targets, loss)
except smp.CommError as raised:
    error = str(raised)
waited = time.monotonic() - start

expected = {"evaluate_alone": "it is in its evaluate 1 after step 1, this rank in its train_step 1",
            "own_batch": "rank 1 was given a batch with other values than rank 0, in the same replica (train_step 1)"}
failures = []
if error is None:
    failures.append("no error")
elif expected[mistake] not in error or "the ranks of a replica with the same batch" not in error:
    failures.append(f"the error does not say that {expected[mistake]!r}: {error}")
if waited > 60:
    failures.append(f"the mistake was found after {waited:.1f} s (timeout 120 s)")
raise SystemExit(report.finish(failures))
