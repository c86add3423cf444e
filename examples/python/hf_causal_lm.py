"""Bring your own model: an unmodified Hugging Face causal LM, trained by smp on pipeline stages with its attention
mask and its own loss. Built from a small config with random weights (nothing is downloaded):

    smprun -n 2 -- python examples/python/hf_causal_lm.py            # 2 pipeline stages
    smprun -n 4 -- python examples/python/hf_causal_lm.py --replicas 2  # 2 stages x 2 data-parallel replicas
"""

import argparse

import torch
import transformers

import smp

parser = argparse.ArgumentParser()
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

smp.init({"partitions": 2, "microbatches": 4, "ddp": args.replicas > 1, "global_batch_size": 8 * args.replicas})
torch.manual_seed(0)                                    # every rank builds the same weights
net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def batch(samples, length=32):
    ids = torch.randint(1, 256, (samples, length))
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}   # as a tokenizer would give them


model = smp.DistributedModel(net, batch(2))             # the sample: one microbatch, as the model takes it
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
for step in range(args.steps):
    optimizer.zero_grad()
    result = model.train_step(batch(8 * args.replicas))  # loss=None: the model's own (output.loss)
    optimizer.step()
    if smp.runtime().rank == 0:
        print(f"step {step} loss {result.loss:.4f}")
outputs = model.evaluate(batch(8 * args.replicas), keep_outputs=True).outputs  # a CausalLMOutput, last stage
if outputs is not None:
    print(f"rank {smp.runtime().rank}: validation logits {tuple(outputs.logits.shape)}")
