"""What each microbatch given to a captured model may be, checked on every rank before a step sends anything: the
shapes the capture allows (InputShapes) and the embedding rows the inputs alone decide (TableLookups)."""

import inspect
import re

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ._captured_node import _attribute, _is_op
from ._smp import ConfigError
from ._value_sketch import sketch_of

_aten = torch.ops.aten


class TableLookups:
    """The rows the model will read from its embedding tables where they follow from the inputs alone (token ids,
    position ids made from a sequence length), checked on every rank before a step sends anything: an input longer
    than a position table, or an id beyond the vocabulary, is a ConfigError naming the table, not an IndexError on
    one stage while the others wait."""

    def __init__(self, code, sources, tables):
        self._code, self._sources, self._tables = code, sources, tables

    @classmethod
    def of(cls, graph, dynamic, attributes, input_names, order):
        lookups = []
        for node in graph.nodes:
            if _is_op(node) and node.target == _aten.embedding.default and node.args[0] in attributes \
                    and isinstance(attributes[node.args[0]][1], torch.nn.Parameter) and node.args[1] not in dynamic:
                lookups.append(node)
        needed, sources = {}, []
        kept = []
        for lookup in lookups:
            stack, seen, ok = [lookup.args[1]], set(), True
            while stack and ok:
                value = stack.pop()
                if value in seen:
                    continue
                seen.add(value)
                if value in dynamic:
                    ok = False  # read through something computed from parameters: not known before the step
                elif value in input_names or value in attributes:
                    continue
                else:
                    stack.extend(value.all_input_nodes)
            if ok:
                kept.append(lookup)
                needed.update(dict.fromkeys(seen))
        if not kept:
            return None
        code = fx.Graph()
        env = {}
        for value in sorted(needed, key=lambda n: order[n]):
            if value in input_names or (value in attributes and attributes[value][0] is not None):
                env[value] = code.placeholder(f"source_{len(sources)}")
                sources.append(input_names.get(value) or ("attribute", attributes[value][0], attributes[value][1]))
            elif value in attributes:
                env[value] = attributes[value][1]  # a baked-in constant input
            else:
                env[value] = code.node_copy(value, lambda n: env[n])
        code.output(tuple(env[lookup.args[1]] for lookup in kept))
        tables = [(attributes[lookup.args[0]][0], attributes[lookup.args[0]][1].shape[0]) for lookup in kept]
        return cls(fx.GraphModule(torch.nn.Module(), code), sources, tables)

    def check(self, model, microbatch, what):
        """microbatch: engine input name -> one microbatch's tensor (every input of the model)."""
        values = []
        for source in self._sources:
            if isinstance(source, str):
                values.append(microbatch[source])
                continue
            _, path, captured = source
            value = captured  # the engine's own, the same on every rank
            if not isinstance(value, torch.Tensor) or value.is_meta:
                try:
                    value = _attribute(model, path)  # a model built on the meta device: made real on this rank
                except AttributeError:
                    pass
            if not isinstance(value, torch.Tensor) or value.is_meta:
                return  # not held on this rank: the rank holding it checks
            values.append(value.cpu())
        with torch.no_grad():
            rows_read = self._code(*values)
        for (path, rows), read in zip(self._tables, rows_read):
            if read.is_floating_point() or read.is_complex():
                # Found here, before any rank computes: inside the step it would fail one stage and end the job.
                shapes = ", ".join(f"'{name}' {t.dtype}" for name, t in microbatch.items())
                raise ConfigError(f"{what}: the model would read rows of '{path}' at {read.dtype} positions "
                                  f"(microbatch inputs {shapes}): pass integer ids, as the sample did")
            if read.numel() and (int(read.max()) >= rows or int(read.min()) < 0):
                bad = int(read.max()) if int(read.max()) >= rows else int(read.min())
                shapes = ", ".join(f"'{name}' {tuple(t.shape)}" for name, t in microbatch.items())
                why = ("an input holds a negative id, or a position the model computes from it is negative" if bad < 0
                       else "the inputs are longer, or hold larger ids, than the model takes")
                raise ConfigError(f"{what}: the model would read row {bad} of '{path}', which has {rows} rows "
                                  f"(microbatch inputs {shapes}): {why}")


def _finite(bound):
    """A range's bound as an int, None where it is unbounded (sympy's and torch's infinities)."""
    try:
        return int(bound) if bound.is_finite is not False and str(bound).lstrip("-") not in ("oo", "int_oo") else None
    except (TypeError, ValueError, AttributeError):
        return None


_ZERO_ONE_ASSUMPTION = re.compile(r"!=\s*\(?[01]\)?\s*$|^\s*\(?[01]\)?\s*!=")


