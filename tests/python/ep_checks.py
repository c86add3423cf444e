"""One rank of a data-parallel job (4 replicas of one stage, experts divided over blocks of 2) checking
smp.ep.all_to_all: rows of uneven counts (none to some ranks) reach the ranks of this rank's expert-parallel group
(its block of replicas) in rank order, and gradients come back the same way reversed. Exits 0 only then."""

import sys

import torch

import smp
import report


def rows_from(sender, receiver, rank_count):
    """How many rows `sender` sends `receiver`: uneven, and none on the diagonal of every third pair."""
    return 0 if (sender + 2 * receiver) % 3 == 0 else 1 + (sender * rank_count + receiver) % 3


def main():
    torch.set_num_threads(1)
    runtime = smp.init({"partitions": 1, "microbatches": 1, "ddp": True, "device": "cpu", "expert_parallel_degree": 2})
    me, ranks = runtime.ep_rank, runtime.expert_parallel_degree
    first = runtime.dp_rank - me  # the block's first replica
    failures = [] if ranks == 2 and me == runtime.dp_rank % 2 else [f"ep rank {me} of {ranks} at dp rank {runtime.dp_rank}"]
    input_rows = [rows_from(me, peer, ranks) for peer in range(ranks)]
    output_rows = [rows_from(peer, me, ranks) for peer in range(ranks)]
    # Each row says who sent it to whom, and which of those rows it is.
    sent = torch.tensor([[first + me, peer, index] for peer in range(ranks) for index in range(input_rows[peer])],
                        dtype=torch.float32).reshape(-1, 3).requires_grad_()
    received = smp.ep.all_to_all(sent, output_rows, input_rows)
    expected = torch.tensor([[first + peer, me, index] for peer in range(ranks) for index in range(output_rows[peer])],
                            dtype=torch.float32).reshape(-1, 3)
    if not torch.equal(received.detach(), expected):
        failures.append(f"received {received.tolist()}, expected {expected.tolist()}")
    # The gradient of each received row, scaled by its receiver, goes back to the row's sender.
    (received * (me + 1)).sum().backward()
    back = torch.tensor([[peer + 1.0] * 3 for peer in range(ranks) for _ in range(input_rows[peer])]).reshape(-1, 3)
    if sent.grad is None or not torch.equal(sent.grad, back):
        failures.append(f"gradient {None if sent.grad is None else sent.grad.tolist()}, expected {back.tolist()}")
    try:
        smp.ep.all_to_all(sent.detach(), output_rows, [sum(input_rows) + 1] + [0] * (ranks - 1))
        failures.append("counts that do not add up to the rows were not refused")
    except ValueError as error:
        if "add up to" not in str(error):
            failures.append(f"counts that do not add up: unexpected message {error}")
    # What expert parallelism cannot divide is refused on every rank, before any exchange.
    for what, model, sample, expected in [
            ("a Sequential", torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4), "not a Sequential"),
            ("a model without experts", Dense(), torch.randn(2, 4), "has no experts module")]:
        try:
            smp.DistributedModel(model, sample)
            failures.append(f"{what} under expert_parallel_degree 2 was not refused")
        except smp.ConfigError as error:
            if expected not in str(error):
                failures.append(f"{what}: unexpected message {error}")
    sys.exit(report.finish(failures))


class Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(x).relu()


if __name__ == "__main__":
    main()
