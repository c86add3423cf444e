"""Exports kept on disk, so that a job launched again (a resumed run, the next job of a sweep, a test suite's next
job) skips torch.export, which takes most of a capture's time: with SMP_CAPTURE_CACHE naming a directory, an export
is written there after it ran, and read back in place of running it again when everything it depended on is the
same. Without it nothing is read or written.

What an export depends on, all of it in the key: smp's own code (its package's files), torch's and transformers'
versions, the source files defining every module class of the model, the model's tree (each module's class, its
plain and tensor attributes, forward hooks and replaced functions, its parameters' and buffers' names, shapes,
dtypes, whether they train and which share one tensor), a Hugging Face model's config, the tensor-parallel group's
size, the sample (its structure, every tensor's shape, dtype, device and values), which dimensions may change, the
device a meta-built model is exported for, the experts divided, the grad and autocast modes and the model's own
(training, or eval for the export that checks evaluation's path). Anything else a
model's code reads (another file's helper it calls, a parameter's value it branches on) is not: clear the directory
when such code changes. A model the key cannot describe (a class or hook without a source file) is not cached.
Entries are pickles, which run code when read: a directory another user owns, or others may write into, is not used
(said once); one smp makes is made for this user alone.

An entry is the exported graph as the capture keeps it, its values sketched (smp._value_sketch: shapes and shared
memory, no fake tensors to rebuild), pickled by the GraphPickler torch's own compile caches use, the signature, the constants, the input ranges and the output structure. It is
written to a temporary file and renamed into place, so a reader never sees half an entry; one that cannot be read is
ignored (exported again) and replaced; an export that cannot be pickled leaves a mark instead, and is not tried
again."""

import contextlib
import fcntl
import functools
import hashlib
import inspect
import io
import logging
import os
import pickle
import sys
import tempfile
import types
import warnings

import torch
import torch.utils._pytree as pytree

ENVIRONMENT = "SMP_CAPTURE_CACHE"
_FORMAT = 3  # 2: the values sketched (smp._value_sketch), no fake tensors; 3: export's guards kept
_log = logging.getLogger("smp.capture_cache")


def directory():
    return os.environ.get(ENVIRONMENT) or None


def _cached_export(graph_module, input_specs, output_specs, constants, range_constraints, out_spec, guards_code):
    """The parts of an ExportedProgram smp's capture reads, under the same names, as read back from the cache."""
    return types.SimpleNamespace(
        graph_module=graph_module, constants=constants, range_constraints=range_constraints, _guards_code=guards_code,
        graph_signature=types.SimpleNamespace(input_specs=input_specs, output_specs=output_specs),
        call_spec=types.SimpleNamespace(out_spec=out_spec))


def _file_digest(path):
    """Its contents' hash, read again only when its size or time changed (a module edited and reloaded)."""
    try:
        stat = os.stat(path)
    except OSError:
        return "unreadable"
    return _contents_digest(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _contents_digest(path, size, mtime_ns):
    try:
        with open(path, "rb") as file:
            return hashlib.sha256(file.read()).hexdigest()
    except OSError:
        return "unreadable"


@functools.lru_cache(maxsize=1)
def _code_digest():
    """smp's Python files and its extension, and the library versions an export's graph comes from."""
    package = os.path.dirname(os.path.abspath(__file__))
    parts = [str(_FORMAT), torch.__version__, sys.version]
    for name in sorted(os.listdir(package)):
        if name.endswith((".py", ".so")):
            path = os.path.join(package, name)
            stat = os.stat(path)
            # The extension by size and time (reading tens of MB on every start would cost more than it proves).
            parts.append(f"{name}:{_file_digest(path) if name.endswith('.py') else (stat.st_size, stat.st_mtime_ns)}")
    transformers = sys.modules.get("transformers")
    parts.append(getattr(transformers, "__version__", "-"))
    return "\n".join(parts)


_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class _Undescribable(Exception):
    """Something the export may depend on that the key cannot say: that capture is not cached."""


def _plain(value):
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)) or (
        isinstance(value, (tuple, list)) and all(_plain(item) for item in value))


def _tensor_description(tensor, values):
    text = f"{tuple(tensor.shape)} {tensor.dtype} {tensor.device.type} {tensor.requires_grad}"
    if values and not tensor.is_meta:
        data = tensor.detach().cpu().contiguous().reshape(-1)
        text += " " + hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
    return text


def _code_of(function, files):
    """A function's (or class's, or partial's) name, its source file added to `files`."""
    if isinstance(function, functools.partial):
        arguments = [*function.args, *sorted(function.keywords.items())]
        if not _plain(arguments):
            raise _Undescribable(f"a partial of {function.func!r} over {arguments!r}")
        return f"partial({_code_of(function.func, files)}, {arguments!r})"
    function = getattr(function, "__func__", function)
    name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__qualname__)}"
    if not name.startswith(("torch.", "builtins.")):
        _add_source(function, files)
    return name


