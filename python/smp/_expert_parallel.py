"""Expert parallelism for captured mixture-of-experts models ("expert_parallel_degree" > 1): each experts module's
stacked experts are divided over the ranks of an expert-parallel group (blocks of consecutive data-parallel
replicas), and its call in the captured code becomes an exchange of tokens: each token row goes to the rank holding
its chosen expert (all-to-all by the actual counts, no capacity limit), the rank runs the module's own forward on
its experts, and the results come back to be weighted and summed. The router, the weights and the experts' math are
the model's; smp moves the rows.

An experts module is one of Hugging Face's experts classes (transformers' ``use_experts_implementation``; Mixtral,
Qwen-MoE, OLMoE, DeepSeek-V3 and most families since transformers 5): ``forward(hidden_states, top_k_index,
top_k_weights)``, every parameter stacked with the experts along dimension 0, ``num_experts`` of them. It is
exported as one opaque call (``smp::routed_experts``), so that the export neither traces the experts' loop nor sees
their count; after the export the call becomes an ``ExpertsAcrossRanks`` reading the module's parameters, which
then hold this rank's experts only (tagged ``_smp_expert_shard``, so that the engine averages their gradients over
the replicas holding the same experts)."""

import contextlib
import inspect

import torch
from torch import Tensor

from . import _smp, ep
from ._materialize import made_whole
from ._smp import ConfigError, ModelError
from ._state import runtime as _runtime


def experts_modules(model):
    """{path: module} of the model's stacked-experts modules."""
    return {path: module for path, module in model.named_modules()
            if hasattr(type(module), "_apply_gate") and isinstance(getattr(module, "num_experts", None), int)}


def check_divisible(experts, degree):
    if not experts:
        raise ConfigError(f"\"expert_parallel_degree\" {degree}: the model has no experts module to divide (a Hugging "
                          "Face mixture-of-experts model's experts classes); set it to 1")
    for path, module in experts.items():
        count = module.num_experts
        if count % degree:
            raise ConfigError(f"\"expert_parallel_degree\" {degree} does not divide the {count} experts of '{path}'")
        for name, parameter in module.named_parameters():
            if parameter.dim() == 0 or parameter.shape[0] != count:
                raise ModelError(f"'{path}.{name}' of shape {tuple(parameter.shape)} is not stacked over the {count} "
                                 "experts along its first dimension; expert parallelism cannot divide it")


def without_experts(model, plan):
    """A tensor-parallel plan without its entries for the experts modules and their tensors (a Hugging Face model's
    own plan shards its experts): expert parallelism divides them whole, every tensor-parallel rank holding its
    experts whole."""
    from .tp import _paths_matching
    divided = set()
    for path, module in experts_modules(model).items():
        divided.add(path)
        divided.update(f"{path}.{name}" for name, _ in module.named_parameters())
    return {pattern: style for pattern, style in plan.items() if not _paths_matching(pattern, divided)}


@torch.library.custom_op("smp::routed_experts", mutates_args=())
def _routed_experts(hidden: Tensor, index: Tensor, weights: Tensor, path: str) -> Tensor:
    raise RuntimeError(f"internal: smp::routed_experts ({path}) stands in for an experts module during capture only")


@_routed_experts.register_fake
def _(hidden, index, weights, path):
    return torch.empty_like(hidden)


@contextlib.contextmanager
def opaque_for_export(experts):
    """The experts modules called as one opaque operation, for the export."""
    def stand_in(path, module):
        signature = inspect.signature(type(module).forward)

        def forward(*args, **kwargs):
            bound = signature.bind(module, *args, **kwargs)
            hidden, index, weights = list(bound.arguments.values())[1:4]
            return _routed_experts(hidden, index, weights, path)
        return forward

    for path, module in experts.items():
        module.forward = stand_in(path, module)
    try:
        yield
    finally:
        for module in experts.values():
            del module.forward


