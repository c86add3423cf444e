"""smp.Checkpointer from Python: a 2-stage job trains 4 steps (torch.optim.AdamW under a LambdaLR warm-up) and
checkpoints after each; a second job resumes from the newest checkpoint (optimizer and scheduler state) and trains 2
more, its optimizer built over the parameters in reverse order. Both runs' final parameters must equal 6 (or 4) steps
of plain PyTorch training on the same batches, so the learning rate must continue where it was, and each Adam moment
with its own parameter; Python's and NumPy's generators continue too. Launches both jobs itself. With --sharded, the first job has two replicas
that shard the optimizer state ("shard_optimizer_state"), each drawing random numbers of its own, which a resume
continues replica by replica; the second, one replica, trains one step from it (reading both
shares), and a third, sharded over two replicas again, resumes from that one's unsharded checkpoint: each time every
replica must hold exactly the Adam moments of the parameters it updates. With --tp, each stage is split over two
tensor-parallel ranks (a column- and a row-parallel layer): every shard writes its file, the resumed job continues
from its own, and the export puts the shards together.

  checkpoint_check.py SMPRUN PYTHON [--sharded | --tp]
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

WORKER = """
import json, random, sys, numpy, torch, torch.nn.functional as F, smp
config, steps, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
runtime = smp.init(config)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                          torch.nn.Linear(16, 3))
plan = {"0": "colwise", "2": "rowwise"} if runtime.tensor_parallel_degree > 1 else None
model = smp.DistributedModel(net, torch.zeros(2, 6), tp_plan=plan)
# A resumed job may list the parameters in another order: the saved state follows them by name.
order = -1 if "reversed" in sys.argv[4:] else 1
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(list(model.parameters())[::order], lr=1e-2))
if "teacher" in sys.argv[4:]:
    # A frozen teacher of another architecture beside it: it takes no checkpoint, and is cut freely where the
    # layout's pins (planned, or the checkpoint's) name the student's modules.
    teacher = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3),
                                                       torch.nn.Tanh()).requires_grad_(False),
                                   torch.zeros(2, 6), resume=False)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0 / (step + 1))


class Batches:  # a data loader's place, as torchdata's StatefulDataLoader keeps it
    def __init__(self):
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


loader, progress = Batches(), {"samples": 0}
checkpointer = smp.Checkpointer(model, optimizer, lr_scheduler=scheduler,
                                extra_state={"loader": loader, "progress": progress})
torch.manual_seed(100 + runtime.dp_rank)  # each replica's own augmentation stream, as the README advises
random.seed(7)  # a shuffle's and a crop's generators, Python's and NumPy's, which a resume continues
numpy.random.seed(7)
first = checkpointer.resume()
if loader.next != first or progress != {"samples": 8 * first}:
    raise SystemExit(f"rank {runtime.rank}: resumed at {first} with the loader at {loader.next}, {progress}")
held = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
stray = [p for p in optimizer.optimizer.state if id(p) not in held]
if stray:
    raise SystemExit(f"rank {runtime.rank}: the optimizer keeps state for {len(stray)} parameters it does not update")
for step in range(first, steps):
    data = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(8, 6, generator=data), torch.randn(8, 3, generator=data)
    torch.rand(3)  # the augmentation's draws
    random.random(), numpy.random.rand()
    optimizer.zero_grad()
    model.train_step(inputs, targets, F.mse_loss)
    optimizer.step()
    scheduler.step()
    loader.next, progress["samples"] = step + 1, progress["samples"] + 8
    if checkpointer.due(step):
        checkpointer.save(step)
checkpointer.wait()
print(f"rank {runtime.rank}: draws next {random.random():.8f} {numpy.random.rand():.8f} {torch.rand(1).item():.8f}",
      flush=True)
# Each tensor with where it sits in the whole: (dim, blocks, tp rank, degree) for a shard.
torch.save({name: (tensor.detach().clone(), getattr(tensor, "_smp_shard", None) and
                   (*tensor._smp_shard, runtime.tp_rank, runtime.tensor_parallel_degree))
            for name, tensor in model.named_parameters()}, f"{out}.rank{runtime.rank}")
