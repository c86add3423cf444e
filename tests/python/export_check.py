"""Models built on the meta device through checkpoints and exports: a 2-stage job trains 3 steps of a GPT-2 (or a
Mixtral-shaped mixture of experts, alone or with its experts divided over 2 replicas (ep 2 x pp 2, 4 processes, the
optimizer state sharded), or
a ResNet-18, whose batch norm statistics are state too) and checkpoints after each; a second job resumes and trains to step 5. Both must hold exactly what plain PyTorch training of the
smp.materialize'd model holds after 3 and 5 steps, parameters and buffers. The newest checkpoint is then exported as safetensors shards with an index: from_pretrained
(or load_state_dict of the shards) must give the trained model, and a third job, of one stage, must load it with
load_parameters. Launches the jobs itself.

  export_check.py SMPRUN PYTHON
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import report

WORKER = r"""
import json, sys, torch, torch.nn.functional as F, smp
sys.path.insert(0, sys.argv[4])
from export_check import build, batch, loss_of
config, steps, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kind = config.pop("model")
load = config.pop("load", None)
torch.set_num_threads(1)
runtime = smp.init(config)
with torch.device("meta"):
    net = build(kind)
init_fn = getattr(net, "_init_weights", None)
model = smp.DistributedModel(net, batch(kind, 0, 2)[0], init_fn=init_fn)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
checkpointer = smp.Checkpointer(model, optimizer)
first = checkpointer.resume()
if load:
    model.load_parameters(load)
for step in range(first, steps):
    inputs, targets = batch(kind, step, config["global_batch_size"])
    optimizer.zero_grad()
    model.train_step(inputs, targets, loss_of(kind))
    optimizer.step()
    if checkpointer.due(step):
        checkpointer.save(step)
checkpointer.wait()
state = dict(model.named_parameters())
state.update(model.named_buffers())
def key(name, tensor):  # a share of the experts: which one
    share = getattr(tensor, "_smp_expert_shard", None)
    return name if share is None else f"{name}@{share[0]}/{share[1]}"
