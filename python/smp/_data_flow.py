"""Which values of an exported graph depend on parameters or draw random numbers (computed once, sent where
read) and which are recomputed wherever read; in-place writes turned into data flow on the way (data_flow)."""

import collections

import torch

from ._captured_node import _is_op, _mutates_first_argument, written_through
from ._smp import ModelError
from ._value_sketch import sketch_of

_aten = torch.ops.aten

# Operations that read only their tensor inputs' shape, dtype and device: what they make depends on no parameter
# even when those inputs do (a mask made with x.new_zeros, filled in place, recomputed where read).
READS_METADATA_ONLY = {getattr(_aten, name).default for name in
                       ("new_zeros", "new_ones", "new_empty", "zeros_like", "ones_like", "empty_like")} | \
                      {_aten.new_full.default, _aten.full_like.default, _aten.sym_size.int, _aten.sym_numel.default,
                       _aten.sym_stride.int}


def _copied(into, source, non_blocking=False):
    """copy_ out of place, with a derivative (aten.copy has none): the source as the written tensor would hold it."""
    return source.to(dtype=into.dtype, device=into.device, non_blocking=non_blocking).expand_as(into)


# In-place operations whose out-of-place form is not their name without the underscore.
_OUT_OF_PLACE = {_aten.bernoulli_.float: _aten.bernoulli.p, _aten.copy_.default: _copied}


def _spell_out_defaults(node):
    """Gives the positional arguments an operation's call left to their defaults."""
    arguments = list(node.args)
    for argument in node.target._schema.arguments[len(arguments):]:
        if argument.kwarg_only or argument.name in node.kwargs or not argument.has_default_value():
            break
        arguments.append(argument.default_value)
    node.args = tuple(arguments)


def _permute_back(view, value):
    dims = list(view.args[1])
    inverse = [0] * len(dims)
    for position, dim in enumerate(dims):
        inverse[dim % len(dims)] = position
    return _aten.permute.default, (value, inverse)


# A view's base with `value` written through the view, out of place: view operation -> (scatter, its arguments).
_SCATTER_BACK = {
    _aten.slice.Tensor: lambda view, value: (_aten.slice_scatter.default, (view.args[0], value, *view.args[1:])),
    _aten.select.int: lambda view, value: (_aten.select_scatter.default, (view.args[0], value, *view.args[1:])),
    _aten.diagonal.default: lambda view, value: (_aten.diagonal_scatter.default, (view.args[0], value,
                                                                                  *view.args[1:])),
    _aten.as_strided.default: lambda view, value: (_aten.as_strided_scatter.default, (view.args[0], value,
                                                                                      *view.args[1:])),
    _aten.transpose.int: lambda view, value: (_aten.transpose.int, (value, *view.args[1:])),
    _aten.t.default: lambda view, value: (_aten.t.default, (value,)),
    _aten.permute.default: _permute_back,
}
for _reshaping in ("view.default", "_unsafe_view.default", "reshape.default", "unsqueeze.default", "squeeze.dim",
                   "squeeze.dims", "squeeze.default", "alias.default", "flatten.using_ints", "unflatten.int"):
    _packet, _overload = _reshaping.split(".")
    _SCATTER_BACK[getattr(getattr(_aten, _packet), _overload)] = \
        lambda view, value: (_aten.reshape_as.default, (value, view.args[0]))


def _is_view(node):
    schema = getattr(node.target, "_schema", None) if _is_op(node) else None
    if schema is None or not schema.returns or not schema.arguments:
        return False
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return returned is not None and not returned.is_write and first is not None and not first.is_write


