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
import inspect
import itertools

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ._captured_node import (_ASSERTS, CapturedNode, _attribute, _is_op, _mutates_first_argument, placeholder_name,
                             run_fuser)
from . import _routing
from ._smp import ConfigError, ModelError

_aten = torch.ops.aten

# Operations that read only their tensor inputs' shape, dtype and device: what they make depends on no parameter
# even when those inputs do (a mask made with x.new_zeros, filled in place, recomputed where read).
_READS_METADATA_ONLY = {getattr(_aten, name).default for name in
                        ("new_zeros", "new_ones", "new_empty", "zeros_like", "ones_like", "empty_like")} | \
                       {_aten.new_full.default, _aten.full_like.default, _aten.sym_size.int, _aten.sym_numel.default,
                        _aten.sym_stride.int}


def _copied(into, source, non_blocking=False):
    """copy_ out of place, with a derivative (aten.copy has none): the source as the written tensor would hold it."""
    return source.to(dtype=into.dtype, device=into.device, non_blocking=non_blocking).expand_as(into)


# In-place operations whose out-of-place form is not their name without the underscore.
_OUT_OF_PLACE = {_aten.bernoulli_.float: _aten.bernoulli.p, _aten.copy_.default: _copied}


def _permute_back(view, value):
    dims = list(view.args[1])
    inverse = [0] * len(dims)
    for position, dim in enumerate(dims):
        inverse[dim % len(dims)] = position
    return _aten.permute.default, (value, inverse)


# A view's base with `value` written through the view, out of place: view operation -> (scatter, its arguments).
_SCATTER_BACK = {
    _aten.slice.Tensor: lambda view, value: (_aten.slice_scatter.default, (view.args[0], value, *view.args[1:])),
    _aten.select.int: lambda view, value: (_aten.select_scatter.default, (view.args[0], value, *view.args[1:])),
    _aten.diagonal.default: lambda view, value: (_aten.diagonal_scatter.default, (view.args[0], value,
                                                                                  *view.args[1:])),
    _aten.as_strided.default: lambda view, value: (_aten.as_strided_scatter.default, (view.args[0], value,
                                                                                      *view.args[1:])),
    _aten.transpose.int: lambda view, value: (_aten.transpose.int, (value, *view.args[1:])),
    _aten.t.default: lambda view, value: (_aten.t.default, (value,)),
    _aten.permute.default: _permute_back,
}
for _reshaping in ("view.default", "_unsafe_view.default", "reshape.default", "unsqueeze.default", "squeeze.dim",
                   "squeeze.dims", "squeeze.default", "alias.default", "flatten.using_ints", "unflatten.int"):
    _packet, _overload = _reshaping.split(".")
    _SCATTER_BACK[getattr(getattr(_aten, _packet), _overload)] = \
        lambda view, value: (_aten.reshape_as.default, (value, view.args[0]))


def _is_view(node):
    schema = getattr(node.target, "_schema", None) if _is_op(node) else None
    if schema is None or not schema.returns or not schema.arguments:
        return False
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return returned is not None and not returned.is_write and first is not None and not first.is_write


class CaptureError(Exception):
    pass


def _functional_variant(op):
    """aten.add_.Tensor -> aten.add.Tensor, or None."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.endswith("_"):
        return None
    packet = getattr(_aten, schema.name.split("::")[1][:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)


def _is_random(node):
    """Draws random numbers as captured: a seeded operation, unless its probability is 0 (dropout(p=0), an LSTM
    without dropout between layers)."""
    if not _is_op(node) or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema else ()):
        if argument.name in ("p", "dropout", "dropout_p"):
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, (int, float)) and value == 0:
                return False
    return True


def _module_paths(node):
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


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
            for path in _module_paths(op):
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
        for path in reversed(_module_paths(op)):
            if path in self.units:
                return path
        return None


def _model_frame(error):
    """Where in the model's own code (not torch's) the export failed: 'file:line in function: code'."""
    import os
    import traceback
    torch_dir = os.path.dirname(torch.__file__)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith(torch_dir) and not frame.filename.startswith(os.path.dirname(__file__))]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _every_dimension_free(model, args, kwargs):
    """Export's dynamic_shapes with every dimension of every tensor input left to export (Dim.AUTO): those the model
    lets change become symbols, those it needs fixed (a patch size, channels) keep the sample's size."""
    def free(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return {dim: torch.export.Dim.AUTO for dim in range(value.dim())}
        return None

    # By the forward's parameter names, as export binds the inputs: keyword arguments a forward takes through
    # **kwargs (use_cache given to a BERT) sit under that parameter's name.
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(free, value) for name, value in bound.items()}


