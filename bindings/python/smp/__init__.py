"""smp: pipeline- and data-parallel training of PyTorch models, configured by an SMP-style JSON file.

Every process of the job runs the same script, launched by smprun (``smprun -n 8 -- python train.py``)::

    import torch, smp

    smp.init("config.json")                       # partitions, microbatches, pipeline, ddp, ...
    torch.manual_seed(0)                          # every rank builds the same weights
    net = MyModel()                               # any nn.Module: stages are cut between its children
    model = smp.DistributedModel(net, sample)     # sample: one microbatch; rank 0 profiles and partitions
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    for inputs, targets in batches:               # the global batch, the same on every rank
        optimizer.zero_grad()
        out = model.train_step(inputs, targets, torch.nn.functional.cross_entropy)
        optimizer.step()
    validation = model.evaluate(inputs, targets, torch.nn.functional.cross_entropy).loss

Modules run as they are, in Python (the engine calls each stage module's forward); a module compiled with
``torch.jit.script`` runs as TorchScript, without Python. The engine trains the model's own parameter tensors:
``model.named_parameters()`` returns this rank's, named as in the model's ``state_dict()`` (a scripted module is
copied, so there they are the copy's).
"""

import collections
import inspect
import io
import json
import operator
import os
import re
import weakref

import torch  # loads LibTorch before the extension that links it

from . import _smp
from ._smp import CheckpointError, CommError, ConfigError, ModelError, NonFiniteError

__all__ = ["init", "runtime", "GraphModel", "DistributedModel", "DistributedOptimizer", "Checkpointer",
           "latest_checkpoint", "export_checkpoint", "load_full_model",
           "ConfigError", "ModelError", "NonFiniteError", "CheckpointError", "CommError"]

_runtime = None
_models = weakref.WeakSet()  # this process's DistributedModels, for DistributedOptimizer to find its own


def init(config):
    """Joins the job: reads the config (a JSON file path, or a dict holding what the file would), checks it against
    the launch (smprun's environment), and connects to the other processes. Returns the runtime (rank, pp_rank,
    dp_rank, ...). Raises ConfigError for a bad config and CommError when peers do not show up in time."""
    global _runtime
    if isinstance(config, dict):
        parsed = _smp.Config.from_json_text(json.dumps(config), "<config dict>")
    else:
        parsed = _smp.Config.from_file(os.fspath(config))
    _runtime = _smp.Runtime.init(parsed)
    return _runtime


def runtime():
    """The runtime of smp.init."""
    if _runtime is None:
        raise RuntimeError("smp.init(config) has not been called in this process")
    return _runtime


def _is_sequential(module):
    """An nn.Sequential, or one compiled by torch.jit.script (whose forward is the chain of its children)."""
    if isinstance(module, torch.jit.ScriptModule):
        return getattr(module, "original_name", None) == "Sequential"
    return isinstance(module, torch.nn.Sequential)


def _kind(module):
    if isinstance(module, torch.jit.ScriptModule):
        return f"a scripted {getattr(module, 'original_name', type(module).__name__)}"
    return type(module).__name__


def _engine_module(name, module, call=None):
    """A module as the engine takes it: a scripted one as TorchScript (it then runs without Python), any other
    nn.Module as itself (its forward, or `call`, is called from the engine, in Python)."""
    if isinstance(module, torch.jit.ScriptModule):
        buffer = io.BytesIO()
        torch.jit.save(module, buffer)
        return _smp.load_scripted(buffer.getvalue())
    if isinstance(module, torch.nn.Module):
        return _smp.wrap_eager(module, call)
    raise TypeError(f"module '{name}': expected a torch.nn.Module, got {type(module).__name__}")


