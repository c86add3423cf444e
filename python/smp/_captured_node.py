"""The code an engine node of a captured model runs: its parameters and buffers under their model paths, and a small
generated ``fx.GraphModule`` per (training mode, device) computing the node's value from its sources; and, once the
partition is known, a stage's consecutive nodes as one generated function (FusedRun), so that a microbatch costs
one Python call per run of nodes rather than one per node. smp._export_capture makes the nodes."""

import functools
import itertools
import re

import torch
import torch.fx as fx

from ._smp import ModelError

_aten = torch.ops.aten

# Arguments that follow the module's training flag, baked into the export (always run in training mode): by schema
# argument name, what they become in evaluation. Dropout's flag and probability (attention's dropout_p, which Hugging
# Face models pass as `p if self.training else 0.0`), recurrent layers' dropout between layers, rrelu's training.
_TRAINING_ARGUMENTS = {"train": False, "training": False, "dropout_p": 0.0}


def _in_evaluation(op, args, kwargs):
    """args, kwargs of `op` as evaluation mode runs it. Batch norm uses batch statistics in evaluation too when it
    keeps none (track_running_stats=False: no running mean), and instance norm's flag is not a training flag."""
    schema = getattr(op, "_schema", None)
    if schema is None or op in (_aten.instance_norm.default,):
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for index, argument in enumerate(schema.arguments):
        if argument.name not in _TRAINING_ARGUMENTS:
            continue
        if op == _aten.batch_norm.default and args[3] is None:
            continue  # no running statistics: batch statistics in either mode
        if index < len(args):
            args[index] = _TRAINING_ARGUMENTS[argument.name]
        elif argument.name in kwargs:
            kwargs[argument.name] = _TRAINING_ARGUMENTS[argument.name]
    return tuple(args), kwargs
# Checks export leaves in the graph: they fail under autocast (dtype checks) and check nothing the engine needs.
_ASSERTS = {_aten._assert_tensor_metadata.default, _aten._assert_scalar.default,
            _aten.sym_constrain_range_for_size.default}


def _is_op(node):
    return node.op == "call_function"


def _mutates_first_argument(node):
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def written_through(value):
    """The tensor an in-place write into `value` writes: through earlier in-place writes, each of which returns the
    tensor it wrote (mean.mul_(0.9).add_(x) writes mean)."""
    while isinstance(value, torch.fx.Node) and _is_op(value) and _mutates_first_argument(value) and value.args and \
            isinstance(value.args[0], torch.fx.Node):
        value = value.args[0]
    return value


# Where a node keeps the constant tensors export lifted out of the forward (a table made from literals).
CONSTANTS = "_smp_constants."


def _set_path(root, path, value):
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part) or not isinstance(getattr(module, part), torch.nn.Module):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.nn.Module):
        module.add_module(leaf, value)
    elif isinstance(value, torch.Tensor):
        # A tensor the forward made from literals is the capture's, not the model's state: out of state_dict.
        module.register_buffer(leaf, value, persistent=not path.startswith(CONSTANTS))
    else:
        setattr(module, leaf, value)


def _attribute(root, path):
    value = root
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _owner_path(node):
    """The path of the innermost module whose forward ran the operation ("layer1.0.bn1"); "" for the model's own
    forward."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    owner = list(stack.values())[-1]
    return owner[0] if isinstance(owner, tuple) and owner and isinstance(owner[0], str) else ""


def module_paths(node):
    """The paths of the modules whose forwards ran the operation, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


# An operation of a module whose eval-mode forward returns its input (stochastic depth: `if not self.training:
# return x`), as smp._evaluation_path found by comparing the two modes' exports: left out in evaluation, and its
# module's output there is the input that IN_EVALUATION_ROUTE leads to (argument positions from the output).
IN_EVALUATION = "smp_in_evaluation"
IN_EVALUATION_ROUTE = "smp_in_evaluation_route"
ORIGIN = "smp_origin"  # the name of the export's operation a node's copy was made from


