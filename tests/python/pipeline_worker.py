"""One rank of a job that trains through the smp Python package and, in the same process, the same model with plain
PyTorch on the whole global batch; every step's loss and, at the end, every parameter this rank holds must match.
Exits 0 only then, so `smprun -n N -- python pipeline_worker.py ...` fails when any rank differs. With
"device": "cuda" smp trains on the GPU against plain PyTorch on the CPU; without a GPU that exits 77 (skipped).

  --smp JSON     the config (as smp.init takes a dict)
  --model NAME   "sequential" (blocks with nested parameter names), "graph" (a residual and a skip across stages)
                 or "traced" (a model with a forward of its own, which smp traces with torch.fx)
  --steps N
  --optimizer    "sgd" (torch.optim.SGD, momentum 0.9) or "adamw" (torch.optim.AdamW with two parameter groups,
                 weight decay on matrices only, and a LambdaLR warm-up); Adam turns float rounding in near-zero
                 gradients into updates of the learning rate's size, so compare it with a looser --rtol
  --rtol R       a parameter matches when max |smp - plain| <= 1e-5 + R * max |plain| (default 1e-4); under bf16 or
                 fp16 (against float32 PyTorch) losses must match within R too
  --script       hand smp the modules compiled with torch.jit.script (TorchScript) instead of as they are
  --replica-share  each replica hands smp only its own share of every batch (replica_share=True), as a job
                 whose replicas load their own data does
  --nan-step K   the loss is NaN at step K (run with "nonfinite": "skip"): smp must drop that step, and
                 DistributedOptimizer.step() must not move the weights (momentum would), as plain PyTorch skipping it
"""

import argparse
import copy
import json
import sys

import torch
import torch.nn.functional as F

import smp
import report


