"""A channels_last activation crosses a pipeline cut in channels_last, as in one process: the next stage runs the
kernels of the format its producer chose (it arrived contiguous in the default format, and an EfficientNet drifted
1e-4 from plain PyTorch in 3 steps). 2 stages on 2 ranks, 3 SGD steps against plain PyTorch on the same
microbatches; a pooled [N, C, 1, 1] map, contiguous in both formats, keeps one process's strides too. Run under `smprun -n 2`; exits 0 when every check holds, printing each failure."""

import copy
import sys

import torch
import torch.nn.functional as F

import report
import smp


class FormatSeen(torch.nn.Module):
    """Records whether its input is channels_last (the first module of stage 1)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        if not torch.compiler.is_compiling() and x.device.type != "meta":
            self.seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return x


def main():
    torch.set_num_threads(1)
    runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 8, "device": "cpu",
                        "auto_partition": False, "default_partition": 1,
                        "partition_overrides": {"0": 0, "1": 0, "2": 0}})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              FormatSeen(), torch.nn.Conv2d(8, 8, 3, padding=1, groups=2), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net, torch.zeros(4, 3, 12, 12).contiguous(memory_format=torch.channels_last))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    failures = []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(8, 3, 12, 12, generator=generator).contiguous(memory_format=torch.channels_last)
        targets = torch.randint(0, 4, (8,), generator=generator)
        optimizer.zero_grad()
        loss = model.train_step(inputs, targets, F.cross_entropy).loss
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = 0.0
        for rows in (slice(0, 4), slice(4, 8)):
            piece = F.cross_entropy(reference(inputs[rows]), targets[rows]) / 2
            piece.backward()
            expected += piece.item()
        reference_optimizer.step()
        if abs(loss - expected) > 1e-6:
            failures.append(f"step {step}: loss {loss} != {expected}")
    if 1 in model.stages and not (net[3].seen and all(net[3].seen)):
        failures.append(f"stage 1 did not receive its input channels_last: {net[3].seen}")
    plain = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        difference = (parameter.detach() - plain[name].detach()).abs().max().item()
        if difference > 1e-6:
            failures.append(f"{name} differs from plain PyTorch's by {difference}")
    failures += squeezed_map_failures(model.stages)
    sys.exit(report.finish(failures, f"rank {runtime.rank}"))


class StridesSeen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        if x.device.type != "meta":
            self.seen.append(x.stride())
        return x


def squeezed_map_failures(stages):
    """A channels_last map pooled to [N, C, 1, 1] (a squeeze-excite's) is contiguous in both formats: it still
    arrives with the strides one process gives it, so that the 1x1 convolution after the cut computes as there."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              StridesSeen(), torch.nn.Conv2d(8, 4, 1), torch.nn.Flatten())
    inputs = torch.randn(8, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    expected = net[:3](inputs[:4]).stride()
    model = smp.DistributedModel(net, inputs[:4])
    model.evaluate(inputs, torch.zeros(8, 4), F.mse_loss)
    if 1 in stages and (not net[3].seen or any(seen != expected for seen in net[3].seen)):
        return [f"a pooled channels_last map arrived with strides {net[3].seen}, one process's {expected}"]
    return []


if __name__ == "__main__":
    main()
