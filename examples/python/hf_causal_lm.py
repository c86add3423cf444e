"""Bring your own model: an unmodified Hugging Face causal LM, trained by smp on pipeline stages with its attention
mask and its own loss, each step's batch padded to its own length (as dynamic padding gives them). Built from a small
config with random weights (nothing is downloaded):

    smprun -n 2 -- python examples/python/hf_causal_lm.py            # 2 pipeline stages
    smprun -n 4 -- python examples/python/hf_causal_lm.py --replicas 2  # 2 stages x 2 data-parallel replicas
    smprun -n 2 -- python examples/python/hf_causal_lm.py --moe      # a Mixtral-style mixture of experts
"""

import argparse

import torch
import transformers

import smp

parser = argparse.ArgumentParser()
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--moe", action="store_true", help="Mixtral: 4 experts, top-2, its load-balancing loss")
args = parser.parse_args()

smp.init({"partitions": 2, "microbatches": 4, "ddp": args.replicas > 1, "global_batch_size": 8 * args.replicas})
torch.manual_seed(0)                                    # every rank builds the same weights
shape = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
if args.moe:
    net = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **shape, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02))
else:
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))


def batch(samples, length=32):
    ids = torch.randint(1, 256, (samples, length))
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}   # as a tokenizer would give them


model = smp.DistributedModel(net, batch(2))             # the sample: one microbatch, as the model takes it
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
for step in range(args.steps):
    length = (32, 48, 24, 64, 40)[step % 5]            # the capture takes any length its model does
    optimizer.zero_grad()
    result = model.train_step(batch(8 * args.replicas, length))  # loss=None: the model's own (output.loss)
    optimizer.step()
    if smp.runtime().rank == 0:
        routing = "".join(f"; {router}: {counts.tolist()} tokens per expert"
                          for router, counts in list(result.tokens_per_expert.items())[:1])
        print(f"step {step} length {length} loss {result.loss:.4f}{routing}")
outputs = model.evaluate(batch(8 * args.replicas), keep_outputs=True).outputs  # a CausalLMOutput, last stage
if outputs is not None:
    print(f"rank {smp.runtime().rank}: validation logits {tuple(outputs.logits.shape)}")
