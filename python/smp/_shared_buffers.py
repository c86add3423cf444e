"""A buffer that the forward updates (batch norm's statistics, a counter) must live on one stage: a module called
on two stages would have each stage update a copy of its own, where PyTorch updates one, and the second call read
what the first wrote. Checked once the model is cut, the same on every rank."""

import collections

import torch

from ._captured_node import _is_op, written_through
from ._smp import ModelError


_RUNNING_STATISTICS = {"running_mean", "running_var"}


def _written_by(node):
    """The fx node an operation writes (its first argument, or an argument batch_norm writes its statistics into),
    followed through earlier in-place writes (mean.mul_(0.9).add_(x) writes mean)."""
    schema = getattr(node.target, "_schema", None) if _is_op(node) else None
    if schema is None:
        return []
    targets = []
    for argument, value in zip(schema.arguments, node.args):
        if not isinstance(value, torch.fx.Node):
            continue
        # batch_norm writes its running statistics without saying so in its schema.
        if argument.name in _RUNNING_STATISTICS or (argument.alias_info is not None and argument.alias_info.is_write):
            targets.append(written_through(value))
    return targets


def _captured_writes(node):
    """(buffer paths the node's graph writes, its inputs' indices it writes into, the buffer its output is after a
    write into it or None)."""
    placeholders = [n for n in node._graph.nodes if n.op == "placeholder"]
    buffers, inputs = set(), set()
    for op in node._graph.nodes:
        for target in _written_by(op):
            if target.op == "get_attr":
                buffers.add(target.target)
            elif target in placeholders:
                inputs.add(placeholders.index(target))
    output = next(n for n in node._graph.nodes if n.op == "output").args[0]
    output = output[0] if isinstance(output, (tuple, list)) and len(output) == 1 else output
    root = written_through(output) if isinstance(output, torch.fx.Node) and _is_op(output) else None
    return buffers, inputs, root.target if root is not None and root.op == "get_attr" and root.target in buffers \
        else None


def check_updated_buffers_on_one_stage(model, graph, stage_of_node):
    """Raises ModelError naming the buffer, its nodes and their stages when nodes on different stages hold a buffer
    that one of them updates. `graph`: smp's GraphModel of `model`; `stage_of_node`: by the graph's node order."""
    names = graph.node_names()
    stage = dict(zip(names, stage_of_node))
    holders = collections.defaultdict(set)  # buffer -> nodes holding it
    updated = set()
    if graph._captured:
        writes = {name: _captured_writes(node) for name, node in graph._captured.items()}
        for name, node in graph._captured.items():
            for path, _ in node.named_buffers():
                holders[path].add(name)
            buffers, inputs, _ = writes[name]
            updated |= buffers
            # A write into a buffer's value received from the node that wrote it (the module's second call on
            # another stage) writes that buffer too, on a copy.
            for index in inputs:
                source = node._sources[index] if index < len(node._sources) else None
                aliased = writes[source][2] if source in writes else None
                if aliased is not None:
                    holders[aliased].add(name)
                    updated.add(aliased)
    elif isinstance(model, torch.nn.Sequential):
        # Modules run as they are: a persistent buffer of a module used twice is taken as updated (batch norm's).
        for name, child in model._modules.items():
            persistent = set(child.state_dict(keep_vars=True))
            for path, _ in child.named_buffers():
                key = (id(child), path)
                holders[key].add(name)
                if path in persistent:
                    updated.add(key)
    for buffer, nodes in holders.items():
        stages = sorted({stage[node] for node in nodes if node in stage})
        if buffer in updated and len(stages) > 1:
            shown = buffer if isinstance(buffer, str) else buffer[1]
            pins = ", ".join(f'"{node}": {stages[0]}' for node in sorted(nodes, key=names.index))
            raise ModelError(f"buffer '{shown}' is updated by the forward and held by nodes on stages "
                             f"{', '.join(map(str, stages))} ({', '.join(sorted(nodes, key=names.index))}): each stage "
                             "would update a copy of its own, where PyTorch updates one; put its module's calls on "
                             f"one stage (\"partition_overrides\": {{{pins}}})")