def shape_guards(guards_code, model, args, kwargs, leaf_inputs, leaves):
    """Export's guards beyond the ranges (x.size()[0] != 3 where the code branched on that size, or two dimensions
    tied), over smp's engine inputs: [(compiled expression of `inputs`, its text by input names)]. They read
    L['name'] (the forward's argument paths); a guard over anything else (a baked-in value) is left out."""
    if not guards_code:
        return []
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        paths = pytree.tree_leaves_with_path(bound.arguments)
    except (TypeError, ValueError):
        return []
    engine_names = {id(leaf): name for leaf, name in zip(leaves, leaf_inputs) if name is not None}
    sources = {}
    for path, leaf in paths:
        name = engine_names.get(id(leaf))
        if name is not None:
            sources["L" + pytree.keystr(path)] = name
    # export's own tracer may name an input by its position among the flattened (args, kwargs), as smp's leaves
    for index, name in enumerate(leaf_inputs):
        if name is not None:
            sources[f"L['flat_args'][{index}]"] = name
    guards = []
    for code in guards_code:
        if _ZERO_ONE_ASSUMPTION.search(code):
            # Export's own assumption that a size is not 0 or 1 (it specializes those), not a branch of the model:
            # `(x.size()[1] // 4) != 1` holds in the sample, yet the captured code serves a 1 there too.
            continue
        readable = actual = code
        for source in sorted(sources, key=len, reverse=True):
            actual = actual.replace(source, f"inputs[{sources[source]!r}]")
            readable = readable.replace(source, sources[source])
        if "L[" in actual:
            continue
        try:
            guards.append((compile(actual, "<export guard>", "eval"), " ".join(readable.split())))
        except SyntaxError:
            continue
    return guards


