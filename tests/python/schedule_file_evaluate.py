"""Schedule files with skip connections across ranks: a training step runs, and evaluate() finishes and gives the
training step's loss on the same batch (no optimizer step between). Run under smprun, as many processes as ranks.

  contiguous (3 ranks): two consecutive stages on each rank, skips from rank 0 to both later ranks. Rank 0 sends to
    two ranks, so evaluation must not wait for its oldest send (that could deadlock through the third rank).
  explicit (4 ranks): the file brings its own transfers, rank 0 sending to ranks 3, 2, 1 in that order; the
    transfers follow skips a chain of stages does not have.
"""

import os
import sys
import tempfile

import torch
import torch.nn.functional as F

import smp
import report

HEADER = "rank,action,stage,microbatch,peer_stage\n"

CONTIGUOUS = ("# smp schedule name=contiguous ranks=3 stages=6 microbatches=1 split_backward=0 "
              "stage_to_rank=0;0;1;1;2;2\n" + HEADER + "".join(
                  f"{rank},{action},{stage},0,-1\n" for rank in range(3)
                  for action, stage in [("F", 2 * rank), ("F", 2 * rank + 1), ("B", 2 * rank + 1), ("B", 2 * rank)]))

EXPLICIT = ("# smp schedule name=explicit ranks=4 stages=4 microbatches=1 split_backward=0 stage_to_rank=0;1;2;3\n" +
            HEADER + "".join(f"{line}\n" for line in [
                "0,F,0,0,-1", "0,SEND_F,0,0,3", "0,SEND_F,0,0,2", "0,SEND_F,0,0,1",
                "0,RECV_B,0,0,1", "0,RECV_B,0,0,2", "0,RECV_B,0,0,3", "0,B,0,0,-1",
                "1,RECV_F,1,0,0", "1,F,1,0,-1", "1,SEND_F,1,0,2", "1,RECV_B,1,0,2", "1,B,1,0,-1", "1,SEND_B,1,0,0",
                "2,RECV_F,2,0,1", "2,RECV_F,2,0,0", "2,F,2,0,-1", "2,SEND_F,2,0,3", "2,RECV_B,2,0,3", "2,B,2,0,-1",
                "2,SEND_B,2,0,0", "2,SEND_B,2,0,1",
                "3,RECV_F,3,0,2", "3,RECV_F,3,0,0", "3,F,3,0,-1", "3,B,3,0,-1", "3,SEND_B,3,0,0",
                "3,SEND_B,3,0,2"]))


class Join(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, a, b):
        return self.linear(a + b)


def main():
    case = sys.argv[1]
    torch.set_num_threads(1)
    if case == "contiguous":
        text, keys = CONTIGUOUS, {"partitions": 3, "virtual_stages": 2}
        nodes = [("n0", torch.nn.Linear(8, 8), ["x"]), ("n1", torch.nn.Linear(8, 8), ["n0"]),
                 ("n2", torch.nn.Linear(8, 8), ["n1"]), ("n3", Join(), ["n2", "n1"]),
                 ("n4", torch.nn.Linear(8, 8), ["n3"]), ("n5", Join(), ["n4", "n0"])]
    else:
        text, keys = EXPLICIT, {"partitions": 4}
        nodes = [("n0", torch.nn.Linear(8, 8), ["x"]), ("n1", torch.nn.Linear(8, 8), ["n0"]),
                 ("n2", Join(), ["n1", "n0"]), ("n3", Join(), ["n2", "n0"])]
    # Every rank writes the same file under its own name, so no rank reads a half-written one.
    path = os.path.join(tempfile.gettempdir(), f"smp_schedule_{case}_{os.getpid()}.csv")
    with open(path, "w") as file:
        file.write(text)
    smp.init(dict(keys, microbatches=1, schedule_file=path, device="cpu", comm_timeout_s=20, auto_partition=False,
                  partition_overrides={name: stage for stage, (name, _, _) in enumerate(nodes)}))
    torch.manual_seed(0)
    graph = smp.GraphModel("x")
    for name, module, inputs in nodes:
        graph.add(name, module, inputs)
    model = smp.DistributedModel(graph, torch.randn(4, 8))
    os.unlink(path)
    inputs, targets = torch.randn(4, 8), torch.randn(4, 8)
    trained = model.train_step(inputs, targets, F.mse_loss).loss
    evaluated = model.evaluate(inputs, targets, F.mse_loss).loss
    failures = []
    if abs(trained - evaluated) > 1e-6 * max(1.0, abs(trained)):
        failures.append(f"evaluation loss {evaluated}, training step's {trained}")
    return report.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
