"""Tensor parallelism (Megatron-LM's) for Python models: each rank of a tensor-parallel group (the config's
"tensor_parallel_degree" consecutive ranks of one pipeline stage and replica) holds a shard of every planned layer
and computes its share; the collectives in the layers' forward and backward make the result the whole layer's.

A plan maps module paths (``*`` for one path component) to styles, as Hugging Face's ``tp_plan`` and torch's
``parallelize_module`` do::

    plan = {"layers.*.attn.qkv": smp.tp.Colwise(blocks=3),   # a fused query/key/value: each block split
            "layers.*.attn.out": "rowwise",
            "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}
    model = smp.DistributedModel(net, sample, tp_plan=plan)

Without a plan, smp takes the model's own: a Hugging Face model's ``base_model_tp_plan`` (Llama, Mistral, Qwen2 and
most decoders since transformers 4.50), or smp's for GPT-2 and BERT (``builtin_plan``). Each shard is cut from the
whole layer the model was built with, so every degree trains the weights one process would.

The layers also serve models written for tensor parallelism: ``ColumnParallelLinear(nn.Linear(...))`` etc. in an
``nn.Sequential`` or a ``GraphModel``, and ``vocab_parallel_cross_entropy`` as the loss of sharded logits.
"""

import contextlib
import re

import torch
import torch.nn.functional as F

from . import _smp
from ._materialize import made_whole
from ._smp import ConfigError
from ._state import runtime_or_none

__all__ = ["Colwise", "Rowwise", "VocabParallel", "Replicated", "Divide", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "apply_plan", "builtin_plan", "shard_of", "copy_to_shards", "reduce_from_shards",
           "gather_last_dim", "scatter_last_dim", "scatter_sequence", "gather_sequence", "reduce_scatter_sequence",
           "sequence_parallel_plan", "SequenceParallel", "vocab_parallel_cross_entropy", "degree", "rank",
           "whole_shape",
           "local_part", "collective_bytes"]


# The degree the planner shards, captures and profiles a copy of the model at (as rank 0 of it), while it does.
_profiled_degree = None


def degree():
    """The config's tensor_parallel_degree (1 before smp.init)."""
    if _profiled_degree is not None:
        return _profiled_degree
    initialized = runtime_or_none()
    return 1 if initialized is None else initialized.tensor_parallel_degree


def rank():
    """This rank's place in its tensor-parallel group."""
    if _profiled_degree is not None:
        return 0
    initialized = runtime_or_none()
    return 0 if initialized is None else initialized.tp_rank


@contextlib.contextmanager
def _profiled_at(shards):
    """Sharding, capture and profile as rank 0 of `shards` ranks would do them, in this process alone: degree() and
    rank() say so, and the collectives' group is a stand-in of that size that moves nothing (they run only under the
    profile's WithoutCollectives, which counts them for the planner)."""
    global _profiled_degree
    before = _profiled_degree
    _profiled_degree = shards
    try:
        with _smp.ProfiledDegree(shards):
            yield
    finally:
        _profiled_degree = before


# The collectives, each paired with the one its gradient takes, are the engine's operators (torch.ops.smp.tp_*,
# engine/src/parallel/tp_collectives.cpp): C++ layers and these call the same, and a torch.export capture keeps them
# as nodes. They skip communication while rank 0 profiles a node alone, count bytes and show in timelines.

def scatter_sequence(x):
    """This rank's slice of the sequence: slice forward, all-gather backward (where sequence parallelism begins)."""
    return _smp.tp_scatter_sequence(x)


def gather_sequence(x, for_whole=False):
    """The slices put together: all-gather forward, reduce-scatter backward (before column layers, whose gradients
    are partial). for_whole: before computation whole on every rank (where sequence parallelism ends), whose
    gradient each rank has whole: this rank's slice of it backward."""
    return _smp.tp_gather_sequence(x, for_whole)


def reduce_scatter_sequence(x):
    """Partial sums added up and split along the sequence: reduce-scatter forward, all-gather backward (after a row
    layer)."""
    return _smp.tp_reduce_scatter_sequence(x)