def _take_evaluation_tags(graph, tags):
    """Tags the copies of the operations named in `tags` ({export name: tags}); returns whether any was."""
    tagged = False
    for node in graph.nodes:
        tag = tags.get(node.meta.get(ORIGIN))
        if tag:
            node.meta.update(tag)
            tagged = True
    return tagged


def evaluation_input(node):
    """The value an operation tagged as its module's output stands for in evaluation: its module's input."""
    for index in node.meta[IN_EVALUATION_ROUTE]:
        node = node.args[index]
    return node


def _is_buffer_update(node):
    """An in-place write into a buffer that nothing reads after (batch norm's count of batches): training only."""
    return _is_op(node) and _mutates_first_argument(node) and bool(node.args) and \
        getattr(node.args[0], "op", None) == "get_attr" and not node.users


def _follows_mode(node):
    """An operation whose result depends on its module's training flag: one with a training argument (dropout,
    batch norm) or a buffer update."""
    if not _is_op(node):
        return False
    if _is_buffer_update(node) or IN_EVALUATION in node.meta:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(argument.name in _TRAINING_ARGUMENTS for argument in schema.arguments)


def _with_subgraphs(graph, resolve):
    """The graph's nodes and those of the subgraphs its higher-order operations run (a no-grad region, autocast),
    found by `resolve(get_attr target)`."""
    for node in graph.nodes:
        yield node
        subgraph = resolve(node.target) if node.op == "get_attr" else None
        if isinstance(subgraph, fx.GraphModule):
            yield from _with_subgraphs(subgraph.graph, lambda target, held=subgraph: _attribute_or_none(held, target))


def _attribute_or_none(module, path):
    try:
        return _attribute(module, path)
    except AttributeError:
        return None


def mode_owners(graph, model, resolve=lambda target: None):
    """[(path, module)]: the modules of `model` whose training flag the graph's operations follow, as each of
    PyTorch's modules follows its own (a batch norm frozen with .eval() inside a model in training), those inside a
    no-grad region or another higher-order operation's subgraph (found by `resolve`) included: a teacher frozen with
    .eval() and called under torch.no_grad() ran its dropout in training mode."""
    owners = []
    for path in sorted({_owner_path(node) for node in _with_subgraphs(graph, resolve) if _follows_mode(node)}):
        try:
            module = _attribute(model, path) if path else model
        except AttributeError:
            continue
        if isinstance(module, torch.nn.Module):
            owners.append((path, module))
    return owners