def export_model(model, args, kwargs):
    """The model exported so that its inputs' shapes may change where the model allows (a sequence length, the batch
    of a short last step), else on the sample's shapes: (exported program, why the shapes are fixed or None)."""
    try:
        dynamic = _every_dimension_free(model, args, kwargs)
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False), None
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - export raises many kinds; the fixed-shape export says what is wrong
        text = str(error).strip()
        reason = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    return _export_fixed(model, args, kwargs), reason


def _export_fixed(model, args, kwargs):
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except ConfigError:
        raise  # what the job's config cannot do with this input (a sequence tensor parallelism cannot split)
    except Exception as error:  # noqa: BLE001 - export raises many kinds
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        where = _model_frame(error)
        raise CaptureError(f"{type(error).__name__}: {first}" + (f" (at {where})" if where else "")) from error


def _export_as_if_on(device, model, args, kwargs):
    """Exports a model built on the meta device as if its tensors were on `device`, where the job runs it: model code
    that branches on the device (transformers' experts count tokens with histc on floats on a CPU, on integers
    elsewhere) takes the branch that will run. Its tensors stand in as fake tensors on that device for the export,
    and are the model's own meta tensors again afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    converter = mode.fake_tensor_converter

    def fake(tensor):
        return converter.from_meta_and_device(mode, tensor.to("meta"), device)

    originals = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is not None:
                    originals.append((table, key, tensor))
    stand_ins = {}
    try:
        for table, key, tensor in originals:
            if id(tensor) not in stand_ins:  # a tied tensor stays one tensor
                stand_in = fake(tensor)
                stand_ins[id(tensor)] = torch.nn.Parameter(stand_in, tensor.requires_grad) \
                    if isinstance(tensor, torch.nn.Parameter) else stand_in
            table[key] = stand_ins[id(tensor)]
        with mode:
            args, kwargs = pytree.tree_map(lambda v: fake(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
            return export_model(model, args, kwargs)
    finally:
        for table, key, tensor in originals:
            table[key] = tensor


def _real_constant(value, target, name):
    """A tensor the forward made from literals: exported on fake tensors (a meta-built model), its value is the one
    the fake tensor remembers."""
    from torch._subclasses.fake_tensor import FakeTensor
    if not isinstance(value, FakeTensor):
        return value
    if value.constant is None:
        raise ModelError(f"{name}'s forward makes a constant tensor ({target}) whose value a model built on the meta "
                         "device does not have; build the model on a real device, or compute it from the inputs")
    return value.constant


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


def capture(model, args, kwargs, stages, pinned_paths, graph_factory, device=torch.device("cpu")):
    """Exports `model` on the sample (args, kwargs) and builds the engine's graph: returns (graph, input leaves,
    output spec), where the input leaves say for each leaf of the flattened (args, kwargs) the engine input name it
    feeds (None for leaves baked into the capture), and the output spec how the model's outputs are rebuilt from
    the engine's output tensors."""
    name = type(model).__name__
    # Capturing must leave no trace in the training state: buffers, and the random numbers dropout draws next.
    buffers_before = [(b, b.detach().clone()) for b in model.buffers()]
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    # Captured in training mode, whatever mode the model is in (from_pretrained gives eval): evaluation turns dropout
    # and batch statistics off in the captured code, but nothing could turn them on.
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    # A forward that passes its keyword arguments on (GraniteMoE's) takes use_cache from the model's config.
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False
    try:
        with torch.random.fork_rng(devices=[]):
            exported, fixed_because = (_export_as_if_on(device, model, args, kwargs) if on_meta else
                                        export_model(model, args, kwargs))
    finally:
        for module, mode in modes:
            module.training = mode
        if cached:
            config.use_cache = cached
    with torch.no_grad():
        for buffer, saved in buffers_before:
            buffer.copy_(saved)
    graph = exported.graph_module.graph
    _merge_tensor_parallel_copies(graph)
    kinds = _signature_kinds(exported)
    for spec in exported.graph_signature.output_specs:
        if spec.kind.name not in ("USER_OUTPUT",):
            raise ModelError(f"{name}'s forward {spec.kind.name.lower().replace('_', ' ')} "
                             f"({spec.target or spec.arg}); smp cannot cut it into stages")

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
                attributes[node] = ("_smp_constants." + target.replace(".", "_"),
                                    _real_constant(exported.constants[target], target, name))
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
    for leaf, node in zip(leaves, user_inputs):
        if isinstance(leaf, torch.Tensor):
            input_names[node] = node.name
            leaf_inputs.append(node.name)
        else:
            attributes[node] = (None, leaf)  # baked in: the value the sample had
            leaf_inputs.append(None)

    shapes = InputShapes.of(exported, [node for node in user_inputs if node in input_names], fixed_because)
    for node in list(graph.nodes):
        if _is_op(node) and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    order = {node: i for i, node in enumerate(graph.nodes)}

    # Values that depend on no parameter and draw no random numbers are recomputed wherever they are read.
    dynamic, extra_inputs = _data_flow(graph, order, attributes, name)
    order = {node: i for i, node in enumerate(graph.nodes)}  # with the operations written writes added
    for node in reversed(list(graph.nodes)):
        if _is_op(node) and not node.users and not _mutates_first_argument(node) and not _is_random(node):
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
                paths = _module_paths(value)
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
    for op in side_effects:
        if units.unit_of(op) not in plan:
            raise ModelError(f"{name}'s forward updates a buffer in place outside any submodule "
                             f"({op.format_node()}); do it inside a module the forward calls, so that a stage holds it")
    runs_in = collections.defaultdict(list)  # a random operation -> the nodes that would run it
    counters = {}  # a router's chosen experts -> the operation counting them, run by the node that computes them
    for chosen, experts, router in _routing.routers(graph, dynamic, _module_paths):
        with graph.inserting_after(chosen):
            counters[chosen] = graph.call_function(_routing.RoutingCounter(router), (chosen, experts))
        order[counters[chosen]] = order[chosen] + 0.5
    for value in materialized:
        home = home_of_value[value]
        extra = [op for op in side_effects if units.unit_of(op) == home] if plan[home][0] is value else []
        node_graph, sources, node_attributes, computed = _node_graph(value, extra, value_name, attributes, order,
                                                                     extra_inputs)
        counted_here = [counters.pop(chosen) for chosen in list(counters) if chosen in computed]
        if counted_here:
            extra = extra + counted_here
            node_graph, sources, node_attributes, computed = _node_graph(value, extra, value_name, attributes, order,
                                                                         extra_inputs)
        for op in computed:
            if _is_random(op):
                runs_in[op].append(node_name[value])
        source_names = [value_name[s] for s in sources]
        module = CapturedNode(node_graph, node_attributes, node_name[value], captured_device, source_names)
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
    engine._graph.set_run_fuser(run_fuser(engine._captured, engine.node_names()))
    output_spec = (exported.call_spec.out_spec,
                   [None if isinstance(leaf, fx.Node) else leaf for leaf in output_leaves])
    shapes.lookups = TableLookups.of(graph, dynamic, attributes, input_names, order)
    return engine, leaf_inputs, output_spec, shapes


