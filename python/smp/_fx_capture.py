"""Models with a forward of their own traced with torch.fx into a GraphModel (the path for models torch.export
cannot capture, and for models with TorchScript children): one node per call of a child module."""

import inspect
import operator
import re

import torch

from ._smp import ModelError


def _leaf_paths(model):
    """Paths of the modules a traced model is cut between: its children, the elements of ModuleList and ModuleDict
    children (recursively) standing in for those containers, which cannot be called."""
    paths = set()

    def visit(prefix, module):
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                visit(path + ".", child)
            else:
                paths.add(path)

    visit("", model)
    return paths


class _Operation(torch.nn.Module):
    """A traced operation between modules, as a module without parameters: runs `evaluate` on its inputs."""

    def __init__(self, evaluate, text):
        super().__init__()
        self._evaluate = evaluate
        self._text = text

    def forward(self, *tensors):
        return self._evaluate(*tensors)

    def extra_repr(self):
        return self._text


def _device_of(module):
    """Where a module's tensors live (None for none): for a node that reads no other node's output."""
    if module is None:
        return None
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None


_OUT_OF_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                 operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
                 operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
                 operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
                 operator.irshift: operator.rshift}


# Reads of a value's metadata alone, which a write into its memory does not change.
_METADATA_METHODS = {"size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous", "get_device"}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}


def _reads_metadata_only(node):
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and \
        node.args[1] in _METADATA_ATTRIBUTES


