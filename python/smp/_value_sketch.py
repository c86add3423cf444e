"""What the capture knows of each value of an exported graph: whether it is a tensor, its shape (a size export left
free as its symbol's expression) and which values share memory. Export leaves a fake tensor on every node
(node.meta["val"]); the capture reads only this much of it, so it keeps a sketch in its place (node.meta["sketch"]),
made once right after the export. The capture cache then keeps and reads back sketches, plain data, where rebuilding
the fake tensors with their symbolic sizes took most of the time of reading an entry (Mixtral: 0.37 s, 629 tensors).
"""

import typing

import torch

# What else export leaves that holds fake tensors or their symbols; the capture reads none of it.
_FAKE_METADATA = ("val", "tensor_meta", "example_value", "eager_input_vals", "unbacked_bindings")


class ValueSketch(typing.NamedTuple):
    shape: tuple  # each size an int, or the expression (str) of a symbol export left free
    storage: typing.Optional[int]  # equal for values sharing memory; None where the memory cannot be told

    def dim(self):
        return len(self.shape)


def sketch_values(graph):
    """Puts a ValueSketch on every node whose value is a tensor (None on the others) and drops export's fake
    tensors."""
    from torch.multiprocessing.reductions import StorageWeakRef
    storages = {}

    def storage_of(value):
        try:
            reference = StorageWeakRef(value.untyped_storage())
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        return storages.setdefault(reference, len(storages))

    for node in graph.nodes:
        value = node.meta.get("val")
        sketch = None
        if isinstance(value, torch.Tensor):
            shape = tuple(size if isinstance(size, int) else str(size.node.expr) for size in value.shape)
            sketch = ValueSketch(shape, storage_of(value))
        for key in _FAKE_METADATA:
            node.meta.pop(key, None)
        node.meta["sketch"] = sketch


def sketch_of(node):
    """The node's ValueSketch: None where its value is not a tensor (a tuple, a list, a size, nothing)."""
    return node.meta.get("sketch")
