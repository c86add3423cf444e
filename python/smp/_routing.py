"""Tokens a mixture-of-experts model routes to each expert, counted in the captured code where the router chooses
them (the indices of its top-k), once per microbatch's forward: a checkpointed stage's recompute does not count
again. A step's counts are in StepResult.tokens_per_expert, by router module path."""

import contextlib
import inspect
import operator
import warnings

import torch

from . import _smp
from ._model_io import split_sample
from ._smp import ConfigError
from ._value_sketch import sketch_of

_counts = {}  # router path -> tokens per expert in the current step, on the device the router runs on


class RoutingCounter:
    """Called by the captured code with the router's chosen expert indices (any shape) and the number of experts."""

    __module__ = __name__

    def __init__(self, router):
        self.router = router
        self.__name__ = "smp_count_routing"  # how torch.fx names it in the generated code

    def __call__(self, indices, experts):
        if _smp.recomputing():
            return
        counted = torch.bincount(indices.detach().flatten().long(), minlength=experts)
        before = _counts.get(self.router)
        _counts[self.router] = counted if before is None else before + counted

    def __repr__(self):
        return "smp_count_routing"  # the same in every block: identical blocks share one profile measurement


def take():
    """The counts since the last take, and a fresh start."""
    counts = dict(_counts)
    _counts.clear()
    return counts


def routers(graph, dynamic, module_paths):
    """(indices node, expert count, router path) for each top-k over a value computed from parameters whose indices
    a module other than the top-k's own reads: a router handing its choice to the experts. A top-k whose indices stay
    inside its module (DeepSeek's choice of expert groups) is not one."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.topk.default or node not in dynamic:
            continue
        scores = sketch_of(node.args[0])
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        if scores is None or dim not in (-1, scores.dim() - 1) or \
                not isinstance(scores.shape[-1], int):
            continue
        chosen = [user for user in node.users if user.target is operator.getitem and user.args[1] == 1]
        paths = module_paths(node)
        if not chosen or not paths:
            continue
        if any(paths[-1] not in module_paths(reader) for reader in chosen[0].users):
            found.append((chosen[0], scores.shape[-1], paths[-1]))
    return found


def per_sample(model, sample, experts):
    """{experts module path: [[tokens per expert] for each sample of `sample`]}: one forward of `model` without
    gradients, each experts module's chosen indices read on the way in (rows of the flattened tokens, sample-major;
    indices outside [0, experts) not counted). {} (routing then assumed even) for a model on the meta device, which
    cannot run, or one whose experts modules are not called as (hidden states, chosen indices, weights), said in a
    warning."""
    if not experts or any(parameter.is_meta for parameter in model.parameters()):
        return {}
    args, kwargs = split_sample(model, sample)
    # The batch: the longest first dimension (position ids and the like have 1).
    samples = max([value.shape[0] for value in [*args, *kwargs.values()] if torch.is_tensor(value) and value.dim() > 0],
                  default=1)
    device = next(model.parameters()).device
    args = [value.to(device) if torch.is_tensor(value) else value for value in args]
    kwargs = {key: value.to(device) if torch.is_tensor(value) else value for key, value in kwargs.items()}
    found, unread = {}, []

    def counter(path, module):
        signature = inspect.signature(type(module).forward)

        def count(_, hook_args, hook_kwargs):
            try:
                index = list(signature.bind(module, *hook_args, **hook_kwargs).arguments.values())[2]
            except (TypeError, IndexError):
                index = None
            if not torch.is_tensor(index) or index.is_floating_point() or index.is_complex():
                unread.append(path)
                return
            index = index.detach().long()
            rows = index.reshape(samples, -1) if index.numel() % samples == 0 else index.reshape(1, -1)
            counted = found.setdefault(path, [])
            for row in rows.cpu():
                chosen = row[(row >= 0) & (row < module.num_experts)]
                counted.append(torch.bincount(chosen, minlength=module.num_experts).tolist())
        return count

    # The forward draws no random numbers a job would see (dropout, router jitter): on the model's device too.
    generators = [device.index or 0] if device.type == "cuda" else []
    with contextlib.ExitStack() as stack:
        for path, module in experts.items():
            stack.callback(module.register_forward_pre_hook(counter(path, module), with_kwargs=True).remove)
        stack.enter_context(torch.random.fork_rng(devices=generators))
        stack.enter_context(torch.no_grad())
        model(*args, **kwargs)
    if unread:
        warnings.warn(f"smp.plan: routing assumed even: the chosen experts of '{unread[0]}' could not be read from its "
                      "call (expected (hidden states, chosen expert indices, weights))", stacklevel=3)
        return {}
    return found


def counted_for(experts_path, keys):
    """Which of `keys` (router or experts module paths) counts for the experts module at `experts_path`: itself, or
    the router beside it (the deepest whose parent module holds it); None."""
    def shared_depth(key):
        parent = key if key == experts_path else key.rpartition(".")[0]
        return len(parent) if key == experts_path or experts_path.startswith(parent + ".") else -1
    key = max(keys, key=shared_depth, default=None)
    return key if key is not None and shared_depth(key) >= 0 else None


def by_experts_module(counts, experts):
    """{experts module path: [[tokens per expert], ...]} from `counts` keyed by router path (as
    StepResult.tokens_per_expert gives them) or by experts path, each a list of counts (or a tensor) or several
    (rows: samples or steps): a router counts for the experts module beside it (the deepest module holding both).
    Experts without counts are left out (routing assumed even there)."""
    found = {}
    for path, module in experts.items():
        key = counted_for(path, counts)
        if key is None:
            continue
        given = counts[key].tolist() if torch.is_tensor(counts[key]) else list(counts[key])
        given = [row.tolist() if torch.is_tensor(row) else row for row in given]
        rows = [[int(count) for count in row] for row in
                (given if given and isinstance(given[0], (list, tuple)) else [given])]
        for row in rows:
            if len(row) != module.num_experts:
                raise ConfigError(f"tokens_per_expert['{key}'] counts {len(row)} experts; '{path}' has "
                                  f"{module.num_experts}")
            if min(row) < 0:
                raise ConfigError(f"tokens_per_expert['{key}'] has a negative count: {row}")
        found[path] = rows
    return found


def busiest_share(counts, ep):
    """How many times its even share of one exchange's rows (`counts`: tokens per expert) the busiest of `ep` ranks
    received, each holding a consecutive block of the experts: what happened, where smp::routing_imbalance predicts."""
    counts = [int(count) for count in counts]
    total, share = sum(counts), len(counts) // ep
    if ep <= 1 or total <= 0 or len(counts) % ep:
        return 1.0
    return max(sum(counts[rank * share:(rank + 1) * share]) for rank in range(ep)) * ep / total


def exchanged(counts):
    """{router path: tokens per expert} of this rank's step summed over its expert-parallel group (the rows of one
    exchange, a step's microbatches together), on the CPU; every member of the group calls it alike. One exchange
    for all layers: members whose layers differed would fail on the rows' width rather than wait."""
    from ._state import runtime
    rt = runtime()
    group = rt.expert_parallel_degree
    paths = sorted(counts)
    rows = [counts[path].detach().to("cpu", torch.int64).reshape(-1) for path in paths]
    if not rows:
        return {}
    joined = torch.cat(rows).reshape(1, -1)
    if group > 1:
        joined = rt._ep_all_to_all(joined.repeat(group, 1), [1] * group, [1] * group, counted=False).sum(0,
                                                                                                        keepdim=True)
    return dict(zip(paths, joined[0].split([row.numel() for row in rows])))
