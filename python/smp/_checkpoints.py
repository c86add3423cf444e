"""Checkpoints from Python: smp.Checkpointer (a model's and its optimizer's state saved and resumed), and whole-model
exports of a checkpoint."""

import atexit
import collections.abc
import copy
import io
import os
import random
import sys
import warnings
import weakref
import zlib

import torch

from . import _smp
from ._distributed_optimizer import DistributedOptimizer
from ._smp import CheckpointError, ConfigError
from ._state import runtime


class Checkpointer:
    """Checkpoints as the config's checkpoint_dir / checkpoint_interval say: resume() continues from the newest
    complete one (when the config says "resume": true) and returns the step to start at; save(step) writes in the
    background; wait() before exiting (on every rank it returns once the checkpoint is complete). Saves the
    parameters and the buffers that are state (batch norm's statistics), the optimizer's state_dict, the LR
    scheduler's when one is given, the random states and the fp16 loss scale.

    extra_state: the program's own state to save and resume with them, by name: objects with state_dict() and
    load_state_dict() (a torchdata StatefulDataLoader, a sampler, a metrics tracker) or plain dicts (saved as they
    are at save(), refilled in place at resume()), e.g. {"loader": loader, "progress": {"epoch": 0}}. Each rank
    saves its own with its optimizer state; a resume gives every rank that of the first replica of its pipeline
    rank, so hold the same on every rank (a loader over the global batch, or one per replica whose position is the
    same on each)."""

    def __init__(self, model, optimizer, lr_scheduler=None, extra_state=None):
        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"expected an smp.DistributedOptimizer, got {type(optimizer).__name__}")
        extra_state = _checked_extra_state(extra_state)
        if not runtime().config.checkpoint_dir and runtime().rank == 0:
            # SMP's save_checkpoint took its path in code: a ported script would save nothing, said only in the log.
            warnings.warn("smp.Checkpointer: the config gives no \"checkpoint_dir\", so save() saves nothing and "
                          "resume() starts at step 0: set it in smp.init's config (with \"resume\": true to go on "
                          "from its newest checkpoint)", stacklevel=2)
        extra_checked = []  # whether a save's extra state was read back once: a resume must be able to load it
        inner = optimizer.optimizer
        name_of = {id(tensor): name for name, tensor in model._model.named_parameters().items()}

        def snapshot():
            # Serialized now, in the save's pause, so that the writer thread never needs Python. torch.optim's state
            # goes by position in the groups: the names in that order let a resume match it by name, and the class
            # tells another optimizer's state from this one's.
            state = {"optimizer": inner.state_dict(), "optimizer_class": type(inner).__name__,
                     "parameter_names": [[name_of[id(p)] for p in group["params"]] for group in inner.param_groups]}
            if lr_scheduler is not None:
                state["lr_scheduler"] = lr_scheduler.state_dict()
            state["program_random"] = _program_random_state()
            if extra_state:
                state["extra_state"] = {name: _state_of(held) for name, held in extra_state.items()}
                if not extra_checked:
                    _check_loadable(state["extra_state"])
                    extra_checked.append(True)
            buffer = io.BytesIO()
            torch.save(state, buffer)
            return buffer.getvalue()

        def load(share_count, first_share, shares_to_read, read):
            def scheduler_state(state):
                # Every share holds the same scheduler state: it follows the step count alone.
                if lr_scheduler is None and "lr_scheduler" in state and runtime().rank == 0:
                    warnings.warn("resume: the checkpoint holds an LR scheduler's state, but this Checkpointer was "
                                  "given no lr_scheduler: the learning rate stays where the checkpoint left it, "
                                  "unscheduled", stacklevel=4)
                if lr_scheduler is not None:
                    if "lr_scheduler" not in state:
                        raise CheckpointError("the checkpoint was saved without an LR scheduler, but one was given")
                    lr_scheduler.load_state_dict(state["lr_scheduler"])
                _restore_extra_state(extra_state, state.get("extra_state", {}))
                if restore_program_random and restore_program_random[0]:
                    _restore_program_random_state(state.get("program_random", {}))

            optimizer._load_shares(first_share, shares_to_read, read, on_first=scheduler_state,
                                   scheduled=lr_scheduler is not None)

        restore_program_random = []  # set by resume(): whether every rank's generators were seeded alike

        self._restore_program_random = restore_program_random
        self._checkpointer = _smp.Checkpointer(model._model, snapshot, load)
        # A program that ends without wait() must not end as if its last checkpoint were saved: the engine's
        # Checkpointer then exits with status 1, and Python may never collect this one, so exit waits for it.
        atexit.register(_wait_at_exit, weakref.ref(self))

    def resume(self):
        """Loads the newest complete checkpoint when the config says "resume": true and returns the step to start
        at (the one after the saved step), else 0. Python's and NumPy's generators continue where the program
        seeded them alike on every rank (the checkpoint holds one rank's); seeded per rank, each keeps its seeding."""
        self._restore_program_random[:] = [_program_random_alike()]
        return self._checkpointer.resume()

    def due(self, step):
        """Whether `step` (0-based, the step just done) is a save point of checkpoint_interval."""
        return self._checkpointer.due(step)

    def save(self, step):
        """Saves the state after `step`, the 0-based step just done (resume() then returns step + 1). Every rank
        calls it; it returns once the state is copied, and the files are written in the background."""
        self._checkpointer.save(step)

    def wait(self):
        """Waits for the save in progress; raises CheckpointError if it failed. Call it before the program ends."""
        self._checkpointer.wait()


