"""A whole model captured with torch.export (non-strict) and cut into engine nodes along its module tree.

The exported program is one graph of ATen operations, each tagged with the module calls it ran inside
(``nn_module_stack``). The graph is grouped into *units*: module paths at whatever depth balance needs (whole
transformer blocks when there are many per stage, their attention and MLP halves, or finer, when there are few).
Each value a unit computes that something outside it reads becomes a node of the engine's graph, computed by a small
generated ``fx.GraphModule`` from the node's sources (other nodes' values and the model's inputs). Values that depend
on no parameter (attention masks, rotary tables, position ids: functions of the inputs and buffers alone) are
recomputed inside every node that reads them, so they never cross stages. Operations of a module that was cut
finer (the glue between its children: a residual add, a model-level position embedding, a class token) belong to the
node of the value they feed, or become nodes of their own when several nodes read them.

Parameters keep the names of the model's ``state_dict``: each node's module mirrors the model's tree for the
parameters and buffers it reads (``names_from_root``), so a parameter read by nodes on several stages (a tied LM
head, a model-level embedding) is one tied parameter, and one read directly by the model's own forward lives on the
stage of the node that reads it.
"""

import collections
import contextlib
import functools
import itertools
import weakref

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import _capture_cache, _evaluation_path, _expert_parallel, _materialize, _mode_calls, _routing
from ._captured_node import (_ASSERTS, CONSTANTS, IN_EVALUATION, IN_EVALUATION_ROUTE, ORIGIN, CapturedNode, _attribute,
                             _is_op, _mutates_first_argument, _owner_path, mode_owners, module_paths, placeholder_name,
                             run_fuser)
from ._data_flow import READS_METADATA_ONLY, data_flow, is_random
from ._exporting import CaptureError, dynamic_shapes, export_as_if_on, export_model, real_constant
from ._input_limits import InputShapes, TableLookups, shape_guards
from ._smp import ModelError
from ._state import runtime_or_none
from ._value_sketch import sketch_of, sketch_values

_aten = torch.ops.aten

def _signature_kinds(exported):
    """Placeholder name -> (kind, target) from the export's graph signature."""
    kinds = {}
    for spec in exported.graph_signature.input_specs:
        kinds[spec.arg.name] = (spec.kind.name, spec.target, getattr(spec.arg, "value", None))
    return kinds


class _Units:
    """Groups the operations by module path: a unit is a module whose operations (its children's included, unless a
    child is a unit of its own) run together on one stage."""

    def __init__(self, model, ops):
        self.model = model
        self.ops = ops
        self.parameter_count = collections.Counter()
        for path, parameter in model.named_parameters():
            parts = path.split(".")
            for depth in range(len(parts)):
                self.parameter_count[".".join(parts[:depth])] += parameter.numel()
        self.used = set()  # module paths some operation ran inside, and their containers (never called themselves)
        for op in ops:
            for path in module_paths(op):
                parts = path.split(".")
                self.used.update(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
        self.units = set()
        self._expand("")

    def children(self, path):
        module = self.model.get_submodule(path) if path else self.model
        return [f"{path}.{name}" if path else name for name, _ in module.named_children()
                if (f"{path}.{name}" if path else name) in self.used]

    def expandable(self, path):
        """Has children, and they hold most of its parameters: cutting a module whose tensors are its own (stacked
        experts, whose only child is an activation) would split its computation into pieces, not its weight."""
        children = self.children(path)
        held = sum(self.parameter_count[child] for child in children)
        return bool(children) and 2 * held >= self.parameter_count[path]

    def _expand(self, path):
        self.units.discard(path)
        for child in self.children(path):
            module = self.model.get_submodule(child)
            # A container is never called: its elements stand in for it.
            if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                self._expand(child)
            else:
                self.units.add(child)

    def expand(self, path):
        self._expand(path)

    def refine(self, stages, pinned_paths=()):
        """Cuts the heaviest units (by parameters) finer until each holds at most a quarter of a stage's share, so
        that the partitioner can balance; and down to every pinned path."""
        for path in pinned_paths:
            for unit in sorted(self.units):
                if path.startswith(unit + ".") and path != unit:
                    self.expand(unit)
                    return self.refine(stages, pinned_paths)
        total = max(self.parameter_count[""], 1)
        limit = total / (4.0 * max(stages, 1))
        while True:
            candidates = [u for u in self.units if self.expandable(u)]
            if not candidates or len(self.units) > 64 * max(stages, 1):
                return
            heaviest = max(candidates, key=lambda u: (self.parameter_count[u], u))
            if self.parameter_count[heaviest] <= limit:
                return
            self.expand(heaviest)

    def unit_of(self, op):
        for path in reversed(module_paths(op)):
            if path in self.units:
                return path
        return None


def _merge_tensor_parallel_copies(graph):
    """One copy to the tensor-parallel shards per value: a plan's sibling column layers (query, key and value; gate
    and up) each copy the same input, and one copy sums their gradients in one all-reduce, not one each."""
    from .tp import COPY_TO_SHARDS
    first = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is COPY_TO_SHARDS:
            kept = first.setdefault(node.args[0], node)
            if kept is not node:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)


