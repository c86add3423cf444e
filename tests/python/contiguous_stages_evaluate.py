"""Evaluation under a schedule file that puts two consecutive stages on each of 3 ranks, with skips from the first
rank's stages to both later ranks: rank 0 sends to two ranks, so it must not wait for its oldest send (that could
deadlock through the third rank); evaluate() must finish and give the training step's loss on the same batch.
Run under smprun -n 3."""

import os
import sys
import tempfile

import torch
import torch.nn.functional as F

import smp

# Compute actions only (the transfers are inserted when it is loaded): each rank runs its two stages forward, then
# backward.
SCHEDULE = "# smp schedule name=contiguous ranks=3 stages=6 microbatches=1 split_backward=0 stage_to_rank=0;0;1;1;2;2\n" \
    "rank,action,stage,microbatch,peer_stage\n" + "".join(
        f"{rank},{action},{stage},0,-1\n" for rank in range(3)
        for action, stage in [("F", 2 * rank), ("F", 2 * rank + 1), ("B", 2 * rank + 1), ("B", 2 * rank)])


class Join(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, a, b):
        return self.linear(a + b)


def main():
    torch.set_num_threads(1)
    # Every rank writes the same file under its own name, so no rank reads a half-written one.
    path = os.path.join(tempfile.gettempdir(), f"smp_contiguous_{os.getpid()}.csv")
    with open(path, "w") as file:
        file.write(SCHEDULE)
    smp.init({"partitions": 3, "virtual_stages": 2, "microbatches": 1, "schedule_file": path, "device": "cpu",
              "comm_timeout_s": 20, "auto_partition": False,
              "partition_overrides": {"n0": 0, "n1": 1, "n2": 2, "n3": 3, "n4": 4, "n5": 5}})
    torch.manual_seed(0)
    graph = smp.GraphModel("x")
    graph.add("n0", torch.nn.Linear(8, 8), ["x"])
    graph.add("n1", torch.nn.Linear(8, 8), ["n0"])
    graph.add("n2", torch.nn.Linear(8, 8), ["n1"])
    graph.add("n3", Join(), ["n2", "n1"])  # a skip from rank 0 to rank 1
    graph.add("n4", torch.nn.Linear(8, 8), ["n3"])
    graph.add("n5", Join(), ["n4", "n0"])  # and one from rank 0 to rank 2
    model = smp.DistributedModel(graph, torch.randn(4, 8))
    os.unlink(path)
    inputs, targets = torch.randn(4, 8), torch.randn(4, 8)
    trained = model.train_step(inputs, targets, F.mse_loss).loss
    evaluated = model.evaluate(inputs, targets, F.mse_loss).loss
    if abs(trained - evaluated) > 1e-6 * max(1.0, abs(trained)):
        print(f"evaluation loss {evaluated}, training step's {trained}", flush=True)
        return 1
    print(f"evaluation loss {evaluated} equals the training step's", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
