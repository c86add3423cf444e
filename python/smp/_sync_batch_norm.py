"""torch.nn.SyncBatchNorm under smp: in training, each microbatch's statistics are pooled over the same microbatch of
every data-parallel replica of the stage (torch.ops.smp.replica_sum, whose gradient sums the replicas' too), so a
job of r replicas normalizes as one process would a microbatch of r replicas' rows, and every replica keeps the same
running statistics. torch's own SyncBatchNorm would gather over torch.distributed's world group, which under a
pipeline holds other stages: it is not used.

The statistics are the two-pass ones of a batch norm (the pooled mean, then the pooled squared distance from it), each
pooled by one all-reduce of a channel's worth of values, in the forward and again in the backward."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def synchronized_modules(model):
    """{path: module} of the model's SyncBatchNorm modules."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {path: module for path, module in model.named_modules() if isinstance(module, torch.nn.SyncBatchNorm)}


def pool_over_replicas(modules, replicas):
    """Each module's forward pools its training statistics over `replicas` replicas (with one, a batch norm's)."""
    for module in modules.values():
        module.forward = _pooled_forward(module, replicas)


def _pooled_forward(module, replicas):
    def forward(x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions, got {x.dim()}")
        factor = _momentum(module)
        tracked = module.track_running_stats
        if replicas == 1:  # one replica's microbatch is the whole microbatch: a batch norm
            return F.batch_norm(x, module.running_mean if not module.training or tracked else None,
                                module.running_var if not module.training or tracked else None,
                                module.weight, module.bias, module.training or not tracked, factor, module.eps)
        # One operation in both modes, whose training flag evaluation of a training capture turns off, as it does
        # batch norm's; in training the new running statistics it gives are written over the old, and those writes,
        # which nothing reads, are all that the training path has more.
        out, new_mean, new_variance, _, _ = _replica_batch_norm(
            x, module.weight, module.bias, module.running_mean, module.running_var, module.training, factor, module.eps)
        if module.training and tracked:
            module.running_mean.copy_(new_mean)
            module.running_var.copy_(new_variance)
        return out
    return forward


def _momentum(module):
    """The running statistics' factor this step, as torch's batch norm takes it (None: a cumulative average)."""
    if not (module.training and module.track_running_stats):
        return 0.0 if module.momentum is None else module.momentum
    module.num_batches_tracked.add_(1)
    return 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum


def _shape(x):
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduced(x):
    return [0, *range(2, x.dim())]


def _statistics(x, running_mean, running_var, training):
    """(mean, variance, rows): over every replica's rows of this microbatch in training, else the running statistics
    (batch statistics of this rank's rows where it keeps none, as torch's in eval mode)."""
    channels, reduced = x.shape[1], _reduced(x)
    if training or running_mean is None:
        sums = torch.cat([x.sum(reduced), x.new_full((1,), x.numel() // channels)])
        if training:
            sums = torch.ops.smp.replica_sum(sums)
        count = sums[channels:]
        mean = sums[:channels] / count
        squares = ((x - mean.view(_shape(x))) ** 2).sum(reduced)
        if training:
            squares = torch.ops.smp.replica_sum(squares)
        return mean, squares / count, count
    return running_mean.to(x.dtype), running_var.to(x.dtype), x.new_full((1,), x.numel() // channels)


@torch.library.custom_op("smp::replica_batch_norm", mutates_args=())
def _replica_batch_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], training: bool,
                        momentum: float, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """Batch norm of `x` whose training statistics are pooled over the replicas: (output, the running mean and
    variance updated by `momentum` in training (empty where there are none), the batch's mean and variance)."""
    given = x.dtype
    if given in (torch.float16, torch.bfloat16):  # sums and counts of half precision would round (as torch's: float)
        x = x.float()
    mean, variance, count = _statistics(x, running_mean, running_var, training)
    out = (x - mean.view(_shape(x))) * torch.rsqrt(variance + eps).view(_shape(x))
    if weight is not None:
        out = out * weight.view(_shape(x)) + bias.view(_shape(x))
    if running_mean is None:
        new_mean, new_variance = x.new_empty((0,)), x.new_empty((0,))
    elif training:
        unbiased = variance * (count / (count - 1).clamp(min=1))
        new_mean = (running_mean * (1 - momentum) + mean * momentum).to(running_mean.dtype)
        new_variance = (running_var * (1 - momentum) + unbiased * momentum).to(running_var.dtype)
    else:
        new_mean, new_variance = running_mean.clone(), running_var.clone()
    return out.to(given), new_mean, new_variance, mean.clone(), variance.clone()


@_replica_batch_norm.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps):
    channels = x.shape[1]
    statistic = x.new_empty((channels,), dtype=torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
    running = (running_mean.new_empty((channels,)), running_var.new_empty((channels,))) if running_mean is not None \
        else (statistic.new_empty((0,)), statistic.new_empty((0,)))
    return torch.empty_like(x), *running, statistic, statistic.clone()


def _keep_for_backward(ctx, inputs, output):
    x, weight, _, running_mean, _, training, _, eps = inputs
    _, new_mean, new_variance, mean, variance = output
    ctx.mark_non_differentiable(new_mean, new_variance, mean, variance)  # statistics, written into buffers as such
    ctx.save_for_backward(x, weight, mean, variance)
    # Batch statistics (whose gradient reaches every row) in training, and in eval mode where none are kept.
    ctx.training, ctx.batch_statistics, ctx.eps = training, training or running_mean is None, eps


def _gradients(ctx, gradient, *_):
    """Batch norm's backward with the two sums over the output's gradient pooled as the statistics were: the
    replicas' losses all read the pooled statistics."""
    x, weight, mean, variance = ctx.saved_tensors
    given = x.dtype
    if given in (torch.float16, torch.bfloat16):
        x, gradient = x.float(), gradient.float()
    shape, reduced = _shape(x), _reduced(x)
    inverse = torch.rsqrt(variance + ctx.eps)
    normalized = (x - mean.view(shape)) * inverse.view(shape)
    scaled = gradient * weight.view(shape) if weight is not None else gradient
    if ctx.batch_statistics:
        channels = x.shape[1]
        sums = torch.cat([scaled.sum(reduced), (scaled * normalized).sum(reduced),
                          x.new_full((1,), x.numel() // channels)])
        if ctx.training:  # pooled as the statistics were
            sums = torch.ops.smp.replica_sum(sums)
        count = sums[2 * channels:]
        mean_scaled, mean_scaled_normalized = sums[:channels] / count, sums[channels:2 * channels] / count
        x_gradient = (scaled - mean_scaled.view(shape) - normalized * mean_scaled_normalized.view(shape)) * \
            inverse.view(shape)
    else:
        x_gradient = scaled * inverse.view(shape)
    weight_gradient = (gradient * normalized).sum(reduced).to(weight.dtype) if weight is not None else None
    bias_gradient = gradient.sum(reduced).to(weight.dtype) if weight is not None else None
    return x_gradient.to(given), weight_gradient, bias_gradient, None, None, None, None, None


_replica_batch_norm.register_autograd(_gradients, setup_context=_keep_for_backward)
