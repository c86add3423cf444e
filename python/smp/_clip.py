"""Gradient clipping by the whole model's norm, over every stage and shard: DistributedOptimizer.clip_grad_norm,
and torch.nn.utils.clip_grad_norm_ given a DistributedModel's parameters. Each rank holds only its stages'
gradients, so torch's own function, as a ported training loop calls it, would clip each stage by its own norm and
train differently from the single process, without an error; smp takes that call over for its parameters alone
(the name in torch.nn.utils, and wherever a module imported it from there before smp.init)."""

import functools
import sys

import torch
import torch.nn.utils

from ._state import runtime


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


def _clip_grad_norm_(original, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    model = _model_of(listed)
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
    return torch.tensor(clip_model_grad_norm(model, max_norm))


def take_over_torch_clipping():
    """torch.nn.utils.clip_grad_norm_ (both names it goes by) clips a DistributedModel's parameters by the whole
    model's norm; any other tensors as before."""
    for namespace in (torch.nn.utils, torch.nn.utils.clip_grad):
        original = namespace.clip_grad_norm_
        if getattr(original, "_smp_original", None) is not None:
            continue
        taken_over = functools.wraps(original)(functools.partial(_clip_grad_norm_, original))
        taken_over._smp_original = original
        namespace.clip_grad_norm_ = taken_over
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