print(f"rank {runtime.rank}: resumed at {first}", flush=True)
"""


def reference(steps):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for step in range(steps):
        data = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(8, 6, generator=data), torch.randn(8, 3, generator=data)
        optimizer.zero_grad()
        F.mse_loss(net(inputs), targets).backward()
        optimizer.step()
        scheduler.step()
    return dict(net.named_parameters())


def run(smprun, python, worker, config, steps, out, processes, *extra):
    result = subprocess.run([smprun, "-n", str(processes), "--timeout", "120", "--", python, worker, json.dumps(config),
                             str(steps), out, *extra], capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")
        raise SystemExit(f"job of {steps} steps: exit status {result.returncode}")
    return result.stdout


def check(out, steps, processes):
    expected = reference(steps)
    for rank in range(processes):
        for name, (tensor, shard) in torch.load(f"{out}.rank{rank}").items():
            want = expected[name].detach()
            if shard is not None:
                import smp
                dim, blocks, tp_rank, degree = shard
                want = smp.tp.shard_of(want, dim, blocks, of=(tp_rank, degree))
            difference = (tensor - want).abs().max().item()
            if difference > 1e-5 + 1e-3 * expected[name].abs().max().item():
                raise SystemExit(f"after {steps} steps, rank {rank}: {name} differs by {difference:.3g}")


NO_WAIT = """
import shutil, sys, torch, smp
root = sys.argv[1]
smp.init({"partitions": 1, "microbatches": 1, "checkpoint_dir": root, "device": "cpu"})
model = smp.DistributedModel(torch.nn.Linear(3, 2), torch.zeros(2, 3))
checkpointer = smp.Checkpointer(model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
shutil.rmtree(root)
open(root, "w").write("the checkpoint directory became a file")
checkpointer.save(0)  # fails in the background; nothing calls wait()
"""


def lost_save(python, root):
    """A program whose last save failed and that never called wait() must not exit 0."""
    result = subprocess.run([python, "-c", NO_WAIT, root], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 1 or "the last checkpoint was not saved" not in result.stderr:
        raise SystemExit(f"a failed save without wait() exited {result.returncode}:\n{result.stderr[-2000:]}")


RANK0_FAILS = """
import os, sys, time, torch, smp
root, blocked = sys.argv[1:3]
rt = smp.init({"partitions": 2, "microbatches": 1, "checkpoint_dir": root, "device": "cpu", "comm_timeout_s": 60})
torch.manual_seed(0)
model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)), torch.zeros(2, 3))
checkpointer = smp.Checkpointer(model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
if rt.rank == 0:  # a rank's own file cannot be written: a directory in its place
    os.makedirs(os.path.join(root, "step-00000000", blocked))
rt.all_reduce_sum(torch.zeros(1))
start = time.monotonic()
checkpointer.save(0)
try:
    checkpointer.wait()
    print(f"rank {rt.rank}: saved")
except smp.CheckpointError as error:
    print(f"rank {rt.rank}: after {time.monotonic() - start:.1f} s: {error}")
"""


def rank0_fails(smprun, python, root):
    """A rank's own file failing ends every rank's save at once, saying so (not after comm_timeout_s): each rank's
    wait() ends when the checkpoint is complete, rank 0 says how its part ended (its own file's failure too, where
    rank 1 waited comm_timeout_s blaming rank 0's silence), and rank 0 waits for no word from a rank that failed."""
    with open(os.path.join(os.path.dirname(root), "rank0_fails.py"), "w") as file:
        file.write(RANK0_FAILS)
    for blocked, waiter, said in (("partition-0000.pt", 1, "the checkpoint was left incomplete"),
                                  ("partition-0001.pt", 0, "rank 1 failed to save")):
        result = subprocess.run([smprun, "-n", "2", "--timeout", "100", "--", python, file.name, f"{root}-{waiter}",
                                 blocked], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        lines = [line for line in result.stdout.splitlines() if f"rank {waiter}: after" in line]
        seconds = float(lines[0].split(f"rank {waiter}: after ")[1].split()[0]) if lines else None
        if not lines or said not in lines[0] or seconds > 20:
            raise SystemExit(f"{blocked} failing, rank {waiter}'s wait():\n{result.stdout[-2000:]}\n"
                             f"{result.stderr[-2000:]}")


OPTIONS = """
import datetime, sys, torch, smp
root, lr, scheduled = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "scheduled"
smp.init({"partitions": 1, "microbatches": 1, "checkpoint_dir": root, "resume": True, "device": "cpu"})
model = smp.DistributedModel(torch.nn.Linear(3, 2), torch.zeros(2, 3))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0) if scheduled else None
if sys.argv[3] == "unloadable":  # state a weights_only load refuses: the save says so, not the resume
    checkpointer = smp.Checkpointer(model, optimizer, extra_state={"progress": {"day": datetime.date(2026, 1, 1)}})
    try:
        checkpointer.save(0)
    except smp.CheckpointError as error:
        print(error)
    raise SystemExit(0)
checkpointer = smp.Checkpointer(model, optimizer, lr_scheduler=scheduler)
if checkpointer.resume() == 0:
    checkpointer.save(0)
    checkpointer.wait()
print("lr", optimizer.param_groups[0]["lr"])
"""


def options_replaced(python, root):
    """A resume whose optimizer was built with other options (a learning rate), or without the LR scheduler the
    checkpoint holds the state of, takes the checkpoint's as torch.optim does, and says so."""
    def run(*args):
        return subprocess.run([python, "-c", OPTIONS, root, *args], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    unloadable = run("0.1", "unloadable")
    if unloadable.returncode or "extra_state holds objects a resume could not load" not in unloadable.stdout:
        raise SystemExit(f"extra_state a resume cannot load was saved:\n{unloadable.stdout[-1500:]}\n"
                         f"{unloadable.stderr[-1500:]}")
    saved = run("0.1", "scheduled")
    resumed = run("0.5", "unscheduled")
    said = resumed.stderr
    if saved.returncode or resumed.returncode or "lr 0.1" not in resumed.stdout or \
            "optimizer options replaced this optimizer's (lr 0.5 -> 0.1)" not in said or \
            "holds an LR scheduler's state, but this Checkpointer was given no lr_scheduler" not in said:
        raise SystemExit(f"a resume with another learning rate and no scheduler:\n{saved.stderr[-1500:]}\n"
                         f"{resumed.stdout[-500:]}\n{said[-2000:]}")


FROZEN = """
import sys, torch, smp
root, held = sys.argv[1], sys.argv[2]
smp.init({"partitions": 1, "microbatches": 1, "checkpoint_dir": root, "resume": True, "device": "cpu"})
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
net[0].requires_grad_(False)
model = smp.DistributedModel(net, torch.zeros(2, 3))
params = [p for p in model.parameters() if p.requires_grad] if held == "trainable" else list(model.parameters())
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(params, lr=0.1))
checkpointer = smp.Checkpointer(model, optimizer)
first = checkpointer.resume()
print(f"resumed at {first} with {len(optimizer.optimizer.state)} states")
for step in range(first, first + 2):
    optimizer.zero_grad()
    model.train_step(torch.ones(2, 3) * step, torch.ones(2, 2), torch.nn.functional.mse_loss)
    optimizer.step()
checkpointer.save(first + 1)
checkpointer.wait()
"""


LEAN = """
import os, sys, torch, smp
root, seed = sys.argv[1], int(sys.argv[2])
smp.init({"partitions": 1, "microbatches": 1, "checkpoint_dir": root, "resume": True, "device": "cpu",
          "checkpoint_frozen_parameters": False})
torch.manual_seed(seed)  # the frozen layer's values: the base a LoRA job loads
base = torch.nn.Linear(256, 256)  # 256 KiB, which the files leave out
torch.manual_seed(0)
net = torch.nn.Sequential(base.requires_grad_(False), torch.nn.Linear(256, 2))
model = smp.DistributedModel(net, torch.zeros(2, 256))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
checkpointer = smp.Checkpointer(model, optimizer)
try:
    first = checkpointer.resume()
except smp.CheckpointError as error:
    print("refused:", error)
    raise SystemExit(0)
optimizer.zero_grad()
model.train_step(torch.ones(2, 256), torch.ones(2, 2), torch.nn.functional.mse_loss)
optimizer.step()
checkpointer.save(first)
checkpointer.wait()
newest = smp.latest_checkpoint(root)
smp.export_checkpoint(newest, newest + ".pt")
print(f"resumed at {first}, saved {sorted(smp.load_full_model(newest + '.pt'))},",
      os.path.getsize(newest + "/partition-0000.pt") < 256 * 256 * 4, flush=True)
"""


def frozen_left_out(smprun, python, root):
    """"checkpoint_frozen_parameters": false: partition files and exports leave out the frozen parameters (a LoRA
    job's base), a resume finds them in place, and one whose frozen values differ from those saved beside is
    refused, saying to load them first."""
    def run(seed):
        result = subprocess.run([python, "-c", LEAN, root, str(seed)], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        if result.returncode:
            raise SystemExit(f"checkpoints without the frozen parameters:\n{result.stdout[-1000:]}\n"
                             f"{result.stderr[-2000:]}")
        return result.stdout
    saved, resumed, other_base = run(5), run(5), run(6)
    if "resumed at 0, saved ['1.bias', '1.weight'], True" not in saved or \
            "resumed at 1, saved ['1.bias', '1.weight'], True" not in resumed or \
            "refused:" not in other_base or "this model's 0.weight differs from the one it was saved beside" not in \
            other_base:
        raise SystemExit(f"checkpoints without the frozen parameters: {saved}\n{resumed}\n{other_base}")
    listed = subprocess.run([os.path.join(os.path.dirname(smprun), "smp_checkpoint"), "list", root],
                            capture_output=True, text=True, timeout=60)
    if "step-00000001: complete" not in listed.stdout or "frozen parameters left out" not in listed.stdout:
        raise SystemExit(f"smp_checkpoint list does not say the frozen parameters were left out:\n{listed.stdout}"
                         f"{listed.stderr}")


def frozen_optimizer_lists(python, root):
    """A partly frozen model's optimizer over its trainable parameters alone resumes one over model.parameters(), and
    back (frozen parameters hold no state; it was refused as a group that held other parameters)."""
    said = []
    for held in ("trainable", "all", "trainable"):
        result = subprocess.run([python, "-c", FROZEN, root, held], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        if result.returncode:
            raise SystemExit(f"a frozen layer's optimizer over {held} parameters:\n{result.stdout[-1000:]}\n"
                             f"{result.stderr[-2000:]}")
        said += [line for line in result.stdout.splitlines() if line.startswith("resumed at")]
    if said != ["resumed at 0 with 0 states", "resumed at 2 with 2 states", "resumed at 4 with 2 states"]:
        raise SystemExit(f"a frozen layer's optimizer state across lists: {said}")


OTHER_MODEL = """
import sys, torch, smp
root, opted_out = sys.argv[1], sys.argv[2] == "opted-out"
smp.init({"partitions": 1, "microbatches": 1, "checkpoint_dir": root, "resume": True, "device": "cpu"})
model = smp.DistributedModel(torch.nn.Linear(3, 2), torch.zeros(2, 3))
teacher_net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
try:
    teacher = smp.DistributedModel(teacher_net, torch.zeros(2, 3), resume=not opted_out)
except smp.CheckpointError as error:
    print("teacher refused:", error)
    raise SystemExit(0)
checkpointer = smp.Checkpointer(model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
print("resumed at", checkpointer.resume())
try:
    smp.Checkpointer(teacher, smp.DistributedOptimizer(torch.optim.SGD(teacher.parameters(), lr=0.1)))
except smp.CheckpointError as error:
    print("teacher's checkpointer refused:", error)
"""


def other_model(python, root):
    """A job's second model of another architecture (a teacher) built with resume=False while the job resumes: it does
    not take the checkpoint (built without it, it is refused as another model), and no Checkpointer saves it."""
    def run(mode):
        return subprocess.run([python, "-c", OTHER_MODEL, root, mode], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    refused, opted_out = run("resumes"), run("opted-out")
    if refused.returncode or "teacher refused:" not in refused.stdout or opted_out.returncode or \
            "resumed at 1" not in opted_out.stdout or "teacher's checkpointer refused:" not in opted_out.stdout or \
            "built not to resume" not in opted_out.stdout:
        raise SystemExit(f"a second model while resuming:\n{refused.stdout[-1500:]}\n{refused.stderr[-1500:]}\n"
                         f"{opted_out.stdout[-1500:]}\n{opted_out.stderr[-1500:]}")


def main():
    smprun, python = sys.argv[1:3]
    sharded = "--sharded" in sys.argv[3:]
    tensor_parallel = "--tp" in sys.argv[3:]
    processes = 4 if sharded or tensor_parallel else 2
    with tempfile.TemporaryDirectory() as directory:
        worker = os.path.join(directory, "worker.py")
        with open(worker, "w") as file:
            file.write(WORKER)
        config = {"partitions": 2, "microbatches": 2, "global_batch_size": 8, "device": "cpu",
                  "checkpoint_dir": os.path.join(directory, "checkpoints"), "checkpoint_interval": 1}
        if sharded:
            config.update(ddp=True, shard_optimizer_state=True)
        if tensor_parallel:
            config.update(tensor_parallel_degree=2)
        out = os.path.join(directory, "parameters")
        trained = run(smprun, python, worker, config, 4, out, processes)
        check(out, 4, processes)
        if sharded:
            # Resumed with nothing left to train, every rank draws what it would have drawn next: its own replica's
            # stream (before, each replica took the first replica's).
            again = run(smprun, python, worker, dict(config, resume=True), 4, out, processes)
            draws = [sorted(line for line in output.splitlines() if "draws next" in line) for output in (trained, again)]
            if draws[0] != draws[1] or len(draws[0]) != processes or len({line.split()[-1] for line in draws[0]}) < 2:
                raise SystemExit(f"random states after the resume: {draws[1]}, without it: {draws[0]}")
            one_replica = {key: value for key, value in config.items() if key not in ("ddp", "shard_optimizer_state")}
            resumed = run(smprun, python, worker, dict(one_replica, resume=True), 5, out, 2)
            if "resumed at 4" not in resumed:
                raise SystemExit(f"the one-replica job did not resume at step 4:\n{resumed}")
            check(out, 5, 2)
            resumed = run(smprun, python, worker, dict(config, resume=True), 6, out, processes)
            if "resumed at 5" not in resumed:
                raise SystemExit(f"the sharded job did not resume at step 5:\n{resumed}")
            # Replica 1, which the one-replica job did not have, keeps the seeding the program gave it per replica
            # (it took the first replica's before: both drew alike).
            draws = {line.split()[-1] for line in resumed.splitlines() if "draws next" in line}
            if len(draws) < 2:
                raise SystemExit(f"the replicas seeded apart draw alike after resuming into two: {draws}")
        else:
            resumed = run(smprun, python, worker, dict(config, resume=True), 6, out, processes, "reversed")
            if "resumed at 4" not in resumed:
                raise SystemExit(f"the second job did not resume at step 4:\n{resumed}")
        check(out, 6, processes)
        # The trained model back in plain PyTorch: the newest checkpoint exported and loaded into a fresh net.
        import smp
        newest = smp.latest_checkpoint(config["checkpoint_dir"])
        if newest is None or not newest.endswith("step-00000005"):
            raise SystemExit(f"newest checkpoint: {newest}")
        smp.export_checkpoint(newest, os.path.join(directory, "model.pt"))
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                  torch.nn.Linear(16, 3))
        missing, unexpected = net.load_state_dict(smp.load_full_model(os.path.join(directory, "model.pt")),
                                                  strict=False)
        if missing or unexpected:
            raise SystemExit(f"exported model: missing {missing}, unexpected {unexpected}")
        expected = reference(6)
        for name, tensor in net.named_parameters():
            if not torch.allclose(tensor, expected[name].detach(), rtol=1e-3, atol=1e-5):
                raise SystemExit(f"exported model: {name} differs from 6 steps of plain PyTorch")
        if not sharded and not tensor_parallel:
            # "auto" layout keys resume in the layout the checkpoint was saved with (they planned one it refused),
            # here on 4 ranks: two replicas of its two stages; a teacher beside the model is built under its pins.
            planned = dict(config, resume=True, partitions="auto", microbatches="auto", ddp="auto", pipeline="auto")
            resumed = run(smprun, python, worker, planned, 7, out, 4, "teacher")
            if "resumed at 6" not in resumed:
                raise SystemExit(f"the \"auto\" job did not resume at step 6:\n{resumed}")
            check(out, 7, 4)
            lost_save(python, os.path.join(directory, "lost"))
            rank0_fails(smprun, python, os.path.join(directory, "rank0_fails"))
            options_replaced(python, os.path.join(directory, "options"))
            other_model(python, os.path.join(directory, "options"))
            frozen_optimizer_lists(python, os.path.join(directory, "frozen"))
            frozen_left_out(smprun, python, os.path.join(directory, "lean"))
    print("trained 4 steps" + (" in tensor-parallel shards" if tensor_parallel else "") + ", resumed" +
          (" into one replica, then into two shards again" if sharded else "") +
          ", trained to 6, exported" + ("" if sharded or tensor_parallel else ", resumed by an \"auto\" job on 4 ranks") +
          ": parameters equal plain PyTorch's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