class GraphModel:
    """A model as a DAG of modules with named tensors between them (residuals, skips, branches)::

        graph = smp.GraphModel("tokens")
        graph.add("embed", Embedding(...), ["tokens"])
        graph.add("block0", Block(...), ["embed"])
        graph.add("mix", Add(), ["block0", "embed"])     # forward(a, b)
        graph.add("head", Head(...), ["mix"])            # the last node is the model's output
    """

    def __init__(self, input_name="input"):
        self._graph = _smp.GraphModel(input_name)

    def add(self, name, module, inputs):
        self._graph.add(name, _engine_module(name, module), list(inputs))
        return self

    def _add_call(self, name, module, call, inputs, parameter_prefix=""):
        """A node that trains `module`'s parameters but runs `call(*inputs)` (a traced call site); its parameters
        are named after `parameter_prefix` (a child's path) when given."""
        self._graph.add(name, _engine_module(name, module, call), list(inputs), parameter_prefix)
        return self

    @staticmethod
    def from_sequential(sequential, input_name="input"):
        """One node per child, named as in the Sequential, so parameter names match its state_dict."""
        if not _is_sequential(sequential):
            raise TypeError(f"expected a torch.nn.Sequential, got {_kind(sequential)}")
        graph = GraphModel(input_name)
        previous = input_name
        for name, child in sequential.named_children():
            graph.add(name, child, [previous])
            previous = name
        if previous == input_name:
            raise ModelError("the Sequential has no modules")
        return graph

    @staticmethod
    def from_module(model, sample_input):
        """A model with a forward of its own, traced with torch.fx: one node per call of a child module (the
        elements of a ModuleList or ModuleDict child count as children), named by its path in the model so that
        parameter names match its state_dict, and one node per tensor-valued operation between them. See
        _traced_graph for what cannot be traced."""
        return _traced_graph(model, sample_input)

    def node_names(self):
        return self._graph.node_names()

    def forward(self, input):
        """The whole model in this process, as plain PyTorch would run it."""
        return self._graph.forward(input)


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


def _traced_graph(model, sample_input):
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
    result = GraphModel(input_name)
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


def _replica_share(inputs, targets, already_shared):
    rt = runtime()
    if not already_shared:
        return rt.replica_slice(inputs), rt.replica_slice(targets)
    # Replicas count equally in the mean over the global batch, so their shares must be the same size: checked
    # against global_batch_size when the config fixes it.
    fixed = rt.config.global_batch_size
    if fixed and inputs.shape[0] * rt.data_parallel_degree != fixed:
        raise ConfigError(f"replica_share: a share of {inputs.shape[0]} samples x {rt.data_parallel_degree} replicas "
                          f"is not the config's global_batch_size of {fixed}")
    return inputs, targets