def _functional_variant(op):
    """aten.add_.Tensor -> aten.add.Tensor, or None."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.endswith("_"):
        return None
    packet = getattr(_aten, schema.name.split("::")[1][:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)


def is_random(node):
    """Draws random numbers as captured: a seeded operation, unless its probability is 0 (dropout(p=0), an LSTM
    without dropout between layers)."""
    if not _is_op(node) or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema else ()):
        if argument.name in ("p", "dropout", "dropout_p"):
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, (int, float)) and value == 0:
                return False
    return True


def data_flow(graph, order, attributes, name):
    """Which values depend on a parameter or draw random numbers (`dynamic`: computed once, sent where read; the rest
    is recomputed wherever it is read), with in-place writes turned into data flow on the way, in graph order, so
    that a reader of a write's result is judged by what the write made.

    A write that makes a dynamic value runs out of place, and whatever reads the written tensor afterwards reads
    the write's result: plain PyTorch sees the change through the shared tensor, pipeline stages only through edges
    (a reader on another stage, or a value sent before the write). A write through views writes the tensors they
    view: each is scattered anew (slice_scatter, ...), and its later readers read that; another view of the same
    memory read afterwards is refused, naming it. That covers writes into values computed from
    parameters and writes of such values into fresh tensors of none (mixture-of-experts routing scattering token
    positions into an empty_like, a group mask filled by scatter_, stochastic depth's new_empty(...).bernoulli_(p)).
    A write of no parameter into a value of none (a mask, shifted labels: recomputed where read) stays in place, and
    whatever reads that memory afterwards, through the value or a view sharing it, runs after the write in the same
    node (returned: node -> writes it must follow). Writes into buffers (batch norm's statistics) stay: they update
    the model's own. Returns (dynamic, extra_inputs)."""
    storage = {node: sketch.storage for node in graph.nodes if (sketch := sketch_of(node)) is not None}
    dynamic = set()
    extra_inputs = collections.defaultdict(list)
    for node in list(graph.nodes):
        if node.op == "placeholder" and isinstance(attributes.get(node, (None, None))[1], torch.nn.Parameter):
            dynamic.add(node)
        if not _is_op(node):
            continue
        if is_random(node) or (node.target not in READS_METADATA_ONLY and
                                any(a in dynamic for a in node.all_input_nodes)):
            dynamic.add(node)
        if not _mutates_first_argument(node):
            continue
        written = node.args[0]
        if written_through(written) in attributes:
            # A buffer's update stays in place, computed once where it is (were it recomputed where read, the
            # buffer would be written once per reader; out of place, not at all).
            dynamic.add(node)
            continue
        shared = storage.get(written)
        aliases = [other for other in graph.nodes if shared is not None and other is not written and other is not node
                   and order[other] < order[node] and storage.get(other) is not None and storage[other] == shared]
        late_alias_reads = [(alias, reader) for alias in aliases for reader in alias.users
                            if order.get(reader, -1) > order[node] and reader is not node]
        late_alias_readers = [reader for _, reader in late_alias_reads]
        later_readers = [reader for reader in list(written.users) if reader is not node and
                         order.get(reader, -1) > order[node]]
        if node not in dynamic:
            for reader in later_readers:
                reader.replace_input_with(written, node)
            for reader in late_alias_readers:
                extra_inputs[reader].append(node)
            continue
        # A write through views of a tensor (key[..., :d].copy_(k) into a new_empty) writes that tensor: out of
        # place, the views' bases are scattered into anew, and what reads them afterwards reads the new ones.
        chain = [written]
        while _is_view(chain[0]) and chain[0].args[0] not in attributes and chain[0].target in _SCATTER_BACK:
            chain.insert(0, chain[0].args[0])
        stale = [(alias, reader) for alias, reader in late_alias_reads if alias not in chain]
        if stale:
            alias, reader = stale[0]
            raise ModelError(f"{name}'s forward writes in place into {written.name} ({node.format_node()}), which "
                             f"shares memory with {alias.name}, read afterwards by {reader.name}; "
                             "write it out of place so that it can be cut into stages")
        functional = _OUT_OF_PLACE.get(node.target) or _functional_variant(node.target)
        if functional is None:
            raise ModelError(f"{name}'s forward writes in place ({node.format_node()}) with an operation that has no "
                             "out-of-place form; write it out of place so that it can be cut into stages")
        _spell_out_defaults(node)  # the out-of-place form may lack them (bernoulli_'s p=0.5, bernoulli.p's required)
        node.target = functional
        later = {view: [r for r in view.users if r is not node and order.get(r, -1) > order[node]] for view in chain}
        new_value, after = node, node
        for view in reversed(chain):
            for reader in later[view]:
                reader.replace_input_with(view, new_value)
            if view is chain[0]:
                break
            scatter, arguments = _SCATTER_BACK[view.target](view, new_value)
            with graph.inserting_after(after):
                base = graph.call_function(scatter, arguments)
            base.meta = dict(node.meta, sketch=sketch_of(view.args[0]))
            order[base] = order[after] + 1e-3
            dynamic.add(base)
            new_value, after = base, base
    return dynamic, extra_inputs
