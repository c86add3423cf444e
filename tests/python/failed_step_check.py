"""A 2-rank pipeline where one rank's step fails midway, its peer waiting for its transfers: both must raise (the
peer at once, naming the failed rank and why, not at the timeout) and refuse every later step (and optimizer step), never pair later
activations with earlier targets. Errors found before any transfer (a batch that does not split) leave the job in
step. Exits 0 only then."""

import copy
import sys
import time

import torch

import smp

runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 4, "pipeline": "1f1b",
                    "comm_timeout_s": 120, "device": "cpu"})
failures = []
torch.manual_seed(0)
inputs, targets = torch.randn(4, 16), torch.randn(4, 8)
failing_call = sys.argv[1] if len(sys.argv) > 1 else "train_step"
width = 2 ** 19 if failing_call == "evaluate" else 32
net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 8), torch.nn.ReLU())
net_reference = copy.deepcopy(net)
model = smp.DistributedModel(net, inputs[:2])
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def raised(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is what is checked
        return error
    return None




def fails_on_rank0():
    raise smp.ModelError("the model fails on the sample")


# What rank 0 alone computes (a profile, a plan) fails every rank with its kind of error: a loop catching
# smp.ModelError catches it everywhere (the others raised ConfigError).
error = raised(lambda: runtime._from_rank0("kind_check", fails_on_rank0))
if not isinstance(error, smp.ModelError) or "the model fails on the sample" not in str(error):
    failures.append(f"rank 0's ModelError reached rank {runtime.rank} as {error!r}")
# Targets as a dict of a float and a bool tensor reach the last stage's loss, each microbatch its own rows.
masked = model.evaluate(inputs, {"labels": targets, "keep": torch.tensor([True, True, False, True])},
                        lambda output, target: ((output - target["labels"]) ** 2).mean(1)[target["keep"]].sum() /
                        len(target["keep"])).loss
kept_rows = (torch.nn.functional.mse_loss(net_reference(inputs), targets, reduction="none").mean(1) *
             torch.tensor([1.0, 1.0, 0.0, 1.0])).sum().item() / 4
if abs(masked - kept_rows) > 1e-6:
    failures.append(f"a dict of targets gave loss {masked}, plain PyTorch {kept_rows}")
error = raised(lambda: model.train_step(inputs, targets[:3], torch.nn.functional.mse_loss))
if not isinstance(error, smp.ConfigError):
    failures.append(f"3 targets for 4 inputs raised {error!r}, expected ConfigError")
before = model.train_step(inputs, targets, torch.nn.functional.mse_loss).loss
optimizer.clip_grad_norm(1.0)
optimizer.step()
if not before > 0:
    failures.append(f"a step after a ConfigError gave loss {before}")


def failing_loss(outputs, target):
    raise ZeroDivisionError("the loss of a broken batch")


start = time.monotonic()
error = raised(lambda: getattr(model, failing_call)(inputs, targets, failing_loss))
waited = time.monotonic() - start
if runtime.rank == 1 and not isinstance(error, ZeroDivisionError):
    failures.append(f"the last stage's failing loss raised {error!r}")
if runtime.rank == 0:
    if not isinstance(error, smp.CommError) or "rank 1 left the job" not in str(error) or \
            "the loss of a broken batch" not in str(error):
        failures.append(f"the first stage, waiting for the failed rank, raised {error!r}")
    if waited > 60:
        failures.append(f"the first stage learned of the failure after {waited:.1f} s (timeout 120 s)")

for name, call in [("train_step", lambda: model.train_step(inputs, targets, torch.nn.functional.mse_loss)),
                   ("evaluate", lambda: model.evaluate(inputs, targets, torch.nn.functional.mse_loss)),
                   ("optimizer.step", optimizer.step), ("clip_grad_norm", lambda: optimizer.clip_grad_norm(1.0)),
                   ("all_reduce_sum", lambda: runtime.all_reduce_sum(torch.ones(1)))]:
    error = raised(call)
    if not isinstance(error, smp.CommError) or "left the job" not in str(error) or \
            "resume from the last checkpoint" not in str(error):
        failures.append(f"{name} after the failed step raised {error!r}, expected a refusal")

for failure in failures:
    print(f"rank {runtime.rank}: {failure}")
raise SystemExit(1 if failures else 0)