class InputShapes:
    """What shapes the captured code takes, per engine input: each dimension either fixed (the sample's size) or a
    symbol of the export with the range it allows; inputs that share a symbol must agree on it; and export's other
    guards on them (shape_guards)."""

    def __init__(self, dimensions, fixed_because, held=None, guards=()):
        self.dimensions = dimensions  # input name -> [int, or (symbol, low, high)]
        self.fixed_because = fixed_because  # why export could not let any shape change, or None
        self.held = held or {}  # input name -> the dimensions smp kept at the sample's size (dynamic_shapes)
        self.guards = list(guards)
        self.lookups = None  # TableLookups, set once the graph is planned

    @classmethod
    def of(cls, exported, inputs, fixed_because, held=None, guards=()):
        ranges = {str(symbol): bounds for symbol, bounds in exported.range_constraints.items()}
        dimensions = {}
        for node in inputs:
            sketch = sketch_of(node)
            sizes = []
            for size in (sketch.shape if sketch is not None else ()):
                if isinstance(size, int):
                    sizes.append(size)
                    continue
                symbol = size
                bounds = ranges.get(symbol)
                low = _finite(bounds.lower) if bounds is not None else None
                high = _finite(bounds.upper) if bounds is not None else None
                low = 0 if low is None else low
                # A least of 2 is export's own assumption that sizes 0 and 1 are not the sample's (it specializes
                # them), which torch's exported programs do not enforce when run: they take a 1 there, and so does
                # smp (the short last microbatch of an epoch). A branch of the model's own on a size of 1 was
                # traced the other way, as torch.export's own programs run it.
                low = 1 if low == 2 else low
                sizes.append((symbol, low, high))
            dimensions[node.name] = sizes
        return cls(dimensions, fixed_because, held, guards)

    def first_dimension_range(self, names):
        """(least, most) the inputs `names` allow in their first dimension together (most 0: unbounded): a range
        where it may change, the sample's size where the capture fixed it."""
        least, highs = 1, []
        for name in names:
            sizes = self.dimensions.get(name)
            if not sizes:
                continue
            if isinstance(sizes[0], int):
                least, highs = max(least, sizes[0]), highs + [sizes[0]]
                continue
            _, low, high = sizes[0]
            least = max(least, low)
            highs += [high] if high is not None else []
        return least, min(highs, default=0)

    def check_guards(self, microbatch, what):
        """microbatch: engine input name -> one microbatch's tensor. A guard that fails means the model's code would
        take another path for these shapes than the one captured (which the sample took)."""
        if not self.guards:
            return
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
        namespace = {**SYMPY_INTERP, "torch": torch, "inputs": microbatch}
        for code, readable in self.guards:
            try:
                holds = bool(eval(code, namespace))  # noqa: S307 - export's own guard text, over shapes
            except Exception:  # noqa: BLE001 - a guard this check cannot read is left to the model
                continue
            if not holds:
                shapes = ", ".join(f"'{name}' {tuple(t.shape)}" for name, t in microbatch.items())
                split = _sequence_split(readable)
                if split:
                    raise ConfigError(f"{what}: microbatch inputs {shapes}: sequence parallelism splits the sequence "
                                      f"over \"tensor_parallel_degree\" {split}, so every batch's sequence length "
                                      f"must divide by {split} (pad the batch to a multiple of it)")
                fixed = re.fullmatch(r"\s*(\w+)\.size\(\)\[(\d+)\]\s*==\s*(\d+)\s*", readable)
                if fixed and fixed.group(1) in microbatch and int(fixed.group(2)) < microbatch[fixed.group(1)].dim():
                    # One size the code allows (a convolution's input channels): said as the input's mistake.
                    name, dim, size = fixed.group(1), int(fixed.group(2)), int(fixed.group(3))
                    raise ConfigError(f"{what}: input '{name}' has {microbatch[name].shape[dim]} at dimension {dim}, "
                                      f"where the model's code takes {size} alone (its guard {readable}, as the "
                                      f"sample had it): microbatch inputs {shapes}")
                raise ConfigError(f"{what}: the captured model cannot take microbatch inputs {shapes}: export "
                                  f"captured it under a condition these shapes break (its guard {readable}), where "
                                  "the model's code takes another path than the sample's, or fails; give a sample of "
                                  "these shapes, or inputs the guard allows")

    def check(self, name, shape, what):
        """Raises ConfigError when a microbatch's input `name` of `shape` is one the captured code cannot take."""
        sizes = self.dimensions.get(name)
        if sizes is None:
            return
        if len(shape) != len(sizes):
            raise ConfigError(f"{what}: input '{name}' has {len(shape)} dimensions, the sample had {len(sizes)}")
        for dim, (size, allowed) in enumerate(zip(shape, sizes)):
            if isinstance(allowed, int):
                if size != allowed:
                    if dim in self.held.get(name, ()):
                        free = sorted({d for d, s in enumerate(sizes) if not isinstance(s, int)} | {0, dim})
                        why = ("smp.DistributedModel's dynamic_shapes held it at the sample's size (dynamic_shapes="
                               f"{{'{name}': {free}}}, the dimensions that may change, or \"all\" lets it)")
                    elif self.fixed_because:
                        why = f"the model could not be captured with changing shapes ({self.fixed_because})"
                    elif allowed == 1:
                        why = ("export keeps a size of 1 constant (it specializes sizes 0 and 1), so a sample with 1 "
                               "there fixes it: give a sample with at least 2 in that dimension")
                    else:
                        why = "the model's code fixes it (export kept it constant)"
                    raise ConfigError(f"{what}: input '{name}' gives microbatches of shape {tuple(shape)}, but its "
                                      f"dimension {dim} must be {allowed}, the sample's: {why}")
                continue
            symbol, low, high = allowed
            if size < low or (high is not None and size > high):
                bound = f"{low} to {high}" if high is not None else f"at least {low}"
                hint = ""
                if dim == 0 and size < low:
                    hint = (f" (give at least {low} samples a microbatch: fewer \"microbatches\", or a batch's "
                            "last short one dropped, as DataLoader's drop_last=True does)")
                raise ConfigError(f"{what}: input '{name}' gives microbatches of shape {tuple(shape)}; the captured "
                                  f"model takes {bound} in its dimension {dim}{hint}")

    def check_agreement(self, shapes, what):
        """Inputs sharing a symbol (input_ids and labels' sequence length) have the same size there."""
        seen = {}
        for name, shape in shapes.items():
            for dim, allowed in enumerate(self.dimensions.get(name, ())):
                if isinstance(allowed, int) or dim >= len(shape):
                    continue
                first = seen.setdefault(allowed[0], (name, dim, shape[dim]))
                if first[2] != shape[dim]:
                    raise ConfigError(f"{what}: input '{name}' has {shape[dim]} in its dimension {dim} where "
                                      f"'{first[0]}' has {first[2]} in its dimension {first[1]}; the model needs "
                                      "them equal")


def _sequence_split(guard):
    """The tensor-parallel degree when `guard` is sequence parallelism's (a length's remainder by it), else None."""
    import re
    from ._state import runtime
    try:
        config = runtime().config
        degree = runtime().tensor_parallel_degree
    except Exception:  # noqa: BLE001 - no runtime: not a job's guard
        return None
    if not config.sequence_parallel or degree < 2:
        return None
    return degree if re.search(rf"%\s*{degree}\b", guard) else None
