"""SyncBatchNorm over 2 pipeline stages x 2 replicas trains as one process whose batch norms see, for each
microbatch, the rows of that microbatch of both replicas together: every step's loss, every parameter, the running
statistics and the evaluation within 1e-5. A Sequential (run module by module) and a module with a forward of its own
(captured by torch.export). Exits 0 only then; run under `smprun -n 4`."""

import copy
import json
import sys

import torch
import torch.nn.functional as F

import report
import smp

REPLICAS, MICROBATCHES, GLOBAL_BATCH, STEPS = 2, 2, 16, 3
TOLERANCE = 1e-5


def layers():
    return [torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
            torch.nn.Conv2d(6, 8, 3, padding=1), torch.nn.BatchNorm2d(8, momentum=0.3), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
            torch.nn.Tanh(), torch.nn.Linear(8, 3)]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(*layers()[:6])
        self.head = torch.nn.Sequential(*layers()[6:])

    def forward(self, x):
        return self.head(self.features(x))


def pooled_microbatches(samples):
    """Rows of each microbatch index over the replicas: what a synchronized batch norm normalizes together."""
    share, piece = samples // REPLICAS, samples // (REPLICAS * MICROBATCHES)
    return [torch.cat([torch.arange(r * share + m * piece, r * share + (m + 1) * piece) for r in range(REPLICAS)])
            for m in range(MICROBATCHES)]


def close(a, b):
    return torch.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)


def check(name, build, runtime):
    torch.manual_seed(0)
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build())
    reference = copy.deepcopy(net)  # torch's SyncBatchNorm in one process without torch.distributed: a batch norm
    data = torch.Generator().manual_seed(1)
    model = smp.DistributedModel(net, torch.randn(4, 3, 6, 6))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    failures = []
    model.train()
    reference.train()
    for step in range(STEPS):
        # Replicas' shares far apart, so that per-replica statistics would differ from pooled ones.
        inputs = torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=data)
        inputs[GLOBAL_BATCH // 2:] = 3 * inputs[GLOBAL_BATCH // 2:] + 2
        targets = torch.randn(GLOBAL_BATCH, 3, generator=data)
        optimizer.zero_grad()
        loss = model.train_step(inputs, targets, F.mse_loss).loss
        optimizer.step()

        reference_optimizer.zero_grad()
        expected = 0.0
        for rows in pooled_microbatches(GLOBAL_BATCH):
            value = F.mse_loss(reference(inputs[rows]), targets[rows])
            (value / MICROBATCHES).backward()
            expected += value.item() / MICROBATCHES
        reference_optimizer.step()
        if abs(loss - expected) > TOLERANCE * max(1.0, abs(expected)):
            failures.append(f"{name} step {step}: loss {loss} != {expected}")

    plain = dict(reference.named_parameters())
    for path, parameter in model.named_parameters():
        if not close(parameter.detach(), plain[path].detach()):
            failures.append(f"{name}: {path} differs from one process's by "
                            f"{(parameter - plain[path]).abs().max().item():.3g}")
    plain_buffers = dict(reference.named_buffers())
    for path, buffer in model.named_buffers():
        if buffer.is_floating_point() and not close(buffer, plain_buffers[path]):
            failures.append(f"{name}: running statistic {path} differs by "
                            f"{(buffer - plain_buffers[path]).abs().max().item():.3g}")
        elif not buffer.is_floating_point() and not torch.equal(buffer, plain_buffers[path]):
            failures.append(f"{name}: {path} is {buffer.item()}, one process's {plain_buffers[path].item()}")

    # Evaluation reads the running statistics, the same on every replica: the same as one process, on each replica.
    inputs, targets = torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=data), torch.randn(GLOBAL_BATCH, 3, generator=data)
    evaluation = model.evaluate(inputs, targets, F.mse_loss, keep_outputs=True)
    reference.eval()
    with torch.no_grad():
        outputs = reference(inputs)
    expected = F.mse_loss(outputs, targets).item()
    if abs(evaluation.loss - expected) > TOLERANCE * max(1.0, expected):
        failures.append(f"{name} evaluation: loss {evaluation.loss} != {expected}")
    if evaluation.outputs is not None and not close(evaluation.outputs, runtime.replica_slice(outputs)):
        failures.append(f"{name} evaluation: this replica's outputs differ from one process's")
    return failures


def main():
    torch.set_num_threads(1)
    keys = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}  # more smp keys (a schedule, recomputation)
    runtime = smp.init({"partitions": 2, "microbatches": MICROBATCHES, "ddp": True, "global_batch_size": GLOBAL_BATCH,
                        "device": "cpu", **keys})
    failures = check("sequential", lambda: torch.nn.Sequential(*layers()), runtime)
    failures += check("captured", Net, runtime)
    raise SystemExit(report.finish(failures))


if __name__ == "__main__":
    main()
