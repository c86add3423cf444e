"""smp.GraphModel: a model as a DAG of modules with named tensors, as the engine takes it."""

import io
import itertools
import weakref

import torch

from . import _smp
from ._fx_capture import traced_graph
from ._smp import ModelError


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


def _profile_key(module):
    """What makes two modules cost the same: their code (a class and its configuration as repr shows it, or a
    scripted module's graph) and their tensors' shapes. Nodes of equal keys share one profile measurement."""
    if isinstance(module, torch.jit.ScriptModule):
        body = str(module.inlined_graph)
    else:
        body = f"{type(module).__module__}.{type(module).__qualname__}:{module!r}"
    tensors = ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
                       for name, t in itertools.chain(module.named_parameters(), module.named_buffers()))
    return f"{body}|{tensors}"


def transient_buffers(module, prefix=""):
    """The names of a module's buffers that its state_dict leaves out (non-persistent: a rotary table, a causal
    mask), as the engine names them: checkpoints and exports leave them out too."""
    kept = set(module.state_dict(keep_vars=True))
    return [prefix + name for name, _ in module.named_buffers() if name not in kept]


class GraphModel:
    """A model as a DAG of modules with named tensors between them (residuals, skips, branches)::

        graph = smp.GraphModel("tokens")                 # or several inputs: smp.GraphModel(["ids", "mask"])
        graph.add("embed", Embedding(...), ["tokens"])
        graph.add("block0", Block(...), ["embed"])
        graph.add("mix", Add(), ["block0", "embed"])     # forward(a, b)
        graph.add("head", Head(...), ["mix"])            # the last node is the model's output
        graph.set_outputs(["head", "block0"])            # or several outputs: the loss gets them as a tuple

    A graph of several inputs takes them at train_step and evaluate as a dict by name, or a tuple in this order.
    """

    def __init__(self, input_names="input"):
        names = [input_names] if isinstance(input_names, str) else list(input_names)
        self._graph = _smp.GraphModel(names)
        self._several_outputs = False
        self._captured = {}  # node name -> CapturedNode, for a model captured whole
        self._transient_buffers = []
        # id of a parameter -> (the first node holding it, whether that node is TorchScript, a weak reference to it)
        self._parameter_nodes = {}

    @property
    def input_names(self):
        return list(self._graph.input_names)

    @property
    def output_names(self):
        return list(self._graph.output_names)

    def add(self, name, module, inputs):
        if isinstance(module, torch.nn.Module):
            self._check_shared_with_script(name, module)
        key = _profile_key(module) if isinstance(module, torch.nn.Module) else ""
        self._graph.add(name, _engine_module(name, module), list(inputs), profile_key=key)
        if isinstance(module, torch.nn.Module):
            self._transient_buffers += transient_buffers(module, name + ".")
        return self

    def _check_shared_with_script(self, name, module):
        """The engine runs a copy of each node's TorchScript module: a parameter a TorchScript node shares with another
        node (the same module used twice, an embedding tied to a head) would be trained as two copies where PyTorch
        trains one. Eager modules' shared parameters are tied instead. Weak references: a module freed after add
        may hand its ids on."""
        script = isinstance(module, torch.jit.ScriptModule)
        for path, parameter in module.named_parameters():
            first, first_script, held = self._parameter_nodes.get(id(parameter), (None, False, None))
            if held is None or held() is not parameter:
                self._parameter_nodes[id(parameter)] = (name, script, weakref.ref(parameter))
            elif first != name and (script or first_script):
                raise ModelError(f"node '{name}' shares parameter '{path}' with node '{first}', and one of them is "
                                 "TorchScript, which smp runs as a copy per node: it would train two copies of what "
                                 "PyTorch trains once; pass eager modules (their shared parameters are tied), or give "
                                 "each node its own")

    def set_outputs(self, outputs):
        """The model's outputs, in the order the loss function (and keep_outputs) receive them as a tuple."""
        self._graph.set_outputs(list(outputs))
        self._several_outputs = True
        return self

    def _add_call(self, name, module, call, inputs, parameter_prefix="", names_from_root=False, profile_key=""):
        """A node that trains `module`'s parameters but runs `call(*inputs)` (a traced call site); its parameters
        are named after `parameter_prefix` (a child's path) when given, or are the paths of `module`'s own tree
        (names_from_root: a module mirroring the whole model's)."""
        self._graph.add(name, _engine_module(name, module, call), list(inputs), parameter_prefix, names_from_root,
                        profile_key)
        return self

    @staticmethod
    def from_sequential(sequential, input_name="input"):
        """One node per child, named as in the Sequential, so parameter names match its state_dict."""
        if not _is_sequential(sequential):
            raise TypeError(f"expected a torch.nn.Sequential, got {_kind(sequential)}")
        graph = GraphModel(input_name)
        previous = input_name
        # _modules, as Sequential.forward runs them: named_children() yields a module used twice once, which would drop
        # its second call.
        for name, child in sequential._modules.items():
            graph.add(name, child, [previous])
            previous = name
        if previous == input_name:
            raise ModelError("the Sequential has no modules")
        return graph

    @classmethod
    def from_module(cls, model, sample_input):
        """A model with a forward of its own, traced with torch.fx: one node per call of a child module (the
        elements of a ModuleList or ModuleDict child count as children), named by its path in the model so that
        parameter names match its state_dict, and one node per tensor-valued operation between them. See
        smp._fx_capture for what cannot be traced. (smp.DistributedModel captures such models with torch.export
        first, which cuts at any depth and takes keyword inputs.)"""
        return traced_graph(model, sample_input, cls)

    def node_names(self):
        return self._graph.node_names()

    def forward(self, *inputs):
        """The whole model in this process, as plain PyTorch would run it: the inputs in input_names order; one
        tensor, or a tuple of the outputs set with set_outputs."""
        outputs = self._graph.forward(list(inputs))
        return tuple(outputs) if self._several_outputs else outputs[0]
