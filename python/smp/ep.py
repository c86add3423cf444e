"""Expert parallelism's token movement: rows of a tensor sent to the ranks of this rank's expert-parallel group (the
"expert_parallel_degree" consecutive data-parallel replicas that divide the experts among them) by counts, with
autograd (the backward moves the gradients back the same way reversed). A captured mixture-of-experts model's
experts use it (smp._expert_parallel); a model of one's own may too.

    received = smp.ep.all_to_all(tokens, output_rows, input_rows)

`input_rows[r]` consecutive rows of `tokens` go to group rank r, in rank order; `received` holds `output_rows[r]`
rows from each rank r, in rank order. The counts are the caller's to agree on (each rank's `output_rows[r]` is rank
r's `input_rows` entry for it): a mixture-of-experts layer exchanges its tokens-per-expert counts first.
"""

from typing import List

import torch
from torch import Tensor

from ._state import runtime as _runtime


def _moved(x: Tensor, output_rows: List[int], input_rows: List[int]) -> Tensor:
    return _runtime()._ep_all_to_all(x, list(output_rows), list(input_rows))


_all_to_all = torch.library.custom_op("smp::all_to_all", _moved, mutates_args=())


@_all_to_all.register_fake
def _(x, output_rows, input_rows):
    return x.new_empty([sum(output_rows), *x.shape[1:]])


def _keep_rows(ctx, inputs, output):
    _, ctx.output_rows, ctx.input_rows = inputs


def _moved_back(ctx, gradient):
    return _all_to_all(gradient.contiguous(), ctx.input_rows, ctx.output_rows), None, None


_all_to_all.register_autograd(_moved_back, setup_context=_keep_rows)


def bytes_sent():
    """Bytes this process's all-to-alls (its experts layers' included) sent to other ranks since it started, to
    compare with the theory: tokens x top-k x hidden x element size x (ep - 1) / ep, each way."""
    from ._smp import collective_bytes
    return collective_bytes()["all_to_all_sent"]


def all_to_all(x: Tensor, output_rows: List[int], input_rows: List[int]) -> Tensor:
    """Rows of `x` to the group's ranks by `input_rows`, `output_rows` from each; differentiable."""
    if len(input_rows) != len(output_rows):
        raise ValueError(f"all_to_all: {len(input_rows)} input counts and {len(output_rows)} output counts")
    if sum(input_rows) != x.shape[0]:
        raise ValueError(f"all_to_all: input counts {list(input_rows)} add up to {sum(input_rows)}, "
                         f"not the {x.shape[0]} rows of the input")
    return _all_to_all(x, [int(r) for r in output_rows], [int(r) for r in input_rows])