def _sees_sequence_slice(parameter):
    """Tags a parameter whose gradient each rank of the group computes part of (it sees this rank's slice of the
    sequence, or of the heads): the engine sums its gradients over the group once per step."""
    parameter._smp_sequence_parallel = True
    return parameter


COPY_TO_SHARDS = torch.ops.smp.tp_copy_to_shards.default  # what a capture merges per input (one all-reduce back)


def collective_bytes():
    """Bytes this process's tensor-parallel collectives moved since it started: {"all_reduced", "all_gathered"}
    (the payload of each all-reduce, the whole tensor of each all-gather), to compare with the theory."""
    from ._smp import collective_bytes as moved
    bytes_moved = moved()
    return {"all_reduced": bytes_moved["all_reduced"], "all_gathered": bytes_moved["all_gathered"]}


def copy_to_shards(x):
    """The input whole on every rank, about to meet sharded weights: identity forward, gradients summed backward."""
    return _smp.tp_copy_to_shards(x)


def reduce_from_shards(x):
    """Partial sums of every rank added up: all-reduce forward, identity backward."""
    return _smp.tp_reduce_from_shards(x)


def gather_last_dim(x):
    """The shards of the last dimension put together: all-gather forward, this rank's slice backward."""
    return _smp.tp_gather_last_dim(x)


def scatter_last_dim(x):
    """This rank's slice of the last dimension: slice forward, all-gather backward."""
    return _smp.tp_scatter_last_dim(x)


def shard_of(whole, dim, blocks=1, of=None):
    """This rank's shard of a whole tensor along `dim`: with `blocks` > 1 the dimension holds that many blocks one
    after the other (a fused query/key/value's output features: 3), and the shard is this rank's part of each, in
    block order. A new tensor (never a view of `whole`). of=(tp rank, degree): that rank's shard instead (offline,
    without a job)."""
    shard_rank, shards = of if of is not None else (rank(), degree())
    return _smp.tp_shard_of(whole, dim, blocks, shard_rank, shards)


def whole_shape(tensor):
    """The shape of the whole tensor `tensor` is this rank's shard of (its own shape when it is whole): a
    tensor-parallel shard, or an expert-parallel one (this rank's experts of a stacked experts tensor)."""
    experts = getattr(tensor, "_smp_expert_shard", None)
    if experts is not None:
        return (tensor.shape[0] * experts[1], *tensor.shape[1:])
    tag = getattr(tensor, "_smp_shard", None)
    if tag is None:
        return tuple(tensor.shape)
    shape = list(tensor.shape)
    shape[tag[0]] *= degree()
    return tuple(shape)


def local_part(tensor, source):
    """What `tensor` (this rank's, a shard or whole) holds of `source`, a whole model's tensor of the same name."""
    experts = getattr(tensor, "_smp_expert_shard", None)
    if experts is not None and tuple(source.shape) != tuple(tensor.shape):
        rank, degree = experts
        return source.chunk(degree)[rank]
    tag = getattr(tensor, "_smp_shard", None)
    return source if tag is None or tuple(source.shape) == tuple(tensor.shape) else shard_of(source, *tag)


def _shard_parameter(whole, dim, blocks):
    """A Parameter holding this rank's shard, tagged with where it sits in the whole (the engine reads the tag:
    gradient norms, checks)."""
    shard = torch.nn.Parameter(shard_of(whole.detach(), dim, blocks), requires_grad=whole.requires_grad)
    shard._smp_shard = (dim, blocks)
    return shard


def _is_conv1d(module):
    """Hugging Face's Conv1D (GPT-2): a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _linear_shapes(module, path):
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, False
    if _is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1], True
    raise ConfigError(f"tensor-parallel plan: '{path}' is a {type(module).__name__}; a column or row style takes an "
                      "nn.Linear (or Hugging Face's Conv1D)")


class _FromWhole(torch.nn.Module):
    """A layer cut from a whole one; on the meta device it keeps the whole one, to be made real and initialized as
    the whole model's (same seed) and cut again (smp.materialize, a rank making its stages real)."""

    def __init__(self, whole):
        super().__init__()
        object.__setattr__(self, "_whole", whole if any(t.is_meta for t in whole.parameters()) else None)

    def _smp_materialize(self, device, initialize):
        whole = self._whole
        whole.to_empty(device=device)
        initialize(whole)
        with torch.no_grad():
            self._cut(whole)
        object.__setattr__(self, "_whole", None)