class CapturedNode(torch.nn.Module):
    """One engine node: its parameters and buffers under their model paths, and the generated code that computes the
    node's value from its sources. The code is made per (training mode, device): dropout and batch norm follow the
    mode (the export baked in the one it ran in), buffer updates happen in training only, and tensors the forward
    creates (arange, masks) go to the device the node runs on. While its tensors are on the meta device (a model
    built there, before this rank makes its own stages real) it runs on random stand-ins, for profiling."""

    def __init__(self, graph, attributes, name, captured_device, sources=(), owners=()):
        super().__init__()
        for path, value in attributes.items():
            _set_path(self, path, value)
        # Not submodules: the engine would see their attributes twice.
        object.__setattr__(self, "_graph", graph)
        object.__setattr__(self, "_variants", {})
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_sources", list(sources))  # the engine names of what the graph's inputs are
        object.__setattr__(self, "_owners", list(owners))  # mode_owners: not submodules, the model's own
        object.__setattr__(self, "_captured_device", captured_device)
        object.__setattr__(self, "_stand_ins", None)
        # True while any tensor is on the meta device; stand-ins are for profiling, before this rank makes its own
        # stages real (after that, a meta tensor reaching a computation is an error naming it).
        object.__setattr__(self, "_meta", any(t.is_meta for t in itertools.chain(self.parameters(), self.buffers())))
        object.__setattr__(self, "_profiling", self._meta)
        object.__setattr__(self, "_job_device", torch.device("cpu"))  # set by DistributedModel

    def _device(self, sources):
        for source in sources:
            if isinstance(source, torch.Tensor):
                return source.device
        for tensor in itertools.chain(self.parameters(), self.buffers()):
            return tensor.device
        return self._captured_device

    def take_evaluation_tags(self, tags, model):
        """What evaluation leaves out, found after the node was made (smp._evaluation_path): its code made anew."""
        if _take_evaluation_tags(self._graph, tags):
            object.__setattr__(self, "_owners", mode_owners(self._graph, model,
                                                            lambda target: _attribute_or_none(self, target)))
            self._variants.clear()
            object.__setattr__(self, "_stand_ins", None)

    def frozen(self):
        """The paths of the model's modules in eval mode whose operations this node runs (mode_owners)."""
        return frozenset(path for path, module in self._owners if not module.training)

    def _code(self, root, training, device, frozen):
        return _retargeted(root, self._graph, training, device, frozen)

    def _variant(self, training, device, frozen):
        key = (training, device, frozen)
        code = self._variants.get(key)
        if code is None:
            code = self._variants[key] = self._code(self, training, device, frozen)
        return code

    def _on_stand_ins(self, training, device, frozen):
        """Random tensors of the shapes of this node's, on `device`: one node's at a time across the process."""
        global _NODE_WITH_STAND_INS
        if _NODE_WITH_STAND_INS is not None and _NODE_WITH_STAND_INS is not self:
            _NODE_WITH_STAND_INS.drop_stand_ins()
        _NODE_WITH_STAND_INS = self
        if self._stand_ins is None or self._stand_ins[0] != (training, device, frozen):
            root = torch.nn.Module()
            with torch.no_grad():
                for path, tensor in self.named_parameters():
                    _set_path(root, path, torch.nn.Parameter(torch.randn(tensor.shape, device=device).to(tensor.dtype)
                                                             * 0.02, requires_grad=tensor.requires_grad))
                for path, tensor in self.named_buffers():
                    _set_path(root, path, torch.ones(tensor.shape, dtype=tensor.dtype, device=device))
                for node in self._graph.nodes:  # what else the code reads (a higher-order operation's subgraph)
                    if node.op == "get_attr" and not isinstance(_attribute(self, node.target), torch.Tensor):
                        _set_path(root, node.target, _attribute(self, node.target))
            code = self._code(root, training, device, frozen)
            object.__setattr__(self, "_stand_ins", ((training, device, frozen), code))
        return self._stand_ins[1]

    def drop_stand_ins(self):
        if self._stand_ins is not None:
            # A GraphModule and its graph refer to each other: without this, the stand-ins would wait for Python's
            # cycle collector, and a profile of many nodes would hold many nodes' stand-ins.
            for module in self._stand_ins[1].modules():
                if isinstance(module, fx.GraphModule):
                    module.graph.owning_module = None
        object.__setattr__(self, "_stand_ins", None)

    def replace_tensors(self, replaced):
        """Takes the new tensors for old ones ({id(old): (old, new)}: made real from the meta device)."""
        changed = False
        for module in self.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is not None and id(tensor) in replaced and replaced[id(tensor)][0] is tensor:
                        table[name] = replaced[id(tensor)][1]
                        changed = True
        if changed:
            self._variants.clear()
            self.drop_stand_ins()
        object.__setattr__(self, "_meta", any(t.is_meta for t in itertools.chain(self.parameters(), self.buffers())))
        object.__setattr__(self, "_profiling", False)

    def forward(self, *sources):
        device = self._device(sources)
        if self._meta:
            if device.type == "meta":  # no input to follow: where this job computes
                device = self._job_device
            if not self._profiling:
                meta = [path for path, t in itertools.chain(self.named_parameters(), self.named_buffers()) if t.is_meta]
                raise ModelError(f"node '{self._name}' reads {meta[0]}, still on the meta device on this rank: its "
                                 "module was not made real")
            return self._on_stand_ins(self.training, device, self.frozen())(*sources)
        return self._variant(self.training, device, self.frozen())(*sources)

    def extra_repr(self):
        return self._name

    def profile_key(self):
        """Its code with the names export gave its values replaced by their positions, and its tensors' paths
        relative to the node's (model.layers.3's "self_attn.q_proj.weight"), with their shapes: identical blocks
        get equal keys, and share one profile measurement."""
        def relative(path):
            return path[len(self._name) + 1:] if path.startswith(self._name + ".") else path

        def canonical(graph):
            position = {node: index for index, node in enumerate(graph.nodes)}

            def argument(value):
                return fx.node.map_arg(value, lambda node: f"%{position[node]}")

            lines = []
            for node in graph.nodes:
                target = relative(node.target) if node.op == "get_attr" else str(node.target)
                if node.op == "placeholder":
                    target = ""  # its name is the source's, different in every block
                lines.append(f"{node.op} {target} {argument(node.args)} {argument(node.kwargs)}")
                subgraph = _attribute(self, node.target) if node.op == "get_attr" else None
                if isinstance(subgraph, fx.GraphModule):
                    lines.append("{" + canonical(subgraph.graph) + "}")
            return "\n".join(lines)

        tensors = ";".join(f"{relative(path)}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
                           for path, t in itertools.chain(self.named_parameters(), self.named_buffers()))
        return f"captured:{canonical(self._graph)}|{tensors}"