def _add_source(thing, files):
    try:
        path = inspect.getsourcefile(thing)
    except TypeError:
        path = None
    if not path or not os.path.isfile(path):
        raise _Undescribable(f"no source file for {thing!r}")
    files.add(path)


def _model_description(model):
    lines = []
    files = set()
    for path, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        attributes = []
        for name, value in sorted(vars(module).items()):
            if name in ("_parameters", "_buffers", "_modules", "training"):
                continue  # below, and capture exports in training mode whatever the mode
            if _plain(value):
                attributes.append(f"{name}={value!r}")
            elif isinstance(value, torch.Tensor):  # exported as a constant, its value with it
                attributes.append(f"{name}={_tensor_description(value, True)}")
            elif callable(value) and not isinstance(value, torch.nn.Module):  # forward replaced, an act=, a norm_layer=
                attributes.append(f"{name}={_code_of(value, files)}")
            elif name in _FORWARD_HOOKS:
                attributes.append(f"{name}={[_code_of(hook, files) for hook in value.values()]}")
        lines.append(f"{path} {cls.__module__}.{cls.__qualname__} {attributes}")
        for base in cls.__mro__:
            if base.__module__.split(".")[0] not in ("torch", "builtins"):
                _add_source(base, files)
    first_path = {}
    for path, tensor in model.named_parameters(remove_duplicate=False):
        # Which paths share one tensor (a tied head) decides the export's parameters.
        lines.append(f"parameter {path} {_tensor_description(tensor, False)} "
                     f"{first_path.setdefault(id(tensor), path)} {getattr(tensor, '_smp_shard', None)}")
    for path, tensor in model.named_buffers(remove_duplicate=False):
        lines.append(f"buffer {path} {_tensor_description(tensor, False)} {first_path.setdefault(id(tensor), path)}")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        lines.append(config.to_json_string(use_diff=False))
        lines.append(repr(getattr(config, "_attn_implementation", None)))
    lines += [f"source {path} {_file_digest(path)}" for path in sorted(files)]
    return "\n".join(lines)