class ColumnParallelLinear(_FromWhole):
    """y = x A^T + b with A's rows (the output features) split: the input whole, the output's last dimension
    sharded, unless gather_output. `blocks`: the output features are that many blocks, each split (a fused
    query/key/value: 3; gate and up projections packed: 2)."""

    def __init__(self, whole, blocks=1, gather_output=False, path="ColumnParallelLinear", input_gathered=False):
        super().__init__(whole)
        # Sequence parallelism gathers the input before (gather_sequence, whose backward sums the gradients).
        self.input_gathered = input_gathered
        in_features, out_features, self.transposed = _linear_shapes(whole, path)
        if out_features % blocks or (out_features // blocks) % degree():
            raise ConfigError(f"{path}: output features {out_features} in {blocks} block(s) do not divide by "
                              f"\"tensor_parallel_degree\" {degree()}" +
                              ("; a vocabulary's: pad it to a multiple of the degree (Hugging Face's "
                               f"model.resize_token_embeddings(n, pad_to_multiple_of={degree()})), or keep the "
                               "layer whole with tp_plan" if "head" in path.rpartition(".")[2] or
                               "embed" in path else ""))
        self.in_features, self.out_features = in_features, out_features // degree()
        self.blocks, self.gather_output = blocks, gather_output
        self._cut(whole)

    def _cut(self, whole):
        self.weight = _shard_parameter(whole.weight, 1 if self.transposed else 0, self.blocks)
        self.bias = _shard_parameter(whole.bias, 0, self.blocks) if whole.bias is not None else None

    def forward(self, x):
        return _smp.tp_column_parallel_linear(x, self.weight, self.bias, self.gather_output, self.input_gathered,
                                              self.transposed)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} of {self.out_features * degree()}"
                + (f", blocks={self.blocks}" if self.blocks > 1 else "") + (", gather_output" if self.gather_output
                                                                             else ""))


class RowParallelLinear(_FromWhole):
    """y = x A^T + b with A's columns (the input features) split: the input sharded along its last dimension (a
    column layer's output; whole with input_is_parallel=False, each rank then taking its slice), the output whole.
    The bias is whole on every rank."""

    def __init__(self, whole, input_is_parallel=True, path="RowParallelLinear", sequence_parallel=False):
        super().__init__(whole)
        self.sequence_parallel = sequence_parallel  # the output split along the sequence (reduce-scatter)
        in_features, out_features, self.transposed = _linear_shapes(whole, path)
        if in_features % degree():
            raise ConfigError(f"{path}: input features {in_features} do not divide by \"tensor_parallel_degree\" "
                              f"{degree()}")
        self.in_features, self.out_features = in_features // degree(), out_features
        self.input_is_parallel = input_is_parallel
        self._cut(whole)

    def _cut(self, whole):
        self.weight = _shard_parameter(whole.weight, 0 if self.transposed else 1, 1)
        # Whole on every rank: added once, after the sum.
        self.bias = torch.nn.Parameter(whole.bias.detach().clone(), whole.bias.requires_grad) \
            if whole.bias is not None else None
        if self.bias is not None and self.sequence_parallel:
            _sees_sequence_slice(self.bias)

    def forward(self, x):
        return _smp.tp_row_parallel_linear(x, self.weight, self.bias, self.input_is_parallel, self.sequence_parallel,
                                           self.transposed)

    def extra_repr(self):
        return f"in_features={self.in_features} of {self.in_features * degree()}, out_features={self.out_features}"


