"""Model patterns that trained differently from PyTorch without an error, on 2 pipeline stages against plain PyTorch
on the same microbatches (every step's loss, then every parameter and buffer this rank holds):
  - an nn.Sequential calling one module twice (its second call was dropped);
  - a buffer written by two in-place operations in a row (the second ran out of place, lost to the buffer);
  - a call counter in a module that the cut splits into its children (refused as "outside any submodule");
  - a forward writing its input in place (microbatches were views sharing one version counter: autograd refused);
  - a head the forward never calls (its parameters were in no rank's state_dict, so not in checkpoints);
  - a batch norm called on two stages is refused (each stage would update a copy of its statistics);
  - a model whose layers are its own parameters (a ParameterList) is refused in its terms, not the partition's;
  - a frozen first stage clipped by the trainable parameters (an empty list there) joins the norm (it hung);
  - a frozen teacher in eval mode called under torch.no_grad() keeps its dropout off in train_step (it ran it);
and in evaluation, against the PyTorch model in eval mode:
  - stochastic depth (torchvision's, p 0.5) returns its input (it dropped rows in evaluate too);
  - the wrapped model keeps only this rank's tensors, and calling it says why (it ran half trained);
  - a forward branching on self.training is refused in evaluate, and in train_step in eval mode (evaluate computed
    the training branch);
  - the quick recording of both modes' calls (smp._mode_calls, which spares the eval-mode export) finds those paths
    equal only where evaluation computes the eval path: dropout, batch norm and attention's dropout by their flags,
    a buffer's update nothing reads; a branch, an in-place write, an extra output, a scalar, instance norm's
    statistics, a buffer read after its update, a tensor attribute chosen by the mode, a Python random draw and an
    input written in training only (a view taken before reads it) are left to the exports, and evaluate refuses the
    last.
Exits 0 only when all agree."""

import copy
import random
import warnings

import torch
import torch.nn.functional as F

import report
import smp

runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 4, "device": "cpu"})
failures = []
WIDTH = 8


class Running(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mean", torch.ones(WIDTH))

    def forward(self, x):
        self.mean.mul_(0.9)
        self.mean.add_(0.1 * x.detach().mean(0))
        return torch.tanh(self.lin(x - self.mean))


class Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


class Chain(torch.nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.a, self.middle, self.b, self.c = torch.nn.Linear(WIDTH, WIDTH), middle, torch.nn.Linear(WIDTH, WIDTH), \
            torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.middle(torch.tanh(self.a(x))))))


class WritesItsInput(Chain):
    def forward(self, x):
        x.mul_(2.0)
        return super().forward(x)


def reused_sequential():
    shared = torch.nn.Linear(WIDTH, WIDTH)
    return torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Tanh())


class Deep(torch.nn.Module):
    """Residual blocks behind stochastic depth, as torchvision's ConvNeXt and EfficientNet have them."""

    def __init__(self):
        super().__init__()
        from torchvision.ops import StochasticDepth
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.drop = torch.nn.ModuleList(StochasticDepth(0.5, "row") for _ in range(4))

    def forward(self, x):
        for block, drop in zip(self.blocks, self.drop):
            x = x + drop(torch.tanh(block(x)))
        return x


class WithUnusedHead(Chain):
    def __init__(self, middle):
        super().__init__(middle)
        self.unused_head = torch.nn.Linear(WIDTH, 2)


class Noisy(Chain):
    def forward(self, x):
        if self.training:
            x = x + 0.1
        return super().forward(x)


def check(label, build):
    torch.manual_seed(3)
    net = build()
    reference = copy.deepcopy(net)
    inputs, targets = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    model = smp.DistributedModel(net, inputs[:2])
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        loss = model.train_step(inputs.clone(), targets, F.mse_loss).loss  # clones: a forward may write its input
        optimizer.step()
        optimizer.zero_grad()
        expected = sum(F.mse_loss(reference(i.clone()), t) for i, t in zip(inputs.chunk(2), targets.chunk(2))) / 2
        expected.backward()
        plain.step()
        plain.zero_grad()
        if abs(loss - expected.item()) > 1e-6:
            failures.append(f"{label}, step {step}: loss {loss}, PyTorch {expected.item()}")
    whole = dict(reference.named_parameters()) | dict(reference.named_buffers())
    # A tensor under several names (a module called twice) is held under its first.
    names_of = {}
    for name, tensor in reference.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    own = model.state_dict()
    held = torch.tensor([float(any(n in own for n in names)) for names in names_of.values()])
    runtime.all_reduce_sum(held)
    lost = [names[0] for names, count in zip(names_of.values(), held.tolist()) if count == 0]
    if lost:
        failures.append(f"{label}: no rank's state_dict holds {lost}")
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not torch.allclose(tensor.float(), whole[name].float(), atol=1e-6):
            failures.append(f"{label}: {name} is {tensor.flatten()[:3].tolist()}, PyTorch {whole[name].flatten()[:3].tolist()}")