class DistributedModel:
    """This rank's stages of `model` (an nn.Sequential, an smp.GraphModel, or any nn.Module with a forward of its
    own, traced: GraphModel.from_module). Every rank passes the same model and
    one microbatch of input as `sample_input`: rank 0 profiles the modules on it and all ranks adopt its partition.
    """

    def __init__(self, model, sample_input):
        if isinstance(model, GraphModel):
            graph = model
        elif _is_sequential(model):
            graph = GraphModel.from_sequential(model)
        elif isinstance(model, torch.jit.ScriptModule):
            # TorchScript keeps no Python forward to trace: its children would run as a chain, wrongly.
            raise TypeError(f"pass an nn.Sequential or an smp.GraphModel, got {_kind(model)}: script its children, "
                            "not the model, or pass the model unscripted (smp traces its forward)")
        elif isinstance(model, torch.nn.Module):
            graph = GraphModel.from_module(model, sample_input)
        else:
            raise TypeError(f"expected a torch.nn.Module or an smp.GraphModel, got {type(model).__name__}")
        self._model = _smp.DistributedModel(runtime(), graph._graph, sample_input)
        _models.add(self)

    def train_step(self, inputs, targets, loss, keep_outputs=False, replica_share=False):
        """One step on the global batch (the same tensors on every rank; each replica takes its share): splits it
        into microbatches, runs the pipeline schedule, averages gradients over replicas. `loss(output, target)`
        returns the mean loss of a microbatch. Returns the step's output: .loss (the global batch's mean loss, the
        same on every rank), .skipped, .seconds, and with keep_outputs=True .outputs: on the rank that runs the
        last stage, the model's outputs for this replica's share of the batch (runtime().replica_slice of it), in
        order and detached, for metrics such as accuracy; None on the other ranks.
        replica_share=True: inputs and targets are already this replica's share (runtime().dp_rank's part of the
        global batch, every replica's the same size), so that each replica loads only its own data; .outputs then
        follow the tensors passed in. Outputs are joined along their first dimension (the batch's); a model whose
        output is a 0-dim tensor gives one value per microbatch."""
        return self._model.train_step(*_replica_share(inputs, targets, replica_share), loss, keep_outputs)

    def evaluate(self, inputs, targets, loss, keep_outputs=False, replica_share=False):
        """The mean loss over the global batch without gradients (validation), taken like train_step by every rank:
        the schedule's forwards alone, keeping nothing for a backward, with the modules in eval mode (dropout off,
        batch norm on its running statistics) and back in training mode after. Returns .loss and .seconds, and
        .outputs as train_step does with keep_outputs=True; replica_share as in train_step."""
        return self._model.evaluate(*_replica_share(inputs, targets, replica_share), loss, keep_outputs)

    def named_parameters(self):
        """This rank's parameters by their names in the full model (shared with the engine: no copies)."""
        return self._model.named_parameters()

    def parameters(self):
        """This rank's parameters, the tensors the engine trains: build the optimizer over these."""
        return list(self._model.named_parameters().values())

    def load_parameters(self, full_model_file):
        self._model.load_parameters(os.fspath(full_model_file))

    @property
    def stages(self):
        """The pipeline stages this rank runs."""
        return self._model.stages

    @property
    def stage_of_module(self):
        return self._model.stage_of_module

    def partition_report(self):
        return self._model.partition_report()


