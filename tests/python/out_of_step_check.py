"""Ranks that fall out of step or disagree, as programs do by mistake: every rank must raise at once, saying how (not
pair one call's activations with another's, train apart without a word, nor wait for the timeout).

  evaluate_alone: rank 0 evaluates after the first step while rank 1 goes on training (`if rank == 0:`).
  own_batch:      rank 1 draws a batch of its own, of the same shapes (an unseeded sampler).
  own_targets:    targets as a tuple (labels and a mask), rank 1's mask drawn apart: compared as one tensor's are.
  own_shapes:     rank 1 is given a batch of twice the samples: the ranks say the shapes each was given (neither
                  can tell which is the odd one; rank 1 blamed rank 0 without a shape).
  replica_batch:  two data-parallel replicas, rank 1 given another global batch (each replica takes its share of
                  the global batch, so the ranks must be given the same one); the replicas' models are initialized
                  under different seeds first, and must start from replica 0's weights (as under torch DDP).
  experts_alone:  two replicas dividing a mixture of experts' experts (expert parallelism), rank 0 evaluating alone:
                  the experts' exchange names the calls (Gloo aborted the process on the rows' sizes).
  whole_batch:    two replicas told of a global batch (next_call_takes_share_of, as a C++ program may) and then
                  given all of it each: their shares would count it twice.
  replica_refused: two replicas passing the engine their own shares (as a C++ program does), rank 1's refused (1
                  sample for 2 microbatches), which rank 1 skips to its next share while rank 0 trains on: that call
                  counts on rank 1, so the next pairs no shares of different calls (it did, silently).
  replica_skipped: the same from Python (replica_share=True), rank 1's share on the meta device: every rank learns
                  of the refusal at that call and refuses it too, so the loop skips the batch on every rank and
                  trains on (exits 0 only then).
  own_config:     rank 1 reads other microbatches: it refuses at smp.init, naming the key (the job then ends).
  own_model:      rank 1's model has one more layer: it refuses at DistributedModel, naming the module.
  replica_model:  rank 1's replica is wider: it refuses at DistributedModel, naming the parameter.

The first three exit 0 only when both ranks raised the expected error; the last three exit 1 on rank 1 with the
error, which the test reads."""

import os
import sys
import time

import torch

import report
import smp

mistake = sys.argv[1]
replicas = mistake in ("replica_batch", "replica_model", "experts_alone", "whole_batch", "replica_refused",
                       "replica_skipped")
keys = {"partitions": 1 if replicas else 2, "ddp": replicas, "microbatches": 2, "global_batch_size": 4, "pipeline": "1f1b",
        "comm_timeout_s": 120, "device": "cpu"}
if mistake == "experts_alone":
    keys["expert_parallel_degree"] = 2
if mistake == "own_config" and os.environ.get("RANK") == "1":
    keys["microbatches"] = 4
runtime = smp.init(keys)
torch.manual_seed(0)
inputs, targets = torch.randn(4, 16), torch.randn(4, 8)
torch.manual_seed(runtime.rank if mistake == "replica_batch" else 0)
hidden = 48 if mistake == "replica_model" and runtime.rank == 1 else 32
layers = [torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 8)]
if mistake == "own_model" and runtime.rank == 1:
    layers.append(torch.nn.Tanh())
net = torch.nn.Sequential(*layers)
loss = torch.nn.functional.mse_loss
if mistake == "experts_alone":
    import real_models
    net = real_models.language_model("mixtral")
    inputs, targets = real_models.batch("mixtral", 4, torch.Generator().manual_seed(0))
    loss = None
model = smp.DistributedModel(net, inputs[:2] if isinstance(inputs, torch.Tensor) else
                             {key: value[:1] for key, value in inputs.items()})
failures = []
if mistake == "replica_batch":
    first = [p.detach().clone() for _, p in model.named_parameters()]
    for tensor in first:
        runtime.all_reduce_sum(tensor)
    if not all(torch.allclose(total, 2 * p) for total, (_, p) in zip(first, model.named_parameters())):
        failures.append("the replicas did not start from replica 0's weights")
model.train_step(inputs, targets, loss)

