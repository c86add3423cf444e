"""One rank of a job that loads pretrained Hugging Face weights per stage into a model built on the meta device:
every rank's parameters must equal those of from_pretrained in one process, and two training steps must match plain
PyTorch on the from_pretrained model. Weights are written first by every rank into a directory of its own (a GPT-2
and a ResNet-18 with batch norm statistics, saved whole, sharded with an index, and as a torch.save state dict);
broken files must be refused naming the tensor and the file.
"""

import contextlib
import io
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import smp
import report


class Adapted(torch.nn.Module):
    """A frozen Conv1D with a trained low-rank update beside it, as LoRA wraps a projection."""

    def __init__(self, base, rank=2):
        super().__init__()
        inputs, outputs = base.weight.shape
        self.base = base.requires_grad_(False)
        self.adapter_down = torch.nn.Linear(inputs, rank, bias=False)
        self.adapter_up = torch.nn.Linear(rank, outputs, bias=False)

    def forward(self, x):
        return self.base(x) + self.adapter_up(self.adapter_down(x))


def main():
    import torchvision
    import transformers as hf
    torch.set_num_threads(1)
    runtime = smp.init({"partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": 3, "device": "cpu"})
    failures = []
    config = hf.GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=32, vocab_size=96, bos_token_id=0,
                           eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(11)
    pretrained = hf.GPT2LMHeadModel(config)
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as sharded, \
            tempfile.TemporaryDirectory() as broken:
        pretrained.save_pretrained(whole)
        pretrained.save_pretrained(sharded, max_shard_size="20KB")
        state_file = f"{whole}/state.pt"
        torch.save(pretrained.state_dict(), state_file)
        for source in (whole, sharded, state_file):
            with torch.device("meta"):
                net = hf.GPT2LMHeadModel(config)
            model = smp.DistributedModel(net, {"input_ids": ids[:2], "labels": ids[:2]}, init_fn=net._init_weights)
            model.load_pretrained(source)
            reference = hf.GPT2LMHeadModel.from_pretrained(whole)
            reference.train()
            plain = dict(reference.named_parameters())
            if not all(torch.equal(p, plain[n]) for n, p in model.named_parameters()):
                failures.append(f"{source}: loaded parameters differ from from_pretrained's")
            optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
            for step in range(2):
                optimizer.zero_grad()
                loss = model.train_step({"input_ids": ids, "labels": ids}).loss
                optimizer.step()
                reference_optimizer.zero_grad()
                expected = 0.0
                for chunk in ids.chunk(2):
                    value = reference(input_ids=chunk, labels=chunk).loss
                    (value / 2).backward()
                    expected += value.item() / 2
                reference_optimizer.step()
                if abs(loss - expected) > 1e-5 * max(1.0, abs(expected)):
                    failures.append(f"{source}: step {step} loss {loss} != {expected}")

        # A base wrapped with adapters (LoRA's shape: each MLP's c_proj under .base, beside two trained matrices the
        # file does not hold): key_map names the file's tensors, strict=False leaves the adapters as initialized.
        with torch.device("meta"):
            net = hf.GPT2LMHeadModel(config)
            for block in net.transformer.h:
                block.mlp.c_proj = Adapted(block.mlp.c_proj)
        adapted = smp.DistributedModel(net, {"input_ids": ids[:2], "labels": ids[:2]}, init_fn=net._init_weights)
        initialized = {n: p.detach().clone() for n, p in adapted.named_parameters() if ".adapter_" in n}
        try:
            adapted.load_pretrained(whole)
            failures.append("adapters, strict: a model the file does not name was loaded")
        except smp.CheckpointError as error:
            if "no tensor 'transformer.h." not in str(error) or "strict=False" not in str(error):
                failures.append(f"adapters, strict: unexpected message {error}")
        # A key_map that finds nothing here is said (a stage may hold only new tensors), and nothing is read.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if adapted.load_pretrained(whole, key_map=lambda name: "x." + name, strict=False) != 0 or \
                    not any("none of this rank's" in str(warning.message) for warning in caught):
                failures.append(f"adapters: a key_map matching nothing: {[str(w.message) for w in caught]}")
        # A key_map that misses the wrapper's name leaves the frozen bases as initialized: said.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            adapted.load_pretrained(whole, key_map=lambda name: None if ".adapter_" in name else name, strict=False)
        if not any("frozen parameter(s) of this rank are not there" in str(warning.message) and ".c_proj.base." in
                   str(warning.message) for warning in caught):
            failures.append(f"adapters: frozen bases left unread were not said: {[str(w.message) for w in caught]}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            read = adapted.load_pretrained(whole, key_map=lambda name: None if ".adapter_" in name else
                                           name.replace(".c_proj.base.", ".c_proj."), strict=False)
        if caught:
            failures.append(f"adapters: a complete base load warned: {[str(w.message) for w in caught]}")
        plain = dict(hf.GPT2LMHeadModel.from_pretrained(whole).named_parameters())
        for name, parameter in adapted.named_parameters():
            if ".adapter_" in name:
                if not torch.equal(parameter, initialized[name]):
                    failures.append(f"adapters: {name} was overwritten")
            elif not torch.equal(parameter, plain[name.replace(".c_proj.base.", ".c_proj.")]):
                failures.append(f"adapters: {name} differs from the pretrained tensor")
        if read != len(list(adapted.named_parameters())) - len(initialized) or not initialized:
            failures.append(f"adapters: {read} tensors read, of {len(list(adapted.named_parameters()))}")

        # Adapters added outside the meta device are real beside a meta base: said (they keep their own draws).
        with torch.device("meta"):
            net = hf.GPT2LMHeadModel(config)
        net.transformer.h[0].mlp.c_proj = Adapted(net.transformer.h[0].mlp.c_proj.to_empty(device="cpu"))
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            smp.DistributedModel(net, {"input_ids": ids[:2], "labels": ids[:2]}, init_fn=net._init_weights)
        if (runtime.rank == 0) != ("of a model built on the meta device are real" in said.getvalue()):
            failures.append(f"real adapters beside a meta base: rank {runtime.rank} said {said.getvalue()[-300:]!r}")

        # Broken weights: a tensor missing, a tensor of another shape.
        tensors = load_file(f"{whole}/model.safetensors")
        name = "transformer.h.0.attn.c_attn.weight" if runtime.pp_rank == 0 else "transformer.h.3.attn.c_attn.weight"
        for what, change, expected_text in [("missing", lambda t: t.pop(name), f"no tensor '{name}'"),
                                            ("reshaped", lambda t: t.update({name: t[name][:, :-1].clone()}),
                                             f"tensor '{name}' has shape")]:
            damaged = dict(tensors)
            change(damaged)
            save_file(damaged, f"{broken}/model.safetensors", metadata={"format": "pt"})
            try:
                model.load_pretrained(broken)
                failures.append(f"a {what} tensor was not refused")
            except smp.CheckpointError as error:
                if expected_text not in str(error) or "model.safetensors" not in str(error) and what == "reshaped":
                    failures.append(f"a {what} tensor: unexpected message {error}")

    # Batch norm statistics are read with the parameters (torchvision's state dict, torch.save).
    torch.manual_seed(12)
    vision = torchvision.models.resnet18(num_classes=5)
    with torch.no_grad():
        for module in vision.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
    with tempfile.NamedTemporaryFile(suffix=".pt") as file:
        torch.save(vision.state_dict(), file.name)
        with torch.device("meta"):
            net = torchvision.models.resnet18(num_classes=5)
        model = smp.DistributedModel(net, torch.zeros(2, 3, 32, 32))
        model.load_pretrained(file.name)
        vision.eval()
        images = torch.randn(4, 3, 32, 32)
        with torch.no_grad():
            expected = F.cross_entropy(vision(images), torch.zeros(4, dtype=torch.long)).item()
        evaluated = model.evaluate(images, torch.zeros(4, dtype=torch.long), F.cross_entropy).loss
        # Two microbatches of two against the whole batch: the mean of the two means equals the whole mean.
        if abs(evaluated - expected) > 1e-5 * max(1.0, abs(expected)):
            failures.append(f"resnet evaluation with loaded statistics: {evaluated} != {expected}")

    sys.exit(report.finish(failures))


if __name__ == "__main__":
    main()