def check_frozen_stage_clipping():
    """A backbone frozen before wrapping, clipped as a fine-tuning loop does, by its trainable parameters: on the
    stage that holds none the list is empty, and that rank must still join the norm (it fell back to torch's own
    function and its peer waited for it until the timeout); get_total_norm's gradients alike. Run first: the empty
    list stands for the one model alive (with several, which is meant cannot be known, and it is refused)."""
    torch.manual_seed(4)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    for layer in list(net)[:3]:  # whatever the cut, stage 0's layers are all frozen
        layer.requires_grad_(False)
    net[0].weight.data.mul_(5)
    reference = copy.deepcopy(net)
    inputs, targets = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    model = smp.DistributedModel(net, inputs[:2])
    # A frozen teacher alive beside it (distillation): no rank trains it, so the empty list is still the student's.
    teacher = smp.DistributedModel(torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)
                                                         for _ in range(2)]), inputs[:2])
    trainable = [p for p in model.parameters() if p.requires_grad]
    empty = torch.tensor([float(not trainable)])
    runtime.all_reduce_sum(empty)
    if empty.item() != 1:
        failures.append(f"a frozen stage: {empty.item():.0f} ranks clip an empty list, not 1: the case is not tried")
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(trainable, lr=0.1)) if trainable else None
    plain = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        model.train_step(inputs, targets, F.mse_loss)
        if step == 0:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.05)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.requires_grad], 0.05, norm)
        if optimizer:
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.zero_grad()
        expected = sum(F.mse_loss(reference(i), t) for i, t in zip(inputs.chunk(2), targets.chunk(2))) / 2
        expected.backward()
        plain_norm = torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 0.05)
        plain.step()
        plain.zero_grad()
        if abs(norm.item() - plain_norm.item()) > 1e-5 * plain_norm.item():
            failures.append(f"a frozen stage, step {step}: norm {norm.item()} here, PyTorch {plain_norm.item()}")
    whole = dict(reference.named_parameters())
    for name, tensor in model.named_parameters():
        if not torch.allclose(tensor, whole[name], atol=1e-6):
            failures.append(f"a frozen stage: {name} differs from PyTorch's")
    del teacher


def check_frozen_teacher_under_no_grad():
    """A frozen teacher in eval mode, called under torch.no_grad() inside the trained model's forward (distillation):
    its dropout stays off in train_step, as its own flag says (export puts the no-grad region in a subgraph, whose
    operations were not seen following their module's flag: the teacher ran its dropout in training mode)."""
    class Distilled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Dropout(0.5),
                                               torch.nn.Linear(WIDTH, WIDTH))
            self.student = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                                               torch.nn.Linear(WIDTH, WIDTH))

        def forward(self, x):
            with torch.no_grad():
                taught = self.teacher(x)
            return self.student(x) - taught

    torch.manual_seed(6)
    net = Distilled()
    net.teacher.requires_grad_(False)
    reference = copy.deepcopy(net)
    inputs, targets = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    model = smp.DistributedModel(net, inputs[:2])
    model.train()
    net.teacher.eval()
    reference.train()
    reference.teacher.eval()
    for step in range(2):
        loss = model.train_step(inputs, targets, F.mse_loss).loss
        model.zero_grad()
        expected = sum(F.mse_loss(reference(i), t).item() for i, t in zip(inputs.chunk(2), targets.chunk(2))) / 2
        if abs(loss - expected) > 1e-6:
            failures.append(f"a frozen teacher under no_grad, step {step}: loss {loss}, PyTorch {expected}")


check_frozen_stage_clipping()
check_frozen_teacher_under_no_grad()
check("a Sequential calling one module twice", reused_sequential)
check("a buffer written twice in place", lambda: Chain(Running()))
check("a call counter in a module cut into its children", lambda: Chain(Counted()))
check("a forward writing its input in place", lambda: WritesItsInput(torch.nn.Linear(WIDTH, WIDTH)))
check("a head the forward never calls", lambda: WithUnusedHead(torch.nn.Linear(WIDTH, WIDTH)))