torch.save({key(name, tensor): tensor.detach().clone() for name, tensor in state.items()}, f"{out}.rank{runtime.rank}")
print(f"rank {runtime.rank}: resumed at {first}, {len(state)} tensors", flush=True)
"""


LANGUAGE = ("gpt2", "mixtral", "mixtral_ep")


def build(kind):
    if kind == "gpt2":
        import transformers as hf
        config = hf.GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=32, vocab_size=96, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)
        return hf.GPT2LMHeadModel(config)
    if kind in ("mixtral", "mixtral_ep"):  # a mixture of experts: stacked expert weights, routers, a load-balancing loss
        import transformers as hf
        config = hf.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
                                  router_aux_loss_coef=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return hf.MixtralForCausalLM(config)
    import torchvision
    return torchvision.models.resnet18(num_classes=5)


def batch(kind, step, size):
    data = torch.Generator().manual_seed(100 + step)
    if kind in LANGUAGE:
        ids = torch.randint(0, 96, (size, 12), generator=data)
        return {"input_ids": ids, "labels": ids}, None
    return torch.randn(size, 3, 32, 32, generator=data), torch.randint(0, 5, (size,), generator=data)


def loss_of(kind):
    return None if kind in LANGUAGE else F.cross_entropy


def reference(kind, steps, seed, pieces=2, samples=4):
    """Plain PyTorch on the same weights (smp.materialize) and microbatches: `pieces` microbatches per step (those
    of every replica, in replica order)."""
    import smp
    with torch.device("meta"):
        net = build(kind)
    smp.materialize(net, "cpu", seed=seed, init_fn=getattr(net, "_init_weights", None))
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        inputs, targets = batch(kind, step, samples)
        optimizer.zero_grad()
        size = samples // pieces
        for piece in range(pieces):
            part = slice(size * piece, size * (piece + 1))
            if kind in LANGUAGE:
                loss = net(**{name: value[part] for name, value in inputs.items()}).loss
            else:
                loss = F.cross_entropy(net(inputs[part]), targets[part])
            (loss / pieces).backward()
        optimizer.step()
    return net


def compare(what, tensors, expected, failures, exact_names=True):
    for name, tensor in tensors.items():
        name, _, share = name.partition("@")
        if name not in expected:
            failures.append(f"{what}: {name} is not in the reference's state_dict")
            continue
        reference_tensor = expected[name].to(tensor.dtype)
        if share:  # this rank's share of the experts
            index, count = (int(part) for part in share.split("/"))
            reference_tensor = reference_tensor.chunk(count)[index]
        difference = (tensor - reference_tensor).abs().max().item() if tensor.numel() else 0.0
        if difference > 1e-5 * max(1.0, reference_tensor.abs().max().item()):
            failures.append(f"{what}: {name} differs by {difference:.3g}")


def run_job(smprun, python, processes, config, steps, out, failures, what):
    command = [smprun, "-n", str(processes), "--timeout", "200", "--", python, "-c", WORKER, json.dumps(config),
               str(steps), out, os.path.dirname(os.path.abspath(__file__))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-5000:], sep="\n")
        failures.append(f"{what}: exit status {result.returncode}")
        return {}
    state = {}
    for rank in range(processes):
        state.update(torch.load(f"{out}.rank{rank}"))
    return state


def check(kind, smprun, python, failures):
    import smp
    seed = 5
    with tempfile.TemporaryDirectory() as directory:
        base = {"model": kind, "partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": seed,
                "device": "cpu", "checkpoint_dir": f"{directory}/checkpoints", "checkpoint_interval": 1}
        experts_divided = kind == "mixtral_ep"
        processes, pieces = (4, 4) if experts_divided else (2, 2)
        if experts_divided:  # microbatches of 2, as the sample: the capture takes no fewer
            # Each replica's share of the optimizer state (ZeRO-1) goes into its partition file.
            base.update(ddp=True, expert_parallel_degree=2, shard_optimizer_state=True, global_batch_size=8)
        first = run_job(smprun, python, processes, base, 3, f"{directory}/first", failures, f"{kind}: first job")
        expected3 = reference(kind, 3, seed, pieces, base["global_batch_size"]).state_dict()
        compare(f"{kind} after 3 steps", first, expected3, failures)
        resumed = run_job(smprun, python, processes, {**base, "resume": True}, 5, f"{directory}/resumed", failures,
                          f"{kind}: resumed job")
        trained = reference(kind, 5, seed, pieces, base["global_batch_size"])
        expected5 = trained.state_dict()
        compare(f"{kind} resumed to 5 steps", resumed, expected5, failures)
        if len(resumed) != len(first):
            failures.append(f"{kind}: the resumed job holds {len(resumed)} tensors, the first {len(first)}")

        exported = f"{directory}/exported"
        files = smp.export_safetensors(smp.latest_checkpoint(f"{directory}/checkpoints"), exported,
                                       max_shard_size="40KB" if kind.startswith("mixtral") else "200KB")
        if len(files) < 2 or not os.path.exists(f"{exported}/model.safetensors.index.json"):
            failures.append(f"{kind}: expected shards and an index, got {files}")
        if kind == "gpt2":
            failures += failed_export_failures(directory, exported, files)
        if experts_divided:  # its files per expert share, which the listing names
            verified = subprocess.run([os.path.join(os.path.dirname(smprun), "smp_checkpoint"), "verify",
                                       smp.latest_checkpoint(f"{directory}/checkpoints")],
                                      capture_output=True, text=True, timeout=60)
            if "experts divided over 2 replicas" not in verified.stdout:
                failures.append(f"smp_checkpoint verify does not name the divided experts: {verified.stdout}")
        if kind in LANGUAGE:
            trained.config.save_pretrained(exported)
            loaded = type(trained).from_pretrained(exported).state_dict()
        else:
            from safetensors.torch import load_file
            tensors = {}
            for file in files:
                tensors.update(load_file(f"{exported}/{file}"))
            loaded_model = build(kind)
            loaded_model.load_state_dict(tensors, strict=True)  # every persistent tensor, nothing else
            loaded = loaded_model.state_dict()
        compare(f"{kind} exported to safetensors", loaded, expected5, failures)
        for name, tensor in expected5.items():
            if name not in loaded:
                failures.append(f"{kind}: the export lacks {name}")

        # Of one stage; with the experts divided, each of its 2 replicas takes its share of every experts tensor.
        single = {**base, "partitions": 1, "microbatches": 2, "load": exported}
        del single["checkpoint_dir"], single["checkpoint_interval"]
        reloaded = run_job(smprun, python, 2 if experts_divided else 1, single, 0, f"{directory}/reloaded", failures,
                           f"{kind}: reloading job")
        if experts_divided and not any("@" in name for name in reloaded):
            failures.append(f"{kind}: the reloading job holds no share of the experts")
        compare(f"{kind} loaded from the export", reloaded, expected5, failures)


def failed_export_failures(directory, exported, files):
    """An export into the same directory that fails at its second shard (where it would write, a directory stands):
    refused as a CheckpointError, nothing of it left, the earlier export whole."""
    import smp
    failures = []
    before = {name: open(f"{exported}/{name}", "rb").read() for name in sorted(os.listdir(exported))}
    blocker = f"{exported}/.shard-1.{os.getpid()}.safetensors.tmp"
    os.mkdir(blocker)
    try:
        smp.export_safetensors(smp.latest_checkpoint(f"{directory}/checkpoints"), exported, max_shard_size="1KB")
        failures.append("an export that cannot write its second shard did not fail")
    except smp.CheckpointError as error:
        if ".shard-1." not in str(error):
            failures.append(f"the failed export's error does not name its shard: {error}")
    os.rmdir(blocker)
    after = {name: open(f"{exported}/{name}", "rb").read() for name in sorted(os.listdir(exported))}
    if after != before:
        failures.append(f"a failed export changed the earlier one: {sorted(set(after) ^ set(before))} differ")
    return failures


def main():
    smprun, python = sys.argv[1:3]
    torch.set_num_threads(1)
    failures = []
    for kind in ("gpt2", "mixtral", "mixtral_ep", "resnet"):
        check(kind, smprun, python, failures)
    return report.finish(failures, label="export_check")


if __name__ == "__main__":
    sys.exit(main())
