"""Whether a captured model's forward takes another path in eval mode than the one captured in training mode.

The capture runs the forward once, in training mode, and evaluation re-targets that graph (dropout and batch norm
follow the mode, buffer updates stop): right for PyTorch's own modules, whose mode is an argument of an operation.
Python code that branches on `self.training` (a noise term added in training only, an auxiliary head returned in
training only, a router's jitter) left only its training branch in the graph, so evaluation would silently compute
the training path. The model is exported again in eval mode and the two graphs compared as evaluation would run
them. A module whose eval-mode forward returns its input (torchvision's stochastic depth) is left out in evaluation,
its operations tagged for the captured code (smp._captured_node.IN_EVALUATION); any other difference makes
evaluation refuse, naming the module.
"""

import collections


import torch
import torch.fx as fx

from ._captured_node import (_ASSERTS, IN_EVALUATION, IN_EVALUATION_ROUTE, _in_evaluation, _is_op,
                             _mutates_first_argument, _owner_path, evaluation_input, module_paths, written_through)
from ._value_sketch import sketch_of
from ._smp import ModelError

_aten = torch.ops.aten
# Operations that give their input's values as they are: export records them in one mode and not the other where
# a tensor's memory layout differs (scaled dot-product attention's output with and without dropout).
_SAME_VALUES = {_aten.contiguous.default, _aten.alias.default}