def key(model, args, kwargs, free, device, on_meta, divided, mode="train"):
    """The entry's name for this export; None when no cache is asked for, or when the model holds something the key
    cannot describe (a class defined without a source file, a hook made by exec): then it is exported as always."""
    if directory() is None:
        return None
    try:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sample = [_tensor_description(leaf, True) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in leaves]
        modes = (torch.is_grad_enabled(), torch.get_default_dtype(),
                 *[(torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")])
        from . import tp
        text = "\n".join([_code_digest(), _model_description(model), str(spec), *sample, repr(free), str(device),
                          str(on_meta), repr(sorted(divided)), repr(modes), repr((tp.degree(), tp.rank())), mode])
    except Exception as error:  # noqa: BLE001 - a capture the key cannot describe is exported, not cached
        _log.debug("capture cache: not for this model (%s: %s)", type(error).__name__, error)
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _path(name, suffix=".pkl"):
    return os.path.join(directory(), f"export-{name}{suffix}")


def exported(name, model, export):
    """(exported program, why its shapes are fixed): read from the entry `name`, or `export()`ed and written there.
    The ranks of a job on one host capture the same model at the same moment: the first to miss exports under the
    entry's lock while the others wait, then read what it wrote. One that cannot be kept leaves a mark, so that the
    others export at once rather than one after another. Any failure of the cache itself (a directory that cannot be
    written, locks a file system lacks) leaves the export to run as without it."""
    if name is not None and _untrusted(directory()):
        return export()
    kept = load(name, model, quiet=True)  # readers never wait for each other
    if kept is not None:
        return kept
    if name is None or os.path.exists(_path(name, ".none")):
        return export()
    with _locked(name) as held:
        if held:
            kept = load(name, model)
            if kept is None and not os.path.exists(_path(name, ".none")):
                kept = export()
                store(name, *kept)
    return kept if kept is not None else export()


_said_untrusted = set()


def _untrusted(path):
    """Whether the directory is one whose entries anyone but this user could have written (entries are pickles, which
    run code when read): then it is not used, said once."""
    try:
        stat = os.stat(path)
    except OSError:
        return False  # made by this user (0700) when the first entry is written, or not at all
    if stat.st_uid != os.getuid():
        why = f"it belongs to user id {stat.st_uid}"
    elif stat.st_mode & 0o022:
        why = f"others may write into it (mode {stat.st_mode & 0o777:o})"
    else:
        return False
    if path in _said_untrusted:
        return True
    _said_untrusted.add(path)
    _log.warning("capture cache: not using %s: %s, and its entries are pickles, which run code when read; give a "
                 "directory of your own that only you may write (chmod go-w)", path, why)
    return True


@contextlib.contextmanager
def _locked(name):
    """Yields whether it holds the entry's lock (released by the holder's end, whatever way it ends); False where the
    directory or the lock cannot be had, said once."""
    try:
        os.makedirs(directory(), mode=0o700, exist_ok=True)
        lock = open(_path(name, ".lock"), "a")
    except OSError as error:
        _log.warning("capture cache: exporting without it (%s)", error)
        yield False
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:
            _log.warning("capture cache: exporting without it (%s)", error)
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(name, model, quiet=False):
    """(exported, why its shapes are fixed) from the entry, or None when there is none or it cannot be used (said
    unless `quiet`)."""
    if name is None:
        return None
    try:
        with open(_path(name), "rb") as file, warnings.catch_warnings():
            # torch 2.11's TreeSpec warns about its own LeafSpec check when a pickled one is read back.
            warnings.simplefilter("ignore", FutureWarning)
            entry = pickle.load(file)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        graph_module = GraphPickler.loads(entry["graph"], FakeTensorMode(shape_env=ShapeEnv()))
        constants = torch.load(io.BytesIO(entry["constants"]), weights_only=False)
        _placeholders_named_as_specs(entry["inputs"], graph_module)
        exported = _cached_export(graph_module, entry["inputs"], entry["outputs"], constants, entry["ranges"],
                                  entry["out_spec"], entry["guards"])
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - a damaged or foreign entry is exported again and replaced
        if not quiet:
            _log.warning("capture cache: ignoring %s (%s: %s)", _path(name), type(error).__name__, error)
        return None
    # Tensors the model made during the export that saved it (none made them this time) cannot be bound: export again.
    held = dict(model.named_parameters(remove_duplicate=False))
    held.update(model.named_buffers(remove_duplicate=False))
    if any(spec.kind.name in ("PARAMETER", "BUFFER") and spec.target not in held for spec in entry["inputs"]):
        return None
    return exported, entry["fixed_because"]


def _placeholders_named_as_specs(input_specs, graph_module):
    """The read-back graph's placeholders under the names the export gave them, which the specs hold: the graph made
    anew avoids Python's builtins in its names, so a forward's `input` (every torch.nn layer's) came back as input_1,
    named otherwise than on a rank that exported it itself (the ranks' models then differed) and than its spec."""
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(input_specs):
        return
    for spec, node in zip(input_specs, placeholders):
        name = getattr(spec.arg, "name", None)
        if name is not None and node.name != name:
            node.name = name  # not _rename: it would pick another name again
    graph_module.recompile()


def store(name, exported, fixed_because):
    """Writes the entry whole or not at all; for an export that cannot be pickled, a mark that says so."""
    from torch.fx._graph_pickler import GraphPickler, Options
    try:
        # Every operation (smp's own among them) and the module stack each operation ran in, which capture cuts by.
        options = Options(ops_filter=None,
                          node_metadata_key_filter=lambda key: key not in ("source_fn_stack", "fwd_source_fn_stack"))
        from torch._subclasses.fake_tensor import FakeTensor
        # The constants capture reads (a non-persistent buffer is read from the model), a meta-built model's as the
        # values its fake tensors remember.
        signature = exported.graph_signature
        values = {spec.target: exported.constants[spec.target] for spec in signature.input_specs
                  if spec.kind.name == "CONSTANT_TENSOR"}
        values = {target: value.constant if isinstance(value, FakeTensor) else value
                  for target, value in values.items()}
        if any(value is None for value in values.values()):
            raise ValueError(f"constants without a value: {sorted(t for t, v in values.items() if v is None)}")
        constants = io.BytesIO()
        torch.save(values, constants)
        data = pickle.dumps({"graph": GraphPickler.dumps(exported.graph_module, options),
                             "inputs": list(signature.input_specs), "outputs": list(signature.output_specs),
                             "constants": constants.getvalue(), "ranges": dict(exported.range_constraints),
                             "guards": list(getattr(exported, "_guards_code", None) or []),
                             "out_spec": exported.call_spec.out_spec, "fixed_because": fixed_because})
    except Exception as error:  # noqa: BLE001 - many kinds; the export stands, uncached, and says why once
        _log.warning("capture cache: this export cannot be kept (%s: %s)", type(error).__name__, error)
        data = b""
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(dir=directory(), prefix=".export-", suffix=".tmp")
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, _path(name, ".pkl" if data else ".none"))
    except OSError as error:
        _log.warning("capture cache: could not write an entry in %s (%s)", directory(), error)
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
