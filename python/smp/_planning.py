"""smp.plan: the parallel layouts a model could train in on a world of ranks, each partitioned as a job would
partition it, its step predicted by the schedule simulator and its memory per rank by the partition search's
model, ranked; a report, without training."""

from . import _smp
from ._distributed_model import graph_of
from ._state import runtime


class Plan:
    """What smp.plan found: .layouts, every layout considered as a dict (layout, config: the smp keys that ask for
    it, step_ms, pipeline_ms, gradient_sync_ms, bubble, memory_mib per pipeline rank, rejected: why not, or
    None), fitting ones first, fastest first; .best, the first that fits (None when none does); str(): the report."""

    def __init__(self, layouts, report):
        self.layouts = layouts
        self.report = report

    @property
    def best(self):
        return next((layout for layout in self.layouts if layout["rejected"] is None), None)

    def __str__(self):
        return self.report


def plan(model, sample, world_size=None, global_batch_size=None, memory_limit_mb=None, optimizer_moments=2.0,
         link_gbps=None, latency_us=50.0):
    """Predicts every layout of `world_size` ranks (default: this job's) for `model` on `sample` (one microbatch):
    pipeline stages x data-parallel replicas, schedule (GPipe, 1F1B, ZB-H1; interleaved 1F1B, ZB-V and DualPipeV at
    two stages per rank), microbatches, recompute, ZeRO-1. The model is captured and profiled here, in this process
    (call smp.init first; one process will do). global_batch_size and memory_limit_mb default to the config's;
    optimizer_moments is the optimizer's state per parameter (Adam 2, SGD with momentum 1); link_gbps (default the
    config's link_bandwidth_gbps) and latency_us price transfers between stages and the replicas' all-reduce.
    Predictions assume compute grows linearly with the microbatch, the zero-bubble split halves a backward, and the
    all-reduce follows the last backward without overlap; tensor parallelism is not among the layouts yet."""
    rt = runtime()
    world = world_size or rt.world_size
    # Cut as finely as the most stages considered: two per rank.
    graph, io_ = graph_of(model, sample, 2 * world, list(rt.config.partition_overrides))
    values = io_.engine_inputs(sample, "sample")
    batched = _smp.batched_inputs(values, None)
    profiled = next((value.shape[0] for value, is_batch in zip(values, batched) if is_batch), 1)
    layouts, report = _smp.plan_layouts(
        graph._graph, values, rt.config, world, profiled, int(global_batch_size or 0),
        -1.0 if memory_limit_mb is None else float(memory_limit_mb), float(optimizer_moments), latency_us * 1e-6,
        -1.0 if link_gbps is None else link_gbps * 1e9)
    return Plan(layouts, report)