_NODE_WITH_STAND_INS = None  # the captured node whose stand-ins exist (profiling one node at a time)


def _set_device_argument(node, device):
    """A device the capture baked into an operation (arange(..., device=cpu), x.to(cpu)), by keyword or position."""
    if node.kwargs.get("device") is not None:
        node.kwargs = dict(node.kwargs, device=device)
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    for index, argument in enumerate(schema.arguments):
        if argument.name == "device" and index < len(node.args) and isinstance(node.args[index], torch.device):
            node.args = node.args[:index] + (device,) + node.args[index + 1:]


# ATen operations whose eager binding takes the schema's arguments as the export writes them (not Tensor.to, whose
# binding is written by hand, nor the operator dunders): the common ones of transformers and convolutional networks.
_EAGER_BINDINGS = frozenset("""
    add sub mul div neg pow rsqrt sqrt exp log abs clamp cos sin tanh sigmoid relu gelu silu softmax log_softmax
    _softmax _log_softmax linear matmul mm bmm addmm baddbmm layer_norm group_norm batch_norm embedding dropout
    scaled_dot_product_attention conv1d conv2d max_pool2d avg_pool2d adaptive_avg_pool2d mean sum amax cumsum
    view reshape permute transpose t select unsqueeze squeeze expand flatten contiguous clone cat stack split
    chunk unbind where masked_fill index_select gather narrow triu tril repeat rms_norm hardtanh erf
""".split())


