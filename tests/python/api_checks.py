"""The smp Python package's contract in one process (run under `smprun -n 1`): errors name what is wrong, and the
parameters it returns are the engine's own tensors. Exits 0 when every check holds; prints each failure."""

import copy
import io
import os
import sys
import tempfile
import types
import warnings

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_ as imported_before_init  # as ported training scripts import it

import smp
import report

failures = []


def expect_error(what, error_type, needle, action):
    report.expect_error(failures, what, error_type, needle, action)


def main():
    torch.set_num_threads(1)
    expect_error("use before init", RuntimeError, "smp.init",
                 lambda: smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.zeros(1, 2)))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as bad:
        bad.write('{"smp": {"partitions": 2, "microbatchs": 4}}')
        bad.flush()
        expect_error("unknown key in a file", smp.ConfigError, "microbatchs", lambda: smp.init(bad.name))
    expect_error("ConfigError is a ValueError", ValueError, "partitions", lambda: smp.init({"partitions": 0}))
    expect_error("nan in a dict", smp.ConfigError, "key \"memory_limit_mb\": nan is not a JSON value",
                 lambda: smp.init({"partitions": 1, "memory_limit_mb": float("nan")}))
    expect_error("too many stages for the launch", smp.ConfigError, "2", lambda: smp.init({"partitions": 2}))
    # Keys beside the "smp" section: an smp key there is misplaced; a section the application does not read is an
    # error once it names the ones it does.
    expect_error("an smp key at the top level", smp.ConfigError, '"checkpoint_dir" is at the top level',
                 lambda: smp.init({"smp": {"partitions": 1}, "checkpoint_dir": "/tmp/nowhere"}))
    expect_error("a section the application does not read", smp.ConfigError, 'unknown top-level key "trainig"',
                 lambda: smp.init({"smp": {"partitions": 1}, "model": {}, "trainig": {}},
                                  sections=("model", "training")))

    runtime = smp.init({"partitions": 1, "microbatches": 2, "global_batch_size": 4, "device": "cpu"})
    if (runtime.rank, runtime.world_size, runtime.pp_rank, runtime.dp_rank) != (0, 1, 0, 0):
        failures.append(f"runtime of one process: rank {runtime.rank} of {runtime.world_size}")

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise KeyError("no such table")

    expect_error("a module whose Python forward raises", smp.ModelError, 'module "0"',
                 lambda: smp.DistributedModel(torch.nn.Sequential(Broken()), torch.zeros(2, 3)))

    # Eager modules may use what TorchScript cannot (here a Python dict and a lambda); they train in place.
    class PythonOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.activations = {"tanh": torch.tanh, "square": lambda t: t * t}

        def forward(self, x):
            return self.activations["tanh"](self.linear(x))

    python_only = torch.nn.Sequential(PythonOnly(), torch.nn.Linear(3, 2))
    eager_model = smp.DistributedModel(python_only, torch.zeros(2, 3))
    eager_optimizer = smp.DistributedOptimizer(torch.optim.SGD(eager_model.parameters(), lr=0.5))
    weight_before = python_only[0].linear.weight.detach().clone()
    eager_optimizer.zero_grad()
    eager_model.train_step(torch.randn(4, 3), torch.randn(4, 2), F.mse_loss)
    eager_optimizer.step()
    if torch.equal(python_only[0].linear.weight.detach(), weight_before):
        failures.append("an eager module's own parameters did not change after a step")
    if "0.linear.weight" not in dict(eager_model.named_parameters()):
        failures.append(f"eager parameter names: {sorted(dict(eager_model.named_parameters()))}")
    # keep_outputs: one process runs the last stage, so the outputs are the model's for the whole batch, in order.
    batch = torch.randn(4, 3)
    kept = eager_model.evaluate(batch, torch.randn(4, 2), F.mse_loss, keep_outputs=True).outputs
    with torch.no_grad():
        if kept is None or not torch.allclose(kept, python_only(batch), atol=1e-6):
            failures.append(f"evaluate(keep_outputs=True) gave {kept}")
    if eager_model.evaluate(batch, torch.randn(4, 2), F.mse_loss).outputs is not None:
        failures.append("evaluate without keep_outputs kept outputs")
    # A share of another size than global_batch_size's (an epoch's short last batch, loaded per replica) trains.
    eager_model.train_step(torch.randn(2, 3), torch.randn(2, 2), F.mse_loss, replica_share=True)
    expect_error("targets of another batch than the inputs", smp.ConfigError,
                 "evaluate: 3 targets, but no input has a first dimension of that size (inputs [4, 3])",
                 lambda: eager_model.evaluate(batch, torch.randn(3, 2), F.mse_loss))
    expect_error("a loss of several values", smp.ModelError,
                 "the loss function returned a tensor of shape [2, 2] for microbatch 0: it must reduce the microbatch",
                 lambda: eager_model.train_step(batch, torch.randn(4, 2), lambda output, target: (output - target) ** 2))
    expect_error("a loss detached from the output", smp.ModelError, "the loss of microbatch 0 does not require gradients",
                 lambda: eager_model.train_step(batch, torch.randn(4, 2),
                                                lambda output, target: F.mse_loss(output, target).detach()))
    # all_reduce_sum: in place, also into a strided view (summed through a dense copy); bool is refused.
    counts = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    view = counts[:, ::2]
    if runtime.all_reduce_sum(view) is not view:
        failures.append("all_reduce_sum does not return the tensor it summed into")
    if not torch.equal(counts, torch.arange(6, dtype=torch.float64).reshape(2, 3)):
        failures.append(f"all_reduce_sum over one rank changed a strided view: {counts}")
    expect_error("all_reduce_sum of bools", smp.ConfigError, "non-bool",
                 lambda: runtime.all_reduce_sum(torch.ones(2, dtype=torch.bool)))
    expect_error("not a module", TypeError, "torch.nn.Module", lambda: smp.DistributedModel(len, torch.zeros(2, 3)))
    expect_error("an averaged copy of the model (EMA)", TypeError, "keep one of this rank's model.state_dict()",
                 lambda: torch.optim.swa_utils.AveragedModel(eager_model))
    expect_error("a dict sample for a forward that takes one dict", smp.ModelError,
                 "takes one dict, 'batch': give the sample and the batches as a one-element tuple",
                 lambda: smp.DistributedModel(TakesOneDict(), {"image": torch.zeros(2, 4)}))
    with tempfile.NamedTemporaryFile("wb", suffix=".pt") as not_a_model:
        not_a_model.write(b"not a model")
        not_a_model.flush()
        expect_error("a file that is no smp model", smp.CheckpointError, "unreadable",
                     lambda: smp.load_full_model(not_a_model.name))
    if smp.latest_checkpoint(tempfile.gettempdir() + "/no-such-smp-checkpoints") is not None:
        failures.append("latest_checkpoint of a missing directory is not None")

    # Models with a forward of their own are traced with torch.fx; what cannot be cut into stages is refused.
    class Branching(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else x  # control flow on a tensor's value

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x, y):
            return self.a(x) + y

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x), x

    class UsesBoth(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            out, skip = self.pair(x)
            return out + skip

    expect_error("a forward torch.fx cannot trace", smp.ModelError, "cannot trace Branching's forward",
                 lambda: smp.DistributedModel(Branching(), torch.zeros(2, 3)))
    expect_error("a forward of two inputs", smp.ModelError, "takes 2 inputs without defaults",
                 lambda: smp.DistributedModel(TwoInputs(), torch.zeros(2, 3)))

    class WithDefaults(torch.nn.Module):  # as Hugging Face models take optional masks
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x, mask=None, scale: float = 2.0):
            y = self.a(x)
            if mask is not None:
                y = y * mask
            return y * scale

    with_defaults = WithDefaults()
    sample = torch.randn(2, 3)
    if not torch.allclose(smp.GraphModel.from_module(with_defaults, sample).forward(sample), with_defaults(sample)):
        failures.append("a forward with defaulted parameters traces to something else than the model")
    # torch.export takes what torch.fx refused: a tuple output (an input among it), two elements of a child's
    # tuple, the model's own parameters used in its forward. Each trains as plain PyTorch does.
    def same_step(net, loss):
        reference = copy.deepcopy(net)
        model = smp.DistributedModel(net, torch.zeros(2, 3))
        inputs, targets = torch.randn(4, 3), torch.randn(4, 3)
        smp_loss = model.train_step(inputs, targets, loss).loss
        plain = sum(loss(reference(chunk), target).item() for chunk, target in zip(inputs.chunk(2), targets.chunk(2)))
        return abs(smp_loss - plain / 2) < 1e-6

    def tuple_loss(output, target):
        return F.mse_loss(output[0] * output[1], target)

    for what, net, loss in [("a forward returning a tuple with its input", Pair(), tuple_loss),
                            ("two elements of a child's tuple", UsesBoth(), F.mse_loss),
                            ("a parameter of the model itself", torch.nn.Linear(3, 3), F.mse_loss)]:
        try:
            if not same_step(net, loss):
                failures.append(f"{what}: the loss differs from plain PyTorch")
        except Exception as error:  # noqa: BLE001 - reported as a failure
            failures.append(f"{what}: {type(error).__name__}: {error}")

    class Scaled(torch.nn.Module):
        def forward(self, a, s: float = 1.0):
            return a * s

    class CallsScripted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.scaled = torch.jit.script(Scaled())

        def forward(self, x):
            return self.scaled(self.a(x), 3.0)

    expect_error("a scripted child called with a constant", smp.ModelError, "scripted child 'scaled'",
                 lambda: smp.DistributedModel(CallsScripted(), torch.zeros(2, 3)))

    # Traced graphs compute what the model computes, in-place operations included.
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 4)
            self.b = torch.nn.Linear(4, 4)
            self.relu = torch.nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.a(x) * 1.0
            g = self.b(h)
            h.add_(1.0)        # result unused: what reads h after it must see the change
            torch.tanh_(h)     # a torch function writing in place
            z = self.relu(g)   # a child writing into its input
            return h.sum(-1, keepdim=True) + z + g

    torch.manual_seed(5)
    in_place = InPlace()
    sample = torch.randn(2, 3)
    traced = smp.GraphModel.from_module(in_place, sample)
    if not torch.allclose(traced.forward(sample), in_place(sample)):
        failures.append("a traced model with in-place operations computes something else than the model")
    # A write through a view changes the tensor it views (and a write into a tensor, its views): plain PyTorch sees
    # it through the shared memory, stages would not; refused when the other one is read after the write.
    class Writes(torch.nn.Module):
        def __init__(self, body, second_width=4):
            super().__init__()
            self.a = torch.nn.Linear(3, 4)
            self.b = torch.nn.Linear(second_width, 4)
            self.body = body

        def forward(self, x):
            return self.body(self, x)

    def through_view(self, x):
        h = self.a(x)
        h.view(-1).mul_(2.0)
        return self.b(h)

    def under_view(self, x):
        h = self.a(x)
        first = h[:, :2]
        h.mul_(2.0)
        return self.b(first)

    def into_own_view(self, x):  # the base is not read again: fine
        h = self.a(x).view(-1, 4)
        h.mul_(2.0)
        return self.b(h)

    def index_of_child_output(self, x):  # an integer index of a child's tensor output is a view too
        h = self.a(x)
        first = h[0]
        h.mul_(2.0)
        return self.b(first)

    def copies_and_shapes(self, x):  # copies, tuples of separate tensors and shape reads share nothing written
        h = self.a(x)
        y = h.transpose(0, 1).contiguous()  # a copy
        y.mul_(2.0)
        values, indexes = h.max(1)
        values.mul_(2.0)
        flat = h.flatten()
        flat.mul_(0.5)  # writes into h itself...
        return self.b(y.t() + indexes.unsqueeze(1).float() + values.unsqueeze(1) + h.size(0))  # ...h read for shape only

    expect_error("a write through a view", smp.ModelError, "shares memory with a",
                 lambda: smp.GraphModel.from_module(Writes(through_view), torch.randn(2, 3)))
    # Captured with torch.export, a write through a view runs out of place and the viewed tensor is scattered anew;
    # a write under a view read afterwards is still refused.
    torch.manual_seed(6)
    viewed = Writes(through_view)
    plain_viewed = copy.deepcopy(viewed)
    data, wanted = torch.randn(4, 3), torch.randn(4, 4)
    captured_loss = smp.DistributedModel(viewed, data[:2]).train_step(data, wanted, F.mse_loss).loss
    if abs(captured_loss - F.mse_loss(plain_viewed(data), wanted).item()) > 1e-6:
        failures.append("a write through a view, captured: another loss than the model's")
    expect_error("a write under a view, captured", smp.ModelError, "shares memory with slice",
                 lambda: smp.DistributedModel(Writes(under_view, second_width=2), torch.randn(2, 3)))
    expect_error("a write under a view", smp.ModelError, "shares memory with getitem",
                 lambda: smp.GraphModel.from_module(Writes(under_view, second_width=2), torch.randn(2, 3)))
    expect_error("a write under an integer index of a child's output", smp.ModelError, "shares memory with getitem",
                 lambda: smp.GraphModel.from_module(Writes(index_of_child_output), torch.randn(2, 3)))
    for body in (into_own_view, copies_and_shapes):
        model = Writes(body)
        sample = torch.randn(2, 3)
        if not torch.allclose(smp.GraphModel.from_module(model, sample).forward(sample), model(sample)):
            failures.append(f"a traced model ({body.__name__}) computes something else than the model")
    # An operation that reads a child's weight before the child runs: the weight keeps the child's name, as in the
    # model's state_dict (what export and load_state_dict go by).
    def reads_before_call(self, x):
        return self.b(self.a(x) * self.b.weight.sum())

    early = smp.DistributedModel(Writes(reads_before_call), torch.randn(2, 3))
    if [name for name, _ in early.named_parameters()] != [name for name, _ in Writes(reads_before_call).named_parameters()]:
        failures.append(f"parameters named {[name for name, _ in early.named_parameters()]}, not as in the model's named_parameters()")
    expect_error("a sample the model rejects", smp.ModelError, "0",
                 lambda: smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(3, 3)), torch.zeros(2, 5)))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = smp.DistributedModel(net, torch.zeros(2, 3))
    names = sorted(dict(model.named_parameters()))
    if names != sorted(name for name, _ in net.named_parameters()):
        failures.append(f"parameter names {names} differ from the model's state_dict names")
    if not all(torch.equal(dict(model.named_parameters())[n], dict(net.named_parameters())[n]) for n in names):
        failures.append("the distributed model does not start from the model's weights")

    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    inputs, targets = torch.randn(4, 3), torch.randn(4, 2)
    before = dict(model.named_parameters())["0.weight"].clone()
    optimizer.zero_grad()
    output = model.train_step(inputs, targets, F.mse_loss)
    optimizer.step()
    if torch.equal(dict(model.named_parameters())["0.weight"], before):
        failures.append("a step left the parameters as they were (named_parameters must share the engine's tensors)")
    if not output.loss > 0:
        failures.append(f"step loss {output.loss}")
    expect_error("a loss that returns no tensor", smp.ModelError, "float",
                 lambda: model.train_step(inputs, targets, lambda output, target: 1.0))
    optimizer.zero_grad()
    model.train_step(inputs, targets, F.mse_loss)
    gradients_before = [p.grad.clone() for p in model.parameters()]
    expect_error("a loss that raises", ZeroDivisionError, "division",
                 lambda: model.train_step(inputs, targets, lambda output, target: 1 / 0))
    if not all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), gradients_before)):
        failures.append("a step that failed changed the gradients earlier steps left")
    model.train_step(inputs, targets, F.mse_loss)  # accumulates: twice the same batch, twice the gradient
    if not all(torch.allclose(p.grad, 2 * g, rtol=1e-5, atol=1e-7) for p, g in zip(model.parameters(), gradients_before)):
        failures.append("a second train_step without zero_grad did not add its gradients to the first's")
    # A loss that is its microbatch's part of the global batch's (a sum over the global count, as with Hugging
    # Face's num_items_in_batch): loss_reduction="sum" adds the parts, the global batch's mean loss and gradient.
    model.zero_grad()
    summed = model.train_step(inputs, targets, lambda output, target: ((output - target) ** 2).sum() / targets.numel(),
                              loss_reduction="sum")
    plain = copy.deepcopy(net)
    for (_, parameter), (_, trained) in zip(plain.named_parameters(), model.named_parameters()):
        parameter.data.copy_(trained.data)
    expected = F.mse_loss(plain(inputs), targets)
    expected.backward()
    if abs(summed.loss - expected.item()) > 1e-6 or not all(
            torch.allclose(p.grad, q.grad, atol=1e-7) for p, q in zip(plain.parameters(), model.parameters())):
        failures.append(f"loss_reduction=\"sum\": loss {summed.loss}, the batch's {expected.item()}, or its gradient")
    expect_error("another loss_reduction", smp.ConfigError, "loss_reduction must be",
                 lambda: model.train_step(inputs, targets, F.mse_loss, loss_reduction="none"))
    expect_error("the optimizer of an older API", TypeError, "torch.optim",
                 lambda: smp.DistributedOptimizer(model, "adamw"))
    expect_error("an optimizer over tensors no DistributedModel trains", ValueError, "model.parameters()",
                 lambda: smp.DistributedOptimizer(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)))
    expect_error("an optimizer over a model's tensors and others", ValueError, "1 tensor",
                 lambda: smp.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [torch.zeros(2, requires_grad=True)], lr=0.1)))
    expect_error("an optimizer that leaves out a parameter", ValueError, "2.bias",
                 lambda: smp.DistributedOptimizer(torch.optim.SGD(list(model.parameters())[:-1], lr=0.1)))
    expect_error("a batch of fewer samples than microbatches", smp.ConfigError,
                 "train_step: a global batch of 1 samples is fewer than 1 replicas x 2 microbatches",
                 lambda: model.train_step(torch.randn(1, 3), torch.randn(1, 2), F.mse_loss))
    # Targets as a tuple or dict (labels and a mask): each microbatch's loss gets its rows of every one.
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    def masked(output, target):
        labels, mask = (target["labels"], target["mask"]) if isinstance(target, dict) else target
        return ((output - labels) ** 2 * mask[:, None]).sum() / (2 * len(mask))

    plain = model.evaluate(x, y, lambda output, target: F.mse_loss(output, target, reduction="sum") / (2 * len(target)))
    for given in ((y, torch.ones(4)), {"labels": y, "mask": torch.ones(4)}):
        taken = model.evaluate(x, given, masked).loss
        if abs(taken - plain.loss) > 1e-6:
            failures.append(f"targets as a {type(given).__name__}: loss {taken}, as one tensor {plain.loss}")
    half = model.evaluate(x, (y, torch.tensor([1.0, 1.0, 0.0, 0.0])), masked).loss
    first_rows = model.evaluate(x[:2], y[:2], lambda output, target: F.mse_loss(output, target, reduction="sum") / 4)
    if abs(half - first_rows.loss) > 1e-6:  # each microbatch weighed by its share of the batch
        failures.append(f"a mask's rows went to other microbatches: loss {half}, expected {first_rows.loss}")
    expect_error("targets of other row counts", smp.ConfigError, "splits along its first dimension",
                 lambda: model.train_step(x, (y, torch.ones(3)), masked))
    expect_error("a dict of targets without a loss function", smp.ConfigError, "need a loss function",
                 lambda: model.train_step(x, {"labels": y}))
    expect_error("a batch on the meta device", smp.ConfigError, "is on the meta device, which holds no values",
                 lambda: model.train_step(torch.randn(4, 3, device="meta"), torch.randn(4, 2), F.mse_loss))
    # torch's clipping over some of a model's parameters (the whole model's is checked against PyTorch by the
    # pipeline jobs): refused on every rank, before any communication, rather than clipped by part of a norm.
    expect_error("torch's clip_grad_norm_ over some of the parameters", ValueError, "pass model.parameters()",
                 lambda: torch.nn.utils.clip_grad_norm_(list(model.parameters())[:1], 1.0))
    expect_error("torch's clip_grad_norm_ by another norm", ValueError, "norm_type inf",
                 lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf")))
    expect_error("torch's clip_grad_norm_ imported before smp.init", ValueError, "pass model.parameters()",
                 lambda: imported_before_init(list(model.parameters())[:1], 1.0))
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    expect_error("torch's get_total_norm over some of the gradients", ValueError, "pass every gradient",
                 lambda: torch.nn.utils.get_total_norm(gradients[:1]))
    expect_error("torch's get_total_norm by another norm", ValueError, "norm_type 1",
                 lambda: torch.nn.utils.get_total_norm(gradients, norm_type=1))

    # Keyword inputs (as a Hugging Face model takes them): what does not fit the captured sample is refused before
    # any communication, naming the input.
    class KeywordModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, input_ids, attention_mask=None, labels=None, scale=1.0):
            hidden = self.embed(input_ids) * attention_mask[..., None] * scale
            logits = self.head(hidden).mean(1)
            return {"logits": logits, "loss": F.cross_entropy(logits, labels)} if labels is not None else {"logits": logits}

    def keyword_batch(samples, with_labels=True):
        batch = {"input_ids": torch.randint(0, 10, (samples, 5)), "attention_mask": torch.ones(samples, 5)}
        if with_labels:
            batch["labels"] = torch.randint(0, 3, (samples,))
        return batch

    keyword = smp.DistributedModel(KeywordModel(), keyword_batch(2))
    keyword.train_step(keyword_batch(4))  # loss=None: the model's own
    expect_error("an input the sample did not have", smp.ConfigError, "'token_type_ids' was not in the sample",
                 lambda: keyword.train_step(dict(keyword_batch(4), token_type_ids=torch.zeros(4, 5))))
    expect_error("an input missing that the sample had", smp.ConfigError, "no 'labels'",
                 lambda: keyword.train_step(keyword_batch(4, with_labels=False)))
    scaled = smp.DistributedModel(KeywordModel(), dict(keyword_batch(2), scale=1.0))
    expect_error("a flag other than the sample's", smp.ConfigError, "capture keeps as it was",
                 lambda: scaled.train_step(dict(keyword_batch(4), scale=2.0)))
    keyword.train_step(keyword_batch(3))  # microbatches of 2 and 1 (export's least of 2 is not enforced)
    keyword.train_step(keyword_batch(5))  # microbatches of 3 and 2 samples
    keyword.train_step(keyword_batch(6))  # microbatches of 3 samples, captured on 2: the shapes may change
    keyword.train_step({"input_ids": torch.randint(0, 10, (4, 9)), "attention_mask": torch.ones(4, 9),
                        "labels": torch.randint(0, 3, (4,))})  # and the sequence's length
    expect_error("inputs whose lengths the model needs equal", smp.ConfigError, "needs them equal",
                 lambda: keyword.train_step(dict(keyword_batch(4), attention_mask=torch.ones(4, 6))))
    keyword.train_step(keyword_batch(2))  # microbatches of 1

    # A batch norm frozen with .eval() inside a model in training keeps its statistics, as in PyTorch: each captured
    # operation follows its own module's flag; the wrapper's train() reaches them all.
    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm, self.head = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.norm(self.linear(x)))

    torch.manual_seed(3)
    normed_net = Normed()
    reference = copy.deepcopy(normed_net)
    normed = smp.DistributedModel(normed_net, torch.randn(2, 3))
    normed_net.norm.eval()
    reference.norm.eval()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    statistics = normed_net.norm.running_mean.clone()
    frozen_loss = normed.train_step(x, y, F.mse_loss).loss
    expected = sum(F.mse_loss(reference(x[i:i + 2]), y[i:i + 2]).item() for i in (0, 2)) / 2
    if not torch.equal(normed_net.norm.running_mean, statistics) or abs(frozen_loss - expected) > 1e-6 * abs(expected):
        failures.append(f"a frozen batch norm: loss {frozen_loss} against PyTorch's {expected}, statistics "
                        f"{'kept' if torch.equal(normed_net.norm.running_mean, statistics) else 'changed'}")
    normed.train()
    normed.train_step(x, y, F.mse_loss)
    if torch.equal(normed_net.norm.running_mean, statistics):
        failures.append("after the wrapper's train(), the batch norm still kept its statistics")

    # Code that branches on a size the capture let change: export followed the sample's branch, and guards it.
    class ThreeRowsDiffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            out = self.linear(x)
            return out * 0 if x.shape[0] == 3 else out

    branching = smp.DistributedModel(ThreeRowsDiffer(), torch.randn(2, 3))
    branching.train_step(torch.randn(8, 3), torch.randn(8, 2), F.mse_loss)  # microbatches of 4 rows
    expect_error("microbatches of a size the model's code branches on", smp.ConfigError, "x.size()[0] != 3",
                 lambda: branching.train_step(torch.randn(6, 3), torch.randn(6, 2), F.mse_loss))
    expect_error("an id beyond the embedding table, before any communication", smp.ConfigError,
                 "row 12 of 'embed.weight', which has 10 rows",
                 lambda: keyword.train_step(dict(keyword_batch(4), input_ids=torch.full((4, 5), 12))))
    expect_error("a loss the model does not compute", smp.ModelError, "holds no loss",
                 lambda: smp.DistributedModel(KeywordModel(), keyword_batch(2, False)).train_step(keyword_batch(4, False)))
    logits = keyword.evaluate(keyword_batch(4), keep_outputs=True).outputs["logits"]
    if tuple(logits.shape) != (4, 3):
        failures.append(f"evaluate(keep_outputs=True) of a dict output: logits of shape {tuple(logits.shape)}")
    fixed = smp.DistributedModel(KeywordModel(), keyword_batch(2), dynamic_shapes="none")
    expect_error("another length where dynamic_shapes is \"none\"", smp.ConfigError,
                 "dynamic_shapes={'input_ids': [0, 1]}, the dimensions that may change",
                 lambda: fixed.train_step({"input_ids": torch.randint(0, 10, (4, 9)), "attention_mask": torch.ones(4, 9),
                                           "labels": torch.randint(0, 3, (4,))}))
    dynamic_shapes_choices()

    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)

        def forward(self, x, mask=None):
            return self.a(x) if mask.sum() > 0 else x  # control flow on a tensor's value

    expect_error("a model torch.export cannot capture", smp.ModelError, "mask.sum() > 0",
                 lambda: smp.DistributedModel(DataDependent(), {"x": torch.zeros(2, 3), "mask": torch.ones(2)}))

    # A model handed over in eval mode (as from_pretrained gives it) is captured in training mode, and trains in
    # eval mode as PyTorch would until the wrapper's train(): then train_step uses dropout and batch statistics (and
    # updates them), evaluate neither; attention's dropout is off in evaluate.
    class Regularized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.norm = torch.nn.BatchNorm1d(8)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            h = self.drop(self.norm(self.linear(x)))
            q = h.view(2, 1, 4, 2)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0).reshape(2, 8)

    regularized_net = Regularized().eval()
    statistics = regularized_net.norm.running_mean.clone()
    regularized = smp.DistributedModel(regularized_net, torch.randn(2, 8))
    regularized.train_step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss)
    if not torch.equal(statistics, regularized_net.norm.running_mean):
        failures.append("a model in eval mode updated batch norm's statistics in train_step")
    regularized.train()
    regularized.train_step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss)
    if torch.equal(statistics, regularized_net.norm.running_mean):
        failures.append("after train(), a model captured from eval mode did not update batch norm's statistics")
    probe = torch.randn(4, 8)
    first = regularized.evaluate(probe, torch.zeros(4, 8), F.mse_loss, keep_outputs=True).outputs
    second = regularized.evaluate(probe, torch.zeros(4, 8), F.mse_loss, keep_outputs=True).outputs
    with torch.no_grad():
        plain = torch.cat([regularized_net.eval()(chunk) for chunk in probe.chunk(2)])
    if not torch.equal(first, second) or not torch.allclose(first, plain, atol=1e-6):
        failures.append("evaluate of a captured model draws dropout (batch norm, attention) or differs from eval mode")

    # Stochastic depth (a random write into a fresh tensor) is captured; a random value read apart by two nodes and a
    # buffer updated by the model's own forward are refused, naming them.
    from torchvision.ops import StochasticDepth

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.depth = StochasticDepth(0.2, "row")

        def forward(self, x):
            return x + self.depth(self.linear(x))

    smp.DistributedModel(Deep(), torch.zeros(2, 3)).train_step(torch.randn(4, 3), torch.randn(4, 3), F.mse_loss)

    class RandomPair(torch.nn.Module):  # no children to cut it into: each value it returns would be a node
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3, 3))

        def forward(self, x):
            h = F.dropout(x @ self.weight, 0.5)
            return h * 2.0, h + 1.0

    class TwoReads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = RandomPair()

        def forward(self, x):
            a, b = self.pair(x)
            return torch.tanh(a) * torch.sigmoid(b)

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.steps.add_(1)
            return self.linear(x)

    # A random value read apart is drawn once, in a node of its own, and both values see the same dropout mask.
    pair = smp.DistributedModel(TwoReads().pair, torch.ones(2, 3))
    kept = pair.train_step(torch.ones(4, 3), None, lambda output, _: output[0].sum() + output[1].sum(),
                           keep_outputs=True).outputs
    if kept is None or not torch.allclose(kept[0] / 2 + 1, kept[1]) or bool((kept[0] != 0).all()):
        failures.append(f"a random value read apart: its readers saw different draws ({kept})")
    expect_error("a buffer the model's own forward updates", smp.ModelError, "updates a buffer in place",
                 lambda: smp.DistributedModel(Counting(), torch.zeros(2, 3)))

    # Built on the meta device: a module without reset_parameters() needs init_fn, and the error names it.
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.factor

    class MetaModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.scale = Scale()

        def forward(self, x):
            return self.scale(self.linear(x))

    with torch.device("meta"):
        meta_chain = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    expect_error("a meta-built Sequential", smp.ModelError, "forward of its own",
                 lambda: smp.DistributedModel(meta_chain, torch.zeros(2, 3)))
    with torch.device("meta"):
        meta_net = MetaModel()
    expect_error("a meta module without reset_parameters", smp.ModelError, "module 'scale' (Scale)",
                 lambda: smp.DistributedModel(meta_net, torch.zeros(2, 3)))
    with torch.device("meta"):
        meta_net, reference_net = MetaModel(), MetaModel()

    def ones_for_scale(module):
        if isinstance(module, Scale):
            torch.nn.init.ones_(module.factor)
        else:
            module.reset_parameters()

    smp.materialize(reference_net, seed=runtime.config.seed, init_fn=ones_for_scale)
    meta_model = smp.DistributedModel(meta_net, torch.zeros(2, 3), init_fn=ones_for_scale)
    if not all(torch.equal(p, dict(reference_net.named_parameters())[n]) for n, p in meta_model.named_parameters()):
        failures.append("a meta-built model's weights differ from smp.materialize's with the same seed")

    # A scripted module with a forward of its own (a residual) cannot be cut as a chain of its children.
    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) + x)

    expect_error("a scripted module that is not a Sequential", TypeError, "scripted Residual",
                 lambda: smp.DistributedModel(torch.jit.script(Residual()), torch.zeros(2, 3)))

    # evaluate() runs in eval mode: dropout off, batch norm on running statistics that it leaves unchanged; the
    # next training step is in training mode again.
    torch.manual_seed(1)
    regularized = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                      torch.nn.Linear(8, 2))
    reference = copy.deepcopy(regularized).eval()
    model = smp.DistributedModel(regularized, torch.zeros(2, 3))
    inputs, targets = torch.randn(4, 3), torch.randn(4, 2)
    first = model.evaluate(inputs, targets, F.mse_loss).loss
    second = model.evaluate(inputs, targets, F.mse_loss).loss
    with torch.no_grad():
        expected = F.mse_loss(reference(inputs), targets).item()
    if abs(first - expected) > 1e-6 or first != second:
        failures.append(f"evaluate in eval mode: {first}, then {second}; eval-mode PyTorch gives {expected}")
    torch.manual_seed(2)
    trained = [model.train_step(inputs, targets, F.mse_loss).loss for _ in range(2)]
    if abs(trained[0] - expected) < 1e-6 or trained[0] == trained[1]:
        failures.append(f"train_step after evaluate is not in training mode (dropout): losses {trained}")
    # The model's random stream seeded anew: the same dropout masks again (torch.manual_seed does not reach it).
    model.manual_seed(7)
    seeded = model.train_step(inputs, targets, F.mse_loss).loss
    torch.manual_seed(99)
    model.manual_seed(7)
    again = model.train_step(inputs, targets, F.mse_loss).loss
    model.manual_seed(8)
    other = model.train_step(inputs, targets, F.mse_loss).loss
    if seeded != again or seeded == other:
        failures.append(f"model.manual_seed: losses {seeded}, {again} (the same seed), {other} (another)")
    # Each module gets its own mode back after evaluate, not the model's: a batch norm the program froze stays
    # frozen (its running statistics unchanged by the next step), and a model in eval mode stays so after a call.
    regularized[1].eval()
    frozen = regularized[1].running_mean.clone()
    model.evaluate(inputs, targets, F.mse_loss)
    model.train_step(inputs, targets, F.mse_loss)
    if regularized[1].training or not regularized[2].training or not torch.equal(regularized[1].running_mean, frozen):
        failures.append(f"evaluate changed the modules' own modes: batch norm training {regularized[1].training}, "
                        f"dropout training {regularized[2].training}")
    model.eval()
    model(inputs)
    if any(module.training for module in regularized.modules()):
        failures.append(f"calling a model in eval mode put modules in training mode: "
                        f"{[module.training for module in regularized.modules()]}")
    model.train()
    # The wrapped model's modules through the wrapper, by their names in it, as DistributedDataParallel's module
    # gives them: fine-tuning's freeze of batch norm by walking model.modules() or model.apply reaches it.
    if dict(model.named_modules()).get("1") is not regularized[1] or model.get_submodule("1") is not regularized[1] \
            or model.get_parameter("0.weight") is not dict(model.named_parameters())["0.weight"]:
        failures.append(f"model.named_modules() gives {list(dict(model.named_modules()))}, not the model's modules")
    model.apply(lambda module: module.eval() if isinstance(module, torch.nn.BatchNorm1d) else None)
    frozen = regularized[1].running_mean.clone()
    model.train_step(inputs, targets, F.mse_loss)
    if regularized[1].training or not torch.equal(regularized[1].running_mean, frozen):
        failures.append("model.apply(freeze batch norm) did not reach the model's batch norm")
    # Within a parent's walk the wrapper stands alone: its tensors this rank's, not the modules' of other stages.
    if [name for name, _ in torch.nn.ModuleDict({"student": model}).named_modules()] != ["", "student"]:
        failures.append("a module holding the wrapper walks into the wrapped model's modules")
    expect_error("model.apply(half)", ValueError, "model.apply changed the dtype",
                 lambda: model.apply(lambda module: module.double() if isinstance(module, torch.nn.Linear) else None))
    for module in regularized.modules():
        module.float()
    model.train()

    class Merging(torch.nn.Linear):  # a LoRA layer's way: eval() merges its adapter, train() unmerges it
        merged = False

        def train(self, mode=True):
            self.merged = not mode
            return super().train(mode)

    merging = torch.nn.Sequential(Merging(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    wrapped = smp.DistributedModel(merging, torch.zeros(2, 3))
    wrapped.evaluate(inputs, targets, F.mse_loss)
    if merging[0].merged or not merging[0].training:
        failures.append("evaluate gave a module its training mode back without its own train(): still merged")

    expect_error("extra_state that cannot be saved", TypeError, "a list_iterator has no state_dict()",
                 lambda: smp.Checkpointer(model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                                          extra_state={"loader": iter([])}))

    fused_runs()
    pytorch_conventions()
    sync_batch_norm_math()
    hugging_face_checkpointing_said()
    items_counted()
    uneven_batches()
    one_tensor_as_two_inputs()
    scripted = torch.jit.script(torch.nn.Linear(4, 4))
    expect_error("a TorchScript module used twice", smp.ModelError, "node '2' shares parameter 'weight' with node '0'",
                 lambda: smp.DistributedModel(torch.nn.Sequential(scripted, torch.nn.ReLU(), scripted), torch.randn(2, 4)))
    return report.finish(failures)


def dynamic_shapes_choices():
    """Every dimension may change by default (an image's size too); dynamic_shapes holds the ones it does not name."""
    def image_model():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))

    class Images(torch.nn.Module):  # a forward of its own: captured with torch.export
        def __init__(self):
            super().__init__()
            self.net = image_model()

        def forward(self, x):
            return self.net(x)

    images = torch.randn(6, 3, 12, 10)
    targets = torch.randint(0, 3, (6,))
    sample = torch.randn(2, 3, 8, 8)
    plain = Images()
    loss = smp.DistributedModel(Images(), sample).train_step(images, targets, F.cross_entropy).loss
    expected = F.cross_entropy(plain(images), targets).item()
    if abs(loss - expected) > 1e-5 * abs(expected):
        failures.append(f"an image of another size than the sample's: loss {loss}, plain PyTorch {expected}")
    held = smp.DistributedModel(Images(), sample, dynamic_shapes={"x": [0]})
    held.train_step(torch.randn(6, 3, 8, 8), targets, F.cross_entropy)  # microbatches of 3: the batch changes
    expect_error("an image of another size where dynamic_shapes holds it", smp.ConfigError,
                 "dynamic_shapes={'x': [0, 2]}", lambda: held.train_step(images, targets, F.cross_entropy))
    expect_error("a plan where dynamic_shapes holds the batch", smp.ConfigError, "first dimension must stay free",
                 lambda: smp.plan(Images(), sample, world_size=2, dynamic_shapes={"x": [2, 3]}))
    expect_error("dynamic_shapes of an unknown kind", smp.ConfigError, "dynamic_shapes must be",
                 lambda: smp.DistributedModel(Images(), sample, dynamic_shapes="some"))
    expect_error("dynamic_shapes naming no input", smp.ConfigError, "'pixels', which the sample does not give",
                 lambda: smp.DistributedModel(Images(), sample, dynamic_shapes={"pixels": [2]}))
    expect_error("dynamic_shapes naming no dimension", smp.ConfigError, "dimension 4",
                 lambda: smp.DistributedModel(Images(), sample, dynamic_shapes={"x": [4]}))
    # A size the code takes alone (a convolution's 3 input channels), said as the input's mistake.
    expect_error("grayscale images for a model of 3 channels", smp.ConfigError,
                 "input 'x' has 1 at dimension 1, where the model's code takes 3 alone",
                 lambda: smp.DistributedModel(Images(), sample).train_step(torch.randn(6, 1, 8, 8), targets,
                                                                           F.cross_entropy))