start = time.monotonic()
error = None
try:
    if mistake in ("evaluate_alone", "experts_alone") and runtime.rank == 0:
        model.evaluate(inputs, targets, loss)
    own = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    engine_loss = lambda outputs, target: loss(outputs[0], target)  # noqa: E731 - the engine's form
    if mistake == "replica_refused":
        if runtime.rank == 1:
            try:
                model._model.train_step([torch.randn(1, 16)], targets[:1], engine_loss, False, [True])
                failures.append("rank 1's share was not refused")
            except smp.ConfigError:
                pass  # skipped, as a loop catching a bad batch would
        model._model.train_step([inputs[:2]], targets[:2], engine_loss, False, [True])
    elif mistake == "replica_skipped":
        bad = torch.randn(2, 16, device="meta") if runtime.rank == 1 else inputs[2:]
        try:
            model.train_step(bad, targets[:2], loss, replica_share=True)
            failures.append("the share rank 1 refused was trained on")
        except smp.ConfigError as refused:
            said = "meta device" if runtime.rank == 1 else "rank 1 refused its replica's share"
            if said not in str(refused):
                failures.append(f"the refusal does not say {said!r}: {refused}")
        share = slice(2 * runtime.dp_rank, 2 * runtime.dp_rank + 2)
        model.train_step(inputs[share], targets[share], loss, replica_share=True)  # the next batch, on every rank
        raise SystemExit(report.finish(failures))
    elif mistake == "whole_batch":
        model._model.next_call_takes_share_of([inputs], targets, [True])
        model._model.train_step([inputs], targets, lambda outputs, target: loss(outputs[0], target), False, [True])
    elif mistake == "own_targets":
        mask = torch.ones(4) if runtime.rank == 0 else torch.tensor([1.0, 0.0, 1.0, 1.0])
        model.train_step(inputs, (targets, mask),
                         lambda output, target: (((output - target[0]) ** 2).mean(1) * target[1]).mean())
    elif mistake == "own_shapes":
        model.train_step(torch.cat([inputs, inputs]) if runtime.rank == 1 else inputs,
                         torch.cat([targets, targets]) if runtime.rank == 1 else targets, loss)
    else:
        model.train_step(own if mistake in ("own_batch", "replica_batch") and runtime.rank == 1 else inputs, targets,
                         loss)
except (smp.CommError, smp.ModelError) as raised:  # a stage's failure: ModelError naming the stage and its cause
    error = str(raised)
waited = time.monotonic() - start

expected = {"evaluate_alone": "it is in its evaluate 1 after train_step 0, this rank in its train_step 1",
            "own_batch": "rank 1 was given a batch with other values than rank 0, in the same replica (train_step 1)",
            "replica_batch": "rank 1 was given a global batch with other values than rank 0 (train_step 1)",
            "own_targets": "rank 1 was given a batch with other values than rank 0, in the same replica (train_step 1)",
            "own_shapes": "in train_step 1 the two were given batches of other shapes; this rank's first microbatch: "
                          "inputs [4, 16], targets [",  # rank 1's, which rank 0 relays
            "experts_alone": f"expert parallelism: group rank {1 - runtime.rank} is in its "
                             f"{'train_step 1' if runtime.rank == 0 else 'evaluate 1 after train_step 0'}",
            "whole_batch": "the replicas' shares hold 8 samples in all, the global batch they were told of 4",
            "replica_refused": "the ranks are in different calls (rank 0 in train_step 1; rank 1 in train_step 2)"}
advice = {"replica_batch": "pass each replica's own share with replica_share=True",
          "whole_batch": "pass each replica its share (Runtime::replica_slice)",
          "experts_alone": "every rank must call train_step and evaluate alike",
          "replica_refused": "refuse a call its peers took"}
if error is None:
    failures.append("no error")
elif expected[mistake] not in error or advice.get(mistake, "the ranks of a replica with the same batch") not in error:
    failures.append(f"the error does not say that {expected[mistake]!r}: {error}")
if waited > 60:
    failures.append(f"the mistake was found after {waited:.1f} s (timeout 120 s)")
raise SystemExit(report.finish(failures))
