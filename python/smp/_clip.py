"""Gradient clipping by the whole model's norm, over every stage and shard: DistributedOptimizer.clip_grad_norm,
torch.nn.utils.clip_grad_norm_ given a DistributedModel's parameters, and get_total_norm given their gradients. Each rank holds only its stages'
gradients, so torch's own function, as a ported training loop calls it, would clip each stage by its own norm and
train differently from the single process, without an error; smp takes that call over for its parameters alone
(the name in torch.nn.utils, and wherever a module imported it from there before smp.init)."""

import functools
import math
import sys
import weakref

import torch
import torch.nn.utils

from ._state import runtime

# Gradients carry no mark of their model (each backward may make them anew), so get_total_norm finds it here.
_models = weakref.WeakSet()


def clipped_by_whole_norm(model):
    _models.add(model)


def clip_model_grad_norm(model, max_norm):
    """Scales `model`'s gradients (a DistributedModel) so that their 2-norm over the whole model is at most max_norm;
    returns the norm before clipping. Every rank calls it."""
    runtime()._refuse_after_leaving("clip_grad_norm")
    return runtime()._with_peers("clip_grad_norm", lambda: model._model.clip_grad_norm(float(max_norm)))


def _model_of(tensors):
    for tensor in tensors:
        owner = getattr(tensor, "_smp_model", None)
        model = owner() if owner is not None else None
        if model is not None:
            return model
    return None


def _only_model(caller):
    """The model an empty list of tensors stands for on this rank (one whose stages here train none of a model's
    parameters): the one live DistributedModel with a rank that trains none (known on every rank alike; an empty
    list is none of any other's); with several, which one's norm the peers take cannot be known."""
    live = [model for model in _models if getattr(model, "_some_rank_trains_none", True)]
    if len(live) > 1:
        given = "model.parameters() to clip_grad_norm_ (the frozen ones have no gradient and are left alone)" \
            if caller == "clip_grad_norm_" else \
            "clip with optimizer.clip_grad_norm(max_norm), which returns the whole model's norm, or with " \
            "clip_grad_norm_(model.parameters(), max_norm)"
        raise ValueError(f"torch.nn.utils.{caller} was given no tensors while {len(live)} smp.DistributedModels with a "
                         "rank that trains none of their parameters live: on such a rank it must still join its "
                         f"model's norm, and which model is meant cannot be known; pass {given}")
    return live[0] if live else None


def _norm_like(norm, tensors):
    """The norm as torch gives it: a tensor of the gradients' dtype and device."""
    first = next((t for t in tensors if t is not None), None)
    return torch.tensor(norm, dtype=first.dtype, device=first.device) if first is not None else torch.tensor(norm)


def _clip_grad_norm_(original, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # An empty list is this rank's share of a model whose trainable parameters all live on other stages (a frozen
    # backbone: [p for p in model.parameters() if p.requires_grad]): it must join the norm its peers take.
    model = _model_of(listed) if listed else _only_model("clip_grad_norm_")
    if model is None:
        return original(listed, max_norm, norm_type, error_if_nonfinite, foreach)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    given = {id(p) for p in listed if p.requires_grad}
    # Those without a gradient may be left out ([p for p in ... if p.grad is not None]): clipping leaves them alone.
    left_out = [p for p in model.parameters() if p.requires_grad and p.grad is not None and id(p) not in given]
    if left_out or not given <= trainable:
        raise ValueError(f"torch.nn.utils.clip_grad_norm_ was given {len(given & trainable)} of the {len(trainable)} "
                         "trainable parameters this rank holds of an smp.DistributedModel"
                         f"{' and other tensors' if not given <= trainable else ''}: smp clips by the whole model's "
                         "norm, over every stage; pass model.parameters() (or call optimizer.clip_grad_norm)")
    if float(norm_type) != 2.0:
        raise ValueError(f"torch.nn.utils.clip_grad_norm_ with norm_type {norm_type} over an smp.DistributedModel: "
                         "smp clips by the 2-norm over every stage")
    if error_if_nonfinite:  # as torch raises it: before any gradient is scaled
        norm = clip_model_grad_norm(model, float("inf"))
        if not torch.isfinite(torch.tensor(norm)):
            raise RuntimeError(f"the total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
    return _norm_like(clip_model_grad_norm(model, max_norm), [p.grad for p in model.parameters()])


def _get_total_norm(original, tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.get_total_norm (clip_grad_norm_'s first half, which a loop pairs with clip_grads_with_norm_)
    over a DistributedModel's gradients: the whole model's norm, over every stage and shard."""
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    given = {id(t) for t in listed}
    model = next((m for m in list(_models)
                  if any(id(p.grad) in given for p in m.parameters() if p.grad is not None)), None) if listed \
        else _only_model("get_total_norm")  # this rank's gradients of a model trained on other stages alone: none
    if model is None:
        return original(listed, norm_type, error_if_nonfinite, foreach)
    gradients = {id(p.grad) for p in model.parameters() if p.requires_grad and p.grad is not None}
    if given != gradients:
        raise ValueError(f"torch.nn.utils.get_total_norm was given {len(given & gradients)} of the {len(gradients)} "
                         "gradients this rank holds of an smp.DistributedModel"
                         f"{' and other tensors' if not given <= gradients else ''}: smp takes the whole model's "
                         "norm, over every stage; pass every gradient ([p.grad for p in model.parameters() if "
                         "p.grad is not None])")
    if float(norm_type) != 2.0:
        raise ValueError(f"torch.nn.utils.get_total_norm with norm_type {norm_type} over an smp.DistributedModel's "
                         "gradients: smp takes the 2-norm over every stage")
    norm = clip_model_grad_norm(model, float("inf"))
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"the total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
    return _norm_like(norm, listed)


def take_over_torch_clipping():
    """torch.nn.utils.clip_grad_norm_ (both names it goes by) and get_total_norm take a DistributedModel's
    parameters or gradients by the whole model's norm; any other tensors as before."""
    # clip_grad's own _get_total_norm stays torch's: its clip_grad_norm_ calls it, on tensors that are not smp's.
    for name, takeover, namespaces in (("clip_grad_norm_", _clip_grad_norm_, (torch.nn.utils, torch.nn.utils.clip_grad)),
                                       ("get_total_norm", _get_total_norm, (torch.nn.utils,))):
        for namespace in namespaces:
            original = getattr(namespace, name)
            if getattr(original, "_smp_original", None) is not None:
                continue
            taken_over = functools.wraps(original)(functools.partial(takeover, original))
            taken_over._smp_original = original
            setattr(namespace, name, taken_over)
            _rebind_imported(original, taken_over)


def _rebind_imported(original, taken_over):
    """A `from torch.nn.utils import clip_grad_norm_` run before smp.init (a training script's first lines) bound
    torch's own function in the importing module, which would clip each stage by its own norm: those names take the
    takeover too. torch's and smp's own modules keep what they hold."""
    for name, module in list(sys.modules.items()):
        if module is None or name in ("torch", "smp") or name.startswith(("torch.", "smp.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if value is original:
                namespace[key] = taken_over