def fused_runs():
    """A captured model's consecutive nodes on one stage run as one call per microbatch, with the same results; a
    failure inside names the run's first and last module."""
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 3)
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 3)

        def forward(self, ids):
            hidden = self.a(self.embed(ids))
            return self.b(torch.relu(hidden)) + hidden

    torch.manual_seed(3)
    net = Tokens()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, torch.zeros(1, 4, dtype=torch.long))
    nodes, calls = len(model._graph.node_names()), model._model.calls_per_microbatch()
    if nodes < 2 or calls != {0: 1}:
        failures.append(f"{nodes} captured nodes on one stage ran in {calls} calls per microbatch, expected 1")
    inputs, targets = torch.randint(0, 8, (2, 4)), torch.randn(2, 4, 3)
    loss = model.train_step(inputs, targets, F.mse_loss).loss
    expected = F.mse_loss(reference(inputs), targets).item()
    if abs(loss - expected) > 1e-6:
        failures.append(f"fused run: loss {loss}, PyTorch {expected}")
    expect_error("a failure inside a fused run", smp.ModelError, '"embed" to "',
                 lambda: model.train_step(inputs.short(), targets, F.mse_loss))  # ids embedding does not take
    # Floats where the sample had ids: refused before any rank computes, where inside the step it would end the job.
    expect_error("float ids", smp.ConfigError, "the model would read rows of 'embed.weight' at torch.float32 positions",
                 lambda: model.train_step(torch.full((2, 4), 1.5), targets, F.mse_loss))