def _owner_of(optimizer):
    """The DistributedModel whose parameters the optimizer holds."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in list(_models):
        if held & {id(p) for p in model.parameters()}:
            return model
    raise ValueError("the optimizer holds no parameter of a DistributedModel of this process: build it over "
                     "model.parameters() (for a scripted module the engine trains a copy, so the original "
                     "module's parameters are not the ones it trains)")


class DistributedOptimizer:
    """A torch.optim optimizer over this rank's parameters, built over ``model.parameters()`` (parameter groups
    with options of their own are fine)::

        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, warmup)   # schedulers take the inner one

    ``step()`` steps it unless the engine dropped the step (an fp16 overflow, or a non-finite gradient under
    "nonfinite": "skip"); ``clip_grad_norm`` clips to the whole model's gradient norm, over all stages. With
    "shard_optimizer_state" in the config, the optimizer is left holding only the parameters this replica updates
    (so its state is a 1/replicas share), and ``step()`` then exchanges the updated parameters with the other
    replicas.
    """

    def __init__(self, optimizer, model=None):
        if isinstance(optimizer, DistributedModel):
            raise TypeError("DistributedOptimizer takes a torch.optim optimizer: "
                            "smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=...))")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer built over model.parameters(), got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self._model = model if model is not None else _owner_of(optimizer)
        named = self._model.named_parameters()
        ours = {id(p) for p in named.values()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = sum(1 for p in held if id(p) not in ours)
        if foreign:
            raise ValueError(f"the optimizer holds {foreign} tensor(s) that are not this rank's DistributedModel "
                             "parameters: build it over model.parameters()")
        held_ids = {id(p) for p in held}
        missing = [name for name, p in named.items() if p.requires_grad and id(p) not in held_ids]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"the optimizer leaves out {len(missing)} trainable parameter(s) of this rank ({shown}): "
                             "build it over model.parameters(), or set requires_grad=False on what stays frozen")
        engine = self._model._model
        self._built_groups = [list(group["params"]) for group in optimizer.param_groups]
        if engine.optimizer_state_shards > 1:
            # "shard_optimizer_state": this replica's optimizer keeps only the parameters it updates (the others'
            # updates arrive after each step), so it never makes state for the rest.
            if len(optimizer.state) > 0:
                raise ValueError("with \"shard_optimizer_state\" the optimizer must not have stepped yet (it already "
                                 "holds state for every parameter): wrap it right after building it")
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError("torch.optim.LBFGS cannot have its state sharded (it keeps its own list of all the "
                                 "parameters and needs a closure): leave \"shard_optimizer_state\" off")
            for group in optimizer.param_groups:  # groups keep their places, possibly empty, for checkpoints
                kept = [engine.updates_parameter(p) for p in group["params"]]
                for key in ("params", "param_names"):  # names (torch.optim over named_parameters()) stay aligned
                    if key in group:
                        group[key] = [item for item, keep in zip(group[key], kept) if keep]
            # The inner optimizer is handed out (LR schedulers take it, and loops call it directly): its own step
            # must still share the updates, and its zero_grad clear the gradients it no longer holds.
            optimizer.register_step_post_hook(lambda *_: engine.share_updated_parameters())
            optimizer.zero_grad = lambda set_to_none=True: engine.zero_grad(set_to_none)
            self._shard = {"replica": runtime().dp_rank, "replicas": engine.optimizer_state_shards}
        else:
            self._shard = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        """Clears the gradients of all of this rank's parameters (with sharded optimizer state, also those this
        replica's optimizer does not hold)."""
        self._model._model.zero_grad(set_to_none)

    def step(self):
        """Steps the optimizer, unless the engine dropped this step: even zero gradients would move the weights
        through momentum. Returns whether it stepped."""
        if self._model._model.last_step_skipped:
            return False
        self.optimizer.step()  # with sharded state, its hook shares the updates
        return True

    def clip_grad_norm(self, max_norm):
        """Scales the gradients so that their 2-norm over the whole model is at most max_norm; returns the norm
        before clipping. Every rank calls it."""
        return self._model._model.clip_grad_norm(float(max_norm))

    def state_dict(self):
        """The optimizer's state_dict; with sharded state, this replica's share, marked with the replica it
        belongs to."""
        state = self.optimizer.state_dict()
        if self._shard is not None:
            state["smp_optimizer_shard"] = dict(self._shard)
        return state

    def load_state_dict(self, state):
        """Loads a state_dict of state_dict(); a sharded one only into the replica that saved it (the shapes of
        another replica's share may well fit, and silently train on the wrong moments)."""
        saved = state.get("smp_optimizer_shard")
        if saved != self._shard:
            def describe(shard):
                return (f"replica {shard['replica']}'s share of state sharded over {shard['replicas']} replicas"
                        if shard else "unsharded state")
            raise ValueError(f"this optimizer state_dict holds {describe(saved)}, but this optimizer takes "
                             f"{describe(self._shard)}")
        state = {key: value for key, value in state.items() if key != "smp_optimizer_shard"}
        self.optimizer.load_state_dict(state)

    def _load_shares(self, first_share, shares_to_read, read, on_first=None):
        """Loads optimizer state saved as shares, whatever this optimizer's sharding: a checkpoint resumes into
        another number of replicas, or with sharding switched on or off. read(share) gives (path, state_dict, names
        of the parameters the saving replica's optimizer held); on_first(state_dict) sees the first one read."""
        # load_state_dict matches saved state to the groups' parameters by position: each share loads while the
        # groups hold exactly the parameters of the replica that saved it; the groups then get this replica's back,
        # and the state of those another replica now updates goes at once.
        inner = self.optimizer
        if len(inner.param_groups) != len(self._built_groups):
            raise CheckpointError(f"the optimizer has {len(inner.param_groups)} parameter groups but had "
                                  f"{len(self._built_groups)} when DistributedOptimizer wrapped it (groups added later "
                                  "are not in its checkpoints)")
        by_name = self._model.named_parameters()
        held = [{key: group[key] for key in ("params", "param_names") if key in group} for group in inner.param_groups]
        kept = {id(p) for group in held for p in group["params"]}
        merged = {}

        def restore_groups():
            for group, saved in zip(inner.param_groups, held):
                group.pop("param_names", None)
                group.update(saved)

        for share in range(first_share, first_share + shares_to_read):
            path, state, names = read(share)
            state = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
            if on_first is not None and share == first_share:
                on_first(state)
            saved_with = {id(by_name[name]) for name in names if name in by_name}
            try:
                for group, built in zip(inner.param_groups, self._built_groups):
                    group["params"] = [p for p in built if id(p) in saved_with]
                    group.pop("param_names", None)  # torch.optim checks them against the saved ones otherwise
                inner.load_state_dict(state["optimizer"])
            except Exception as error:
                restore_groups()
                inner.state = collections.defaultdict(dict)  # no half-loaded state
                raise CheckpointError(f"{path}: optimizer state does not fit this optimizer: {error}") from error
            merged.update({p: s for p, s in inner.state.items() if id(p) in kept})
            restore_groups()
        inner.state = collections.defaultdict(dict, merged)