class TableLookups:
    """The rows the model will read from its embedding tables where they follow from the inputs alone (token ids,
    position ids made from a sequence length), checked on every rank before a step sends anything: an input longer
    than a position table, or an id beyond the vocabulary, is a ConfigError naming the table, not an IndexError on
    one stage while the others wait."""

    def __init__(self, code, sources, tables):
        self._code, self._sources, self._tables = code, sources, tables

    @classmethod
    def of(cls, graph, dynamic, attributes, input_names, order):
        lookups = []
        for node in graph.nodes:
            if _is_op(node) and node.target == _aten.embedding.default and node.args[0] in attributes \
                    and isinstance(attributes[node.args[0]][1], torch.nn.Parameter) and node.args[1] not in dynamic:
                lookups.append(node)
        needed, sources = {}, []
        kept = []
        for lookup in lookups:
            stack, seen, ok = [lookup.args[1]], set(), True
            while stack and ok:
                value = stack.pop()
                if value in seen:
                    continue
                seen.add(value)
                if value in dynamic:
                    ok = False  # read through something computed from parameters: not known before the step
                elif value in input_names or value in attributes:
                    continue
                else:
                    stack.extend(value.all_input_nodes)
            if ok:
                kept.append(lookup)
                needed.update(dict.fromkeys(seen))
        if not kept:
            return None
        code = fx.Graph()
        env = {}
        for value in sorted(needed, key=lambda n: order[n]):
            if value in input_names or (value in attributes and attributes[value][0] is not None):
                env[value] = code.placeholder(f"source_{len(sources)}")
                sources.append(input_names.get(value) or ("attribute", attributes[value][0], attributes[value][1]))
            elif value in attributes:
                env[value] = attributes[value][1]  # a baked-in constant input
            else:
                env[value] = code.node_copy(value, lambda n: env[n])
        code.output(tuple(env[lookup.args[1]] for lookup in kept))
        tables = [(attributes[lookup.args[0]][0], attributes[lookup.args[0]][1].shape[0]) for lookup in kept]
        return cls(fx.GraphModule(torch.nn.Module(), code), sources, tables)

    def check(self, model, microbatch, what):
        """microbatch: engine input name -> one microbatch's tensor (every input of the model)."""
        values = []
        for source in self._sources:
            if isinstance(source, str):
                values.append(microbatch[source])
                continue
            _, path, captured = source
            try:
                value = _attribute(model, path)  # the model's own (a buffer made real on this rank)
            except AttributeError:
                value = captured
            if not isinstance(value, torch.Tensor) or value.is_meta:
                return  # not held on this rank: the rank holding it checks
            values.append(value.cpu())
        with torch.no_grad():
            rows_read = self._code(*values)
        for (path, rows), read in zip(self._tables, rows_read):
            if read.numel() and (int(read.max()) >= rows or int(read.min()) < 0):
                bad = int(read.max()) if int(read.max()) >= rows else int(read.min())
                shapes = ", ".join(f"'{name}' {tuple(t.shape)}" for name, t in microbatch.items())
                raise ConfigError(f"{what}: the model would read row {bad} of '{path}', which has {rows} rows "
                                  f"(microbatch inputs {shapes}): the inputs are longer, or hold larger ids, than "
                                  "the model takes")