class SummedOverItems(torch.nn.Module):
    """A loss as Hugging Face models compute it given num_items_in_batch: a sum over the items, divided by the global
    batch's count."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x, labels, num_items_in_batch):
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).sum() / num_items_in_batch}


class SummedOverItemsWithAux(SummedOverItems):
    """And a mixture of experts' router loss beside it, as Hugging Face's add it: a mean over the batch's own rows."""
    config = types.SimpleNamespace(router_aux_loss_coef=0.5)

    def forward(self, x, labels, num_items_in_batch):
        auxiliary = self.linear(x).pow(2).mean()
        loss = super().forward(x, labels, num_items_in_batch)["loss"] + self.config.router_aux_loss_coef * auxiliary
        return {"loss": loss, "aux_loss": auxiliary}


class SummedOverTokensThroughKwargs(torch.nn.Module):
    """As Hugging Face's causal LMs take num_items_in_batch: through **kwargs, on to the loss; batches of tokens."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x, labels, **kwargs):
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).sum() / kwargs["num_items_in_batch"]}


class TakesOneDict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, batch):
        return self.linear(batch["image"])


class LossOfItsOwn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, inputs, labels):
        return {"loss": F.mse_loss(self.linear(inputs), labels)}


def one_tensor_as_two_inputs():
    """A sample giving one tensor as two inputs (labels=input_ids): the capture read the labels where the model reads
    its inputs, wrong once a batch's labels differ."""
    torch.manual_seed(7)
    net = LossOfItsOwn()
    reference = copy.deepcopy(net)
    same = torch.randn(2, 4)
    model = smp.DistributedModel(net, {"inputs": same, "labels": same})
    inputs, labels = torch.randn(4, 4), torch.randn(4, 4)
    loss = model.train_step({"inputs": inputs, "labels": labels}).loss
    expected = sum(reference(i, t)["loss"].item() for i, t in zip(inputs.chunk(2), labels.chunk(2))) / 2
    if abs(loss - expected) > 1e-6:
        failures.append(f"a sample giving one tensor as two inputs: loss {loss}, PyTorch {expected}")