def capture(model, args, kwargs, stages, pinned_paths, graph_factory, device=torch.device("cpu"), experts=(1, 0),
            dynamic=None, evaluation=True):
    """Exports `model` on the sample (args, kwargs) and builds the engine's graph: returns (graph, input leaves,
    output spec, input shapes), where the input leaves say for each leaf of the flattened (args, kwargs) the engine input name it
    feeds (None for leaves baked into the capture), the output spec how the model's outputs are rebuilt from the
    engine's output tensors, and the InputShapes each microbatch is checked against. A model on the meta device is
    exported as if on `device`, where the job runs it. `experts`: (expert-parallel degree, this rank's place in its
    group); above 1, the experts modules are divided over the group (smp._expert_parallel). `dynamic`: which input
    dimensions may change (smp._exporting.dynamic_shapes' choice). `evaluation`: give the graph the check of
    evaluation's path that its first evaluation runs (`_check_evaluation`, smp._evaluation_path)."""
    name = type(model).__name__
    expert_degree, expert_rank = experts
    divided = _expert_parallel.experts_modules(model) if expert_degree > 1 else {}
    if expert_degree > 1:
        _expert_parallel.check_divisible(divided, expert_degree)
    args, kwargs = _distinct_inputs(args, kwargs)
    on_meta = _materialize.is_meta(model)
    free, held = dynamic_shapes(model, args, kwargs, dynamic)
    # Autocast where the export computes: a model of real tensors is traced where they are (a CPU-built model of a
    # CUDA job, under CPU autocast), a meta one on the job's device.
    traced_on = device if on_meta else next((t.device for t in itertools.chain(model.parameters(), model.buffers())
                                             if not t.is_meta), device)
    with _exporting(model, traced_on):
        exported, fixed_because = _export_in("train", model, args, kwargs, free, device, divided, on_meta)
    # Evaluation's path is checked at the first evaluation (smp._evaluation_path), against the export as it was
    # before the capture rewrites it below: most jobs never evaluate, and a second export at every capture cost the
    # test suite a fifth of its time.
    raw_graph = _copied(exported.graph_module)
    # Its capture cache key now, while every rank describes the model alike (later each holds its own tensors only):
    # the ranks of a job then export it once between them.
    with stage_autocast(device):
        evaluation_key = _capture_cache.key(model, args, kwargs, free, device, True, divided, mode="eval") \
            if evaluation else None
    evaluation_check = functools.partial(_check_evaluation, model, args, kwargs, free, device, divided, raw_graph,
                                         evaluation_key) if evaluation else None
    graph = exported.graph_module.graph
    _merge_tensor_parallel_copies(graph)
    kinds = _signature_kinds(exported)
    for spec in exported.graph_signature.output_specs:
        if spec.kind.name not in ("USER_OUTPUT",):
            raise ModelError(f"{name}'s forward {spec.kind.name.lower().replace('_', ' ')} "
                             f"({spec.target or spec.arg}); smp cannot cut it into stages")

    if divided:
        parameter_nodes = {kinds[node.name][1]: node for node in graph.nodes
                           if node.op == "placeholder" and kinds[node.name][0] == "PARAMETER"}
        _expert_parallel.across_ranks(graph, parameter_nodes, divided, expert_degree, expert_rank)

    # The model's own tensors, by their paths: the same objects the engine then trains. A tensor under several
    # paths (a tied LM head) goes by its first, as in the model's named_parameters().
    parameters = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    first_path = {}
    for path, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        first_path.setdefault(id(tensor), path)
    attributes = {}  # placeholder or get_attr node -> (path, object)
    user_inputs = []
    for node in graph.nodes:
        if node.op == "placeholder":
            kind, target, value = kinds[node.name]
            if kind == "PARAMETER":
                attributes[node] = (first_path[id(parameters[target])], parameters[target])
            elif kind == "BUFFER":
                attributes[node] = (first_path.get(id(buffers[target]), target), buffers[target])
            elif kind == "CONSTANT_TENSOR":
                attributes[node] = (CONSTANTS + target.replace(".", "_"),
                                    real_constant(exported.constants[target], target, name))
            elif kind == "USER_INPUT":
                user_inputs.append(node)
            else:
                raise ModelError(f"{name}'s forward takes a {kind.lower()} ({target}); smp cannot cut it into stages")
        elif node.op == "get_attr":
            attributes[node] = (node.target, _attribute(exported.graph_module, node.target))

    # Flattened (args, kwargs) leaves, in the export's order: tensors become engine inputs, the rest stays as captured.
    leaves, _ = pytree.tree_flatten((args, kwargs))
    if len(leaves) != len(user_inputs):
        raise ModelError(f"{name}: the export has {len(user_inputs)} inputs for {len(leaves)} sample values")
    input_names = {}
    leaf_inputs = []
    held_by_input = {}
    for leaf, node in zip(leaves, user_inputs):
        if isinstance(leaf, torch.Tensor):
            input_names[node] = node.name
            leaf_inputs.append(node.name)
            held_by_input[node.name] = held.get(id(leaf), set())
        else:
            attributes[node] = (None, leaf)  # baked in: the value the sample had
            leaf_inputs.append(None)

    shapes = InputShapes.of(exported, [node for node in user_inputs if node in input_names], fixed_because,
                            held_by_input, shape_guards(getattr(exported, "_guards_code", None), model, args, kwargs,
                                                        leaf_inputs, leaves))
    shapes.one_value_norms = _one_value_norms(graph)
    for node in list(graph.nodes):
        if _is_op(node) and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    order = {node: i for i, node in enumerate(graph.nodes)}

    # Values that depend on no parameter and draw no random numbers are recomputed wherever they are read.
    dynamic, extra_inputs = data_flow(graph, order, attributes, name)
    order = {node: i for i, node in enumerate(graph.nodes)}  # with the scatters that writes through views added
    for node in reversed(list(graph.nodes)):
        if _is_op(node) and not node.users and not _mutates_first_argument(node) and not is_random(node):
            graph.erase_node(node)
    ops = [node for node in graph.nodes if _is_op(node)]
    # Buffer updates with no reader: part of their module's unit.
    side_effects = [op for op in ops if not op.users and _mutates_first_argument(op) and op.args[0] in attributes]

    output_node = next(node for node in graph.nodes if node.op == "output")
    output_leaves = list(output_node.args[0])

    units = _Units(model, ops)
    units.refine(stages, pinned_paths)
    while True:
        plan = _plan_nodes(graph, ops, dynamic, units, output_leaves, side_effects)
        split = [unit for unit, values in plan.items() if unit is not None and isinstance(unit, str) and
                 len(values) > 1 and units.expandable(unit)]
        if not split:
            break
        for unit in split:
            units.expand(unit)
    _draw_once(plan, input_names, order, units)

    engine = graph_factory([input_names[n] for n in user_inputs if n in input_names])
    engine._fused_runs = weakref.WeakSet()  # what evaluation's tags reach besides the nodes
    engine._check_evaluation = (lambda: evaluation_check(engine)) if evaluation_check else None
    captured_device = next((t.device for t in parameters.values()), torch.device("cpu"))
    value_name = dict(input_names)  # what a node reads a value by: a model input's name, or its node's
    node_name = {}  # value -> the engine node that makes it (a returned input: an identity node of its own)
    taken = set(value_name.values())
    for home, values in plan.items():
        for index, value in enumerate(values):
            if value in input_names:
                base = f"{value.name}_returned"
            elif isinstance(home, str):
                base = home
            else:  # glue: named inside the module whose forward it belongs to
                paths = module_paths(value)
                base = f"{paths[-1]}.{value.name}" if paths and paths[-1] else value.name
            candidate, suffix = (base if index == 0 else f"{base}#{index}"), index
            while candidate in taken or any(candidate.startswith(t + ".") or t.startswith(candidate + ".")
                                            for t in taken):
                suffix += 1  # "#n" still names the module for partition_overrides (cut_from)
                candidate = f"{base}#{suffix}"
            taken.add(candidate)
            node_name[value] = candidate
            value_name.setdefault(value, candidate)
    # In graph order, so that every node reads values made before it.
    materialized = sorted({value for values in plan.values() for value in values}, key=lambda n: order[n])
    home_of_value = {value: home for home, values in plan.items() for value in values}
    # Each buffer update runs with its module's unit, or, where that module was cut into its children (its forward's
    # own operations between them), with the first of them.
    home_of_update = {}
    for op in side_effects:
        unit = units.unit_of(op)
        owner = unit if unit is not None else _owner_path(op)  # a module cut into children has no unit of its own
        homes = [home for home in plan if isinstance(home, str) and owner and
                 (home == owner or home.startswith(owner + "."))]
        if not homes and owner:
            raise ModelError(f"{name}'s forward calls {owner} and uses nothing it returns, but {owner} updates a buffer "
                             f"in place ({op.format_node()}): smp places a module by the values it makes; use its "
                             "output, or do not call it")
        if not homes:
            raise ModelError(f"{name}'s forward updates a buffer in place outside any submodule "
                             f"({op.format_node()}); do it inside a module the forward calls, so that a stage holds it")
        home_of_update[op] = owner if owner in homes else homes[0]
    runs_in = collections.defaultdict(list)  # a random operation -> the nodes that would run it
    counters = {}  # a router's chosen experts -> the operation counting them, run by the node that computes them
    for chosen, experts, router in _routing.routers(graph, dynamic, module_paths):
        with graph.inserting_after(chosen):
            counters[chosen] = graph.call_function(_routing.RoutingCounter(router), (chosen, experts))
        order[counters[chosen]] = order[chosen] + 0.5
    made = []  # (value, its node's graph, attributes, source names), in graph order
    for value in materialized:
        home = home_of_value[value]
        extra = [op for op in side_effects if home_of_update[op] == home] if plan[home][0] is value else []
        node_graph, sources, node_attributes, computed = _node_graph(value, extra, value_name, attributes, order,
                                                                     extra_inputs)
        counted_here = [counters.pop(chosen) for chosen in list(counters) if chosen in computed]
        if counted_here:
            extra = extra + counted_here
            node_graph, sources, node_attributes, computed = _node_graph(value, extra, value_name, attributes, order,
                                                                         extra_inputs)
        for op in computed:
            if is_random(op):
                runs_in[op].append(node_name[value])
        made.append((value, node_graph, node_attributes, [value_name[s] for s in sources]))
    _hold_unread(model, made, node_name, first_path, divided)
    for value, node_graph, node_attributes, source_names in made:
        module = CapturedNode(node_graph, node_attributes, node_name[value], captured_device, source_names,
                              mode_owners(node_graph, model, node_attributes.get))
        engine._add_call(node_name[value], module, module, source_names, names_from_root=True,
                         profile_key=module.profile_key())
        engine._captured[node_name[value]] = module
    for op, nodes in runs_in.items():
        if len(nodes) > 1:
            raise ModelError(f"{name}: {op.format_node()} draws random numbers, and the values it leads to are read "
                             f"apart ({', '.join(nodes)}), each computing it again with other numbers; let one module "
                             "compute it and return one value, or give it a probability of 0")
    outputs = []
    for leaf in output_leaves:
        if isinstance(leaf, fx.Node):
            outputs.append(node_name[leaf])
    if not outputs:
        raise ModelError(f"{name}'s forward returns no tensor")
    engine._graph.set_outputs(outputs)
    # Not the GraphModel itself: the engine's graph holds the fuser, and would keep itself alive through it.
    engine._graph.set_run_fuser(run_fuser(engine._captured, engine.node_names(), engine._fused_runs))
    output_spec = (exported.call_spec.out_spec,
                   [None if isinstance(leaf, fx.Node) else leaf for leaf in output_leaves])
    shapes.lookups = TableLookups.of(graph, dynamic, attributes, input_names, order)
    return engine, leaf_inputs, output_spec, shapes