@functools.lru_cache(maxsize=None)
def _eager_binding(op):
    """The function eager PyTorch calls for an ATen operation (torch.layer_norm, torch._C._nn.linear, Tensor.view),
    or None. A graph calls it rather than the OpOverload: the overload parses its arguments against the schema in
    Python at every call, several microseconds per operation, as much as a small operation's compute. The binding
    of a name dispatches among that name's overloads by the arguments' types, as eager code does; out= variants and
    named dimensions stay with their overload."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    if name not in _EAGER_BINDINGS or any(argument.is_out or "Dimname" in str(argument.type)
                                          for argument in op._schema.arguments):
        return None
    for namespace in (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase):
        binding = getattr(namespace, name, None)
        if binding is not None:
            return binding
    return None


def _retargeted(root, source, training, device, frozen=frozenset()):
    """The code of a captured graph for one training mode and device: dropout and batch norm follow the mode (the
    export baked in the one it ran in), or evaluation where their module's path is in `frozen`; buffer updates
    happen in training only; tensors the code creates (arange, masks) go to `device`; the same for the subgraphs of
    higher-order operations (a no-grad region, autocast)."""
    graph = fx.Graph()
    values = {}
    # A new graph, never `source` itself: a GraphModule made over a graph becomes its owner, and the graph would keep
    # that module (and the tensors it holds, profiling stand-ins) alive.
    for node in source.nodes:
        in_training = training and (not frozen or _owner_path(node) not in frozen)
        if not in_training and _is_buffer_update(node):
            continue
        if not in_training and IN_EVALUATION in node.meta:
            if node.meta[IN_EVALUATION] == "output":
                values[node] = values[evaluation_input(node)]
            continue
        if _is_op(node) and node.target in _ASSERTS and not node.users:
            continue
        copy = graph.node_copy(node, lambda n: values[n])
        if _is_op(copy):
            if not in_training:
                copy.args, copy.kwargs = _in_evaluation(copy.target, copy.args, copy.kwargs)
            _set_device_argument(copy, device)
            copy.target = _eager_binding(copy.target) or copy.target
        values[node] = copy
    code = fx.GraphModule(root, graph)
    for node in graph.nodes:
        subgraph = _attribute(code, node.target) if node.op == "get_attr" else None
        if isinstance(subgraph, fx.GraphModule):
            _set_path(code, node.target, _retargeted(subgraph, subgraph.graph, training, device, frozen))
    return code


def placeholder_name(value_name):
    """A Python identifier for an engine value's name ("trunk_output.block4.block4-1#2", a ModuleDict key)."""
    name = re.sub(r"\W", "_", value_name)
    return name if name[:1].isalpha() or name[:1] == "_" else f"_{name}"


class FusedRun:
    """Consecutive captured nodes of one stage as one generated function, from what the run reads outside itself (by
    engine name) to every node's value in node order: the nodes' operations in the same order (random numbers
    included), without the Python calls between them. Made once the partition is known, after this rank's tensors
    are real (the nodes' tensors are not replaced after that)."""

    def __init__(self, members, inputs):
        self._members = members
        self._graph = fx.Graph()
        made = {name: self._graph.placeholder(placeholder_name(name)) for name in inputs}
        outputs = []
        self._root = torch.nn.Module()
        for member in members:
            env = {}
            sources = iter(member._sources)
            for node in member._graph.nodes:
                if node.op == "placeholder":
                    env[node] = made[next(sources)]
                elif node.op == "output":
                    made[member._name] = env[node.args[0]]
                    outputs.append(made[member._name])
                else:
                    if node.op == "get_attr":
                        _set_path(self._root, node.target, _attribute(member, node.target))
                    env[node] = self._graph.node_copy(node, lambda n: env[n])
        self._graph.output(tuple(outputs))
        self._variants = {}

    def take_evaluation_tags(self, tags):
        if _take_evaluation_tags(self._graph, tags):
            self._variants.clear()

    def __call__(self, *sources):
        first = self._members[0]
        key = (first.training, first._device(sources), frozenset().union(*(member.frozen() for member in self._members)))
        code = self._variants.get(key)
        if code is None:
            code = self._variants[key] = _retargeted(self._root, self._graph, *key)
        return code(*sources)


def run_fuser(captured, node_names, made):
    """The fuser a captured model's engine graph takes (GraphModel.set_run_fuser): `captured` maps node names to their
    CapturedNode, `node_names` is the engine's node order; each run made is added to `made` (a WeakSet)."""
    def fuse(nodes, inputs):
        members = [captured.get(node_names[index]) for index in nodes]
        if any(member is None or member._meta for member in members):
            return None
        run = FusedRun(members, inputs)
        made.add(run)
        return run

    return fuse