def uneven_batches():
    """A batch that does not split evenly into microbatches (an epoch's last) runs them at two sizes, each counted by
    its samples: the loss, gradients and evaluation are the whole batch's mean, its kept outputs all its rows."""
    torch.manual_seed(8)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, torch.zeros(2, 3))
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    loss = model.train_step(x, y, F.mse_loss).loss
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    if abs(loss - expected.item()) > 1e-6:
        failures.append(f"7 samples in 2 microbatches: loss {loss}, PyTorch's on the whole batch {expected.item()}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7):
            failures.append(f"7 samples in 2 microbatches: {name}'s gradient differs from PyTorch's on the whole batch")
    evaluation = model.evaluate(x, y, F.mse_loss, keep_outputs=True)
    with torch.no_grad():
        outputs = reference(x)
    if abs(evaluation.loss - F.mse_loss(outputs, y).item()) > 1e-6 or evaluation.outputs is None or \
            not torch.allclose(evaluation.outputs, outputs, rtol=1e-5, atol=1e-6):
        failures.append(f"evaluating 7 samples in 2 microbatches: loss {evaluation.loss}, kept outputs "
                        f"{None if evaluation.outputs is None else tuple(evaluation.outputs.shape)}")

    # A captured batch norm in training given a microbatch of 1 sample: refused, as PyTorch refuses it (the capture,
    # on 2 samples, would have taken its statistics over one value a channel, a NaN variance); in evaluation, on its
    # running statistics, it runs.
    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))

        def forward(self, x):
            return self.body(x)

    normed = smp.DistributedModel(Normed(), torch.zeros(2, 3))
    expect_error("a 1-sample microbatch through batch norm in training", smp.ConfigError, "more than 1 value per channel",
                 lambda: normed.train_step(torch.randn(3, 3), torch.randn(3, 2), F.mse_loss))

    # Over images one sample holds many values a channel: PyTorch takes a microbatch of 1, and so does smp.
    class Convolved(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                            torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(10)
    convolved = Convolved()
    plain = copy.deepcopy(convolved)
    images, wanted = torch.randn(3, 2, 6, 6), torch.randn(3, 2)
    loss = smp.DistributedModel(convolved, torch.zeros(2, 2, 6, 6)).train_step(images, wanted, F.mse_loss).loss
    expected = sum(F.mse_loss(plain(x), y).item() * len(x) / 3 for x, y in zip(images.tensor_split(2),
                                                                                wanted.tensor_split(2)))
    if abs(loss - expected) > 1e-5:
        failures.append(f"a 1-sample microbatch through BatchNorm2d: loss {loss}, PyTorch's {expected}")
    if not torch.isfinite(torch.tensor(normed.evaluate(torch.randn(3, 3), torch.randn(3, 2), F.mse_loss).loss)):
        failures.append("evaluating 3 samples (microbatches of 2 and 1) through batch norm gave no finite loss")


def items_counted():
    """num_items_in_batch: train_step's loss is the whole batch's sum over its count (the engine's mean over
    microbatches would divide it again)."""
    torch.manual_seed(6)
    net = SummedOverItems()
    reference = copy.deepcopy(net)
    x, labels = torch.randn(4, 3), torch.randn(4)
    count = torch.tensor(4.0)
    model = smp.DistributedModel(net, {"x": x[:2], "labels": labels[:2], "num_items_in_batch": count})
    loss = model.train_step({"x": x, "labels": labels, "num_items_in_batch": count}).loss
    expected = reference(x, labels, count)["loss"].item()
    if abs(loss - expected) > 1e-6:
        failures.append(f"num_items_in_batch: train_step's loss {loss}, PyTorch's on the whole batch {expected}")
    # A batch that splits unevenly (microbatches of 3 and 2): the parts are added up, not weighed by their sizes.
    odd_x, odd_labels, odd_count = torch.randn(5, 3), torch.randn(5), torch.tensor(5.0)
    loss = model.train_step({"x": odd_x, "labels": odd_labels, "num_items_in_batch": odd_count}).loss
    expected = reference(odd_x, odd_labels, odd_count)["loss"].item()
    if abs(loss - expected) > 1e-6:
        failures.append(f"num_items_in_batch, 5 samples in 2 microbatches: train_step's loss {loss}, PyTorch's on the "
                        f"whole batch {expected}")
    # Given as an int (a program's own loop), the count may change from step to step as a tensor's does.
    torch.manual_seed(6)
    model = smp.DistributedModel(SummedOverItems(), {"x": x[:2], "labels": labels[:2], "num_items_in_batch": 2})
    for count in (4, 5):
        loss = model.train_step({"x": odd_x[:count], "labels": odd_labels[:count], "num_items_in_batch": count}).loss
        expected = reference(odd_x[:count], odd_labels[:count], count)["loss"].item()
        if abs(loss - expected) > 1e-6:
            failures.append(f"num_items_in_batch as the int {count}: train_step's loss {loss}, PyTorch's {expected}")
    # The router's auxiliary loss is each microbatch's mean, averaged, not multiplied by the microbatches.
    net = SummedOverItemsWithAux()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, {"x": x[:2], "labels": labels[:2], "num_items_in_batch": count})
    loss = model.train_step({"x": x, "labels": labels, "num_items_in_batch": count}).loss
    pieces = [reference(xs, ls, count) for xs, ls in zip(x.chunk(2), labels.chunk(2))]
    expected = sum(p["loss"].item() - 0.5 * p["aux_loss"].item() for p in pieces) + \
        0.5 * sum(p["aux_loss"].item() for p in pieces) / 2
    if abs(loss - expected) > 1e-6:
        failures.append(f"num_items_in_batch with a router's auxiliary loss: train_step's loss {loss}, the token "
                        f"sum's global mean plus the microbatches' mean auxiliary loss {expected}")
    # Through **kwargs, where torch 2.11's export takes no dynamic shapes: batches of another length (dynamic
    # padding) still run on the sample's capture.
    net = SummedOverTokensThroughKwargs()
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, {"x": torch.randn(2, 5, 3), "labels": torch.randn(2, 5),
                                       "num_items_in_batch": torch.tensor(10.0)})
    for length in (7, 4):
        x, labels, count = torch.randn(4, length, 3), torch.randn(4, length), torch.tensor(4.0 * length)
        loss = model.train_step({"x": x, "labels": labels, "num_items_in_batch": count}).loss
        expected = reference(x, labels, num_items_in_batch=count)["loss"].item()
        if abs(loss - expected) > 1e-5:
            failures.append(f"num_items_in_batch through **kwargs, sequences of {length}: train_step's loss {loss}, "
                            f"PyTorch's on the whole batch {expected}")