class VocabParallelEmbedding(_FromWhole):
    """An embedding whose rows (the vocabulary) are split: each rank looks up the ids in its range, and the rows
    are summed over the group."""

    def __init__(self, whole, path="VocabParallelEmbedding"):
        super().__init__(whole)
        if not isinstance(whole, torch.nn.Embedding):
            raise ConfigError(f"tensor-parallel plan: '{path}' is a {type(whole).__name__}; the vocabulary style "
                              "takes an nn.Embedding")
        if whole.num_embeddings % degree():
            raise ConfigError(f"{path}: vocabulary {whole.num_embeddings} does not divide by "
                              f"\"tensor_parallel_degree\" {degree()}")
        self.rows = whole.num_embeddings // degree()
        self.first = rank() * self.rows
        self.padding_idx = whole.padding_idx  # a whole-vocabulary id: no gradient for its row, on its rank
        self._cut(whole)

    def _cut(self, whole):
        self.weight = _shard_parameter(whole.weight, 0, 1)

    def forward(self, ids):
        return _smp.tp_vocab_parallel_embedding(ids, self.weight, self.first, self.padding_idx)

    def extra_repr(self):
        return f"rows {self.first}..{self.first + self.rows - 1} of {self.rows * degree()}"


def vocab_parallel_cross_entropy(logits, targets, ignore_index=-100):
    """The mean cross entropy of logits sharded along the vocabulary (a column-parallel output layer's, not
    gathered) against whole targets: the same on every rank, without gathering the logits. `logits` [...,
    vocabulary / tp], `targets` [...] of ids over the whole vocabulary; targets equal to ignore_index are left out
    of the mean, as F.cross_entropy leaves them. The engine's (smp::tp::vocab_parallel_cross_entropy), so that C++
    and Python compute one loss."""
    if degree() == 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
    return _smp.tp_vocab_parallel_cross_entropy(logits, targets, ignore_index)


# Styles: what a plan does to the module at a path.

class Colwise:
    def __init__(self, blocks=1, gather_output=False, input_gathered=False):
        self.blocks, self.gather_output, self.input_gathered = blocks, gather_output, input_gathered

    def apply(self, module, path):
        return ColumnParallelLinear(module, self.blocks, self.gather_output, path, self.input_gathered)

    def __repr__(self):
        return (f"Colwise(blocks={self.blocks}, gather_output={self.gather_output}, "
                f"input_gathered={self.input_gathered})")


class Rowwise:
    def __init__(self, input_is_parallel=True, sequence_parallel=False):
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel

    def apply(self, module, path):
        return RowParallelLinear(module, self.input_is_parallel, path, self.sequence_parallel)

    def __repr__(self):
        return f"Rowwise(input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel})"


def _replace_hidden_states(args, kwargs, change):
    """A module's first input (hidden_states, by position or keyword) changed."""
    if args:
        return (change(args[0]),) + tuple(args[1:]), kwargs
    return args, dict(kwargs, hidden_states=change(kwargs["hidden_states"]))


class ScatterSequenceIn:
    """The module's input split along the sequence: where sequence parallelism begins (the first block)."""

    def apply(self, module, path):
        module.register_forward_pre_hook(lambda m, args, kwargs: _replace_hidden_states(args, kwargs, scatter_sequence),
                                         with_kwargs=True)
        return module


class GatherSequenceIn:
    """The module's input gathered from the sequence's slices (an attention or MLP whose column layers follow)."""

    def apply(self, module, path):
        module.register_forward_pre_hook(lambda m, args, kwargs: _replace_hidden_states(args, kwargs, gather_sequence),
                                         with_kwargs=True)
        return module


class GatherSequenceOut:
    """The module's output gathered from the sequence's slices: where sequence parallelism ends (the final norm)."""

    def apply(self, module, path):
        module.register_forward_hook(lambda m, args, output: gather_sequence(output, for_whole=True))
        return module


class SummedGradients:
    """Whole on every rank, each rank computing part of its gradients: a norm over this rank's heads between a
    column and a row layer (Qwen3's q_norm and k_norm; transformers' "replicated_with_grad_allreduce"), or over its
    slice of the sequence. The gradients are summed over the group."""

    def apply(self, module, path):
        for parameter in module.parameters(recurse=False):
            _sees_sequence_slice(parameter)
        return module

    def __repr__(self):
        return f"{type(self).__name__}()"