_BATCH_NORMS = tuple(op for op in (getattr(torch.ops.aten, name, None) for name in
                                    ("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                                     "_native_batch_norm_legit_functional", "_batch_norm_with_update",
                                     "_batch_norm_with_update_functional", "cudnn_batch_norm"))
                     if op is not None)


def _one_value_norms(graph):
    """Paths of the batch norms whose input holds one value a channel per sample (a (N, C) input, 1 x 1 maps): a
    microbatch of 1 sample would give them statistics over one value, which PyTorch refuses ("more than 1 value per
    channel") and export's least size of 2, not enforced, no longer keeps away."""
    paths = []
    for node in graph.nodes:
        if not _is_op(node) or getattr(node.target, "overloadpacket", node.target) not in _BATCH_NORMS:
            continue
        sketch = sketch_of(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        if sketch is None:
            continue
        per_sample = 1
        for size in sketch.shape[2:]:
            per_sample = per_sample * size if isinstance(size, int) else 2  # a size that changes: more than 1
        if per_sample == 1 and _owner_path(node) not in paths:
            paths.append(_owner_path(node))
    return paths


def _distinct_inputs(args, kwargs):
    """The sample with a tensor given as two inputs (labels=input_ids, Hugging Face's way) given as two tensors:
    export makes one tensor one input, whose readers then read whichever name it kept, the labels for the embedding,
    wrong as soon as a batch's labels differ from its inputs (-100 padding)."""
    seen = set()

    def distinct(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in seen:
            return value.clone()
        seen.add(id(value))
        return value

    return pytree.tree_map(distinct, (args, kwargs))


def stage_autocast(device):
    """torch.autocast as the config's "bf16" or "fp16" runs every stage. Traced in float32, a cast back to a dtype the
    code read off an autocast result (Qwen3's q_norm: .to(input_dtype) after a bfloat16 projection) was recorded as a
    cast to float32, and the stage computed on in float32 where autocast's model gives bfloat16."""
    rt = runtime_or_none()
    dtype = None if rt is None else torch.bfloat16 if rt.config.bf16 else torch.float16 if rt.config.fp16 else None
    return torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _exporting(model, device):
    """Exports leave no trace in the training state: the modules' modes, buffers, the random numbers dropout draws
    next, a Hugging Face config's use_cache (a forward that passes its keyword arguments on, GraniteMoE's, takes it
    from there). They trace under the autocast the stages run under (stage_autocast)."""
    buffers_before = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(module, module.training) for module in model.modules()]
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False
    try:
        with torch.random.fork_rng(devices=[]), stage_autocast(device):
            yield
    finally:
        for module, mode in modes:
            module.training = mode
        if cached:
            config.use_cache = cached
        with torch.no_grad():
            for buffer, saved in buffers_before:
                buffer.copy_(saved)


def _export_in(mode, model, args, kwargs, free, device, divided, on_meta, key=None):
    """The model exported in training or eval mode ("train", "eval"), through the capture cache. Captured in
    training mode whatever mode the model is in (from_pretrained gives eval): evaluation turns dropout and batch
    statistics off in the captured code, but nothing could turn them on."""
    for module in model.modules():  # the flags alone: a train() of the model's own may do more (merge weights)
        module.training = mode == "train"

    def export():
        with _expert_parallel.opaque_for_export(divided):
            exported, why_fixed = (export_as_if_on(device, model, args, kwargs, free) if on_meta else
                                   export_model(model, args, kwargs, free))
        sketch_values(exported.graph_module.graph)
        return exported, why_fixed

    if key is None:
        key = _capture_cache.key(model, args, kwargs, free, device, on_meta, divided, mode=mode)
    return _capture_cache.exported(key, model, export)


def _copied(graph_module):
    """The export's graph as it is now (its nodes' names and what the capture knows of them), apart from the
    capture's rewrites of it."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return fx.GraphModule(graph_module, graph)


def _check_evaluation(model, args, kwargs, free, device, divided, raw, key, engine):
    """(module path, what differs) where the model's eval-mode export takes another path than evaluating its
    training capture `raw` would, else None, the captured code then tagged to leave out in evaluation what the eval
    forward does not run (stochastic depth). The model may hold only this rank's tensors by now (the others
    released to the meta device): exported on fake tensors then, the release's refusal held off."""
    with _exporting(model, device), _materialize.released_model_runs():
        if _mode_calls.same_in_both_modes(model, args, kwargs, device, divided):
            return None
    try:
        with _exporting(model, device), _materialize.released_model_runs():
            # On fake tensors whatever the model holds (the same export on every rank, which the key promises).
            evaluated, _ = _export_in("eval", model, args, kwargs, free, device, divided, True, key)
    except CaptureError as error:
        return "", f"its eval mode cannot be captured: {error}"
    user_inputs = {spec.arg.name for spec in evaluated.graph_signature.input_specs if spec.kind.name == "USER_INPUT"}
    differs = _evaluation_path.evaluation_difference(raw.graph, evaluated.graph_module.graph, user_inputs)
    if differs is None:
        tags = {node.name: {key: node.meta[key] for key in (IN_EVALUATION, IN_EVALUATION_ROUTE) if key in node.meta}
                for node in raw.graph.nodes if IN_EVALUATION in node.meta}
        for captured in engine._captured.values():
            captured.take_evaluation_tags(tags, model)
        for run in list(engine._fused_runs):
            run.take_evaluation_tags(tags)
    return differs