def hugging_face_checkpointing_said():
    """A model whose own gradient checkpointing is on (Hugging Face's gradient_checkpointing_enable, before wrapping)
    recomputes nothing under smp: said, naming the config key (the partition report showed no recompute, silently)."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    net.is_gradient_checkpointing = True
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        smp.DistributedModel(net, torch.zeros(2, 4))
    if not any("\"activation_checkpointing\"" in str(w.message) for w in said):
        failures.append(f"gradient checkpointing on before wrapping was not said: {[str(w.message) for w in said]}")


def sync_batch_norm_math():
    """smp's SyncBatchNorm operation (smp._sync_batch_norm) in one process, where pooling over replicas sums one
    replica's: nn.BatchNorm2d's outputs, gradients and running statistics in float64, in training and eval mode, with
    and without running statistics (eval mode without them dropped the batch statistics' terms of the gradient)."""
    from smp import _sync_batch_norm
    for training, tracked in ((True, True), (True, False), (False, True), (False, False)):
        torch.manual_seed(9)
        plain = torch.nn.BatchNorm2d(3, momentum=0.3, track_running_stats=tracked).double().train(training)
        synced = torch.nn.SyncBatchNorm(3, momentum=0.3, track_running_stats=tracked).double().train(training)
        synced.load_state_dict(plain.state_dict())
        synced.forward = _sync_batch_norm._pooled_forward(synced, 2)  # the replicas' path
        x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
        x_plain, x_synced = x.clone().requires_grad_(), x.clone().requires_grad_()
        upstream = torch.randn_like(x)
        (plain(x_plain) * upstream).sum().backward()
        (synced(x_synced) * upstream).sum().backward()
        pairs = [(x_plain.grad, x_synced.grad), (plain.weight.grad, synced.weight.grad),
                 (plain.bias.grad, synced.bias.grad)] + list(zip(plain.buffers(), synced.buffers()))
        if not all(torch.allclose(a.double(), b.double(), atol=1e-12) for a, b in pairs):
            failures.append(f"SyncBatchNorm's operation (training {training}, running statistics {tracked}) "
                            "differs from nn.BatchNorm2d's")


def pytorch_conventions():
    """DistributedModel is an nn.Module and DistributedOptimizer a torch.optim.Optimizer, as PyTorch code expects."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, torch.zeros(2, 4))
    if not isinstance(model, torch.nn.Module):
        failures.append("DistributedModel is not an nn.Module")
    names = [name for name, _ in model.named_parameters()]
    if names != [name for name, _ in reference.named_parameters()]:
        failures.append(f"named_parameters() yields {names}, not the model's names in its order")
    if not all(isinstance(p, torch.nn.Parameter) or p.requires_grad for p in model.parameters()):
        failures.append("parameters() does not yield the trained tensors")
    if list(model.state_dict()) != list(reference.state_dict()):
        failures.append(f"state_dict() keys {list(model.state_dict())}, the model's {list(reference.state_dict())}")
    # What training loops written for DistributedDataParallel and Hugging Face models reach for.
    if model.module is not net or model.device != torch.device("cpu") or model.dtype != torch.float32:
        failures.append(f"module, device, dtype: {type(model.module).__name__}, {model.device}, {model.dtype}")
    loss = model.train_step(torch.randn(4, 4), torch.randn(4, 2), F.mse_loss).loss
    if loss.item() != float(loss):
        failures.append(f"the step's loss answers .item() with {loss.item()}, not {float(loss)}")
    expect_error("the step's loss given to backward", RuntimeError, "ran the backward already", loss.backward)
    expect_error("generate", AttributeError, "export the trained model", lambda: model.generate)
    expect_error("save_pretrained", AttributeError, "smp.export_safetensors", lambda: model.save_pretrained)
    if loss.detach() != loss or loss.cpu() != loss:
        failures.append("the step's loss does not answer .detach() and .cpu() as a logging line takes them")
    # A DDP script's habits: the wrapper stays where the config put it (a move said, not silently ignored), no_sync
    # says what accumulates, compile is refused, and train_step under autocast(float16) without "fp16" refused.
    if model.to("cpu") is not model or model.float() is not model:
        failures.append("model.to('cpu') / .float() on a CPU float32 model did not return it")
    expect_error("model.half()", ValueError, "mixed precision with \"bf16\" or \"fp16\"", model.half)
    expect_error("model.to(float64)", ValueError, "stays on the device and dtype", lambda: model.to(torch.float64))
    expect_error("model.no_sync", AttributeError, "raising \"microbatches\"", lambda: model.no_sync)
    expect_error("model.compile()", NotImplementedError, "runs each stage's modules as they are", model.compile)
    scaler = torch.amp.GradScaler("cpu")
    expect_error("GradScaler.step over a DistributedOptimizer", RuntimeError, "\"fp16\": true smp scales the loss",
                 lambda: scaler.step(smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))))
    # A SageMaker SMP script's names: each says what takes its place here.
    expect_error("smp.step", AttributeError, "(SageMaker SMP's); here: smp has no step decorator", lambda: smp.step)
    expect_error("smp.dp_rank", AttributeError, "smp.runtime().dp_rank (the replica: SMP's rdp_rank)",
                 lambda: smp.dp_rank)
    expect_error("smp.no_such_name", AttributeError, "module 'smp' has no attribute 'no_such_name'",
                 lambda: smp.no_such_name)
    expect_error("model.backward", AttributeError, "train_step runs the backward itself", lambda: model.backward)
    expect_error("DistributedModel without a sample", TypeError, "give a sample, one microbatch",
                 lambda: smp.DistributedModel(torch.nn.Linear(4, 2)))
    expect_error("a sample of no rows", smp.ConfigError, "the sample holds no samples (a tensor of shape (0, 4))",
                 lambda: smp.DistributedModel(torch.nn.Linear(4, 2), torch.zeros(0, 4)))
    saved = io.BytesIO()  # a step's loss saved in a log or extra_state reads back as the float it is
    torch.save({"loss": model.train_step(torch.randn(4, 4), torch.randn(4, 2), F.mse_loss).loss}, saved)
    saved.seek(0)
    if not isinstance(torch.load(saved, weights_only=True)["loss"], float):
        failures.append("a saved loss does not read back as a float")
    # SMP v1's keyword arguments and names, which a ported script passes on, say what takes their place.
    expect_error("SMP's trace_device", TypeError, "takes no 'trace_device' (SageMaker SMP's)",
                 lambda: smp.DistributedModel(torch.nn.Linear(4, 2), torch.zeros(2, 4), trace_device="cpu"))
    expect_error("an unknown keyword", TypeError, "unexpected keyword argument 'tarce_device'",
                 lambda: smp.DistributedModel(torch.nn.Linear(4, 2), torch.zeros(2, 4), tarce_device="cpu"))
    expect_error("SMP's dynamic_loss_scale", TypeError, "\"fp16\": true in the config",
                 lambda: smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True))
    expect_error("SMP's set_activation_checkpointing", AttributeError, "\"activation_checkpointing\" in the config",
                 lambda: smp.set_activation_checkpointing)
    if (smp.runtime().local_rank, smp.runtime().local_world_size) != (0, 1):
        failures.append(f"runtime local rank and size {smp.runtime().local_rank}, {smp.runtime().local_world_size}")
    with warnings.catch_warnings(record=True) as said:  # SMP's save_checkpoint took its path in code
        warnings.simplefilter("always")
        smp.Checkpointer(model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
    if not any("gives no \"checkpoint_dir\", so save() saves nothing" in str(w.message) for w in said):
        failures.append(f"a Checkpointer without checkpoint_dir said {[str(w.message) for w in said]}")
    if "SM_HP_MP_PARAMETERS" not in os.environ:
        expect_error("smp.init() outside SageMaker", smp.ConfigError, "SM_HP_MP_PARAMETERS, which SMP's smp.init() "
                     "reads, is not set", smp.init)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # overrides unscale_
    expect_error("ShardedGradScaler.unscale_ over a DistributedOptimizer", RuntimeError, "ShardedGradScaler.unscale_",
                 lambda: ShardedGradScaler("cpu").unscale_(
                     smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))))
    with torch.autocast("cpu", dtype=torch.float16):
        expect_error("train_step under autocast(float16)", smp.ConfigError, "set \"fp16\": true",
                     lambda: model.train_step(torch.randn(4, 4), torch.randn(4, 2), F.mse_loss))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compiled = smp.DistributedModel(torch.compile(copy.deepcopy(reference)), torch.zeros(2, 4))
    names = [name for name, _ in compiled.named_parameters()]
    if names != [name for name, _ in reference.named_parameters()] or \
            not any("not compiled" in str(warning.message) for warning in said):
        failures.append(f"a torch.compile'd module: parameters {names}, said {[str(w.message) for w in said]}")
    # load_state_dict: a full model's state_dict by name; what is missing, unknown or of another shape is refused.
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    result = model.load_state_dict(other.state_dict())
    if result.missing_keys or result.unexpected_keys:
        failures.append(f"load_state_dict of the full model: {result}")
    if not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters())):
        failures.append("load_state_dict did not copy the parameters")
    partial = {k: v for k, v in other.state_dict().items() if k != "2.bias"}
    expect_error("load_state_dict missing a tensor", RuntimeError, "2.bias", lambda: model.load_state_dict(partial))
    if model.load_state_dict(partial, strict=False).missing_keys != ["2.bias"]:
        failures.append("load_state_dict(strict=False) does not report the missing key")
    expect_error("load_state_dict with an unknown key", RuntimeError, "unexpected keys: 9.weight",
                 lambda: model.load_state_dict(dict(other.state_dict(), **{"9.weight": torch.zeros(1)})))
    expect_error("load_state_dict of another shape", RuntimeError, "0.weight: shape (8, 3)",
                 lambda: model.load_state_dict(dict(other.state_dict(), **{"0.weight": torch.zeros(8, 3)})))
    reference.load_state_dict(other.state_dict())
    # Calling it: inference, the model's outputs (one process runs the last stage).
    inputs = torch.randn(4, 4)
    model.eval()
    with torch.no_grad():
        outputs = model(inputs)
    if model.training or not torch.allclose(outputs, reference(inputs), atol=1e-6):
        failures.append(f"model(inputs) in eval mode: training={model.training}, outputs differ from the model's")
    model.train()
    # A ported training loop's call: refused, saying how to train (its outputs would have no gradients).
    expect_error("calling the model in training mode", smp.ModelError, "Train with model.train_step",
                 lambda: model(inputs))
    # The optimizer: found from the parameters alone, a torch.optim.Optimizer for LR schedulers and hooks.
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if not isinstance(optimizer, torch.optim.Optimizer) or optimizer._model is not model:
        failures.append("DistributedOptimizer is not an Optimizer paired with its model")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    for _ in range(2):
        optimizer.zero_grad()
        model.train_step(inputs, torch.randn(4, 2), F.mse_loss)
        optimizer.step()
        scheduler.step()
    if abs(optimizer.param_groups[0]["lr"] - 0.025) > 1e-12 or len(steps) != 2:
        failures.append(f"LambdaLR over DistributedOptimizer: lr {optimizer.param_groups[0]['lr']}, "
                        f"{len(steps)} hooked steps")
    if "stages=[0]" not in repr(model):
        failures.append(f"repr: {model!r}")


if __name__ == "__main__":
    sys.exit(main())
