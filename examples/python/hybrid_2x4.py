"""The hybrid job in Python: a small byte-level GPT-style model on Debian's fortunes, trained by smp as 2
data-parallel replicas x 4 pipeline stages when launched with 8 processes:

    smprun -n 8 -- python examples/python/hybrid_2x4.py --config examples/hybrid_2x4.json

(PYTHONPATH must hold build/python; scripts/example.sh --python does all of it.) The config's "smp" section
drives the parallelism, its "model" and "training" sections this script. Every rank builds the same model from the
seed and reads the same batches; each replica trains on its share.
"""

import argparse
import glob
import json
import os

import torch
import torch.nn.functional as F

import smp


class Embedding(torch.nn.Module):
    def __init__(self, vocab_size: int, context: int, width: int):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab_size, width)
        self.positions = torch.nn.Embedding(context, width)

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                      norm_first=True)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), diagonal=1))

    def forward(self, x):
        length = x.size(1)
        return self.layer(x, src_mask=self.mask[:length, :length])


class Head(torch.nn.Module):
    def __init__(self, width: int, vocab_size: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.project = torch.nn.Linear(width, vocab_size)

    def forward(self, x):
        return self.project(self.norm(x))


class GPT(torch.nn.Module):
    """An ordinary PyTorch model with a forward of its own: smp captures it (torch.export) and cuts stages where
    balance needs them, inside the blocks too (between attention and feed-forward)."""

    def __init__(self, vocab_size: int, context: int, width: int, heads: int, layers: int):
        super().__init__()
        self.embed = Embedding(vocab_size, context, width)
        self.blocks = torch.nn.ModuleList([Block(width, heads, context) for _ in range(layers)])
        self.head = Head(width, vocab_size)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def next_byte_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def load_corpus(directory):
    files = sorted(path for path in glob.glob(os.path.join(directory, "*"))
                   if os.path.isfile(path) and not path.endswith(".dat") and not os.path.islink(path))
    data = b"".join(open(path, "rb").read() for path in files)
    if len(data) < 1 << 16:
        raise SystemExit(f"{directory}: found {len(data)} bytes of text; install Debian's fortunes package")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(corpus, seed, step, size, length):
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - length - 1, (size,), generator=generator)
    windows = torch.stack([corpus[s:s + length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--data", default=os.environ.get("SMP_FORTUNES_DIR") or "/usr/share/games/fortunes")
    args = parser.parse_args()
    with open(args.config) as file:
        document = json.load(file)
    model_options, training = document.get("model", {}), document.get("training", {})
    steps = args.steps or training.get("steps", 30)
    length = training.get("sequence_length", 64)

    runtime = smp.init(args.config, sections=("model", "training"))
    seed = runtime.config.seed
    global_batch = runtime.config.global_batch_size
    corpus = load_corpus(args.data)

    torch.manual_seed(seed)
    vocab, context, width = model_options.get("vocab_size", 256), model_options.get("context", 64), model_options.get("d_model", 64)
    net = GPT(vocab, context, width, model_options.get("heads", 4), model_options.get("layers", 6))

    microbatch = global_batch // runtime.data_parallel_degree // runtime.config.microbatches
    model = smp.DistributedModel(net, batch(corpus, seed, -1, microbatch, length)[0])
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=training.get("learning_rate", 3e-3), weight_decay=0.0))
    clip = training.get("clip_grad_norm", 0.0)
    for step in range(steps):
        inputs, targets = batch(corpus, seed, step, global_batch, length)
        optimizer.zero_grad()
        output = model.train_step(inputs, targets, next_byte_loss)
        if clip > 0:
            optimizer.clip_grad_norm(clip)
        optimizer.step()
        if runtime.rank == 0:
            print(f"step {step} loss {output.loss:.6f} samples/s {global_batch / output.seconds:.1f}", flush=True)
    # Validation on batches training never drew (negative step numbers), without gradients. The logits come back on
    # the rank running the last stage, for its replica's share: each such rank counts its correct next-byte guesses,
    # and one all-reduce over every rank sums them.
    validation = []
    guesses = torch.zeros(2, dtype=torch.float64)  # right, all
    for i in range(2):
        inputs, targets = batch(corpus, seed, -2 - i, global_batch, length)
        evaluation = model.evaluate(inputs, targets, next_byte_loss, keep_outputs=True)
        validation.append(evaluation.loss)
        if evaluation.outputs is not None:
            replica_targets = runtime.replica_slice(targets)
            guesses += torch.tensor([(evaluation.outputs.argmax(-1).cpu() == replica_targets).sum().item(),
                                     replica_targets.numel()], dtype=torch.float64)
    runtime.all_reduce_sum(guesses)
    if runtime.rank == 0:
        print(f"validation loss {sum(validation) / len(validation):.6f}", flush=True)
        print(f"validation next-byte accuracy {guesses[0].item() / guesses[1].item():.6f}", flush=True)


if __name__ == "__main__":
    main()
