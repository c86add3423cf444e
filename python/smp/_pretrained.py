"""Pretrained weights read per rank: each rank reads only the tensors of its own stages, lazily, from a Hugging Face
directory (model.safetensors, or shards listed in model.safetensors.index.json) or a torch.save state dict (memory
mapped), so that no process ever holds the whole model."""

import json
import os
import warnings

import torch

from ._smp import CheckpointError
from .tp import local_part, whole_shape


class _Source:
    """Where each tensor name lives, and reading one at a time."""

    def __init__(self, path):
        path = os.fspath(path)
        self.description = path
        self._handles = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                with open(index) as file:
                    weight_map = json.load(file)["weight_map"]
                self._files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
            elif os.path.exists(single):
                self._files = {name: single for name in self._names_in(single)}
            else:
                raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
            self._state_dict = None
        else:
            try:
                self._state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as error:  # noqa: BLE001 - torch.load raises many kinds
                raise CheckpointError(f"{path}: not a safetensors directory or a torch.save state dict: {error}") \
                    from error
            self._files = {name: path for name in self._state_dict}

    def _open(self, file):
        from safetensors import safe_open
        if file not in self._handles:
            if not os.path.exists(file):
                raise CheckpointError(f"{file}: listed in the index, but missing")
            self._handles[file] = safe_open(file, framework="pt", device="cpu")
        return self._handles[file]

    def _names_in(self, file):
        return list(self._open(file).keys())

    def file_of(self, name):
        return self._files.get(name)

    def shape_of(self, name):
        if self._state_dict is not None:
            return tuple(self._state_dict[name].shape)
        return tuple(self._open(self._files[name]).get_slice(name).get_shape())

    def read(self, name):
        if self._state_dict is not None:
            return self._state_dict[name]
        return self._open(self._files[name]).get_tensor(name)


def load_pretrained(tensors, path, key_map=None, strict=True):
    """Copies into `tensors` ({name: this rank's parameter or buffer}) the tensors of the same names at `path`, or
    of the names `key_map(name)` gives (None: not in the file). Every name and shape is checked before anything is
    copied: a missing tensor (unless strict is False, which leaves it as initialized) or a wrong shape is a
    CheckpointError naming the tensor and the file. A tensor-parallel shard takes its part of the whole. Returns how
    many tensors were read."""
    source = _Source(path)
    stored_as = {}
    for name, tensor in tensors.items():
        stored = key_map(name) if key_map is not None else name
        file = source.file_of(stored) if stored is not None else None
        if file is None:
            if strict:
                mapped = f" (key_map's name for '{name}')" if stored != name and stored is not None else ""
                raise CheckpointError(f"{source.description}: no tensor '{stored if stored is not None else name}'"
                                      f"{mapped} (this rank's stages need it; strict=False leaves the tensors the "
                                      "file lacks as initialized)")
            continue
        shape = source.shape_of(stored)
        if shape != tuple(tensor.shape) and shape != whole_shape(tensor):
            raise CheckpointError(f"{file}: tensor '{stored}' has shape {list(shape)}, the model's "
                                  f"{'' if stored == name else repr(name) + ' '}has {list(whole_shape(tensor))}")
        stored_as[name] = stored
    unread_frozen = [name for name, tensor in tensors.items()
                     if name not in stored_as and isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad]
    if stored_as and unread_frozen:
        # Adapters are expected to be missing; a frozen base weight left at its initialization trains nothing and
        # is most often a key_map that misses a wrapper's name.
        example = unread_frozen[0]
        looked_up = key_map(example) if key_map is not None else example
        warnings.warn(f"{source.description}: {len(unread_frozen)} frozen parameter(s) of this rank are not there and "
                      f"stay as initialized ('{example}' looked up as {looked_up!r}): a key_map that misses them?",
                      stacklevel=3)
    if tensors and not stored_as:
        # Most often a key_map that matches no name; but a stage may hold only new tensors (a fresh head), and a
        # refusal on this rank alone would leave the others waiting in their first step: said, not refused.
        first = next(iter(tensors))
        looked_up = key_map(first) if key_map is not None else first
        warnings.warn(f"{source.description}: none of this rank's {len(tensors)} tensors is there ('{first}' looked "
                      f"up as {looked_up!r}): they stay as initialized", stacklevel=3)
    with torch.no_grad():
        for name, stored in stored_as.items():
            tensors[name].copy_(local_part(tensors[name], source.read(stored)))
    return len(stored_as)
