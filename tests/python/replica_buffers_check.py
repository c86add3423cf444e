"""Two replicas of a model with batch norm: each updates the running statistics from its share, and after every step
both hold replica 0's, as torch DDP's default broadcast_buffers leaves them (they drifted apart before, and so did
evaluation of the same rows and the checkpoints, which keep replica 0's). Then shares of different sizes
(replica_share=True) are refused on both: each replica's share counts as the global batch's over replicas. The
program's own torch.distributed works beside smp. Exits 0 only then."""

import torch
import torch.nn.functional as F

import report
import smp

runtime = smp.init({"partitions": 1, "microbatches": 2, "ddp": True, "device": "cpu"})
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
model = smp.DistributedModel(net, torch.randn(2, 4))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
failures = []
for step in range(3):
    # Shares that differ a lot between replicas: their statistics would too.
    inputs = torch.cat([torch.randn(4, 4), 5 + 3 * torch.randn(4, 4)])
    model.train_step(inputs, torch.randn(8, 2), F.mse_loss)
    optimizer.step()
    optimizer.zero_grad()
mean = dict(model.named_buffers())["1.running_mean"].clone()
everyone = mean.unsqueeze(0).repeat(2, 1)
everyone[1 - runtime.dp_rank] = 0
runtime.all_reduce_sum(everyone)  # each replica's own row, the other's zero
if not torch.equal(everyone[0], everyone[1]):
    failures.append(f"running means differ between replicas: {everyone[0][:3].tolist()} and {everyone[1][:3].tolist()}")
# Both replicas given the same share: said once on rank 0 (a C++ program that forgot replica_slice); the test
# reads it in the job's output.
same = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
for _ in range(2):
    model.train_step(same, torch.zeros(4, 2), F.mse_loss, replica_share=True)
optimizer.zero_grad()
# A batch that splits unevenly over the replicas trains: 7 samples give replica 1 a microbatch of 1, which a capture
# on 2 samples takes (export's least of 2 is not enforced); 9 samples give microbatches of 3, 2 and 2, 2.
class Captured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)


captured = smp.DistributedModel(Captured(), torch.randn(2, 4))
data = torch.Generator().manual_seed(9)
captured.train_step(torch.randn(7, 4, generator=data), torch.randn(7, 2), F.mse_loss)
captured.train_step(torch.randn(9, 4, generator=data), torch.randn(9, 2, generator=data), F.mse_loss)
share = torch.randn(8 if runtime.dp_rank == 0 else 4, 4)
report.expect_error(failures, "replica shares of 8 and 4 samples", smp.CommError,
                    "so shares passed apart must be the same size",
                    lambda: model.train_step(share, torch.randn(share.shape[0], 2), F.mse_loss, replica_share=True))
# The program's own torch.distributed beside smp: under smprun MASTER_PORT is left to it (smp's store is on
# SMP_MASTER_PORT), so init_process_group's env:// rendezvous works after smp.init.
import torch.distributed as dist  # noqa: E402
dist.init_process_group("gloo")
everyone = torch.ones(1)
dist.all_reduce(everyone)
if everyone.item() != runtime.world_size:
    failures.append(f"torch.distributed beside smp: all_reduce gave {everyone.item()}")
dist.destroy_process_group()
raise SystemExit(report.finish(failures))
