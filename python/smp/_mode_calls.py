"""The quick answer to whether a model's forward takes the same path in eval mode as in training mode, asked before
smp._evaluation_path exports the model in eval mode (1 to 8 s for the test suite's models, most of a first
evaluate): the forward runs twice on fake tensors of the sample's shapes, once in each mode, and every torch call that
gives or writes a tensor is recorded with its arguments, a tensor named by where it came from (an input, a parameter
or buffer by path, an earlier call's output). The training run's calls are taken as evaluation re-targets the captured
code (smp._captured_node._TRAINING_ARGUMENTS: dropout's flag and probability, batch norm's), and writes into the
model's tensors or inputs that nothing reads afterwards (a buffer's update) are left out, as the exports' comparison
leaves them out. Equal records (Hugging Face's and torchvision's models without stochastic depth: 0.1 to 0.4 s):
evaluating the training capture computes the eval path. Anything else (the records part, the forward cannot run on
fake tensors, a call's mode arguments cannot be named) leaves the answer to the exports, which also say where the
paths part and tag what evaluation leaves out (stochastic depth).

A record is made as torch.export's own tracing sees the forward: torch.compiler.is_exporting() and is_compiling()
true, the experts divided over ranks called as one operation, an in-place call's output named anew (the traced graph
reads it from there). What a record cannot share with an export is anything outside torch's calls that changes
between two runs of one forward: a forward that draws Python's or NumPy's global random numbers (a layer drop,
which the capture baked in) is left to the exports; one drawing from a generator of its own (random.Random(seed),
numpy.random.default_rng()) is not seen, and evaluate may then run the draw the capture baked in."""

import contextlib
import inspect
import itertools

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from . import _expert_parallel, _smp
from ._captured_node import _TRAINING_ARGUMENTS
from ._exporting import on_fake_tensors


class _Unsure(Exception):
    pass


def same_in_both_modes(model, args, kwargs, device, divided):
    """True when the forward makes the same torch calls in eval mode as in training mode once evaluation re-targets the
    latter; False when they differ or cannot be known that way (then only the exports can tell)."""
    outside = _Outside()
    try:
        return _record(model, args, kwargs, device, divided, True, outside) == \
            _record(model, args, kwargs, device, divided, False, outside)
    except Exception:  # noqa: BLE001 - a forward fake tensors cannot run (sizes a value decides): the exports tell
        return False


class _Outside:
    """Names of the tensors a model keeps outside its parameters and buffers (plain attributes), one table for both
    recordings: the same object is the same name in either mode, another object another name (`self.a if
    self.training else self.b` differs)."""

    def __init__(self):
        self._names = {}
        self._kept = []  # so that no id is reused while both recordings run

    def name(self, tensor):
        if id(tensor) not in self._names:
            self._names[id(tensor)] = ("outside", len(self._names))
            self._kept.append(tensor)
        return self._names[id(tensor)]


@contextlib.contextmanager
def _python_random_unread():
    """Raises _Unsure when the forward draws Python's or NumPy's random numbers (a layer drop: the capture baked in
    its own draw, which a recording cannot know), and leaves their states as they were."""
    import random
    states = [(random.getstate, random.setstate)]
    try:
        import numpy
        states.append((numpy.random.get_state, numpy.random.set_state))
    except ImportError:
        pass
    before = [get() for get, _ in states]
    try:
        yield
    finally:
        after = [get() for get, _ in states]
        for (_, put), state in zip(states, before):
            put(state)
    if any(not _same_state(a, b) for a, b in zip(before, after)):
        raise _Unsure("the forward draws Python random numbers")


def _same_state(a, b):
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # a NumPy state's key array
        return a.shape == b.shape and bool((a == b).all())
    return a == b


@contextlib.contextmanager
def _as_export_sees_it(divided):
    before = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    try:
        with _expert_parallel.opaque_for_export(divided):
            yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = before