def _checked_extra_state(extra_state):
    if extra_state is None:
        return {}
    if not isinstance(extra_state, collections.abc.Mapping):
        raise TypeError("extra_state: expected a dict of names to objects with state_dict() and load_state_dict() "
                        f"(or to dicts), got {type(extra_state).__name__}")
    for name, held in extra_state.items():
        if not isinstance(name, str):
            raise TypeError(f"extra_state: its names must be strings, got {name!r}")
        if not isinstance(held, dict) and not (callable(getattr(held, "state_dict", None)) and
                                               callable(getattr(held, "load_state_dict", None))):
            raise TypeError(f"extra_state[{name!r}]: a {type(held).__name__} has no state_dict() and "
                            "load_state_dict(); give a dict, or an object with both")
    return dict(extra_state)


def _state_of(held):
    # A dict is copied now, in the save's pause: the program changes it while the files are written.
    return copy.deepcopy(held) if isinstance(held, dict) else held.state_dict()


def _check_loadable(extra_state):
    """A resume loads checkpoints with torch.load(weights_only=True): state it could not read back must fail the
    save that writes it, not the resume that needs it."""
    buffer = io.BytesIO()
    torch.save(extra_state, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as error:
        raise CheckpointError(f"extra_state holds objects a resume could not load (torch.load with weights_only=True): "
                              f"{error}; keep tensors, numbers, strings, lists and dicts in it, or allow the class "
                              "with torch.serialization.add_safe_globals") from None


def _restore_extra_state(extra_state, saved):
    said = []
    for name, held in extra_state.items():
        if name not in saved:
            said.append(f"'{name}' is not in the checkpoint and starts as it is")
        elif isinstance(held, dict):
            held.clear()
            held.update(saved[name])
        else:
            held.load_state_dict(saved[name])
    said += [f"the checkpoint's '{name}' was not given, and is left unread" for name in saved if name not in extra_state]
    if said and runtime().rank == 0:
        warnings.warn(f"resume: extra_state: {'; '.join(said)}", stacklevel=5)


def _program_random_state():
    """Python's and NumPy's global generators (torch's are the engine's), in what torch.load(weights_only=True) reads
    back: a program shuffling with random.shuffle or cropping with np.random continues its sequence on resume, as
    Accelerate's checkpoints do. NumPy only when the program imported it."""
    version, internal, gauss = random.getstate()
    state = {"python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, key, position, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
        state["numpy"] = {"kind": kind, "key": torch.from_numpy(key.astype("int64")), "position": int(position),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return state


def _program_random_alike():
    """Whether every rank's Python and NumPy generators are in the same state now (every rank calls it): digests of
    20 bits, equal everywhere when the square of their sum is the ranks times the sum of their squares (exact in a
    double)."""
    state = _program_random_state()
    python = state["python"]
    parts = (python["version"], tuple(python["internal"].tolist()), python["gauss"])
    if "numpy" in state:
        numpy = state["numpy"]
        parts += (tuple(numpy["key"].tolist()), numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"])
    digest = float(zlib.crc32(repr(parts).encode()) >> 12)
    sums = torch.tensor([digest, digest * digest], dtype=torch.float64)
    runtime().all_reduce_sum(sums)
    return float(sums[0]) ** 2 == runtime().world_size * float(sums[1])


def _restore_program_random_state(saved):
    if "python" in saved:
        python = saved["python"]
        random.setstate((python["version"], tuple(python["internal"].tolist()), python["gauss"]))
    numpy = sys.modules.get("numpy")
    if "numpy" in saved and numpy is not None:
        kept = saved["numpy"]
        numpy.random.set_state((kept["kind"], kept["key"].numpy().astype("uint32"), kept["position"],
                                kept["has_gauss"], kept["cached_gaussian"]))


def _wait_at_exit(checkpointer):
    checkpointer = checkpointer()
    if checkpointer is None:
        return
    try:
        checkpointer.wait()
    except CheckpointError as error:
        print(f"smp: the last checkpoint was not saved and nothing called Checkpointer.wait(): {error}; "
              "exiting with status 1", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def latest_checkpoint(root):
    """The newest complete checkpoint directory under `root` (the config's checkpoint_dir), or None."""
    return _smp.latest_checkpoint(os.fspath(root))


def export_checkpoint(checkpoint_directory, output_file):
    """Merges a complete checkpoint's partitions into one full-model file (parameters and buffers by name), as
    `smp_checkpoint export` does: for inference, or for a job with another partitioning
    (DistributedModel.load_parameters)."""
    _smp.export_checkpoint(os.fspath(checkpoint_directory), os.fspath(output_file))


def _bytes(size):
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = str(size).strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * factor)
    raise ConfigError(f"max_shard_size: expected a number of bytes or a size such as '5GB', got {size!r}")


def export_safetensors(checkpoint_directory, output_directory, max_shard_size="5GB"):
    """Writes a complete checkpoint's parameters and persistent buffers as Hugging Face safetensors in
    `output_directory` (model.safetensors, or shards of at most max_shard_size and model.safetensors.index.json),
    by the model's state_dict names, reading one partition file at a time: transformers' from_pretrained loads it
    (save the model's config there too: `net.config.save_pretrained(output_directory)`), and so do
    DistributedModel.load_parameters and load_pretrained. A tied weight is written once, under its first name, as
    save_pretrained writes it. Returns the files written."""
    return _smp.export_checkpoint_safetensors(os.fspath(checkpoint_directory), os.fspath(output_directory),
                                              _bytes(max_shard_size))


def load_full_model(full_model_file):
    """The parameters and buffers of a full-model file by their names in the model: load them into the plain PyTorch
    model with `model.load_state_dict(smp.load_full_model(path), strict=False)` (a tied weight is there once, and
    non-persistent buffers not at all)."""
    return _smp.read_full_model(os.fspath(full_model_file))
