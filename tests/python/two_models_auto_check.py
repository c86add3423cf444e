"""Two models in a job whose layout is planned ("auto" keys): the plan's cut pins the student's modules, and a teacher
of another architecture built after it is cut freely (the pins named modules it lacks, and it was refused); both
train and evaluate. The teacher's 2 MiB, which the plan did not count, are said where they overflow the memory
limit beside the student's predicted peak. Run under `smprun -n 2`; exits 0 when every check holds, printing each failure."""

import sys

import torch
import torch.nn.functional as F

import report
import smp


class Student(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 64)
        self.body = torch.nn.Linear(64, 2048)
        self.head = torch.nn.Linear(2048, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(torch.tanh(self.embed(x)))))


class Teacher(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 32768)  # 2 MiB, past what the plan's memory limit leaves beside the student
        self.second = torch.nn.Linear(32768, 4)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def main():
    torch.set_num_threads(1)
    runtime = smp.init({"partitions": "auto", "microbatches": "auto", "ddp": "auto", "pipeline": "auto",
                        "global_batch_size": 8, "device": "cpu", "memory_limit_mb": 3.2})
    failures = []
    torch.manual_seed(0)
    student = smp.DistributedModel(Student(), torch.zeros(2, 16))
    pins = dict(runtime.config.partition_overrides)
    if not pins or not all(path.split(".")[0] in ("embed", "body", "head") for path in pins):
        failures.append(f"the plan pinned {pins}, not the student's modules")
    teacher = smp.DistributedModel(Teacher().requires_grad_(False), torch.zeros(2, 16))
    inputs, targets = torch.randn(8, 16), torch.randn(8, 4)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(student.parameters(), lr=0.1))
    for _ in range(2):
        optimizer.zero_grad()
        loss = student.train_step(inputs, targets, F.mse_loss).loss
        optimizer.step()
    taught = teacher.evaluate(inputs, targets, F.mse_loss).loss
    if not (torch.isfinite(torch.tensor(loss)) and torch.isfinite(torch.tensor(taught))):
        failures.append(f"losses {loss}, {taught}")
    sys.exit(report.finish(failures))


if __name__ == "__main__":
    main()
