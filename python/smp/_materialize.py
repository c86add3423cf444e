"""Models built on the meta device (``with torch.device("meta"): net = MyModel()``): each rank makes real only the
modules its stages read, and initializes each from a generator seeded by (seed, module path), so that the weights
do not depend on the partition; ``smp.materialize`` makes a whole model real the same way in one process."""

import contextlib
import ctypes
import itertools
import weakref

import torch

from . import _smp
from ._smp import ModelError


def made_whole(module, whole_shapes, device):
    """`module`'s own parameters named in `whole_shapes` ({name: shape}), which hold its part (a tensor- or
    expert-parallel share), replaced by uninitialized whole ones on `device`: to be initialized as the whole model's
    module is (the same seed) and cut again, so that the weights do not depend on the layout."""
    for name, shape in whole_shapes.items():
        part = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(torch.empty(shape, dtype=part.dtype, device=device),
                                                      requires_grad=part.requires_grad)


def release_freed_memory():
    """Hands memory freed since (profiling stand-ins, up to a few tens of MiB each, which glibc keeps in its heap
    rather than unmapping) back to the system, so that a rank's resident memory is what it holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def is_meta(model):
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def module_seed(seed, path):
    """A generator seed of its own for each module: the same whichever rank or process initializes it (the engine's
    rule, which C++ nodes built on demand follow too)."""
    return _smp.module_seed(seed, path)


def _own_meta_tensors(module):
    return [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)) if t.is_meta]


def _first_owners(model):
    """id(tensor) -> the path of the module that owns it first (named_parameters order): a tensor several modules
    hold (a tied LM head) is made and initialized by that one, on every rank and in smp.materialize alike."""
    owners = {}
    for path, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        owners.setdefault(id(tensor), owning_module(path))
    return owners


def materialize_modules(model, paths, device, seed, init_fn=None, replaced=None):
    """Makes the modules at `paths` (the parameters and buffers they own first) real on `device` and initializes them:
    with init_fn(module) when given, else the module's reset_parameters(). Returns {id(old tensor): (old, new)}, for
    whatever else holds the old ones (a tied weight's other module, a captured node); the old tensors stay in it, so
    that no new object takes one of their ids."""
    replaced = {} if replaced is None else replaced
    owners = _first_owners(model)
    for path in sorted(paths):
        module = model.get_submodule(path) if path else model
        if not any(owners.get(id(t)) == path for t in _own_meta_tensors(module)):
            continue
        if init_fn is None and not hasattr(module, "reset_parameters") and not hasattr(module, "_smp_materialize"):
            raise ModelError(f"module '{path or type(model).__name__}' ({type(module).__name__}) was built on the meta "
                             "device and has no reset_parameters(); pass init_fn (for a Hugging Face model, "
                             "init_fn=model._init_weights)")
        before = {name: t for name, t in itertools.chain(module.named_parameters(recurse=False),
                                                         module.named_buffers(recurse=False))}
        def initialize(target):
            if init_fn is not None:
                init_fn(target)
            else:
                target.reset_parameters()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, path))
            if hasattr(module, "_smp_materialize"):  # a tensor-parallel layer: the whole layer made, then cut
                module._smp_materialize(device, initialize)
            else:
                module.to_empty(device=device, recurse=False)
                initialize(module)
        for name, old in before.items():
            if not old.is_meta:
                continue
            if owners.get(id(old)) == path:
                new = getattr(module, name)
                # What smp tagged the meta tensor with (a norm's gradients summed over the tensor-parallel group) holds
                # for the real one, unless the module's own _smp_materialize tagged it (a layer cut anew).
                for tag, value in vars(old).items():
                    if tag.startswith("_smp_") and not hasattr(new, tag):
                        setattr(new, tag, value)
                replaced[id(old)] = (old, new)
            else:  # another module's first: that one makes it (below, every holder takes the same)
                table = module._parameters if name in module._parameters else module._buffers
                table[name] = old
    # A tensor several modules hold (a tied LM head) is made once: the others take the same.
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and id(tensor) in replaced and replaced[id(tensor)][0] is tensor:
                    table[name] = replaced[id(tensor)][1]
    return replaced


def owning_module(tensor_path):
    """The path of the module a tensor's path names it in ("layers.0.mlp.weight" -> "layers.0.mlp")."""
    return tensor_path.rpartition(".")[0]


def materialize(model, device="cpu", seed=0, init_fn=None):
    """The whole model made real on `device`, initialized module by module from generators seeded by (seed, module
    path), as each rank of a job with that config seed initializes its own stages: the single-process reference of
    such a job, or a model for inference. Returns the model."""
    owners = _first_owners(model)
    paths = {owners[id(t)] for t in itertools.chain(model.parameters(), model.buffers()) if t.is_meta}
    materialize_modules(model, paths, torch.device(device), seed, init_fn)
    return model


_released_may_run = False
_released = weakref.WeakSet()  # models released by a DistributedModel


def was_released(model):
    return isinstance(model, torch.nn.Module) and model in _released


@contextlib.contextmanager
def released_model_runs():
    """Lets a released model run its forward (smp's own export of it on fake tensors, which reads no tensor)."""
    global _released_may_run
    before, _released_may_run = _released_may_run, True
    try:
        yield
    finally:
        _released_may_run = before


# What saving the whole model takes, where a rank holds its stages only.
SAVE_WHOLE_MODEL = ("save a checkpoint (smp.Checkpointer) and write the whole model from it with "
                    "smp.export_safetensors(checkpoint, directory), a directory from_pretrained reads")


def release_other_stages(model, kept, stages):
    """The inverse, once a model is cut: `model`'s parameters that this rank does not train (`kept`: the ids of those
    it does) become meta tensors, so that the model the user still holds cannot be saved or run as if trained (its
    other stages would stay at their first values on every rank); calling it then says so. Buffers stay (a rank's
    own modules read their non-persistent ones, and smp's checks of the inputs read tables from them); tied
    parameters stay tied; TorchScript modules are left as they are (the engine trains copies of them). The memory
    is not freed by this: the other stages' captured nodes still hold their tensors. Returns how many parameters were
    released."""
    if isinstance(model, torch.jit.ScriptModule):
        return 0  # TorchScript: the engine trains copies, and a scripted module takes no hooks
    released = {}
    for module in model.modules():
        if isinstance(module, torch.jit.ScriptModule):
            continue
        table = module._parameters
        for key, tensor in table.items():
            if tensor is None or tensor.is_meta or id(tensor) in kept:
                continue
            if id(tensor) not in released:
                released[id(tensor)] = torch.nn.Parameter(torch.empty_like(tensor, device="meta"),
                                                          tensor.requires_grad)
            table[key] = released[id(tensor)]
    if released:
        name = type(model).__name__

        def refuse(module, args):
            if _released_may_run:
                return
            raise ModelError(f"{name} was given to smp.DistributedModel, which trains it in pieces: this rank holds "
                             f"its stage(s) {stages} only, and the model's other tensors were released (now on the "
                             "meta device). Call the DistributedModel (model(inputs), model.evaluate) to run it; for "
                             "the whole trained model, save a checkpoint and use smp.export_safetensors (a Hugging "
                             "Face directory) or smp.export_checkpoint with smp.load_full_model")

        model.register_forward_pre_hook(refuse)
        _released.add(model)
    if callable(getattr(model, "save_pretrained", None)) and any(p.is_meta for p in model.parameters()):
        # Hugging Face's would write a config, then fail on the first meta tensor (released here, or never made
        # real on this rank: a model built on the meta device), leaving a directory that looks like a saved model.
        name = type(model).__name__

        def save_pretrained(*args, **kwargs):
            raise ModelError(f"{name}.save_pretrained: this rank holds its stage(s) {stages} only (the other "
                             f"stages' tensors are on the meta device here): {SAVE_WHOLE_MODEL}")
        model.save_pretrained = save_pretrained
    release_freed_memory()
    return len(released)