class SequenceParallel(SummedGradients):
    """A module that runs on this rank's slice of the sequence with whole parameters (a norm)."""


class VocabParallel:
    def apply(self, module, path):
        return VocabParallelEmbedding(module, path)

    def __repr__(self):
        return "VocabParallel()"


class Replicated:
    """Whole on every rank (what a plan does not name is too): each rank computes the same gradients."""

    def apply(self, module, path):
        return module

    def __repr__(self):
        return "Replicated()"


class Divide:
    """Integer attributes of a module divided by the degree, for code that reads a width the sharding changed
    (GPT-2's attention splits its fused projection by `split_size`)."""

    def __init__(self, *attributes):
        self.attributes = attributes

    def apply(self, module, path):
        for name in self.attributes:
            value = getattr(module, name, None)
            if not isinstance(value, int) or value % degree():
                raise ConfigError(f"{path}.{name} ({value!r}) does not divide by \"tensor_parallel_degree\" "
                                  f"{degree()}")
            setattr(module, name, value // degree())
        return module

    def __repr__(self):
        return f"Divide{self.attributes!r}"


class ShardedExperts:
    """A stacked-experts module (transformers' experts classes: gate_up_proj [experts, 2 x intermediate, hidden],
    down_proj [experts, hidden, intermediate]) with every expert's intermediate features split over the group, as in
    a column layer (gate and up packed: each half split) followed by a row layer: each rank runs its part of every
    chosen expert on the whole hidden states, and the weighted sums are added up over the group (transformers'
    "moe_tp_experts"; its plan's entries for the two tensors name what this style does to them)."""

    LAYOUT = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}  # name -> (dimension split, blocks in it)

    def apply(self, module, path):
        parameters = dict(module.named_parameters(recurse=False))
        other = sorted(set(parameters) - set(self.LAYOUT)) or sorted(set(self.LAYOUT) - set(parameters))
        if other:
            raise ConfigError(f"tensor-parallel plan: '{path}' ({type(module).__name__}) holds "
                              f"{', '.join(sorted(parameters))}; smp splits stacked experts of gate_up_proj and "
                              "down_proj alone (no biases), or set \"expert_parallel_degree\" to divide them whole")
        gate_up, down = parameters["gate_up_proj"], parameters["down_proj"]
        intermediate = down.shape[-1]
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * intermediate or \
                gate_up.shape[2] != down.shape[1]:
            raise ConfigError(f"tensor-parallel plan: '{path}' stacks gate_up_proj {tuple(gate_up.shape)} and "
                              f"down_proj {tuple(down.shape)}, not [experts, 2 x intermediate, hidden] and "
                              "[experts, hidden, intermediate]")
        if intermediate % degree():
            raise ConfigError(f"{path}: the experts' intermediate features {intermediate} do not divide by "
                              f"\"tensor_parallel_degree\" {degree()}")
        whole_shapes = {name: tuple(parameter.shape) for name, parameter in parameters.items()}
        for name, (dim, blocks) in self.LAYOUT.items():
            module._parameters[name] = _shard_parameter(parameters[name], dim, blocks)
        if isinstance(getattr(module, "intermediate_dim", None), int):
            module.intermediate_dim = intermediate // degree()

        def materialize(device, initialize):
            made_whole(module, whole_shapes, device)
            initialize(module)
            with torch.no_grad():
                for name, (dim, blocks) in self.LAYOUT.items():
                    module._parameters[name] = _shard_parameter(module._parameters[name], dim, blocks)
        module._smp_materialize = materialize

        def inputs_to_shards(_, args, kwargs):
            # (hidden_states, top_k_index, top_k_weights): the states and the weights meet every rank's part.
            names = ("hidden_states", "top_k_index", "top_k_weights")
            values = dict(zip(names, args), **kwargs)
            for name in ("hidden_states", "top_k_weights"):
                values[name] = copy_to_shards(values[name])
            return tuple(values.pop(name) for name in names[:len(args)]), values

        module.register_forward_pre_hook(inputs_to_shards, with_kwargs=True)
        module.register_forward_hook(lambda _, args, output: reduce_from_shards(output))
        return module

    def __repr__(self):
        return "ShardedExperts()"