def _hold_unread(model, made, node_name, first_path, divided):
    """Gives the parameters and persistent buffers no node reads (a head the forward does not call) to the node
    nearest them in the module tree (the first of those as near): they are the model's all the same, in its
    state_dict, checkpoints and exports, and train as PyTorch trains them (no gradient). Not for divided experts,
    whose tensors the model holds whole and the nodes by share."""
    held = {id(tensor) for _, _, attributes, _ in made for tensor in attributes.values()
            if isinstance(tensor, torch.Tensor)}
    for path, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in held or first_path.get(id(tensor), path) != path or \
                any(path.startswith(experts + ".") for experts in divided):
            continue
        parts = path.split(".")[:-1]

        def shared_depth(entry):
            node_parts = node_name[entry[0]].split("#")[0].split(".")
            depth = 0
            while depth < min(len(parts), len(node_parts)) and parts[depth] == node_parts[depth]:
                depth += 1
            return depth
        nearest = max(made, key=shared_depth)  # max keeps the first of equals
        nearest[2][path] = tensor
        held.add(id(tensor))


def _plan_nodes(graph, ops, dynamic, units, output_leaves, side_effects):
    """home -> the values of that home other homes read (or the model returns), in graph order. A home is a unit's
    path, or a glue operation (one of no unit) read by several operations. An operation whose value is not a tensor
    (a split's list, a tuple) never crosses stages: it belongs to its readers' home, or is recomputed in each."""
    outputs = {leaf for leaf in output_leaves if isinstance(leaf, fx.Node)}
    recomputed = object()
    home = {}
    for op in reversed(ops):  # users first: a glue operation read once joins its reader's home
        if op not in dynamic:
            continue
        readers = [u for u in op.users if u.op != "output"]
        if sketch_of(op) is None:
            homes = {home.get(u, recomputed) for u in readers}
            home[op] = homes.pop() if len(homes) == 1 else recomputed
            continue
        unit = units.unit_of(op)
        if unit is not None:
            home[op] = unit
        elif len(readers) == 1 and op not in outputs and home.get(readers[0], recomputed) is not recomputed:
            home[op] = home[readers[0]]
        else:
            home[op] = op
    plan = collections.OrderedDict()
    # An output of no parameter (an input returned as it is, a mask) is made where the model's output is needed.
    for leaf in output_leaves:
        if isinstance(leaf, fx.Node) and leaf not in dynamic:
            plan.setdefault(leaf, []).append(leaf)
    for op in ops:
        if op not in dynamic or home[op] is recomputed or sketch_of(op) is None:
            continue
        # A reader of its shape alone (zeros_like) is recomputed where its result is read: the value goes there
        # rather than its whole computation.
        read_elsewhere = op in outputs or any((u in home and home[u] is not home[op] and home[u] != home[op]) or
                                              (_is_op(u) and u.target in READS_METADATA_ONLY) for u in op.users)
        if read_elsewhere:
            plan.setdefault(home[op], []).append(op)
    return plan