class Checkpointer:
    """Checkpoints as the config's checkpoint_dir / checkpoint_interval say: resume() continues from the newest
    complete one (when the config says "resume": true) and returns the step to start at; save(step) writes in the
    background; wait() before exiting. Saves the parameters, the optimizer's state_dict, the LR scheduler's when
    one is given, the RNG state and the fp16 loss scale."""

    def __init__(self, model, optimizer, lr_scheduler=None):
        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"expected an smp.DistributedOptimizer, got {type(optimizer).__name__}")
        inner = optimizer.optimizer

        def snapshot():
            # Serialized now, in the save's pause, so that the writer thread never needs Python.
            state = {"optimizer": inner.state_dict()}
            if lr_scheduler is not None:
                state["lr_scheduler"] = lr_scheduler.state_dict()
            buffer = io.BytesIO()
            torch.save(state, buffer)
            return buffer.getvalue()

        def load(share_count, first_share, shares_to_read, read):
            def scheduler_state(state):
                # Every share holds the same scheduler state: it follows the step count alone.
                if lr_scheduler is not None:
                    if "lr_scheduler" not in state:
                        raise CheckpointError("the checkpoint was saved without an LR scheduler, but one was given")
                    lr_scheduler.load_state_dict(state["lr_scheduler"])

            optimizer._load_shares(first_share, shares_to_read, read, on_first=scheduler_state)

        self._checkpointer = _smp.Checkpointer(model._model, snapshot, load)

    def resume(self):
        return self._checkpointer.resume()

    def due(self, step):
        return self._checkpointer.due(step)

    def save(self, step):
        self._checkpointer.save(step)

    def wait(self):
        self._checkpointer.wait()


def latest_checkpoint(root):
    """The newest complete checkpoint directory under `root` (the config's checkpoint_dir), or None."""
    return _smp.latest_checkpoint(os.fspath(root))


def export_checkpoint(checkpoint_directory, output_file):
    """Merges a complete checkpoint's partitions into one full-model file (parameters by name), as
    `smp_checkpoint export` does: for inference, or for a job with another partitioning
    (DistributedModel.load_parameters)."""
    _smp.export_checkpoint(os.fspath(checkpoint_directory), os.fspath(output_file))


def load_full_model(full_model_file):
    """The parameters of a full-model file by their names in the model: load them into the plain PyTorch model
    with `model.load_state_dict(smp.load_full_model(path), strict=False)` (buffers are not in the file)."""
    return _smp.read_full_model(os.fspath(full_model_file))