@contextlib.contextmanager
def _smp_operations_seen():
    """smp's own C++ operations on tensors (tensor parallelism's layers and collectives), which torch function modes
    do not see, called as torch functions for the recording."""
    originals = {name: function for name, function in vars(_smp).items() if name.startswith("tp_")}

    def seen(name, function):
        def call(*args, **kwargs):
            tensors = tuple(value for value in itertools.chain(args, kwargs.values()) if isinstance(value, torch.Tensor))
            if torch.overrides.has_torch_function(tensors):
                return torch.overrides.handle_torch_function(call, tensors, *args, **kwargs)
            return function(*args, **kwargs)
        call.__name__ = call.__qualname__ = "smp." + name
        return call
    for name, function in originals.items():
        setattr(_smp, name, seen(name, function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(_smp, name, function)


def _record(model, args, kwargs, device, divided, training, outside):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    for module in model.modules():
        module.training = training
    with on_fake_tensors(device, model, args, kwargs, ShapeEnv()) as (args, kwargs), _as_export_sees_it(divided):
        named = {}
        for path, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                            model.named_buffers(remove_duplicate=False)):
            named.setdefault(id(tensor), ("tensor", path))
        for index, leaf in enumerate(pytree.tree_leaves((args, kwargs))):
            if isinstance(leaf, torch.Tensor):
                named[id(leaf)] = ("input", index)
        recorder = _Recorder(named, training, torch._guards.detect_fake_mode((args, kwargs)), outside)
        with recorder, _smp_operations_seen(), _python_random_unread():
            output = model(*args, **kwargs)
        leaves, structure = pytree.tree_flatten(output)
        recorder.calls.append(_Call("output", (str(structure), recorder.named(leaves)), None, False))
    return _without_unread_writes(recorder.calls)


class _Call:
    __slots__ = ("function", "arguments", "written", "in_place")

    def __init__(self, function, arguments, written, in_place):
        self.function, self.arguments, self.written, self.in_place = function, arguments, written, in_place


def _in_place(name):
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
        (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__"))


class _Recorder(TorchFunctionMode):
    def __init__(self, named, retarget, fake_mode, outside):
        super().__init__()
        self._named = named
        self._fake_mode = fake_mode
        self._retarget = retarget
        self._outside = outside
        self._inside = False
        self._kept = []  # every tensor named, so that no id is reused during the run
        self.calls = []

    def named(self, value):
        if isinstance(value, torch.Tensor):
            name = self._named.get(id(value))
            if name is None and getattr(value, "fake_mode", None) is self._fake_mode:
                raise _Unsure("a tensor made by a call the recording does not see")
            if name is None:  # a tensor the model keeps outside its parameters and buffers
                name = self._outside.name(value)
            return name
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(self.named(item) for item in value))
        if isinstance(value, dict):
            return ("dict", tuple((key, self.named(item)) for key, item in value.items()))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("symbol", str(value))
        return repr(value)

    def __torch_function__(self, function, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside:  # torch's own calls while one runs (fake tensors' dispatch): part of that call
            return function(*args, **kwargs)
        self._inside = True
        try:
            result = function(*args, **kwargs)
        finally:
            self._inside = False
        name = getattr(function, "__name__", "") or ""
        tensors = [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        in_place = _in_place(name)
        if not tensors and not in_place:
            return result  # a size, a flag, a property: a later call takes its value as an argument
        if self._retarget:
            args, kwargs = _as_evaluated(function, args, kwargs)
        written = self.named(args[0]) if in_place and args else None
        self.calls.append(_Call(getattr(function, "__qualname__", name) or repr(function),
                                (self.named(tuple(args)), self.named(kwargs)), written, in_place))
        index = len(self.calls) - 1
        for position, tensor in enumerate(tensors):
            # Named anew even where it is an argument returned (an in-place write, dropout in eval mode), as an
            # export's tracing names it: later calls read it from this call.
            self._named[id(tensor)] = ("value", index, position)
            self._kept.append(tensor)
        return result


_names_cache = {}


def _parameter_names(function):
    """Each way the function's parameters may be named, in order: its Python signature, or the aten schemas of its
    name (a builtin: torch.dropout, Tensor.add_)."""
    try:
        return _names_cache[function]
    except (KeyError, TypeError):
        pass
    if isinstance(function, torch._ops.OpOverloadPacket):  # torch.ops.<namespace>.<name>
        schemas = [getattr(function, overload)._schema for overload in function.overloads()]
    elif isinstance(function, torch._ops.OpOverload):
        schemas = [function._schema]
    elif inspect.isfunction(function):
        schemas = None
    else:
        try:
            schemas = torch._C._jit_get_schemas_for_operator("aten::" + getattr(function, "__name__", ""))
        except RuntimeError:
            schemas = []
    if schemas is None:
        names = [[parameter.name for parameter in inspect.signature(function).parameters.values()
                  if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]]
    else:
        names = [[argument.name for argument in schema.arguments] for schema in schemas]
    try:
        _names_cache[function] = names
    except TypeError:
        pass
    return names


def _as_evaluated(function, args, kwargs):
    """args, kwargs as evaluation runs the call: its training flags and dropout probability re-targeted by name, as
    smp._captured_node._in_evaluation re-targets the exported operation the call becomes. Raises _Unsure where they
    cannot be named alike by every way of naming the parameters, or where the call is not torch's own (a function
    of another library taking a `training` flag may branch on it inside)."""
    results = set()
    for names in _parameter_names(function):
        if len(args) > len(names) or not set(kwargs) <= set(names):
            continue
        if not _TRAINING_ARGUMENTS.keys() & set(names):
            results.add(None)
            continue
        bound = dict(zip(names, args), **kwargs)
        if "running_mean" in bound and bound["running_mean"] is None:
            results.add(None)  # batch norm keeping no statistics: batch statistics in either mode
            continue
        new_args = tuple(_TRAINING_ARGUMENTS.get(name, value) for name, value in zip(names, args))
        new_kwargs = {name: _TRAINING_ARGUMENTS.get(name, value) for name, value in kwargs.items()}
        results.add((new_args, tuple(new_kwargs.items())))
    if results == {None} or not results:
        if not results and not inspect.isfunction(function) and \
                any(isinstance(value, bool) for value in itertools.chain(args, kwargs.values())):
            raise _Unsure(f"the parameters of {function} are not known")
        return args, kwargs
    if len(results) > 1:
        raise _Unsure(f"{function} names its mode arguments in more than one way")
    module = getattr(function, "__module__", None) or ""
    if inspect.isfunction(function) and not (module == "torch" or module.startswith("torch.")):
        raise _Unsure(f"{function} takes a training flag outside torch")
    new_args, new_kwargs = results.pop()
    return new_args, dict(new_kwargs)


def _without_unread_writes(calls):
    """The calls as comparable tuples, less the in-place writes into a model's tensor (through earlier writes into
    it) whose output nothing reads afterwards, the later calls' references renumbered."""
    read = set()
    for call in calls:
        read.update(_values_named(call.arguments))
    root = {}
    for index, call in enumerate(calls):
        if call.in_place and call.written is not None:
            written = call.written
            root[index] = root.get(written[1], written) if written[0] == "value" else written
    # Not an input's: a view taken of it before the write reads what it wrote.
    kept = [index for index, call in enumerate(calls)
            if not (call.in_place and index not in read and root.get(index, ("value",))[0] == "tensor")]
    renumbered = {old: new for new, old in enumerate(kept)}

    def renumber(value):
        if isinstance(value, tuple):
            if len(value) == 3 and value[0] == "value" and isinstance(value[1], int):
                return ("value", renumbered.get(value[1], -1), value[2])
            return tuple(renumber(item) for item in value)
        return value
    return [(calls[index].function, renumber(calls[index].arguments)) for index in kept]


def _values_named(value):
    if isinstance(value, tuple):
        if len(value) == 3 and value[0] == "value" and isinstance(value[1], int):
            yield value[1]
        else:
            for item in value:
                yield from _values_named(item)