def _bound(op, args, kwargs):
    """Every schema argument's value, defaults filled in: export leaves out trailing defaults (dropout_p=0.0)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return tuple(args) + tuple(sorted(kwargs.items()))
    values = []
    for index, argument in enumerate(schema.arguments):
        if index < len(args):
            values.append(args[index])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            values.append(None)
    return tuple(values)


def _comparable(value, names):
    if isinstance(value, fx.Node):
        return names.get(value, ("unknown", value.name))
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(item, names) for item in value)
    if isinstance(value, dict):
        return tuple((key, _comparable(item, names)) for key, item in sorted(value.items()))
    if isinstance(value, torch.SymInt):
        return ("symbol", str(value))
    if isinstance(value, fx.GraphModule):
        return ("graph", tuple(step for step, _ in path_as_evaluated(value.graph, False)))
    return repr(value)


def path_as_evaluated(graph, in_training, user_inputs=frozenset()):
    """[(comparable operation, module path)] that evaluation runs: a graph exported in training mode
    (`in_training`) as evaluation re-targets it, or one exported in eval mode as it is. Buffer updates, checks and
    layout-only copies are left out; a write into an input (`user_inputs`: their placeholders' names) is not, as a
    view taken of it before reads what it wrote."""
    names = {}
    steps = []
    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = ("input", node.name)  # by name: the two exports may order them otherwise
        elif node.op == "get_attr":
            target = node.graph.owning_module
            value = getattr(target, node.target, None) if target is not None else None
            names[node] = _comparable(value, names) if isinstance(value, fx.GraphModule) else ("attr", node.target)
        elif _is_op(node):
            if node.target in _ASSERTS and not node.users:
                continue
            written = written_through(node.args[0])
            if _mutates_first_argument(node) and not node.users and getattr(written, "op", None) == "placeholder" \
                    and written.name not in user_inputs:
                continue  # a buffer's update (training only), left out of both
            if in_training and IN_EVALUATION in node.meta:
                if node.meta[IN_EVALUATION] == "output":
                    names[node] = names[evaluation_input(node)]
                continue
            if node.target in _SAME_VALUES:
                names[node] = _comparable(node.args[0], names)
                continue
            args, kwargs = _in_evaluation(node.target, node.args, node.kwargs) if in_training else \
                (node.args, node.kwargs)
            names[node] = ("value", len(steps))
            steps.append(((str(node.target), _comparable(_bound(node.target, args, kwargs), names)),
                          _owner_path(node)))
        elif node.op == "output":
            steps.append((("output", _comparable(node.args, names)), ""))
    return steps


def evaluation_difference(training_graph, evaluation_graph, user_inputs=frozenset()):
    """None when evaluating the training-mode capture computes what the eval-mode export does, once the modules that
    return their input in eval mode are tagged to do so in `training_graph`; else (module path, what differs) at the
    first operation where they part, and nothing tagged."""
    differs = difference(training_graph, evaluation_graph, user_inputs)
    if differs is None:
        return None
    tagged = []
    for members, output, route in _identity_modules(training_graph, evaluation_graph):
        for node in members:
            node.meta[IN_EVALUATION] = "output" if node is output else "left out"
        output.meta[IN_EVALUATION_ROUTE] = route
        tagged.extend(members)
    if tagged and difference(training_graph, evaluation_graph, user_inputs) is None:
        return None
    for node in tagged:
        node.meta.pop(IN_EVALUATION, None)
        node.meta.pop(IN_EVALUATION_ROUTE, None)
    return differs


def _identity_modules(training_graph, evaluation_graph):
    """(operations, output, route) of each outermost module call that runs operations in training and none in eval mode,
    reads one tensor from outside and gives one: a candidate for returning that input in eval mode (the comparison
    after tagging decides)."""
    in_eval = {path for node in evaluation_graph.nodes if _is_op(node) for path in module_paths(node)}
    regions = collections.defaultdict(list)
    for node in training_graph.nodes:
        if _is_op(node):
            # By the call's key ("...stochastic_depth@1"): a module called twice is two candidates.
            calls = [key for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items()
                     if path and path not in in_eval]
            if calls:
                regions[calls[0]].append(node)
    for members in regions.values():
        inside = set(members)
        outputs = [node for node in members if any(user not in inside for user in node.users)]
        read = {value for node in members for value in node.all_input_nodes
                if value not in inside and sketch_of(value) is not None}
        if len(outputs) == 1 and len(read) == 1:
            route = _route(outputs[0], read.pop(), inside)
            if route is not None:
                yield members, outputs[0], route


def _route(node, target, inside):
    """Argument positions leading from `node` to `target` through operations in `inside`, or None."""
    for index, argument in enumerate(node.args):
        if argument is target:
            return [index]
        if isinstance(argument, fx.Node) and argument in inside:
            rest = _route(argument, target, inside)
            if rest is not None:
                return [index] + rest
    return None


def difference(training_graph, evaluation_graph, user_inputs=frozenset()):
    """None when evaluating the training-mode capture computes what the eval-mode export does; else (module path,
    what differs) at the first operation where they part."""
    trained = path_as_evaluated(training_graph, True, user_inputs)
    evaluated = path_as_evaluated(evaluation_graph, False, user_inputs)
    for index, ((step, owner), (other, other_owner)) in enumerate(zip(trained, evaluated)):
        if step != other:
            return _common_path(owner, other_owner), \
                f"operation {index}: {_described(step)} in training, {_described(other)} in eval mode"
    if len(trained) != len(evaluated):
        longer, mode = (trained, "training") if len(trained) > len(evaluated) else (evaluated, "eval mode")
        step, owner = longer[min(len(trained), len(evaluated))]
        return owner, f"only {mode} runs {_described(step)}"
    return None


def _common_path(first, second):
    """The innermost module both operations ran in: where the paths part, the branch is in a forward around both."""
    common = []
    for a, b in zip(first.split(".") if first else [], second.split(".") if second else []):
        if a != b:
            break
        common.append(a)
    return ".".join(common)


def _described(step):
    target = step[0]
    return "the output" if target == "output" else target.replace("aten.", "").split(".")[0]


def check_mode(model, differs, call):
    """Raises ModelError where `call` ("evaluate", "train_step") would run the captured training path in place of
    the model's eval path: evaluation always; train_step where any module is in eval mode (every rank decides alike,
    before anything is sent)."""
    if differs is None or not isinstance(model, torch.nn.Module):
        return
    path, what = differs
    name = type(model).__name__
    where = f"{name}.{path}" if path else name
    if call == "train_step":
        # Only the first difference is known: any module in eval mode may be one that branches.
        frozen = [path or name for path, module in model.named_modules() if not module.training]
        if not frozen:
            return
        raise ModelError(f"train_step with modules in eval mode ({', '.join(frozen[:3])}"
                         f"{', ...' if len(frozen) > 3 else ''}), and {where}'s forward takes another path in eval mode "
                         f"than in training mode ({what}): smp captured the training path alone; call model.train() "
                         "first")
    raise ModelError(f"{call}: {where}'s forward takes another path in eval mode than in training mode ({what}), "
                     f"and smp captured the training path, which {call} would compute in place of the eval one. "
                     "Make that forward the same in both modes where it branches on self.training (dropout and batch "
                     "norm are fine: they follow the mode), or evaluate the model outside smp")