def _run_on_sample(model, traced, sample_input, name):
    """Every node's value on the sample, in eval mode and without gradients, so that no batch norm statistic or
    random number is spent; buffers a forward writes into are put back."""
    import torch.fx as fx

    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            values[node] = super().run_node(node)
            return values[node]

    modes = [m.training for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    model.eval()
    try:
        with torch.no_grad():
            Recorder(traced).run(sample_input)
    except Exception as error:  # noqa: BLE001
        raise ModelError(f"{name} fails on the sample input {tuple(sample_input.shape)}: {error}") from error
    finally:
        for module, mode in zip(model.modules(), modes):
            module.training = mode
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return values


def _storages(values):
    """The memory each tensor value lives in (an address), None for other values."""
    found = {}
    for node, value in values.items():
        try:
            found[node] = value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None
        except (RuntimeError, NotImplementedError):  # no storage (e.g. sparse)
            found[node] = None
    return found


def _rewrite_in_place(traced, attribute, name, storage):
    """In-place operations as data flow: an operation that writes into a value (x.add_(y), x += y, F.relu(x,
    inplace=True), a child such as nn.ReLU(inplace=True)) becomes the producer of that value for every operation
    after it, and, where it can, runs out of place. Plain PyTorch sees the change through the shared tensor; pipeline
    stages see only the edges of the graph, so without this a reader on another stage, or a result nobody reads
    (removed as dead code), would miss the write."""
    import torch.fx as fx

    order = {node: index for index, node in enumerate(traced.graph.nodes)}
    for node in list(traced.graph.nodes):
        writes = False
        if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
            writes = True
            out_of_place = node.target[:-1]
            if hasattr(torch.Tensor, out_of_place):
                node.target = out_of_place
        elif node.op == "call_function" and node.target in _OUT_OF_PLACE:
            writes = True
            node.target = _OUT_OF_PLACE[node.target]
        elif node.op == "call_function" and node.kwargs.get("inplace") is True:
            writes = True
            node.kwargs = dict(node.kwargs, inplace=False)
        elif node.op == "call_function" and node.target is operator.setitem:
            raise ModelError(f"{name}'s forward assigns into a tensor ({node.format_node()}); write it out of place "
                             "(torch.where, index_put, torch.cat) so that it can be cut into stages")
        elif node.op == "call_module" and getattr(attribute(node.target), "inplace", False) is True:
            writes = True  # runs as it is: in place on its input, as in plain PyTorch
        elif node.op == "call_function" and re.fullmatch(r"[a-z].*[a-z0-9]_", getattr(node.target, "__name__", "")):
            writes = True  # torch.relu_(x) and the like: in place as well
        if not writes or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        written = node.args[0]
        # Values sharing memory with the one written (what it is a view of, views of it taken before the write),
        # as the sample run showed, would see the write in plain PyTorch but not as graph edges: refused when read
        # afterwards for more than their shape.
        memory = storage.get(written)  # 0 for empty tensors, which share nothing
        aliases = [other for other in order if memory and other is not written and other is not node
                   and order[other] < order[node] and storage.get(other) == memory]
        for alias in aliases:
            late = [reader for reader in alias.users
                    if order[reader] > order[node] and not _reads_metadata_only(reader)]
            if late:
                raise ModelError(f"{name}'s forward writes in place into {written.name} ({node.format_node()}), which "
                                 f"shares memory with {alias.name}, read afterwards by {late[0].name}; write it out of "
                                 "place so that it can be cut into stages")
        for reader in list(written.users):
            if reader is not node and order[reader] > order[node]:
                reader.replace_input_with(written, node)
    traced.recompile()


def traced_graph(model, sample_input, graph_factory):
    """Traces `model` with torch.fx, its children (see _leaf_paths) kept whole. Every value the forward computes
    becomes a node when it is a tensor that depends on the input; other values (shapes, sizes, constants, the
    model's buffers) are computed again inside each node that uses them. Refused, with the reason: a forward that
    torch.fx cannot trace (control flow on tensor values), more than one input, an output that is not one tensor,
    a parameter of the model itself used in its forward (it belongs in a child module), and a child whose output
    is a tuple of which more than one element is used."""
    import torch.fx as fx

    name = type(model).__name__
    leaves = _leaf_paths(model)

    class Tracer(fx.Tracer):
        # Also torch.nn's own modules (fx's default), for a forward that reaches into a child's submodules.
        def is_leaf_module(self, module, path):
            return path in leaves or super().is_leaf_module(module, path)

    # One input: the first parameter without a default. The others keep their defaults (an attention mask left
    # None, a flag), baked into the trace as torch.fx's concrete arguments.
    parameters = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    required = [p for p in parameters if p.default is inspect.Parameter.empty]
    if len(required) != 1:
        raise ModelError(f"{name}'s forward takes {len(required)} inputs without defaults; smp passes one tensor per "
                         "microbatch")
    concrete = {p.name: p.default for p in parameters if p is not required[0]}
    try:
        graph = Tracer().trace(model, concrete_args=concrete or None)
    except Exception as error:  # noqa: BLE001 - torch.fx raises many kinds
        raise ModelError(f"cannot trace {name}'s forward with torch.fx ({type(error).__name__}: {error}); write the "
                         "model as an smp.GraphModel") from error
    traced = fx.GraphModule(model, graph)

    def attribute(target):
        value = traced
        for part in target.split("."):
            value = getattr(value, part)
        return value

    # One run of the forward as written (in place where it writes in place; on a copy of the sample, which it may
    # write into) tells which values share memory, and which values are tensors: rewriting in-place operations out
    # of place changes neither kind.
    values = _run_on_sample(model, traced, sample_input.clone(), name)
    _rewrite_in_place(traced, attribute, name, _storages(values))
    traced.graph.eliminate_dead_code()
    nodes = list(traced.graph.nodes)
    # The input, first; the other placeholders hold the defaults of the other parameters.
    placeholders = [n for n in nodes if n.op == "placeholder" and n.target == required[0].name]

    # Materialized values: the input and the nodes below. Everything else is recomputed where it is used.
    source_name = {placeholders[0]: placeholders[0].name}
    element = {}  # a getitem on a child's tuple output -> (the child's node, the index)
    owner = {}  # a parameter read in the forward -> the child holding it (a tied LM head reads the embedding's)
    for node in nodes:
        if node.op == "get_attr" and isinstance(attribute(node.target), torch.nn.Parameter):
            holders = [path for path in leaves if node.target.startswith(path + ".")]
            if not holders:
                raise ModelError(f"{name}'s forward uses the parameter '{node.target}' directly; put it in a child "
                                 "module (called from the forward) so that a pipeline stage holds and trains it")
            owner[node] = holders[0]

    def owners_of(node):
        """The children whose parameters `node` reads directly, through values recomputed in place."""
        found, stack, seen = set(), list(node.all_input_nodes), set()
        while stack:
            argument = stack.pop()
            if argument in seen or argument in source_name:
                continue
            seen.add(argument)
            if argument in owner:
                found.add(owner[argument])
            stack.extend(argument.all_input_nodes)
        return found

    def sources_of(node, found, seen):
        """The materialized values `node` depends on, through values recomputed in place."""
        for argument in node.all_input_nodes:
            if argument in seen:
                continue
            seen.add(argument)
            if argument in source_name:
                found.append(argument)
            else:
                sources_of(argument, found, seen)
        return found

    def evaluator(node, sources, module=None):
        """Computes `node` from the materialized `sources` (in order), recomputing what lies between."""
        def evaluate(*tensors):
            env = dict(zip(sources, tensors))
            device = tensors[0].device if tensors else _device_of(module)

            def value_of(n):
                if n in env:
                    return env[n]
                if n.op == "placeholder":  # a parameter of the forward left at its default
                    result = n.args[0] if n.args else None
                elif n.op == "get_attr":  # a buffer or constant of the model: on the inputs' device
                    result = attribute(n.target)
                    if isinstance(result, torch.Tensor) and device is not None:
                        result = result.to(device)
                else:
                    args = fx.node.map_arg(n.args, value_of)
                    kwargs = fx.node.map_arg(n.kwargs, value_of)
                    if n.op == "call_function":
                        result = n.target(*args, **kwargs)
                    elif n.op == "call_method":
                        result = getattr(args[0], n.target)(*args[1:], **kwargs)
                    elif n.op == "call_module":
                        result = attribute(n.target)(*args, **kwargs)
                        if n in element:
                            result = result[element[n]]
                    else:
                        raise ModelError(f"unexpected traced operation {n.op} {n.target}")
                env[n] = result
                return result

            return value_of(node)
        return evaluate

    input_name = placeholders[0].name if placeholders[0].name not in leaves else "input"
    source_name[placeholders[0]] = input_name
    result = graph_factory(input_name)
    used_names = {input_name}

    def unique(candidate):
        # Not a child's path (nor a path prefix or extension of one), not taken.
        while candidate in used_names or any(candidate == path or path.startswith(candidate + ".") or
                                             candidate.startswith(path + ".") for path in leaves if path != candidate):
            candidate += "_"
        return candidate

    output = None
    for node in nodes:
        if node.op == "output":
            output = node.args[0]
            continue
        if node.op in ("placeholder", "get_attr"):
            continue
        value = values[node]
        if node.op == "call_module":
            if not isinstance(value, torch.Tensor):
                # A child returning a tuple: fine when its users take one element of it (nn.MultiheadAttention's
                # output, weights).
                indexes = {user.args[1] for user in node.users
                           if user.op == "call_function" and user.target is operator.getitem}
                if len(indexes) != 1 or len(node.users) != sum(1 for _ in node.users if _.target is operator.getitem):
                    raise ModelError(f"child '{node.target}' of {name} returns {type(value).__name__}; a pipeline "
                                     "stage passes tensors, so only one element of it may be used")
                element[node] = indexes.pop()
                for user in node.users:
                    source_name[user] = None  # resolved to the child's node below
            module = attribute(node.target)
            holder = node.target
            node_name = node.target if node.target not in used_names else unique(f"{node.target}_{node.name}")
            if owners_of(node) - {node.target}:
                raise ModelError(f"child '{node.target}' of {name} is passed parameters of "
                                 f"{', '.join(sorted(owners_of(node) - {node.target}))}; a pipeline stage trains a "
                                 "child's own parameters only")
        elif isinstance(value, torch.Tensor) and node not in source_name:
            holders = owners_of(node)
            if len(holders) > 1:
                raise ModelError(f"'{node.format_node()}' in {name}'s forward reads parameters of several children "
                                 f"({', '.join(sorted(holders))}); one operation may use one child's parameters")
            holder = holders.pop() if holders else None
            module = attribute(holder) if holder else None
            node_name = unique(node.name)
        else:
            continue
        sources = sources_of(node, [], set())
        if not sources and module is None:  # a constant: recomputed where it is used
            continue
        evaluate = evaluator(node, sources, module)
        inputs = [source_name[s] for s in sources]
        if module is None:
            result.add(node_name, _Operation(evaluate, node.format_node()), inputs)
        elif isinstance(module, torch.jit.ScriptModule):
            # TorchScript runs on the node's inputs alone: a call site with anything more cannot be kept.
            if node.op != "call_module" or node.kwargs or list(node.args) != sources or node in element:
                raise ModelError(f"scripted child '{node.target}' of {name} is called with more than its tensor "
                                 "inputs (constants, keywords, one element of its output, or another child's "
                                 "parameters); pass it unscripted, or script it without those")
            result.add(node_name, module, inputs)
        else:
            # Named after the child whichever node holds them first (an operation reading the child's weight before
            # the child's call, a second call): the names of the model's state_dict.
            result._add_call(node_name, module, evaluate, inputs, parameter_prefix=holder)
        used_names.add(node_name)
        source_name[node] = node_name
        for user in list(node.users) if node in element else []:
            source_name[user] = node_name
    if not isinstance(output, fx.Node) or not isinstance(values.get(output), torch.Tensor):
        raise ModelError(f"{name}'s forward returns {type(values.get(output, output)).__name__}; smp needs one tensor "
                         "(the loss function's first argument)")
    if not result.node_names():
        raise ModelError(f"{name}'s forward computes nothing from its input with a module; there is nothing to cut "
                         "into stages")
    if source_name.get(output) != result.node_names()[-1]:
        # The model's output must be the graph's last node.
        sources = sources_of(output, [], set()) if output not in source_name else [output]
        result.add(unique("output"), _Operation(evaluator(output, sources), "output"),
                   [source_name[s] for s in sources])
    return result