# Hugging Face's style names (transformers' tp_plan), and smp's.
STYLES = {
    "colwise": Colwise(), "rowwise": Rowwise(), "colwise_gather_output": Colwise(gather_output=True),
    "packed_colwise": Colwise(blocks=2), "rowwise_split_input": Rowwise(input_is_parallel=False),
    "replicated_with_grad_allreduce": SummedGradients(), "vocab": VocabParallel(), "moe_tp_experts": ShardedExperts(),
}

# smp's plans for Hugging Face families whose configs carry none, by model_type, relative to the base model.
_OWN_PLANS = {
    "gpt2": {"h.*.attn.c_attn": Colwise(blocks=3), "h.*.attn.c_proj": "rowwise", "h.*.attn": Divide("split_size"),
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
    "bert": {"encoder.layer.*.attention.self.query": "colwise", "encoder.layer.*.attention.self.key": "colwise",
             "encoder.layer.*.attention.self.value": "colwise", "encoder.layer.*.attention.output.dense": "rowwise",
             "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"},
}


def builtin_plan(model):
    """The plan smp takes for `model` without one: a Hugging Face model's own (its config's base_model_tp_plan and
    its head's, e.g. Llama's lm_head gathered), or smp's for GPT-2 and BERT; None when there is none."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or _OWN_PLANS.get(getattr(config, "model_type", None))
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    head_model = bool(prefix) and isinstance(getattr(model, prefix, None), torch.nn.Module)
    plan = {(f"{prefix}.{path}" if head_model else path): style for path, style in base.items()}
    if head_model:
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def _paths_matching(pattern, paths):
    """The module paths a plan's pattern names: `*` stands for one path component."""
    expression = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
    return [path for path in paths if expression.fullmatch(path)]


def _style(value, pattern):
    if isinstance(value, str):
        if value not in STYLES:
            raise ConfigError(f"tensor-parallel plan: '{pattern}' has style '{value}', which smp does not know (it "
                              f"knows {', '.join(sorted(STYLES))}, and smp.tp's style objects)")
        return STYLES[value]
    if not hasattr(value, "apply"):
        raise ConfigError(f"tensor-parallel plan: '{pattern}' maps to {value!r}, not a style")
    return value


def _check_heads(model, path, module, style):
    """Shards of a projection into heads must hold whole heads (the attention module, the parent, knows their
    width)."""
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    head_dim = getattr(parent, "head_dim", None) or getattr(parent, "attention_head_size", None)
    if not isinstance(head_dim, int) or not isinstance(style, (Colwise, Rowwise)):
        return
    features = module.weight.shape[1 if _is_conv1d(module) else 0] // style.blocks if isinstance(style, Colwise) \
        else module.weight.shape[0 if _is_conv1d(module) else 1]
    if features % head_dim == 0 and (features // head_dim) % degree():
        # A grouped-query model's key and value projections hold fewer heads than its attention has.
        kind = "key/value heads (num_key_value_heads)" if path.rpartition(".")[2] in ("k_proj", "v_proj", "key",
                                                                                       "value") else "heads"
        raise ConfigError(f"{path}: {features // head_dim} {kind} do not divide by \"tensor_parallel_degree\" "
                          f"{degree()}")


def _is_norm(module):
    return "Norm" in type(module).__name__


def sequence_parallel_plan(model, plan):
    """`plan` (a decoder's: column and row layers inside blocks of a ModuleList) with Megatron's sequence parallelism
    added: the blocks take and return slices of the sequence (split at the first block's input, gathered at the
    final norm's output), each attention and MLP gathers its input, row layers reduce-scatter, and the norms in
    between are tagged. ConfigError when the model's layout is not that."""
    styles = {pattern: _style(value, pattern) for pattern, value in plan.items()}
    modules = dict(model.named_modules())

    def block_of(path):
        parts = path.split(".")
        for end in range(len(parts) - 1, 0, -1):
            if isinstance(modules.get(".".join(parts[:end - 1]) if end > 1 else ""), torch.nn.ModuleList):
                return ".".join(parts[:end])
        return None

    matched = {}
    for pattern, style in styles.items():
        for path in _paths_matching(pattern, modules):
            matched[path] = (pattern, style)
    experts = sorted(path for path, (_, style) in matched.items() if isinstance(style, ShardedExperts))
    if experts:
        raise ConfigError(f"\"sequence_parallel\" with the experts of '{experts[0]}' split over the tensor-parallel "
                          "ranks: not supported (their tokens are not the sequence's slices); leave sequence_parallel "
                          "off, or divide the experts whole with \"expert_parallel_degree\"")
    blocks = {block_of(path) for path, (_, style) in matched.items() if isinstance(style, (Colwise, Rowwise))}
    blocks.discard(None)
    if not blocks:
        raise ConfigError(f"\"sequence_parallel\": {type(model).__name__}'s plan shards no layer inside blocks of a "
                          "ModuleList, so smp cannot tell where the sequence splits")
    layers = {block.rpartition(".")[0] for block in blocks}
    if len(layers) != 1:
        raise ConfigError(f"\"sequence_parallel\": the plan's layers are in several block lists ({sorted(layers)})")
    layers = layers.pop()
    owner = layers.rpartition(".")[0]  # the base model, holding the blocks and the final norm
    final = [path for path, module in modules.items() if path.rpartition(".")[0] == owner and path != layers and
             _is_norm(module)]
    if len(final) != 1:
        raise ConfigError(f"\"sequence_parallel\": no single final norm beside '{layers}' in {type(model).__name__}")
    result = {}
    for pattern, style in styles.items():
        inside = any(block_of(path) in blocks for path, (p, _) in matched.items() if p == pattern)
        if inside and isinstance(style, Colwise):
            style = Colwise(style.blocks, style.gather_output, input_gathered=True)
        elif inside and isinstance(style, Rowwise):
            style = Rowwise(style.input_is_parallel, sequence_parallel=True)
        result[pattern] = style
    first = layers + ".0"
    result[first] = ScatterSequenceIn()
    for path, (_, style) in matched.items():
        if isinstance(style, Colwise) and block_of(path) in blocks:
            result[path.rpartition(".")[0]] = GatherSequenceIn()
    for path, module in modules.items():
        if _is_norm(module) and (block_of(path) in blocks or path == final[0]):
            result[path] = SequenceParallel()
    result[final[0] + "#gather"] = GatherSequenceOut()
    return result


def apply_plan(model, plan, strict=True):
    """Replaces the modules `plan` names ({path pattern: style}) with their tensor-parallel forms, in place, and
    returns {path: style} of what it did. A pattern that matches no module is a ConfigError when `strict` (a plan
    of the user's), skipped otherwise (a built-in plan's module a config left out). A layer whose weight is tied
    to a module the plan leaves whole (a GPT-2 or Llama head tied to the embedding) stays whole, with a built-in
    plan; a user's plan must name both."""
    holders = {}
    for path, parameter in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(parameter), []).append(path.rpartition(".")[0])
    modules = dict(model.named_modules())
    applied = {}
    for pattern, value in plan.items():
        style = _style(value, pattern)
        pattern = pattern.partition("#")[0]  # "path#...": one more style for the same module
        paths = _paths_matching(pattern, modules)
        if not paths and strict:
            raise ConfigError(f"tensor-parallel plan: '{pattern}' matches no module of {type(model).__name__}")
        for path in paths:
            module = modules[path]
            tied = {holder for parameter in module.parameters(recurse=False) for holder in holders[id(parameter)]
                    if holder != path}
            if tied and isinstance(style, (Colwise, Rowwise, VocabParallel)):
                if strict:
                    raise ConfigError(f"tensor-parallel plan: '{path}' shares its weight with '{sorted(tied)[0]}', "
                                      "which the plan does not shard the same way")
                continue
            _check_heads(model, path, module, style)
            replacement = style.apply(module, path)
            if replacement is not module:
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, name, replacement)
                modules[path] = replacement
            applied[path] = style
    return applied