def _draw_once(plan, model_inputs, order, units):
    """A random operation whose values are read apart (PhiMoE's router jitter, in a module returning several values
    and without children to cut it into) becomes a value of its home of its own: computed once, read by the others,
    rather than drawn again, with other numbers, in each node computing one of them."""
    while True:
        made = set(model_inputs) | {value for values in plan.values() for value in values}
        drawn_in = collections.defaultdict(set)
        for value in made - set(model_inputs):
            stack, seen = list(value.all_input_nodes), set()
            while stack:
                node = stack.pop()
                if node in seen or node in made:
                    continue
                seen.add(node)
                if is_random(node):
                    drawn_in[node].add(value)
                stack.extend(node.all_input_nodes)
        shared = [op for op, values in drawn_in.items() if len(values) > 1 and
                  sketch_of(op) is not None]
        if not shared:
            return
        for op in shared:
            home = units.unit_of(op) or op
            plan.setdefault(home, []).append(op)
            plan[home].sort(key=lambda n: order[n])


def _node_graph(value, extra, value_name, attributes, order, extra_inputs):
    """The graph that computes `value` (and the buffer updates `extra`) from materialized values and model inputs:
    (graph, sources in order, attributes by path)."""
    if value in value_name and value.op == "placeholder":  # a model input returned as it is
        graph = fx.Graph()
        graph.output(graph.placeholder("input"))
        return graph, [value], {}, set()
    needed = set()
    sources = []
    stack = [value] + list(extra)
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node is not value and node in value_name:
            if node not in sources:
                sources.append(node)
            continue
        needed.add(node)
        if node.op == "placeholder" and node not in attributes:
            raise ModelError(f"internal: input {node.name} of the capture has no engine name")
        stack.extend(node.all_input_nodes)
        stack.extend(extra_inputs.get(node, ()))
    sources.sort(key=lambda n: order[n])
    graph = fx.Graph()
    env = {}
    for source in sources:
        env[source] = graph.placeholder(placeholder_name(value_name[source]))
    node_attributes = {}
    for node in sorted(needed, key=lambda n: order[n]):
        if node in attributes:
            path, obj = attributes[node]
            if path is None:
                env[node] = obj  # a constant input (a flag, None)
                continue
            node_attributes[path] = obj
            env[node] = graph.get_attr(path)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            env[node].meta[ORIGIN] = node.name
    graph.output(env[value])
    for node in graph.nodes:  # what the capture knew of each value (fake tensors): not needed to run, and not small
        # The module each operation ran in stays: dropout and batch norm follow that module's flag (mode_owners);
        # and the export's name for it, by which evaluation's tags find it (smp._evaluation_path).
        stack = node.meta.get("nn_module_stack")
        origin = {ORIGIN: node.meta[ORIGIN]} if ORIGIN in node.meta else {}
        node.meta = {"nn_module_stack": dict(list(stack.items())[-1:]), **origin} if stack else origin
    return graph, sources, node_attributes, needed