def check_evaluation():
    torch.manual_seed(4)
    net = Deep()
    reference = copy.deepcopy(net).eval()
    inputs, targets = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    model = smp.DistributedModel(net, inputs[:2])
    model.eval()
    with torch.no_grad():
        expected = sum(F.mse_loss(reference(i), t) for i, t in zip(inputs.chunk(2), targets.chunk(2))).item() / 2
        outputs = model(inputs)
    loss = model.evaluate(inputs, targets, F.mse_loss).loss
    if abs(loss - expected) > 1e-6:
        failures.append(f"stochastic depth in evaluate: loss {loss}, PyTorch in eval mode {expected}")
    if outputs is not None and not torch.allclose(outputs, reference(inputs), atol=1e-6):
        failures.append("stochastic depth: the outputs of model(inputs) in eval mode differ from PyTorch's")
    model.train()
    model.train_step(inputs, targets, F.mse_loss)  # training still drops rows: runs (its numbers are random)
    # The model given to DistributedModel keeps only this rank's tensors: run or saved, it would be half trained.
    if not any(t.is_meta for t in net.parameters()) or any(t.is_meta for _, t in model.named_parameters()):
        failures.append("the wrapped model kept the other stages' tensors (or lost this rank's)")
    report.expect_error(failures, "the wrapped model called after the wrapping", smp.ModelError,
                        "was given to smp.DistributedModel, which trains it in pieces", lambda: net(inputs))

    torch.manual_seed(4)
    model = smp.DistributedModel(Noisy(torch.nn.Linear(WIDTH, WIDTH)), inputs[:2])
    report.expect_error(failures, "evaluate of a forward branching on self.training", smp.ModelError,
                        "evaluate: Noisy's forward takes another path in eval mode than in training mode",
                        lambda: model.evaluate(inputs, targets, F.mse_loss))
    model.eval()
    report.expect_error(failures, "train_step in eval mode of a forward branching on self.training", smp.ModelError,
                        "train_step with modules in eval mode (Noisy",
                        lambda: model.train_step(inputs, targets, F.mse_loss))

    # A write into the input in training only, read through a view taken before it: evaluate computed the write.
    model = smp.DistributedModel(WritesInputInTraining(), inputs[:2].clone())
    report.expect_error(failures, "evaluate of a forward writing its input in training only", smp.ModelError,
                        "evaluate: WritesInputInTraining's forward takes another path in eval mode",
                        lambda: model.evaluate(inputs.clone(), targets, F.mse_loss))


