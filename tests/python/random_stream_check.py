"""The model's random draws (dropout) come from a stream of the engine's own: a program seeded alike on every rank
draws each batch from the default generator, and only the second stage's rank runs the dropout. Before, that rank's
generator moved on by the dropout's draws and the next batch it drew was another one (the ranks out of step at step
1). A second job resumes from step 1's checkpoint and must give the first job's losses of steps 2 and 3 bit for bit:
the checkpoint keeps the program's stream and the model's, each where it was.

  random_stream_check.py SMPRUN PYTHON
"""

import os
import subprocess
import sys
import tempfile

WORKER = """
import sys, torch, torch.nn.functional as F, smp
root, steps = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
smp.init({"partitions": 2, "microbatches": 2, "device": "cpu", "checkpoint_dir": root, "resume": True,
          "partition_overrides": {"3": 1}})
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Dropout(0.5),
                          torch.nn.Linear(16, 3))
model = smp.DistributedModel(net, torch.zeros(2, 6))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
checkpointer = smp.Checkpointer(model, optimizer)
for step in range(checkpointer.resume(), steps):
    inputs, targets = torch.randn(8, 6), torch.randn(8, 3)  # the program's own draws, on every rank
    optimizer.zero_grad()
    loss = model.train_step(inputs, targets, F.mse_loss).loss
    optimizer.step()
    print(f"step {step} loss {loss!r}", flush=True)
    if step == 1:
        checkpointer.save(step)
checkpointer.wait()
"""


def losses(output):
    found = {}
    for line in output.splitlines():
        if "] step " in line:
            _, step, _, value = line.split("] ")[1].split()
            found.setdefault(int(step), set()).add(value)
    return found


def run(smprun, python, worker, root, steps):
    result = subprocess.run([smprun, "-n", "2", "--timeout", "120", "--", python, worker, root, str(steps)],
                            capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-4000:], sep="\n")
        raise SystemExit(f"the job of {steps} steps exited {result.returncode}")
    return losses(result.stdout)


def main():
    smprun, python = sys.argv[1:3]
    with tempfile.TemporaryDirectory() as directory:
        worker = os.path.join(directory, "worker.py")
        with open(worker, "w") as file:
            file.write(WORKER)
        root = os.path.join(directory, "checkpoints")
        whole = run(smprun, python, worker, root, 4)
        resumed = run(smprun, python, worker, root, 4)
    if sorted(whole) != [0, 1, 2, 3] or sorted(resumed) != [2, 3]:
        raise SystemExit(f"steps run: {sorted(whole)}, then resumed {sorted(resumed)}")
    for step in (2, 3):
        if resumed[step] != whole[step] or len(whole[step]) != 1:
            raise SystemExit(f"step {step}: loss {whole[step]} in one job, {resumed[step]} resumed from step 1")
    print("ranks in step with dropout on one stage; the resumed job's losses equal the uninterrupted job's")


if __name__ == "__main__":
    main()
