"""One rank of a 2-rank job checking the capture cache (SMP_CAPTURE_CACHE, smp/_capture_cache.py) in a directory of
its own: the two ranks capturing a GPT-2 export it once between them; an identical model built again is not exported
and trains exactly as the first; another sample length, another config, tied against untied weights, another value
of a tensor attribute, or an edited and reloaded model class is exported again; a damaged entry is exported again and
replaced, with a warning; a directory others may write into is not used, said; one that cannot be made leaves the
capture to run; without the variable nothing is
read or written. Exits 0 only then.

  capture_cache_check.py DIRECTORY
"""

import glob
import importlib
import logging
import os
import sys
import textwrap

import torch

import report
import smp
from smp import _exporting

exports = []
_original_export = _exporting._export


def _counted_export(*args, **kwargs):
    exports.append(1)
    return _original_export(*args, **kwargs)


_exporting._export = _counted_export
runtime = None


def exported_by_the_job(action):
    """How many exports the job's ranks ran, together, while each ran `action`; and what it returned on this rank."""
    before = len(exports)
    result = action()
    count = torch.tensor([float(len(exports) - before)])
    runtime.all_reduce_sum(count)
    return int(count.item()), result


def gpt2(layers=2):
    import transformers as hf
    torch.manual_seed(0)
    return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, n_positions=32, vocab_size=96,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def sample(length=12):
    ids = torch.randint(1, 96, (2, length), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


def losses(model, steps=2):
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out = []
    for step in range(steps):
        ids = torch.randint(1, 96, (4, 12), generator=torch.Generator().manual_seed(10 + step))
        optimizer.zero_grad()
        out.append(model.train_step({"input_ids": ids, "labels": ids}).loss)
        optimizer.step()
    return out


class TiedOrNot(torch.nn.Module):
    """An embedding and a head that may share one matrix, scaled by a tensor that is neither parameter nor buffer:
    the same names and shapes either way, another export."""

    def __init__(self, tied, scale):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.scale = torch.tensor(scale)

    def forward(self, ids):
        return self.head(self.embed(ids) * self.scale)


class TakesInput(torch.nn.Module):
    """A forward whose argument is named `input`, as every torch.nn layer's: the graph read back from the cache named
    it input_1, unlike the export of the rank that made the entry (the ranks' models differed), and unlike its spec."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, input):
        return self.b(torch.tanh(self.a(input))) + input


MODULE_V1 = """
import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
"""
MODULE_V2 = MODULE_V1.replace("torch.relu(self.a(x))", "torch.tanh(self.a(x)) * 2")


def main():
    global runtime
    directory = sys.argv[1]
    torch.set_num_threads(1)
    runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 4, "device": "cpu", "seed": 3})
    failures = []
    os.environ["SMP_CAPTURE_CACHE"] = os.path.join(directory, "cache")
    entries = lambda: sorted(glob.glob(os.path.join(os.environ["SMP_CAPTURE_CACHE"], "export-*.pkl")))  # noqa: E731

    count, first = exported_by_the_job(lambda: smp.DistributedModel(gpt2(), sample()))
    if count != 1 or len(entries()) != 1:
        failures.append(f"two ranks capturing one model: {count} exports, {len(entries())} entries (1 and 1)")
    count, again = exported_by_the_job(lambda: smp.DistributedModel(gpt2(), sample()))
    if count != 0:
        failures.append(f"the same model captured again: {count} exports, expected none")
    fresh, kept = losses(first), losses(again)
    if not torch.allclose(torch.tensor(fresh), torch.tensor(kept), rtol=1e-6, atol=0):
        failures.append(f"the model captured from the cache trained to losses {kept}, the exported one to {fresh}")

    # One rank exports, the other reads the entry back; then both read it back.
    for attempt in ("made", "read back"):
        count, model = exported_by_the_job(lambda: smp.DistributedModel(TakesInput(), torch.zeros(2, 4)))
        if count != (attempt == "made"):
            failures.append(f"a forward taking `input`, entry {attempt}: {count} exports over the 2 ranks")
        inputs = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        loss = model.train_step(inputs, torch.zeros(4, 4), torch.nn.functional.mse_loss).loss
        expected = torch.nn.functional.mse_loss(TakesInput()(inputs), torch.zeros(4, 4)).item()
        if abs(loss - expected) > 1e-6:
            failures.append(f"a forward taking `input`, entry {attempt}: loss {loss}, PyTorch's {expected}")

    for what, build in (("another sample length", lambda: smp.DistributedModel(gpt2(), sample(length=16))),
                        ("another config (3 layers)", lambda: smp.DistributedModel(gpt2(layers=3), sample()))):
        count, _ = exported_by_the_job(build)
        if count != 1:
            failures.append(f"{what}: {count} exports over the 2 ranks, expected 1")

    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(2))
    for what, tied, scale, expected in (("untied", False, 1.0, 1), ("tied", True, 1.0, 1),
                                         ("another scale", False, 2.0, 1), ("untied again", False, 1.0, 0)):
        count, _ = exported_by_the_job(lambda: smp.DistributedModel(TiedOrNot(tied, scale), ids))
        if count != expected:
            failures.append(f"{what} embedding and head: {count} exports, expected {expected}")

    # A model class edited between runs (here: rewritten and reloaded) is exported again.
    source = os.path.join(directory, f"edited_model_{runtime.rank}.py")
    sys.path.insert(0, directory)
    sys.dont_write_bytecode = True  # the edited file is read again, not a bytecode cache of the first
    with open(source, "w") as file:
        file.write(textwrap.dedent(MODULE_V1))
    module = importlib.import_module(os.path.basename(source)[:-3])
    block_input = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    first_count, _ = exported_by_the_job(lambda: smp.DistributedModel(module.Block(), block_input))
    with open(source, "w") as file:
        file.write(textwrap.dedent(MODULE_V2))
    os.utime(source, ns=(os.stat(source).st_atime_ns, os.stat(source).st_mtime_ns + 1_000_000))
    module = importlib.reload(module)
    count, _ = exported_by_the_job(lambda: smp.DistributedModel(module.Block(), block_input))
    if (first_count, count) != (2, 2):  # each rank its own file, so its own entry
        failures.append(f"an edited model class: {first_count} then {count} exports, expected 2 and 2")

    # Damaged entries are exported again, said so (by the rank that read one), and replaced by whole ones.
    if runtime.rank == 0:
        for path in entries():
            with open(path, "r+b") as file:
                file.truncate(100)
    done = torch.zeros(1)
    runtime.all_reduce_sum(done)  # every rank past the damage before anyone reads
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("smp.capture_cache").addHandler(handler)
    count, _ = exported_by_the_job(lambda: smp.DistributedModel(gpt2(), sample()))
    logging.getLogger("smp.capture_cache").removeHandler(handler)
    warned = torch.tensor([float(any("ignoring" in warning for warning in warnings))])
    runtime.all_reduce_sum(warned)
    if count != 1 or warned.item() != 1:
        failures.append(f"a damaged entry: {count} exports, {warned.item():.0f} ranks warned; expected 1 and 1")
    count, _ = exported_by_the_job(lambda: smp.DistributedModel(gpt2(), sample()))
    if count != 0:
        failures.append(f"after a damaged entry was replaced: {count} exports, expected none")

    # A directory others may write into is not used (its entries are pickles, which run code when read), said once.
    if runtime.rank == 0:
        os.chmod(os.environ["SMP_CAPTURE_CACHE"], 0o777)
    runtime.all_reduce_sum(torch.zeros(1))  # every rank past the chmod before anyone looks
    warnings.clear()
    logging.getLogger("smp.capture_cache").addHandler(handler)
    count, _ = exported_by_the_job(lambda: smp.DistributedModel(gpt2(), sample()))
    logging.getLogger("smp.capture_cache").removeHandler(handler)
    if count != 2 or not any("others may write into it (mode 777)" in warning for warning in warnings):
        failures.append(f"a cache directory others may write: {count} exports (expected one per rank), said "
                        f"{warnings}")
    runtime.all_reduce_sum(torch.zeros(1))
    if runtime.rank == 0:
        os.chmod(os.environ["SMP_CAPTURE_CACHE"], 0o700)

    # A cache directory that cannot be made: the capture runs as without one.
    cache = os.environ["SMP_CAPTURE_CACHE"]
    blocked = os.path.join(directory, f"a_file_{runtime.rank}")
    open(blocked, "w").close()
    os.environ["SMP_CAPTURE_CACHE"] = os.path.join(blocked, "cache")
    try:
        count, _ = exported_by_the_job(lambda: smp.DistributedModel(TiedOrNot(False, 3.0), ids))
        if count != 2:
            failures.append(f"a cache directory that cannot be made: {count} exports, expected one per rank")
    except Exception as error:  # noqa: BLE001 - the failure reported
        failures.append(f"a cache directory that cannot be made failed the capture: {type(error).__name__}: {error}")
    os.environ["SMP_CAPTURE_CACHE"] = cache

    # Without SMP_CAPTURE_CACHE nothing is read or written.
    listing = sorted(os.listdir(os.environ["SMP_CAPTURE_CACHE"]))
    del os.environ["SMP_CAPTURE_CACHE"]
    count, _ = exported_by_the_job(lambda: smp.DistributedModel(gpt2(), sample()))
    if count != 2:
        failures.append(f"without SMP_CAPTURE_CACHE: {count} exports, expected one per rank")
    os.environ["SMP_CAPTURE_CACHE"] = os.path.join(directory, "cache")
    if sorted(os.listdir(os.environ["SMP_CAPTURE_CACHE"])) != listing:
        failures.append("without SMP_CAPTURE_CACHE the cache directory changed")
    sys.exit(report.finish(failures))


if __name__ == "__main__":
    main()
