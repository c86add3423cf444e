"""What a model becomes before it is partitioned: the engine graph it runs as (a GraphModel as it is, a Sequential
as a chain, any other module captured whole) with how its inputs and outputs map to the graph's, and its
tensor-parallel shards. DistributedModel builds on it, and so does the planner, which profiles what a job would
build."""

import inspect

import torch

from . import _expert_parallel, tp
from ._graph import GraphModel, _is_sequential, _kind
from ._model_io import CapturedIO, GraphIO, split_sample
from ._smp import ConfigError, ModelError
from ._state import runtime


def _contains_scripted(model):
    return any(isinstance(m, torch.jit.ScriptModule) for m in model.modules())


def _capture(model, sample, stages, pinned, dynamic_shapes=None, experts=None, evaluation=True):
    """A model with a forward of its own as an engine graph and its IO: torch.export first (any depth, keyword
    inputs, any output); torch.fx when export cannot take it (or the model has TorchScript children, which export
    does not enter) and the model takes one tensor. `experts`: (expert-parallel degree, this rank's place) to divide
    the experts for; default the job's."""
    from . import _export_capture as exporting
    from ._exporting import CaptureError
    experts = experts or (runtime().expert_parallel_degree, runtime().ep_rank)
    args, kwargs = split_sample(model, sample)
    export_error = None
    if not _contains_scripted(model):
        try:
            graph, leaf_inputs, output_spec, shapes = exporting.capture(
                model, args, kwargs, stages, pinned, GraphModel, torch.device(runtime().device), experts,
                dynamic_shapes, evaluation)
            return graph, CapturedIO(model, args, kwargs, leaf_inputs, output_spec, shapes)
        except CaptureError as error:
            export_error = error
    name = type(model).__name__
    if experts[0] > 1:
        raise ModelError(f"cannot capture {name} to divide its experts over ranks (\"expert_parallel_degree\" "
                         f"{experts[0]}): " + (f"torch.export failed: {export_error}"
                         if export_error is not None else "it has TorchScript children"))
    if not isinstance(sample, torch.Tensor):
        reason = (f"torch.export failed: {export_error}" if export_error is not None else
                  "it has TorchScript children, which torch.export does not enter, and torch.fx takes one tensor input")
        raise ModelError(f"cannot capture {name} ({reason}); " + (_sample_hint(model, args, kwargs) or
                         "write it as an smp.GraphModel, or change that code so that it can be captured (no branch "
                         "on a tensor's value)"))
    try:
        graph = GraphModel.from_module(model, sample)
    except ModelError as error:
        if export_error is None:
            raise
        raise ModelError(f"cannot capture {name}: torch.export failed ({export_error}), and torch.fx: {error}") \
            from error
    return graph, GraphIO(graph.input_names, False)


def _sample_hint(model, args, kwargs):
    """What to change in the sample when the forward cannot take it as given, or None."""
    if kwargs.get("use_cache") is True:
        return ("use_cache=True makes the forward return its key/value cache, which pipeline stages do not pass on: "
                "leave use_cache out (smp passes use_cache=False, as training with gradient checkpointing does) or "
                "pass use_cache=False")
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        positional = [p for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        if not args and len(positional) == 1 and positional[0].name not in kwargs:
            return (f"a dict sample gives the forward keyword arguments ({', '.join(map(repr, kwargs))}), but "
                    f"{type(model).__name__}.forward takes one dict, {positional[0].name!r}: give the sample and the "
                    "batches as a one-element tuple, (batch,)")
    return None


def graph_of(model, sample, stages, pinned, dynamic_shapes=None, experts=None, evaluation=True):
    """The smp.GraphModel a model runs as, and how its inputs and outputs map to the graph's, for `stages` stages;
    `dynamic_shapes` says which input dimensions a captured model lets change (smp._exporting.dynamic_shapes);
    `experts`, the expert-parallel degree and place a captured model's experts are divided for (default the job's);
    `evaluation`: let its first evaluation check that evaluation's path is the training one's (smp._evaluation_path),
    for a model that runs."""
    if isinstance(model, GraphModel):
        return model, GraphIO(model.input_names, model._several_outputs)
    if _is_sequential(model):
        graph = GraphModel.from_sequential(model)
        return graph, GraphIO(graph.input_names, False)
    if isinstance(model, torch.jit.ScriptModule):
        # TorchScript keeps no Python forward to trace: its children would run as a chain, wrongly.
        raise TypeError(f"pass an nn.Sequential or an smp.GraphModel, got {_kind(model)}: script its children, "
                        "not the model, or pass the model unscripted (smp traces its forward)")
    if isinstance(model, torch.nn.Module):
        return _capture(model, sample, stages, pinned, dynamic_shapes, experts, evaluation)
    raise TypeError(f"expected a torch.nn.Module or an smp.GraphModel, got {type(model).__name__}")


def shard_for_tensor_parallelism(model, plan, announce=True, experts_divided=None):
    """Applies the tensor-parallel plan (the user's, else the model's own) to `model` in place, at smp.tp.degree().
    A GraphModel's modules are the user's: built with smp.tp's layers. experts_divided (default: the job's
    "expert_parallel_degree" > 1): the model's own plan leaves the experts whole, for expert parallelism."""
    if isinstance(model, GraphModel):
        if plan is not None:
            raise TypeError("tp_plan applies to an nn.Module; build an smp.GraphModel's modules with smp.tp's layers")
        return
    given = plan is not None
    plan = plan if given else tp.builtin_plan(model)
    if experts_divided is None:
        experts_divided = runtime().expert_parallel_degree > 1
    if plan and not given and experts_divided:
        plan = _expert_parallel.without_experts(model, plan)
    if plan and runtime().config.sequence_parallel:
        plan = tp.sequence_parallel_plan(model, plan)
    applied = tp.apply_plan(model, plan, strict=given) if plan else {}
    if announce and runtime().rank == 0 and applied:
        print(f"smp: tensor parallelism over {tp.degree()} ranks: {len(applied)} modules sharded or adjusted by "
              f"{'the given' if given else 'the built-in'} plan", flush=True)
    if not any(hasattr(parameter, "_smp_shard") for parameter in model.parameters()):
        raise ConfigError(f"\"tensor_parallel_degree\" {tp.degree()}: {type(model).__name__} has no tensor-parallel "
                          "plan and no smp.tp layers; pass tp_plan={module path: style} (see smp.tp)")