def _finite(bound):
    """A range's bound as an int, None where it is unbounded (sympy's and torch's infinities)."""
    try:
        return int(bound) if bound.is_finite is not False and str(bound).lstrip("-") not in ("oo", "int_oo") else None
    except (TypeError, ValueError, AttributeError):
        return None


class InputShapes:
    """What shapes the captured code takes, per engine input: each dimension either fixed (the sample's size) or a
    symbol of the export with the range it allows; inputs that share a symbol must agree on it."""

    def __init__(self, dimensions, fixed_because):
        self.dimensions = dimensions  # input name -> [int, or (symbol, low, high)]
        self.fixed_because = fixed_because  # why export could not let any shape change, or None
        self.lookups = None  # TableLookups, set once the graph is planned

    @classmethod
    def of(cls, exported, inputs, fixed_because):
        ranges = {str(symbol): bounds for symbol, bounds in exported.range_constraints.items()}
        dimensions = {}
        for node in inputs:
            value = node.meta.get("val")
            sizes = []
            for size in (value.shape if isinstance(value, torch.Tensor) else ()):
                if isinstance(size, int):
                    sizes.append(size)
                    continue
                symbol = str(size.node.expr)
                bounds = ranges.get(symbol)
                low = _finite(bounds.lower) if bounds is not None else None
                high = _finite(bounds.upper) if bounds is not None else None
                low = 0 if low is None else low
                sizes.append((symbol, low, high))
            dimensions[node.name] = sizes
        return cls(dimensions, fixed_because)

    def check(self, name, shape, what):
        """Raises ConfigError when a microbatch's input `name` of `shape` is one the captured code cannot take."""
        sizes = self.dimensions.get(name)
        if sizes is None:
            return
        if len(shape) != len(sizes):
            raise ConfigError(f"{what}: input '{name}' has {len(shape)} dimensions, the sample had {len(sizes)}")
        for dim, (size, allowed) in enumerate(zip(shape, sizes)):
            if isinstance(allowed, int):
                if size != allowed:
                    why = (f"the model could not be captured with changing shapes ({self.fixed_because})"
                           if self.fixed_because else "the model's code fixes it (export kept it constant)")
                    raise ConfigError(f"{what}: input '{name}' gives microbatches of shape {tuple(shape)}, but its "
                                      f"dimension {dim} must be {allowed}, the sample's: {why}")
                continue
            symbol, low, high = allowed
            if size < low or (high is not None and size > high):
                bound = f"{low} to {high}" if high is not None else f"at least {low}"
                raise ConfigError(f"{what}: input '{name}' gives microbatches of shape {tuple(shape)}; the captured "
                                  f"model takes {bound} in its dimension {dim}")

    def check_agreement(self, shapes, what):
        """Inputs sharing a symbol (input_ids and labels' sequence length) have the same size there."""
        seen = {}
        for name, shape in shapes.items():
            for dim, allowed in enumerate(self.dimensions.get(name, ())):
                if isinstance(allowed, int) or dim >= len(shape):
                    continue
                first = seen.setdefault(allowed[0], (name, dim, shape[dim]))
                if first[2] != shape[dim]:
                    raise ConfigError(f"{what}: input '{name}' has {shape[dim]} in its dimension {dim} where "
                                      f"'{first[0]}' has {first[2]} in its dimension {first[1]}; the model needs "
                                      "them equal")