def across_ranks(graph, parameter_nodes, experts, degree, rank):
    """Each opaque experts call in the exported graph becomes an ExpertsAcrossRanks reading the module's parameters
    (their placeholders, by path), and each module's parameters become this rank's experts."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.smp.routed_experts.default:
            continue
        hidden, index, weights, path = node.args
        module = experts[path]
        names = [name for name, _ in module.named_parameters()]
        missing = [name for name in names if f"{path}.{name}" not in parameter_nodes]
        if missing:
            raise ModelError(f"internal: the export of '{path}' reads no parameter {missing}")
        node.target = ExpertsAcrossRanks(module, names, module.num_experts, degree, rank)
        node.args = (hidden, index, weights, *[parameter_nodes[f"{path}.{name}"] for name in names])
    for path, module in experts.items():
        _keep_own_experts(module, degree, rank)


def _own_share(whole, count, degree, rank):
    share = count // degree
    if whole.is_meta:
        local = torch.empty((share, *whole.shape[1:]), dtype=whole.dtype, device="meta")
    else:
        local = whole.detach()[rank * share:(rank + 1) * share].clone()
    shard = torch.nn.Parameter(local, requires_grad=whole.requires_grad)
    shard._smp_expert_shard = (rank, degree)
    return shard


def _keep_own_experts(module, degree, rank):
    count = module.num_experts
    whole_shapes = {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}
    for name, whole in list(module.named_parameters(recurse=False)):
        module._parameters[name] = _own_share(whole, count, degree, rank)
    module.num_experts = count // degree

    def materialize(device, initialize):
        made_whole(module, whole_shapes, device)
        module.to_empty(device=device, recurse=False)
        module.num_experts = count
        try:
            initialize(module)
        finally:
            module.num_experts = count // degree
        for name in whole_shapes:
            module._parameters[name] = _own_share(module._parameters[name], count, degree, rank)
    module._smp_materialize = materialize


class ExpertsAcrossRanks:
    """Called by the captured code in place of an experts module: (hidden states [tokens, hidden], chosen experts
    [tokens, k], their weights [tokens, k], this rank's share of each expert parameter) -> the weighted sum of the
    chosen experts' outputs, as the module computes it."""

    __module__ = __name__

    def __init__(self, module, names, experts, degree, rank):
        self.module = module
        self.names = names
        self.experts = experts
        self.degree = degree
        self.rank = rank
        self.share = experts // degree
        self.__name__ = "smp_experts_across_ranks"  # how torch.fx names it in the generated code

    def __repr__(self):
        return "smp_experts_across_ranks"  # the same in every block: identical blocks share one profile measurement

    def _local_experts(self, rows, local_index, parameters):
        ones = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
        return torch.func.functional_call(self.module, dict(zip(self.names, parameters)),
                                          (rows, local_index.unsqueeze(1), ones))

    def __call__(self, hidden, index, weights, *parameters):
        tokens = hidden.reshape(-1, hidden.shape[-1])
        count = tokens.shape[0]
        index = index.reshape(count, -1)
        chosen = index.shape[1]
        expert_of_row = index.reshape(-1)
        # One row per (token, choice), grouped by expert: each rank's rows are consecutive, by its local expert.
        order = torch.argsort(expert_of_row, stable=True)
        rows = tokens.index_select(0, torch.div(order, chosen, rounding_mode="floor"))
        if _smp.without_collectives():
            # Rank 0 profiling alone: its experts on every row, the compute of an even share.
            out = self._local_experts(rows, expert_of_row.index_select(0, order) % self.share, parameters)
        else:
            per_expert = torch.bincount(expert_of_row, minlength=self.experts).to("cpu")
            # The counts go with this rank's program call: a peer in another call (an evaluate beside a
            # train_step) is named here, before the rows' exchange, whose sizes would not match.
            call = _smp.current_program_call()
            counts = per_expert.view(self.degree, self.share)
            send = torch.cat([counts, torch.full((self.degree, 1), call, dtype=counts.dtype)], 1)
            # receive[r, j]: rows rank r sends to this rank's expert j.
            receive = _runtime()._ep_all_to_all(send, [1] * self.degree, [1] * self.degree, counted=False)
            _check_same_call(receive[:, -1].tolist(), call)
            receive = receive[:, :-1]
            input_rows = counts.sum(1).tolist()
            output_rows = receive.sum(1).tolist()
            received = ep.all_to_all(rows, output_rows, input_rows)
            local_index = torch.repeat_interleave(
                torch.arange(self.share, device=rows.device).repeat(self.degree),
                receive.reshape(-1).to(rows.device))
            out = ep.all_to_all(self._local_experts(received, local_index, parameters), input_rows, output_rows)
        by_token = torch.empty_like(out).index_copy(0, order, out).view(count, chosen, -1)  # unsorted
        combined = (by_token * weights.reshape(count, chosen, 1)).sum(1)
        return combined.to(hidden.dtype).view(hidden.shape)


def _check_same_call(calls, mine):
    """CommError naming the first expert-parallel peer in another program call than this rank."""
    for peer, theirs in enumerate(calls):
        if theirs != mine:
            raise _smp.CommError(f"expert parallelism: group rank {peer} is in its {_smp.describe_program_call(theirs)}, "
                                 f"this rank in its {_smp.describe_program_call(mine)}: every rank must call "
                                 "train_step and evaluate alike, in the same order (did a rank skip or add a call?)")