class WritesInputInTraining(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        view = x.view(-1, WIDTH)
        if self.training:
            x.mul_(2)
        return self.second(torch.tanh(self.first(view)))


check_evaluation()


class Branches(torch.nn.Module):
    """One way of taking another path in eval mode per `kind`, or none ("dropout and batch norm", "buffer unread")."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin, self.aux = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 2)
        self.dropout, self.norm = torch.nn.Dropout(0.3), torch.nn.BatchNorm1d(WIDTH)
        self.instance = torch.nn.InstanceNorm1d(WIDTH, track_running_stats=True)
        self.register_buffer("calls", torch.zeros(WIDTH))
        self.scale_in_training, self.scale_in_eval = torch.full((WIDTH,), 2.0), torch.full((WIDTH,), 3.0)

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "dropout and batch norm":
            q = h.view(x.shape[0], 1, 2, WIDTH // 2)
            attended = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1 if self.training else 0.0)
            return self.norm(self.dropout(h)) + F.dropout(x, 0.2, self.training) + attended.reshape(h.shape)
        if self.kind == "buffer unread":
            if self.training:
                self.calls.add_(1)
            return h
        if self.kind == "buffer read after its update":
            if self.training:
                self.calls.add_(1)
            return h + self.calls
        if self.kind == "instance norm's statistics":
            return self.instance(h.unsqueeze(1)).squeeze(1)
        if self.kind == "an input written in training":  # read through a view taken before the write
            view = x.view(-1, WIDTH)
            if self.training:
                x.mul_(2)
            return self.lin(view)
        if self.kind == "a tensor attribute":  # neither parameter nor buffer
            return h * (self.scale_in_training if self.training else self.scale_in_eval)
        if self.kind == "a Python random draw":  # a layer drop: the capture baked in its own draw
            return h if self.training and random.random() < 0.5 else torch.tanh(h)
        if self.training:
            if self.kind == "a branch":
                h = torch.tanh(h)
            elif self.kind == "an in-place write":
                h[:, 0] = 0
            elif self.kind == "an extra output":
                return h, self.aux(h)
        if self.kind == "a scalar":
            return h * (2 if self.training else 3)
        return h


def check_quick_mode_answers():
    from smp import _mode_calls
    x = torch.randn(4, WIDTH)
    for kind, same in [("dropout and batch norm", True), ("buffer unread", True), ("a branch", False),
                       ("an in-place write", False), ("an extra output", False), ("a scalar", False),
                       ("instance norm's statistics", False), ("buffer read after its update", False),
                       ("a tensor attribute", False), ("a Python random draw", False),
                       ("an input written in training", False)]:
        answer = _mode_calls.same_in_both_modes(Branches(kind), (x.clone(),), {}, torch.device("cpu"), {})
        if answer != same:
            failures.append(f"the quick recording of both modes says {kind} is {'' if answer else 'not '}the same")


check_quick_mode_answers()

# A tensor under two names (the module called twice) loads by either, as PyTorch's load_state_dict does. Built under
# a seed per rank: the copies of the tie on the two stages start as the first holder's (they differed, silently).
torch.manual_seed(10 + runtime.rank)
tied = smp.DistributedModel(reused_sequential(), torch.randn(2, WIDTH))
held = [tensor.detach().double().sum() for name, tensor in tied.named_parameters() if name in ("0.weight", "2.weight")]
copy = held[0] if held else torch.tensor(0.0, dtype=torch.float64)
copies = torch.stack([torch.tensor(float(len(held[:1])), dtype=torch.float64), copy, copy * copy])
runtime.all_reduce_sum(copies)  # holders, the sum of their sums, of their squares: equal copies when sum^2 = 2 squares
if copies[0] != 2 or abs(copies[1] ** 2 - 2 * copies[2]) > 1e-9 * max(1.0, float(copies[2])):
    failures.append(f"a tied weight built under a seed per rank: its copies on the two stages differ "
                    f"(holders, sum, squares: {copies.tolist()})")
# model.state_dict() and optimizer.state_dict() hold this rank's share: said once on every rank (rank 0's alone
# before, the optimizer's never), and not by local_state_dict(), SMP's name for the share.
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    tied.state_dict()
    tied.state_dict()
    tied_optimizer = smp.DistributedOptimizer(torch.optim.SGD(tied.parameters(), lr=0.1))
    tied_optimizer.state_dict()
    if set(tied.local_state_dict()) != set(tied.state_dict()) or tied_optimizer.local_state_dict() is None:
        failures.append("local_state_dict() is not state_dict()'s share")
shares = [str(warning.message) for warning in said if "state_dict() holds" in str(warning.message)]
if len(shares) != 2 or not shares[0].startswith(f"rank {runtime.rank}: model.state_dict() holds this rank's share") \
        or not shares[1].startswith(f"rank {runtime.rank}: optimizer.state_dict() holds"):
    failures.append(f"rank {runtime.rank}: the state_dict() share warnings: {shares}")
tied.load_state_dict({"2.weight": torch.zeros(WIDTH, WIDTH)}, strict=False)
if any(name == "0.weight" and tensor.abs().sum() != 0 for name, tensor in tied.named_parameters()):
    failures.append("load_state_dict by a tied tensor's second name left it as it was")


class OwnParameters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(WIDTH, WIDTH)) for _ in range(3))

    def forward(self, x):
        for weight in self.weights:
            x = torch.tanh(F.linear(x, weight))
        return x


report.expect_error(failures, "a model whose layers are its own parameters", smp.ModelError,
                    "OwnParameters was captured as 1 module(s)",
                    lambda: smp.DistributedModel(OwnParameters(), torch.randn(2, WIDTH)))
bn = torch.nn.BatchNorm1d(WIDTH)
# First and last: on stage 0 and stage 1 whatever the cut.
report.expect_error(failures, "a batch norm called on two stages", smp.ModelError,
                    "buffer 'running_mean' is updated by the forward and held by nodes on stages 0, 1 (0, 3)",
                    lambda: smp.DistributedModel(torch.nn.Sequential(bn, torch.nn.Linear(WIDTH, WIDTH),
                                                                     torch.nn.Linear(WIDTH, WIDTH), bn),
                                                 torch.randn(2, WIDTH)))
raise SystemExit(report.finish(failures))
