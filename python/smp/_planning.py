"""smp.plan: the parallel layouts a model could train in on a world of ranks, each partitioned as a job would
partition it, its step predicted by the schedule simulator and its memory per rank by the partition search's
model, ranked; a report, without training."""

import collections.abc
import contextlib
import copy
import json
import math
import os
import sys
import time
import warnings

import torch

from . import _routing, _smp, tp
from ._export_capture import stage_autocast
from ._expert_parallel import experts_modules
from ._graph import GraphModel
from ._model_graph import graph_of, shard_for_tensor_parallelism
from ._smp import ConfigError
from ._state import runtime


class Plan:
    """What smp.plan found: .layouts, every layout considered as a dict (layout, config: the smp keys that ask for
    it, the cut as "partition_overrides" among them, step_ms, pipeline_ms, gradient_sync_ms, bubble, memory_mib per
    pipeline rank, stages: each stage's modules as cut, "first..last", rejected: why not, or None), fitting ones
    first, fastest first; .best, the first that fits (None when none does); .timeline_svg, the best's simulated step
    drawn as an SVG (one row per pipeline rank; None when none fits); .unplanned_degrees, {tensor-parallel degree:
    why the model cannot be sharded so}; str(): the report. .with_routing(tokens_per_expert): the same profiles
    predicted again with other routing (as smp.plan's tokens_per_expert), without measuring again; .routing, the
    counts priced ({experts module path: rows of tokens per expert}), and .routing_imbalance(row), what they give the
    busiest rank in one of .layouts."""

    def __init__(self, layouts, report, unplanned_degrees=None, predict=None, routing=None, world=1, global_batch=1,
                 choice=None):
        self.layouts = layouts
        self._choice = choice  # a job's own plan: {"config": the adopted config's text} or {"error": why none}
        self.report = report
        self.unplanned_degrees = unplanned_degrees or {}  # {tensor-parallel degree: why the model cannot take it}
        self._predict = predict
        self.routing = routing or {}  # {experts module path: rows of tokens per expert} the plan priced
        self._world, self._global_batch = world, global_batch

    def routing_imbalance(self, row, whole_step=False):
        """{experts module path: how many times its even share of rows the busiest rank gets} in one of
        .layouts' exchanges (its microbatch from every member of its expert-parallel group; whole_step: all its
        microbatches together, as a step's counts add up); {} without ep."""
        ep = json.loads(row["config"])["expert_parallel_degree"]
        if ep <= 1:
            return {}
        samples = self.exchange_samples(row, whole_step)
        return {path: _smp.routing_imbalance(rows, ep, samples) for path, rows in self.routing.items()}

    def exchange_samples(self, row, whole_step=False):
        """The samples an experts layer's exchange carries in one of .layouts: every expert-parallel member's
        microbatch (whole_step: every member's microbatches)."""
        keys = json.loads(row["config"])
        replicas = self._world // (keys["tensor_parallel_degree"] * keys["partitions"])
        microbatches = 1 if whole_step else keys["microbatches"]
        return keys["expert_parallel_degree"] * max(1, self._global_batch // replicas // microbatches)

    def with_routing(self, tokens_per_expert):
        return self._predict(tokens_per_expert)

    @property
    def best(self):
        return next((layout for layout in self.layouts if layout["rejected"] is None), None)

    @property
    def timeline_svg(self):
        return self.best["timeline_svg"] if self.best else None

    def __str__(self):
        return self.report


def _optimizer_seconds_per_byte(device, shapes, optimizer=torch.optim.AdamW, most_elements=1 << 24):
    """One optimizer step's time per parameter byte on this device, and its state per parameter element in
    parameters' worth (Adam's two moments 2, SGD with momentum 1): the median of 5 steps over tensors of the model's
    own parameter shapes (up to `most_elements` of them; one tensor of 4 Mi when none fits). The shapes matter: on a
    CPU one 4 Mi tensor took 1.6 to 1.9 times as long per byte as a small model's own tensors, whose parameter,
    gradient and moments stay in the caches through the optimizer's passes over them. `optimizer`: a torch.optim
    class, or any callable making an optimizer of a list of parameters."""
    chosen, elements = [], 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        if 0 < numel and elements + numel <= most_elements:
            chosen.append(shape)
            elements += numel
    parameters = [torch.zeros(shape, device=device, requires_grad=True) for shape in chosen or [(1 << 22,)]]
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    try:
        stepper = optimizer(parameters)
    except Exception as error:  # noqa: BLE001 - whatever the factory raises, said as the argument's fault
        raise ConfigError(f"smp.plan: optimizer {optimizer!r} did not make an optimizer of a list of parameters: "
                          f"{type(error).__name__}: {error}") from error
    times = []
    for _ in range(7):
        started = time.perf_counter()
        stepper.step()
        if parameters[0].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    # The state tensors of a parameter's size (a step count is not state per element).
    state = sum(value.numel() for per_parameter in stepper.state.values() for value in per_parameter.values()
                if isinstance(value, torch.Tensor) and value.dim() > 0)
    elements = sum(parameter.numel() for parameter in parameters)
    return sorted(times[2:])[2] / sum(parameter.nbytes for parameter in parameters), state / elements


def _check_plan_arguments(world_size, global_batch_size, memory_limit_mb, optimizer_moments, compute_scale,
                          device_speeds, world, optimizer):
    """One-line errors for smp.plan's arguments, naming the argument, before anything is profiled."""
    def whole(value):
        return isinstance(value, int) and not isinstance(value, bool)

    def number(value):  # True is an int to Python, and an infinite limit would reject every layout
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not callable(optimizer):
        raise ConfigError(f"smp.plan: optimizer {optimizer!r}: expected a torch.optim class or a callable making an "
                          "optimizer of a list of parameters")
    if world_size is not None and (not whole(world_size) or world_size < 1):
        raise ConfigError(f"smp.plan: world_size {world_size!r}: expected a whole number of ranks, at least 1")
    if global_batch_size is not None and (not whole(global_batch_size) or not 1 <= global_batch_size <= 1 << 30):
        raise ConfigError(f"smp.plan: global_batch_size {global_batch_size!r}: expected a whole number of samples "
                          f"from 1 to {1 << 30}")
    if memory_limit_mb is not None and not (number(memory_limit_mb) and memory_limit_mb >= 0):
        raise ConfigError(f"smp.plan: memory_limit_mb {memory_limit_mb!r}: expected a finite number, at least 0 (0 or "
                          "None: no limit)")
    if optimizer_moments is not None and not (number(optimizer_moments) and optimizer_moments >= 0):
        raise ConfigError(f"smp.plan: optimizer_moments {optimizer_moments!r}: expected a finite number, at least 0 "
                          "(Adam 2, SGD with momentum 1)")
    if not (number(compute_scale) and compute_scale > 0):
        raise ConfigError(f"smp.plan: compute_scale {compute_scale!r}: expected a finite positive number")
    if device_speeds:  # None or []: the config's
        if isinstance(device_speeds, str) or not all(number(s) and s > 0 for s in device_speeds):
            raise ConfigError(f"smp.plan: device_speeds {device_speeds!r}: expected a list of positive numbers, one "
                              "per rank (an \"auto\" job measures them with \"device_speeds\": \"measure\")")
        if len(device_speeds) != world:
            raise ConfigError(f"smp.plan: device_speeds has {len(device_speeds)} speeds for a world of {world} ranks")


def _candidate_degrees(model, tp_plan, world, config):
    """The tensor-parallel degrees to plan, and {degree: why not} for those left out: the config's degree when it
    fixes one; when it says "auto", every divisor of the world a plan can shard `model` at (its own plan, a Hugging
    Face model's, or `tp_plan`), else 1 alone."""
    if "tensor_parallel_degree" not in config.auto_keys:
        return [config.tensor_parallel_degree], {}
    divisors = [degree for degree in range(1, world + 1) if world % degree == 0]
    if isinstance(model, GraphModel):
        why = "an smp.GraphModel's tensor-parallel layers are built for one degree, the job's"
    elif not isinstance(model, torch.nn.Module) or (tp_plan is None and tp.builtin_plan(model) is None):
        why = f"{type(model).__name__} has no tensor-parallel plan (its own, a Hugging Face model's, or tp_plan)"
    else:
        return divisors, {}
    return [1], {degree: why for degree in divisors if degree > 1}


def _profile_at(model, sample, degree, world, tp_plan, dynamic_shapes, config, device):
    """`model` captured and profiled as rank 0 of a tensor-parallel group of `degree` would capture and profile it:
    a sharded copy for a degree the job has not adopted, its collectives counted, not run. Returns the profile and
    how many ranks its experts are split over: the model's own plan shards them as a job at ep 1 does (the planner
    makes them whole again for a layout dividing them), unless the config fixes an expert-parallel degree."""
    # The model comes unsharded (DistributedModel shards it once the layout is chosen), unless it is an
    # smp.GraphModel, whose tensor-parallel layers were built for the job's degree.
    if isinstance(model, GraphModel) and degree != tp.degree():
        raise ConfigError(f"tensor_parallel_degree {degree}: an smp.GraphModel's tensor-parallel layers were built "
                          f"for degree {tp.degree()}")
    sharded_here = degree > 1 and not isinstance(model, GraphModel)
    with tp._profiled_at(degree) if sharded_here else contextlib.nullcontext():
        experts_split = 1
        if sharded_here:
            model = copy.deepcopy(model)
            fixed_ep = "expert_parallel_degree" not in config.auto_keys and config.expert_parallel_degree > 1
            shard_for_tensor_parallelism(model, tp_plan, announce=False, experts_divided=fixed_ep)
            # The model's own plan splits the experts at ep 1 and leaves them whole at ep > 1, which the planner
            # then undoes; a given plan's split stays whatever the degree.
            if tp_plan is None and any(hasattr(parameter, "_smp_shard") for experts in experts_modules(model).values()
                                       for parameter in experts.parameters()):
                experts_split = degree
        # Cut as finely as the most stages considered: two per rank. Captured as the job will capture it: the plan's
        # cut names the graph's nodes, and which dimensions may change decides some of them.
        # Not divided over expert-parallel ranks, whatever degree the config fixes: the planner divides them itself
        # (and dividing them here would cut the model's own experts before the job does).
        graph, io_ = graph_of(model, sample, 2 * world, list(config.partition_overrides), dynamic_shapes,
                              experts=(1, 0), evaluation=False)
        # On the job's device, and on twice the sample too (a stage call's fixed cost against its cost per sample).
        with stage_autocast(device):  # as the capture traced it: in the precision the stages compute in
            profile = _smp.profile_for_planning(graph._graph, io_.engine_inputs(sample, "sample"), str(device))
        profile.least_microbatch, profile.most_microbatch = io_.microbatch_range()
        return profile, experts_split


def _check_routing_argument(tokens_per_expert):
    if not (tokens_per_expert is None or tokens_per_expert == "even" or
            isinstance(tokens_per_expert, collections.abc.Mapping)):
        raise ConfigError(f"tokens_per_expert {tokens_per_expert!r}: None (as routed on the sample), \"even\", or "
                          "{router or experts module path: tokens per expert, or a row of them per sample or step}")


def _routing_of(model, sample, tokens_per_expert):
    """{experts module path: rows of tokens per expert} as smp.plan's tokens_per_expert asks: None, counted on the
    sample (a row per sample); "even", none; or the counts given ({router or experts module path: tokens per expert,
    or a row of them per sample or step})."""
    experts = experts_modules(model) if isinstance(model, torch.nn.Module) else {}
    if tokens_per_expert is None:
        return _routing.per_sample(model, sample, experts)
    return {} if tokens_per_expert == "even" else _routing.by_experts_module(tokens_per_expert, experts)


def _mark_experts(profile, model, sample, split, routed=None):
    """Tells `profile` where a mixture-of-experts model's stacked experts are (what expert parallelism divides), the
    token rows they read on `sample`, one microbatch: its tokens x the model's experts per token x its hidden
    width, at the parameters' element size (what the ranks exchange), over how many tensor-parallel ranks the
    profile's experts are `split`, and how their routers chose (`routed`: _routing_of's; None: even)."""
    experts = experts_modules(model) if isinstance(model, torch.nn.Module) else {}
    if not experts:
        return
    config = getattr(model, "config", None)
    values = sample.values() if isinstance(sample, collections.abc.Mapping) else [sample]
    ids = next((value for value in values if isinstance(value, torch.Tensor) and not value.is_floating_point()), None)
    top_k, hidden = getattr(config, "num_experts_per_tok", None), getattr(config, "hidden_size", None)
    known = ids is not None and top_k and hidden
    if not known and ("expert_parallel_degree" in runtime().config.auto_keys or
                      runtime().config.expert_parallel_degree > 1):
        missing = [what for what, absent in (("integer token ids in the sample", ids is None),
                                             ("config.num_experts_per_tok", not top_k),
                                             ("config.hidden_size", not hidden)) if absent]
        warnings.warn(f"smp.plan: expert-parallel layouts of {type(model).__name__} are planned without the cost of "
                      f"their token exchanges (the rows exchanged are unknown without {', '.join(missing)})",
                      stacklevel=3)
    rows = {}
    for path, module in experts.items():
        element = next(module.parameters()).element_size()
        rows[path] = ids.numel() * top_k * hidden * element if known else 0
    # A degree must divide every layer's experts.
    profile.mark_experts(rows, math.gcd(*(module.num_experts for module in experts.values())), split, routed or {},
                         int(top_k or 0))


def _routing_report(plan):
    """A line per expert-parallel degree planned: how much more than its even share of rows the busiest rank gets in
    an exchange of the fastest fitting layout of that degree."""
    lines = []
    fastest = {}
    for row in plan.layouts:
        ep = json.loads(row["config"])["expert_parallel_degree"]
        if row["rejected"] is None and ep > 1:
            fastest.setdefault(ep, row)
    for ep, row in sorted(fastest.items()):
        factors = plan.routing_imbalance(row)
        if not factors:
            lines.append(f"routing at ep {ep}: assumed even (not counted: tokens_per_expert=\"even\", a model on "
                         "the meta device, or experts calls that could not be read, warned)\n")
            continue
        worst = max(factors, key=factors.get)
        lines.append(f"routing at ep {ep}: the busiest rank gets {sum(factors.values()) / len(factors):.2f}x its even "
                     f"share of rows in an exchange of {plan.exchange_samples(row)} samples (mean of {len(factors)} "
                     f"layers; most "
                     f"{factors[worst]:.2f}x, {worst})\n")
    return "".join(lines)


def plan(model, sample, world_size=None, global_batch_size=None, memory_limit_mb=None, optimizer_moments=None,
         link_gbps=None, latency_us=50.0, compute_scale=1.0, device_speeds=None, shared_cores=None,
         dynamic_shapes=None, tp_plan=None, tensor_parallel_degrees=None, synchronization_us=None,
         synchronized_gbps=None, tokens_per_expert=None, optimizer=torch.optim.AdamW, _for_this_job=False):
    """Predicts every layout of `world_size` ranks (default: this job's) for `model` on `sample` (one microbatch):
    tensor-parallel degree x pipeline stages x data-parallel replicas, schedule (GPipe, 1F1B, ZB-H1; interleaved
    1F1B, ZB-V and DualPipeV at two stages per rank), microbatches, recompute, ZeRO-1. The model is captured and
    profiled here, in this process (call smp.init first; one process will do). global_batch_size and memory_limit_mb
    default to the config's; optimizer: the job's optimizer, a torch.optim class or a callable making one of a
    list of parameters (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9); default AdamW), whose step is
    timed here; optimizer_moments: its state per parameter (Adam 2, SGD with momentum 1; default as the optimizer
    keeps it after a step);
    link_gbps (default the config's link_bandwidth_gbps) and latency_us price transfers between stages, the
    replicas' all-reduce and the tensor-parallel collectives. compute_scale is how much slower each rank computes in
    the job than here alone. shared_cores: the processors the job's ranks share (by default, on the CPU, this host's
    cores when the ranks outnumber them, a job of one host; 0: a device per rank); each rank then computes at cores /
    ranks computing at once, at most 1. An "auto" job passes what its ranks measured computing at once (other
    tenants of the host and memory contention included).
    Tensor parallelism: tensor_parallel_degrees (default: the config's degree, or with "tensor_parallel_degree":
    "auto" every divisor of the world that `tp_plan` or the model's own plan shards it at). For each degree above 1
    a copy of the model is sharded as rank 0 of that degree would hold it, captured and profiled alone: a shard's
    compute, parameters and activations, and its collectives counted and priced on the links as rings; a degree the
    model cannot take (heads that do not divide) is left out, in .unplanned_degrees and the report.
    Expert parallelism: a mixture-of-experts model (Hugging Face's experts classes) is planned at the config's
    "expert_parallel_degree", or with "auto" there at every degree dividing the replicas and the experts (beside
    tensor parallelism too: at ep 1 the model's own plan splits the experts' features over the tensor-parallel
    ranks; dividing them, each tensor-parallel rank holds its experts whole and divides them with the same
    tensor-parallel rank of other replicas): each rank holds its share of the experts' parameters, gradients and
    optimizer state,
    and every experts layer exchanges its token rows (tokens x num_experts_per_tok x hidden_size) four times a
    microbatch, priced on the links. Routing: as the routers choose on the sample, counted per sample in one more
    forward without gradients (only where a layout may divide the experts); each layer's exchanges wait for the rank
    holding its most-chosen experts, which computes and holds that many more rows (the report says how uneven, per
    degree). tokens_per_expert instead gives the counts ({router or experts module path: tokens per expert, or a row
    of them per sample or step}, e.g. a job's StepResult.tokens_per_expert, for a trained router), or "even".
    synchronization_us and synchronized_gbps: a collective between ranks that computed up to it, its fixed part and
    bandwidth, where ranks share cores and find a peer off its core (an "auto" job that plans tensor or expert
    parallelism measures them there; the tensor-parallel collectives and the experts' exchanges are priced on them).
    Devices that differ: device_speeds (one per rank of world_size; default the config's list) and the config's
    device_memory_mb predict each layout on its devices (a slow rank's replicas wait for it; a pipeline gives it a
    shorter stage; a tensor-parallel group computes at its slowest member's speed). A job with "auto" keys and
    "device_speeds": "measure" passes the speeds its ranks measured.
    The model is profiled on the sample and on twice its samples: a node costs a fixed part plus a part per sample.
    It is profiled on the job's device (the config's "device"), whatever device the sample was made on.
    Nodes timed alone are scaled to one pass of the whole model. The optimizer's step is timed here (`optimizer`,
    on the model's parameter shapes) per parameter byte; its temporaries (Adam's) as torch.optim's default holds them
    on this device (one parameter at a time on a CPU, all at once on a GPU). Predictions take the zero-bubble split
    as profiled (I and W per node) and assume the all-reduce follows the last backward without overlap.
    dynamic_shapes: as smp.DistributedModel will be given it (the plan's cut names the captured graph's nodes)."""
    if dynamic_shapes == "none" or (isinstance(dynamic_shapes, collections.abc.Mapping) and
                                    any(0 not in dims for dims in dynamic_shapes.values())):
        raise ConfigError(f"dynamic_shapes {dynamic_shapes!r}: smp.plan (and an \"auto\" layout) profiles the model on "
                          "the sample and on twice its samples, so every input's first dimension must stay free "
                          "(\"all\", \"batch\", or 0 among each named input's dimensions)")
    rt = runtime()
    _check_plan_arguments(world_size, global_batch_size, memory_limit_mb, optimizer_moments, compute_scale,
                          device_speeds, world_size or rt.world_size, optimizer)
    world = world_size or rt.world_size
    degrees, unplannable = (list(tensor_parallel_degrees), {}) if tensor_parallel_degrees else \
        _candidate_degrees(model, tp_plan, world, rt.config)
    if any(degree < 1 or world % degree for degree in degrees):
        raise ConfigError(f"tensor_parallel_degrees {degrees}: each must divide the world of {world} ranks")
    _check_routing_argument(tokens_per_expert)
    profiles, splits, unplanned = {}, {}, {}
    for degree in degrees:
        try:
            profiles[degree], splits[degree] = _profile_at(model, sample, degree, world, tp_plan, dynamic_shapes,
                                                           rt.config, torch.device(rt.device))
        except ConfigError as error:
            if len(degrees) == 1:
                raise
            unplanned[degree] = str(error)
    unplanned.update(unplannable)
    if not profiles:
        raise ConfigError("smp.plan: no tensor-parallel degree could be planned: " +
                          "; ".join(f"{degree}: {why}" for degree, why in unplanned.items()))
    if shared_cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        shared_cores = cores if rt.device == "cpu" and world > cores else 0
    # Timed on what it steps: a frozen backbone's small trained adapters cost more per byte than its large weights.
    trained = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    optimizer_s_per_byte, moments_kept = _optimizer_seconds_per_byte(
        torch.device(rt.device), trained or [tuple(p.shape) for p in model.parameters()], optimizer)
    optimizer_s_per_byte *= compute_scale
    optimizer_moments = moments_kept if optimizer_moments is None else optimizer_moments

    # Counted only where a layout may divide the experts (the count runs the model once more).
    divides = "expert_parallel_degree" in rt.config.auto_keys or rt.config.expert_parallel_degree > 1

    def predict(tokens_per_expert):
        _check_routing_argument(tokens_per_expert)
        routed = _routing_of(model, sample, tokens_per_expert) if divides else {}
        marked = {}
        for degree, profile in profiles.items():
            marked[degree] = profile.copy()  # the profile as measured, for predictions on other routing
            _mark_experts(marked[degree], model, sample, splits[degree], routed)
        layouts, report, choice = _smp.plan_layouts(
            marked, rt.config, world, int(global_batch_size or 0),
            -1.0 if memory_limit_mb is None else float(memory_limit_mb), float(optimizer_moments), latency_us * 1e-6,
            -1.0 if link_gbps is None else link_gbps * 1e9, float(compute_scale), optimizer_s_per_byte,
            list(device_speeds or []),
            float(shared_cores), rt.device != "cpu",  # torch.optim steps all parameters at once on a GPU (foreach)
            (synchronization_us or 0.0) * 1e-6, (synchronized_gbps or 0.0) * 1e9, _for_this_job)
        found = Plan(layouts, report, unplanned, predict, routed, world,
                     int(global_batch_size or rt.config.global_batch_size), choice)
        found.report += _routing_report(found)
        for degree, why in unplanned.items():
            found.report += f"tp {degree}: not planned: {why}\n"
        return found

    return predict(tokens_per_expert)


def _choose(model, sample, rt, links, speeds, dynamic_shapes, tp_plan, optimizer):
    """Rank 0's choice: (the chosen config's text, the chosen layout's row, the report, its routing as planned:
    Plan.routing_imbalance)."""
    found = plan(model, sample, link_gbps=links["bytes_per_s"] / 1e9, latency_us=links["latency_s"] * 1e6,
                 device_speeds=speeds, shared_cores=links["shared_processors"] or None, dynamic_shapes=dynamic_shapes,
                 tp_plan=tp_plan, synchronization_us=links["synchronization_s"] * 1e6,
                 synchronized_gbps=links["synchronized_bytes_per_s"] / 1e9, optimizer=optimizer, _for_this_job=True)
    if "error" in found._choice:
        unplanned = "".join(f"\ntp {degree}: not planned: {why}" for degree, why in found.unplanned_degrees.items())
        raise ConfigError(found._choice["error"] + unplanned)
    row = found.best  # the job's choice: the fastest it can adopt, which its own plan ranks first
    # Beside a step's counts: every microbatch's together.
    return found._choice["config"], row, found.report, found.routing_imbalance(row, whole_step=True)


# The layout this process's job adopted from rank 0's plan (adopt_planned_layout's message), for the models built
# after it, whose memory the plan did not count.
_adopted = None


def check_room_beside_plan(held_bytes, model_kind):
    """Says, on a rank where it does not fit, that a model built after the planned one takes `held_bytes` here beside
    the plan's predicted peak, past memory_limit_mb (the plan priced the first model alone)."""
    rt = runtime()
    # This rank's device's own figure where the config gives one, as the planner held the layout to it.
    devices = rt.config.device_memory_mb
    own = devices[rt.rank] if rt.rank < len(devices) and devices[rt.rank] > 0 else 0.0
    limit, named = (own, f"device_memory_mb[{rt.rank}]") if own > 0 else (rt.config.memory_limit_mb, "memory_limit_mb")
    if _adopted is None or limit <= 0 or rt.pp_rank >= len(_adopted["memory_mib"]):
        return
    planned = _adopted["memory_mib"][rt.pp_rank]
    held = held_bytes / 2**20
    if planned + held > limit:
        print(f"smp: rank {rt.rank}: this {model_kind} holds {held:.1f} MiB here (its optimizer's state not counted) "
              f"beside the planned model's predicted peak of {planned:.1f} MiB, {planned + held:.1f} MiB in all, over "
              f"{named} {limit:g}: the plan counted the first model alone; to plan room for this one, lower {named} "
              f"by {held:.1f}", file=sys.stderr, flush=True)


def forget_adopted_plan():
    """A new runtime (smp.init again) plans anew: the models of the last one's plan are not its."""
    global _adopted
    _adopted = None


def adopt_planned_layout(model, sample, dynamic_shapes=None, tp_plan=None, optimizer=None):
    """For a config with "auto" layout keys: rank 0 plans (smp.plan) among the layouts that keep what the config
    fixes, and every rank adopts its choice before the model is partitioned. Returns what was chosen: {"config": the
    layout's keys, "layout", "predicted_step_ms" (of which "optimizer_ms"), "memory_mib" per pipeline rank, "routing"
    (with experts divided, {experts module path: the busiest rank's share of a step's rows planned, times its even
    share}), "links"
    (what the ranks measured: latency_s, bytes_per_s, shared_processors, synchronization_s,
    synchronized_bytes_per_s), "report" (rank 0's table, on every rank)}; the model adds "measured_step_ms" after its fifth train_step.
    None when the job resumes a checkpoint, whose layout it keeps (smp._smp.resumed_layout)."""
    rt = runtime()
    # A resume keeps the layout its checkpoint was saved with: nothing to plan (None).
    resumed = rt._from_rank0("resumed_layout", lambda: _smp.resumed_layout(rt.config, rt.world_size))
    if resumed:
        rt._adopt_layout(_smp.Config.from_json_text(resumed, rt.config.source))
        return None
    links = rt._measured_planning_costs()  # every rank at once
    speeds = rt._device_speeds()  # measured here for "measure", and kept for the partition after

    def choose():
        text, row, report, routing = _choose(model, sample, rt, links, speeds, dynamic_shapes, tp_plan,
                                             optimizer or torch.optim.AdamW)
        # Drawn for the fastest layout the job can adopt: its choice.
        if row.get("timeline_svg") and rt.config.trace_dir:
            os.makedirs(rt.config.trace_dir, exist_ok=True)
            _smp.write_file_atomically(os.path.join(rt.config.trace_dir, "planned_layout.svg"), row["timeline_svg"])
        return json.dumps({"text": text, "config": json.loads(row["config"]), "layout": row["layout"],
                           "predicted_step_ms": row["step_ms"], "optimizer_ms": row["optimizer_ms"],
                           "memory_mib": row["memory_mib"], "links": links, "report": report, "routing": routing})

    message = json.loads(rt._from_rank0("planned_layout", choose))
    rt._adopt_layout(_smp.Config.from_json_text(message.pop("text"), rt.config.source))
    rt._expect_planned_model()
    global _adopted
    _adopted = message
    if rt.rank == 0:
        measured = message["links"]
        # 0 is "not measured" (the links above stand in): printed as such, not as a link of no bandwidth.
        synchronized = (f", a collective after computing {measured['synchronization_s'] * 1e6:.0f} us + "
                        f"{measured['synchronized_bytes_per_s'] / 1e9:.2f} GB/s"
                        if measured["synchronization_s"] > 0 and measured["synchronized_bytes_per_s"] > 0 else "")
        shared = (f"; the ranks computing at once had {measured['shared_processors']:.2f} processors{synchronized}"
                  if measured["shared_processors"] else "")
        print(f"smp: planned layout {message['layout']}, predicted step {message['predicted_step_ms']:.1f} ms, "
              f"peak {max(message['memory_mib']):.3f} MiB per rank\n"
              f"smp: links measured: latency {measured['latency_s'] * 1e6:.1f} us, "
              f"{measured['bytes_per_s'] / 1e9:.2f} GB/s{shared}\n{message['report']}", flush=True)
    return message