class Block(torch.nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = torch.nn.Linear(inputs, outputs)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Add(torch.nn.Module):
    def forward(self, a, b):
        return a + b


WIDTH, OUTPUTS = 16, 4


def sequential_model():
    return torch.nn.Sequential(Block(WIDTH, 32), Block(32, 32), Block(32, 32), Block(32, 32), Block(32, 32),
                               torch.nn.Linear(32, OUTPUTS))


# name, module, inputs: a residual around b1 and a skip from b0 to the head's input.
def graph_nodes():
    return [("b0", Block(WIDTH, 32), ["x"]), ("b1", Block(32, 32), ["b0"]), ("mix", Add(), ["b1", "b0"]),
            ("b2", Block(32, 32), ["mix"]), ("b3", Block(32, 32), ["b2"]), ("skip", Add(), ["b3", "b0"]),
            ("head", torch.nn.Linear(32, OUTPUTS), ["skip"])]


class WithAuxiliary(torch.nn.Module):
    """Returns (output, auxiliary), as nn.MultiheadAttention returns (output, weights); the model uses [0]."""

    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        return y, y.sum()


class TracedModel(torch.nn.Module):
    """A forward of its own: residuals written inline, a ModuleList, shape arithmetic, a buffer of the model, a
    child returning a tuple, a skip from the first block to the head, in-place operations, a child's weight used
    again in the forward (tied), and one block called twice (shared weights, typically on two stages)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(WIDTH, 32)
        self.blocks = torch.nn.ModuleList([Block(32, 32) for _ in range(3)])
        self.blocks[2] = self.blocks[0]
        self.mixer = WithAuxiliary(32)
        self.head = torch.nn.Linear(32, OUTPUTS)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))

    def forward(self, x):
        h = self.embed(x)
        first = h * 1.0
        for block in self.blocks:
            h = h + block(h)
        h = self.mixer(h)[0] * self.scale
        h.mul_(0.5)  # in place, its result unused: later readers of h must see it
        batch = h.size(0)
        h = (h.reshape(batch, 4, 8) * 0.5).reshape(batch, -1)
        first.add_(0.1)  # in place on a value made stages earlier
        tied = F.linear(h, self.embed.weight.t())  # the embedding's weight again, as a tied LM head uses it
        return self.head(h + first) + tied[:, :OUTPUTS]


def graph_forward(nodes, x):
    values = {"x": x}
    for name, module, inputs in nodes:
        values[name] = module(*[values[i] for i in inputs])
    return values[nodes[-1][0]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smp", required=True)
    parser.add_argument("--model", choices=["sequential", "graph", "traced"], default="sequential")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--script", action="store_true")
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--replica-share", action="store_true")
    args = parser.parse_args()
    config = json.loads(args.smp)
    torch.set_num_threads(1)
    if config.get("device") == "cuda" and not torch.cuda.is_available():
        print("skipped: the config asks for a GPU and torch sees none", flush=True)
        return 77

    runtime = smp.init(config)
    torch.manual_seed(config.get("seed", 0))
    if args.model == "sequential":
        net = sequential_model()
        reference = copy.deepcopy(net)
        reference_forward = reference
        reference_parameters = dict(reference.named_parameters())
        model_input = torch.jit.script(net) if args.script else net
    elif args.model == "traced":
        net = TracedModel()
        reference = copy.deepcopy(net)
        reference_forward = reference
        reference_parameters = dict(reference.named_parameters())
        model_input = net
    else:
        nodes = graph_nodes()
        reference_nodes = copy.deepcopy(nodes)
        reference_forward = lambda x: graph_forward(reference_nodes, x)  # noqa: E731
        reference_parameters = {f"{name}.{p}": t for name, module, _ in reference_nodes
                                for p, t in module.named_parameters()}
        model_input = smp.GraphModel("x")
        for name, module, inputs in nodes:
            model_input.add(name, torch.jit.script(module) if args.script else module, inputs)

    global_batch = config["global_batch_size"]
    microbatch = global_batch // runtime.data_parallel_degree // config["microbatches"]
    data = torch.Generator().manual_seed(7)
    batches = [(torch.randn(global_batch, WIDTH, generator=data), torch.randn(global_batch, OUTPUTS, generator=data))
               for _ in range(args.steps)]

    model = smp.DistributedModel(model_input, batches[0][0][:microbatch])
    schedulers = []
    failures = []
    sharded = config.get("shard_optimizer_state") and runtime.data_parallel_degree > 1
    if sharded:
        # What sharding cannot take is refused, naming why.
        stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        stepped.state[next(model.parameters())]["momentum_buffer"] = torch.zeros(1)
        for label, make, needle in [("a stepped optimizer", lambda: stepped, "must not have stepped yet"),
                                    ("LBFGS", lambda: torch.optim.LBFGS(model.parameters()), "LBFGS")]:
            try:
                smp.DistributedOptimizer(make())
                failures.append(f"{label} was accepted with sharded optimizer state")
            except ValueError as error:
                if needle not in str(error):
                    failures.append(f"{label}: unexpected message {error}")
    if args.optimizer == "sgd":
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        reference_optimizer = torch.optim.SGD(reference_parameters.values(), lr=0.1, momentum=0.9)
    else:
        def adamw(named):
            # Parameter groups with options of their own: no weight decay on biases.
            groups = [{"params": [p for p in named.values() if p.dim() >= 2], "weight_decay": 0.05},
                      {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=1e-2)

        optimizer = smp.DistributedOptimizer(adamw(dict(model.named_parameters())))
        reference_optimizer = adamw(reference_parameters)
        warm_up = lambda step: min(1.0, (step + 1) / 2)  # noqa: E731
        schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, warm_up),  # smp's optimizer as torch.optim's
                      torch.optim.lr_scheduler.LambdaLR(reference_optimizer, warm_up)]

    # Losses match to float rounding in float32; under bf16/fp16 autocast to the parameters' tolerance.
    loss_tolerance = args.rtol if config.get("bf16") or config.get("fp16") else 1e-5
    runs_last_stage = runtime.config.num_stages() - 1 in model.stages

    def own_share(*tensors):
        # What a replica loading only its own data would have: its block of the global batch, by dp_rank.
        if not args.replica_share:
            return tensors + ({},)
        share = tensors[0].shape[0] // runtime.data_parallel_degree
        return tuple(t[runtime.dp_rank * share:(runtime.dp_rank + 1) * share] for t in tensors) + \
            ({"replica_share": True},)

    def check_outputs(when, outputs, expected):
        # keep_outputs: the replica's outputs on the rank running the last stage, none elsewhere.
        if not runs_last_stage:
            if outputs is not None:
                failures.append(f"{when}: outputs on a rank without the last stage")
        elif outputs is None or outputs.shape != expected.shape:
            failures.append(f"{when}: outputs {None if outputs is None else tuple(outputs.shape)}, "
                            f"plain PyTorch {tuple(expected.shape)}")
        else:
            # Under bf16/fp16 single outputs stray by several percent where the averaged losses and parameters stay
            # within tolerance: there the mean difference is held to a quarter of the mean output, which a wrong or
            # misplaced microbatch (a difference the size of the outputs) still breaks.
            deviation = (outputs.cpu().double() - expected.double()).abs()
            if config.get("bf16") or config.get("fp16"):
                difference, scale, tolerance = deviation.mean(), expected.abs().mean(), 0.25
            else:
                difference, scale, tolerance = deviation.max(), expected.abs().max(), args.rtol
            if difference > 1e-5 + tolerance * scale:
                failures.append(f"{when}: outputs differ from plain PyTorch's by {difference:.3g} (scale {scale:.3g})")
    for step, (inputs, targets) in enumerate(batches):
        inner_calls = sharded and step % 2 == 1
        if not inner_calls:
            optimizer.zero_grad()
        if step == args.nan_step:
            output = model.train_step(inputs, targets, lambda out, target: F.mse_loss(out, target) * float("nan"))
            if not output.skipped or optimizer.step():
                failures.append(f"step {step}: a NaN loss was not dropped (skipped {output.skipped})")
            continue
        if inner_calls:
            # Loops that call the inner optimizer directly (as LR schedulers hold it) must train the same: its
            # zero_grad clears every gradient, its step shares the updates.
            optimizer.optimizer.zero_grad()
            output = model.train_step(inputs, targets, F.mse_loss)
            if args.clip and step % 4 == 1:  # as a ported loop clips: torch's function, by the whole model's norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            elif args.clip:  # or in its two halves, the norm of every gradient (over every stage) then the scaling
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.clip, norm)
            optimizer.optimizer.step()
        else:
            *batch, share = own_share(inputs, targets)
            output = model.train_step(*batch, F.mse_loss, keep_outputs=True, **share)
            if args.clip:
                optimizer.clip_grad_norm(args.clip)
            optimizer.step()
        reference_optimizer.zero_grad()
        reference_output = reference_forward(inputs)
        if not inner_calls:
            check_outputs(f"step {step}", output.outputs, runtime.replica_slice(reference_output.detach()))
        loss = F.mse_loss(reference_output, targets)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(list(reference_parameters.values()), args.clip)
        reference_optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        if abs(output.loss - loss.item()) > loss_tolerance * max(1.0, abs(loss.item())):
            failures.append(f"step {step}: loss {output.loss} under smp, {loss.item()} in plain PyTorch")
        held_out = (torch.randn(global_batch, WIDTH, generator=data), torch.randn(global_batch, OUTPUTS, generator=data))
        *batch, share = own_share(*held_out)
        evaluated = model.evaluate(*batch, F.mse_loss, keep_outputs=True, **share)
        evaluation = evaluated.loss
        with torch.no_grad():
            expected_outputs = reference_forward(held_out[0])
            expected = F.mse_loss(expected_outputs, held_out[1]).item()
        check_outputs(f"evaluation after step {step}", evaluated.outputs, runtime.replica_slice(expected_outputs))
        if abs(evaluation - expected) > loss_tolerance * max(1.0, abs(expected)):
            failures.append(f"step {step}: evaluation loss {evaluation} under smp, {expected} in plain PyTorch")

    parameters = dict(model.named_parameters())
    if sharded:
        trainable = sum(1 for p in parameters.values() if p.requires_grad)
        held = sum(1 for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
        if held >= trainable:
            failures.append(f"the sharded optimizer holds {held} of this rank's {trainable} trainable parameters")
        # A replica's share loads into that replica only: another's would fit by shape and train on wrong moments.
        state = optimizer.state_dict()
        state["smp_optimizer_shard"] = dict(state["smp_optimizer_shard"], replica=1 - runtime.dp_rank)
        try:
            optimizer.load_state_dict(state)
            failures.append("another replica's optimizer state_dict was accepted")
        except ValueError as error:
            if "replica" not in str(error):
                failures.append(f"loading another replica's state: unexpected message {error}")
        optimizer.load_state_dict(optimizer.state_dict())
    def difference(name):
        return (parameters[name].detach().cpu() - reference_parameters[name].detach()).abs().max().item()

    mismatched = [name for name in parameters
                  if difference(name) > 1e-5 + args.rtol * reference_parameters[name].detach().abs().max().item()]
    failures += [f"parameter {name} differs by up to {difference(name):.3g}" for name in mismatched]
    print(f"rank {runtime.rank} stages {model.stages}: {len(parameters)} parameters checked, "
          f"{len(mismatched)} mismatches", flush=True)
    return report.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
