"""One rank of a 2-rank job whose second device is 20 times slower: a model of two Linear+ReLU pairs still gives
that rank a Linear (the partition puts parameters on every stage when enough modules have them), and trains; a model
with one module with parameters leaves that rank none, which it says, and its evaluation still runs. Exits 0 only
then."""

import contextlib
import io
import sys

import torch

import report
import smp

runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 4, "memory_weight": 0,
                    "device_speeds": [1, 0.05], "device": "cpu"})
failures = []
torch.manual_seed(0)
inputs, targets = torch.randn(4, 16), torch.randn(4, 8)

pairs = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8), torch.nn.ReLU())
model = smp.DistributedModel(pairs, inputs[:2])
names = [name for name, _ in model.named_parameters()]
if runtime.rank == 1 and names != ["2.weight", "2.bias"]:
    failures.append(f"the slow rank holds {names}, expected the second Linear's parameters")
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
optimizer.zero_grad()
model.train_step(inputs, targets, torch.nn.functional.mse_loss)
optimizer.step()

single = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Tanh())
said = io.StringIO()
with contextlib.redirect_stderr(said):
    lonely = smp.DistributedModel(single, inputs[:2])
message = said.getvalue()
if runtime.rank == 1:
    if list(lonely.parameters()) != []:
        failures.append("the slow rank got parameters of a model with one module that has any")
    if f"smp: rank 1 holds no parameters (its stages [1] have none)" not in message or \
            "partition_overrides" not in message:
        failures.append(f"the rank without parameters did not say so: {message!r}")
elif message:
    failures.append(f"rank 0, which holds the parameters, said: {message!r}")
output = lonely.evaluate(inputs, targets, torch.nn.functional.mse_loss)
if runtime.rank == 1 and not torch.isfinite(torch.as_tensor(output.loss)):
    failures.append(f"evaluation with a rank without parameters gave loss {output.loss}")
sys.exit(report.finish(failures))