def _data_flow(graph, order, attributes, name):
    """Which values depend on a parameter or draw random numbers (`dynamic`: computed once, sent where read; the rest
    is recomputed wherever it is read), with in-place writes turned into data flow on the way, in graph order, so
    that a reader of a write's result is judged by what the write made.

    A write that makes a dynamic value runs out of place, and whatever reads the written tensor afterwards reads
    the write's result: plain PyTorch sees the change through the shared tensor, pipeline stages only through edges
    (a reader on another stage, or a value sent before the write). That covers writes into values computed from
    parameters and writes of such values into fresh tensors of none (mixture-of-experts routing scattering token
    positions into an empty_like, a group mask filled by scatter_, stochastic depth's new_empty(...).bernoulli_(p)).
    A write of no parameter into a value of none (a mask, shifted labels: recomputed where read) stays in place, and
    whatever reads that memory afterwards, through the value or a view sharing it, runs after the write in the same
    node (returned: node -> writes it must follow). Writes into buffers (batch norm's statistics) stay: they update
    the model's own. Returns (dynamic, extra_inputs)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def memory(node):
        value = node.meta.get("val")
        try:
            return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    storage = {node: memory(node) for node in graph.nodes}
    dynamic = set()
    extra_inputs = collections.defaultdict(list)
    for node in list(graph.nodes):
        if node.op == "placeholder" and isinstance(attributes.get(node, (None, None))[1], torch.nn.Parameter):
            dynamic.add(node)
        if not _is_op(node):
            continue
        if _is_random(node) or (node.target not in _READS_METADATA_ONLY and
                                any(a in dynamic for a in node.all_input_nodes)):
            dynamic.add(node)
        if not _mutates_first_argument(node):
            continue
        written = node.args[0]
        if written in attributes:
            continue
        shared = storage.get(written)
        aliases = [other for other in graph.nodes if shared is not None and other is not written and other is not node
                   and order[other] < order[node] and storage.get(other) is not None and storage[other] == shared]
        late_alias_readers = [reader for alias in aliases for reader in alias.users
                              if order.get(reader, -1) > order[node] and reader is not node]
        later_readers = [reader for reader in list(written.users) if reader is not node and
                         order.get(reader, -1) > order[node]]
        if node not in dynamic:
            for reader in later_readers:
                reader.replace_input_with(written, node)
            for reader in late_alias_readers:
                extra_inputs[reader].append(node)
            continue
        # A write through views of a tensor (key[..., :d].copy_(k) into a new_empty) writes that tensor: out of
        # place, the views' bases are scattered into anew, and what reads them afterwards reads the new ones.
        chain = [written]
        while _is_view(chain[0]) and chain[0].args[0] not in attributes and chain[0].target in _SCATTER_BACK:
            chain.insert(0, chain[0].args[0])
        late_alias_readers = [reader for reader in late_alias_readers
                              if not any(reader in member.users for member in chain)]
        if late_alias_readers:
            raise ModelError(f"{name}'s forward writes in place into {written.name} ({node.format_node()}), which "
                             f"shares memory with {aliases[0].name}, read afterwards by {late_alias_readers[0].name}; "
                             "write it out of place so that it can be cut into stages")
        functional = _OUT_OF_PLACE.get(node.target) or _functional_variant(node.target)
        if functional is None:
            raise ModelError(f"{name}'s forward writes in place ({node.format_node()}) with an operation that has no "
                             "out-of-place form; write it out of place so that it can be cut into stages")
        node.target = functional
        later = {view: [r for r in view.users if r is not node and order.get(r, -1) > order[node]] for view in chain}
        new_value, after = node, node
        for view in reversed(chain):
            for reader in later[view]:
                reader.replace_input_with(view, new_value)
            if view is chain[0]:
                break
            scatter, arguments = _SCATTER_BACK[view.target](view, new_value)
            with graph.inserting_after(after):
                base = graph.call_function(scatter, arguments)
            base.meta = dict(node.meta, val=view.args[0].meta.get("val"))
            order[base] = order[after] + 1e-3
            dynamic.add(base)
            new_value, after = base, base
    return dynamic, extra_inputs


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
        if not isinstance(op.meta.get("val"), torch.Tensor):
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
        if op not in dynamic or home[op] is recomputed or not isinstance(op.meta.get("val"), torch.Tensor):
            continue
        # A reader of its shape alone (zeros_like) is recomputed where its result is read: the value goes there
        # rather than its whole computation.
        read_elsewhere = op in outputs or any((u in home and home[u] is not home[op] and home[u] != home[op]) or
                                              (_is_op(u) and u.target in _READS_METADATA_ONLY) for u in op.users)
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
                if _is_random(node):
                    drawn_in[node].add(value)
                stack.extend(node.all_input_nodes)
        shared = [op for op, values in drawn_in.items() if len(values) > 1 and
                  isinstance(op.meta.get("val"), torch.Tensor)]
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
    graph.output(env[value])
    for node in graph.nodes:  # what the capture knew of each value (fake tensors): not needed to run, and not small
        node.meta = {}
    return graph, sources, node_attributes, needed


def split_sample(model, sample):
    """A sample (or a step's inputs) as (args, kwargs): a tensor is the first positional argument, a tuple or list
    the positional arguments, a dict (or Mapping, e.g. a tokenizer's BatchEncoding) the keyword arguments. A
    forward with a `use_cache` parameter gets use_cache=False unless given: a training step never reads the cache."""
    if isinstance(sample, torch.Tensor):
        args, kwargs = (sample,), {}
    elif isinstance(sample, (tuple, list)):
        args, kwargs = tuple(sample), {}
    elif isinstance(sample, collections.abc.Mapping):
        args, kwargs = (), dict(sample)
    else:
        raise TypeError(f"model inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
                        f"arguments, got {type(sample).__name__}")
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if "use_cache" in parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs
