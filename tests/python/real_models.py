"""One rank of a job that trains an unmodified Hugging Face or torchvision model (small config, random weights,
nothing downloaded) through smp and, in the same process, a copy with plain PyTorch on the same microbatches
(gradient accumulation). Every step's loss and every parameter this rank holds must match (1e-5 relative, float32).
Exits 0 only then.

  --models LIST  comma-separated, trained one after the other in the same job: causal LMs gpt2, llama, mistral,
                 qwen2, phi, gpt_neox, bloom, falcon, opt; sequence classifiers with padded attention masks bert,
                 roberta, distilbert; encoder-decoders t5, bart; torchvision resnet, vit, mobilenet, efficientnet,
                 convnext, swin, regnet, densenet; mixtures of experts mixtral (mixtral_wide: experts of 512
                 features), olmoe, qwen3_moe, deepseek_v3;
                 hf:CLASS, any transformers causal LM by class name (hf:Qwen2MoeForCausalLM), from a small config
  --smp JSON     the config
  --steps N
  --loss own|fn  own: the model's own loss (labels among the inputs, loss=None); fn: a loss function on the
                 model's output and targets
  --lengths L,.. one step per sequence length (the captured model takes them all), --short-last N: the last step
                 a smaller batch of N samples, as an epoch's last
  --meta         build the models on the meta device: each rank makes its own stages real, and plain PyTorch trains
                 the same model made real by smp.materialize (the same seed)
  --plan RANKS   only print the fastest layout smp.plan predicts for each model on RANKS ranks (its config's
                 global_batch_size, a sample of global_batch_size / RANKS), as JSON, and exit
  --rtol R       parameters within 1e-6 + R * max |plain| (default 1e-5); under bf16 or fp16 (against float32
                 PyTorch) losses within R relative too
"device": "cuda" in the config trains smp on the GPU against plain PyTorch on the CPU (losses within R relative
too); without a GPU the job exits 77 (skipped).
"""

import argparse
import copy
import itertools
import functools
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import smp
import report
from smp import _smp

VOCAB, SEQUENCE, CLASSES = 96, 12, 5


NO_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


# A Hugging Face causal LM by class name ("hf:Qwen2MoeForCausalLM"): its config given whichever of these it takes.
GENERIC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=48, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_local_experts=4,
               n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
               router_aux_loss_coef=0.1, shared_expert_intermediate_size=48, decoder_sparse_step=1,
               first_k_dense_replace=1, n_shared_experts=1, num_shared_experts=1, attn_layer_offset=0,
               attn_layer_period=2, expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
GENERIC_OF = {"Lfm2MoeForCausalLM": dict(layer_types=["full_attention", "conv", "full_attention", "conv"])}


def generic_language_model(class_name):
    import inspect
    import transformers as hf
    model_class = getattr(hf, class_name)
    parameters = inspect.signature(model_class.config_class.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    keys = dict(GENERIC, **GENERIC_OF.get(class_name, {}))
    return model_class(model_class.config_class(**{key: value for key, value in keys.items()
                                                   if key in parameters or takes_any}))


def language_model(name):
    import transformers as hf
    if name.startswith("hf:"):
        return generic_language_model(name[3:])
    small = dict(vocab_size=VOCAB)
    quiet = dict(hidden_dropout=0.0, attention_dropout=0.0)
    decoder = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   max_position_embeddings=32, **NO_IDS, **small)
    grouped = dict(decoder, num_key_value_heads=2)
    moe = dict(grouped, output_router_logits=True, router_aux_loss_coef=0.1)
    encoder = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   max_position_embeddings=40, num_labels=CLASSES, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, **small)
    builders = {
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=32,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                         bos_token_id=0, eos_token_id=0, **small)),
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**grouped)),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**grouped)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**grouped)),
        "phi": lambda: hf.PhiForCausalLM(hf.PhiConfig(**decoder, resid_pdrop=0.0, embd_pdrop=0.0,
                                                      attention_dropout=0.0)),
        "gpt_neox": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**decoder, **quiet)),
        "bloom": lambda: hf.BloomForCausalLM(hf.BloomConfig(n_layer=4, hidden_size=32, n_head=4, **quiet, **NO_IDS,
                                                            **small)),
        "falcon": lambda: hf.FalconForCausalLM(hf.FalconConfig(num_hidden_layers=4, hidden_size=32,
                                                               num_attention_heads=4, **quiet, **NO_IDS, **small)),
        "opt": lambda: hf.OPTForCausalLM(hf.OPTConfig(num_hidden_layers=4, hidden_size=32, ffn_dim=64,
                                                      num_attention_heads=4, max_position_embeddings=32,
                                                      word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                                      activation_dropout=0.0, layerdrop=0.0, **NO_IDS, **small)),
        # Mixture of experts: top-k routing writes tokens into expert buffers; output_router_logits adds the
        # load-balancing term to the model's own loss.
        "mixtral": lambda: hf.MixtralForCausalLM(hf.MixtralConfig(**moe, num_local_experts=4,
                                                                  num_experts_per_tok=TOP_K)),
        # Experts that hold most of the model's memory (8 of 512 features): what dividing them saves shows.
        "mixtral_wide": lambda: hf.MixtralForCausalLM(hf.MixtralConfig(**dict(moe, intermediate_size=512),
                                                                       num_local_experts=8, num_experts_per_tok=TOP_K)),
        "olmoe": lambda: hf.OlmoeForCausalLM(hf.OlmoeConfig(**moe, num_experts=4, num_experts_per_tok=TOP_K)),
        "qwen3_moe": lambda: hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(**moe, num_experts=4, num_experts_per_tok=TOP_K,
                                                                      moe_intermediate_size=48, head_dim=8)),
        "deepseek_v3": lambda: hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(
            **dict(moe, num_key_value_heads=4), n_routed_experts=4, num_experts_per_tok=TOP_K, n_shared_experts=1,
            moe_intermediate_size=48, first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
        "bert": lambda: hf.BertForSequenceClassification(hf.BertConfig(**encoder)),
        "roberta": lambda: hf.RobertaForSequenceClassification(hf.RobertaConfig(**encoder, pad_token_id=1)),
        "distilbert": lambda: hf.DistilBertForSequenceClassification(hf.DistilBertConfig(
            n_layers=4, dim=32, hidden_dim=64, n_heads=4, max_position_embeddings=32, num_labels=CLASSES,
            dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, **small)),
        "t5": lambda: hf.T5ForConditionalGeneration(hf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32,
                                                                d_ff=64, num_heads=4, d_kv=8, dropout_rate=0.0,
                                                                decoder_start_token_id=0, pad_token_id=0,
                                                                eos_token_id=1, **small)),
        "bart": lambda: hf.BartForConditionalGeneration(hf.BartConfig(
            encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
            encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=32, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2, **NO_IDS, **small)),
    }
    return builders[name]()


def vision_model(name):
    import torchvision.models as tv
    builders = {
        "resnet": lambda: tv.resnet18(num_classes=CLASSES),
        "vit": lambda: tv.VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=4, hidden_dim=32,
                                            mlp_dim=64, num_classes=CLASSES),
        "mobilenet": lambda: tv.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0),
        "efficientnet": lambda: tv.efficientnet_b0(num_classes=CLASSES, stochastic_depth_prob=0.0, dropout=0.0),
        "convnext": lambda: tv.convnext_tiny(num_classes=CLASSES, stochastic_depth_prob=0.0),
        # Module names that are not identifiers ("block4-1"); a cut across a dense block's many feature maps.
        "regnet": lambda: tv.regnet_y_400mf(num_classes=CLASSES),
        "densenet": lambda: tv.densenet121(num_classes=CLASSES),
        "swin": lambda: tv.SwinTransformer(patch_size=[4, 4], embed_dim=24, depths=[2, 2], num_heads=[2, 4],
                                           window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=CLASSES),
    }
    return builders[name]()


# Captured with the batch alone free: their images' sizes as symbols cost 6 to 13 s of export a rank (Swin's shifted
# windows, DenseNet's 58 concatenations), and these models are here for their module trees, not for changing sizes
# (ResNet and ViT keep every dimension free).
BATCH_ALONE_FREE = {"swin", "densenet"}
VISION = {"resnet", "vit", "mobilenet", "efficientnet", "convnext", "swin", "regnet", "densenet"}
CLASSIFIERS = {"bert", "roberta", "distilbert"}
ENCODER_DECODERS = {"t5", "bart"}
MOE = {"mixtral", "mixtral_wide", "olmoe", "qwen3_moe", "deepseek_v3"}
TOP_K = 2


def initialize_vision_module(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        for parameter in module.parameters(recurse=False):
            torch.nn.init.normal_(parameter, std=0.02)


def batch(name, samples, generator, length=SEQUENCE):
    """(inputs, targets) of one global batch: inputs as the model's forward takes them."""
    if name in VISION:
        # 64 x 64 pixels: ResNet's last batch norms then normalize over 2 x 2 positions per sample; over one they
        # would compare two samples alone, so sensitive that the replicas' summation order moves the next loss.
        size = 32 if name == "vit" else 64
        return torch.randn(samples, 3, size, size, generator=generator), torch.randint(0, CLASSES, (samples,),
                                                                                      generator=generator)
    ids = torch.randint(1, VOCAB, (samples, length), generator=generator)
    if name in CLASSIFIERS:
        # Padded: every sample has its own length, the rest masked.
        lengths = torch.randint(length // 2, length + 1, (samples,), generator=generator)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        labels = torch.randint(0, CLASSES, (samples,), generator=generator)
        inputs = {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}
        if name == "bert":
            inputs["token_type_ids"] = torch.zeros_like(ids)  # an input that does not change the result
        return inputs, labels
    if name in ENCODER_DECODERS:
        decoder = torch.randint(1, VOCAB, (samples, max(2, length // 2)), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": decoder}, decoder
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, ids


def routing_failures(reference, result, routed, routed_by_all, runtime):
    """Each replica's routers counted each of its tokens top-k times, once per forward (a checkpointed stage's
    recompute not again): a router's counts on the rank whose stage chooses its experts, which need not be the rank
    holding its weight (a cut may fall between the router's logits and its top-k), summed over the job to every
    replica's tokens."""
    routers = sorted({path.rsplit(".", 1)[0] for path, _ in reference.named_parameters()
                      if path.endswith(".gate.weight") and ".mlp." in path})
    counts = result.tokens_per_expert
    failures = [f"router {path} is not one of the model's" for path in sorted(set(counts) - set(routers))]
    for path, count in counts.items():
        if int(count.sum()) != routed or (count < 0).any():
            failures.append(f"router {path} counted {count.tolist()}, {int(count.sum())} tokens, expected {routed}")
    totals = torch.tensor([float(counts[path].sum()) if path in counts else 0.0 for path in routers],
                          dtype=torch.float64)
    runtime.all_reduce_sum(totals)
    shards = runtime.tensor_parallel_degree  # a tp group's ranks each count
    for path, total in zip(routers, totals.tolist()):
        if total != routed_by_all * shards:
            failures.append(f"router {path} counted {total:.0f} tokens over the job, expected {routed_by_all * shards}")
    return failures


def function_loss(name):
    if name in VISION:
        return F.cross_entropy
    if name in CLASSIFIERS:
        return lambda output, target: F.cross_entropy(output.logits, target)
    return lambda output, target: F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def microbatches_of(samples, replicas, microbatches):
    """Per replica, its microbatches' (first row, rows) as the engine splits a global batch of `samples`: into
    replica shares, each into microbatches, as torch.tensor_split does (the first pieces a sample more where the
    batch does not split evenly; an evaluation's share of fewer samples than microbatches into one a sample)."""
    return [[(int(rows[0]), len(rows)) for rows in share.tensor_split(min(microbatches, len(share)))]
            if len(share) else [] for share in torch.arange(samples).tensor_split(replicas)]


def evaluation_failures(model, reference, name, own, loss, samples, data, replicas, microbatches, runtime,
                        loss_tolerance, replica_batch_norm, rtol):
    inputs, targets = batch(name, samples, data)
    failures = []
    if runtime.expert_parallel_degree > 1 and samples < replicas * microbatches:
        # Every replica of an expert-parallel group exchanges tokens in each microbatch: refused alike on every rank.
        try:
            model.evaluate(inputs, None if own else targets, loss)
            failures.append(f"evaluation of {samples} under expert parallelism was not refused")
        except smp.ConfigError as error:
            if "expert parallelism's exchanges need every replica" not in str(error):
                failures.append(f"evaluation of {samples}: {error}")
        return failures
    evaluation = model.evaluate(inputs, None if own else targets, loss, keep_outputs=True)
    reference.eval()
    with torch.no_grad():
        outputs, expected = [], 0.0
        for first, rows in itertools.chain(*microbatches_of(samples, replicas, microbatches)):
            piece = rows_of(inputs, first, rows)
            output = reference(**piece) if isinstance(piece, dict) else reference(piece)
            value = output.loss if own else function_loss(name)(output, targets.narrow(0, first, rows))
            expected += value.item() * rows / samples
            outputs.append(output if isinstance(output, torch.Tensor) else output.logits)
    reference.train()
    if abs(evaluation.loss - expected) > loss_tolerance * max(1.0, abs(expected)) and not replica_batch_norm:
        failures.append(f"evaluation of {samples}: loss {evaluation.loss} != {expected}")
    share = runtime.replica_slice(torch.cat(outputs), fill_microbatches=False)
    if evaluation.outputs is not None and not replica_batch_norm:
        kept = evaluation.outputs if isinstance(evaluation.outputs, torch.Tensor) else evaluation.outputs.logits
        kept = kept.cpu()
        if kept.shape != share.shape or not torch.allclose(kept, share, rtol=max(1e-4, rtol), atol=1e-5 + rtol):
            failures.append(f"evaluation of {samples}: kept outputs {tuple(kept.shape)} differ from the model's "
                            f"{tuple(share.shape)}")
    elif evaluation.outputs is None and runtime.config.num_stages() - 1 in model.stages and len(share):
        failures.append(f"evaluation of {samples}: the last stage's rank kept no outputs")
    return failures


def rows_of(inputs, first, rows):
    if isinstance(inputs, torch.Tensor):
        return inputs.narrow(0, first, rows)
    return {key: value.narrow(0, first, rows) for key, value in inputs.items()}


def planned_layout_failures(model, runtime, config):
    """The planner's layout, adopted alike by every rank: each pipeline rank held by as many ranks as there are
    replicas times tensor-parallel ranks, the choice within the config's memory limit."""
    failures = []
    if model.planned is None or runtime.config.auto_keys:
        return ["the \"auto\" keys were not planned"]
    partitions, replicas = runtime.config.partitions, runtime.data_parallel_degree
    shards = runtime.tensor_parallel_degree
    if shards * partitions * replicas != runtime.world_size:
        failures.append(f"tp {shards} x pp {partitions} x dp {replicas} is not the world of {runtime.world_size}")
    held = torch.zeros(partitions, dtype=torch.float64)
    held[runtime.pp_rank] = 1
    runtime.all_reduce_sum(held)
    if held.tolist() != [float(replicas * shards)] * partitions:
        failures.append(f"ranks per pipeline rank {held.tolist()}, not {replicas * shards} each")
    if shards > 1 and not any(hasattr(parameter, "_smp_shard") for parameter in model.parameters()):
        failures.append(f"tensor_parallel_degree {shards} planned, and no parameter is a shard")
    limit = config.get("memory_limit_mb")
    if limit and max(model.planned["memory_mib"]) > limit:
        failures.append(f"the chosen {model.planned['layout']} needs {max(model.planned['memory_mib']):.2f} MiB, "
                        f"over the limit of {limit}")
    return failures


def routing_failures_of_plan(net, found):
    """The plan priced the routing counted on the sample (a line per expert-parallel degree in the report); counts
    given by router path reach the experts module beside the router; and the same profiles predicted with every token
    sent to the first expert make the layouts dividing the experts slower, the others not."""
    from smp import _expert_parallel, _routing
    lines = [line for line in found.report.splitlines() if line.startswith("routing at ep 2: the busiest rank gets ")]
    assert lines, found.report
    assert float(lines[0].split(" gets ")[1].split("x")[0]) > 1.0, lines
    experts = _expert_parallel.experts_modules(net)
    first = sorted(experts)[0]
    router = first.rpartition(".")[0] + ".gate"
    count = experts[first].num_experts
    assert _routing.by_experts_module({router: list(range(count))}, experts) == {first: [list(range(count))]}
    try:
        _routing.by_experts_module({router: [1]}, experts)
    except smp.ConfigError as error:
        assert router in str(error) and first in str(error), error
    else:
        raise AssertionError("counts of the wrong length were taken")
    even = found.with_routing("even")
    assert "routing at ep 2: assumed even" in even.report, even.report
    crowded = found.with_routing({path: [1] + [0] * (module.num_experts - 1) for path, module in experts.items()})
    steps = {name: {row["layout"]: row["step_ms"] for row in plan.layouts if row["rejected"] is None}
             for name, plan in (("even", even), ("crowded", crowded))}
    divided = [layout for layout in steps["even"] if ", ep 2," in layout and layout in steps["crowded"]]
    undivided = [layout for layout in steps["even"] if ", ep " not in layout and layout in steps["crowded"]]
    assert divided and undivided, steps
    assert all(steps["crowded"][layout] > steps["even"][layout] for layout in divided), steps
    assert all(steps["crowded"][layout] == steps["even"][layout] for layout in undivided), steps


# The job's optimizer, which "auto" layouts and --plan price (one moment a parameter, SGD's step).
OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


def print_fastest_layout(name, ranks, config):
    """--plan RANKS: the fastest layout smp.plan predicts for the model on RANKS ranks, and its peak memory; and the
    least peak memory among the fitting layouts of each expert-parallel degree planned that keep the layout keys the
    config fixes ("least_peak_mib_by_ep"; "least_peak_mib_by_tp_ep" by "tp,ep")."""
    torch.manual_seed(0)
    net = vision_model(name) if name in VISION else language_model(name)
    sample, _ = batch(name, 2, torch.Generator().manual_seed(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = smp.plan(net, sample, world_size=ranks, optimizer=OPTIMIZER)
        if config.get("expert_parallel_degree") == "auto":
            # Without token ids the rows exchanged are unknown: planned, but said.
            from smp import _planning
            _planning._mark_experts(_smp.ModelProfile(), net, {"inputs_embeds": torch.zeros(2, 4, 8)}, 1)
    unpriced = [str(warning.message) for warning in caught if "token exchanges" in str(warning.message)]
    if config.get("expert_parallel_degree") == "auto":
        assert len(unpriced) == 1 and "integer token ids in the sample" in unpriced[0], unpriced
        routing_failures_of_plan(net, found)
    least, least_by_tp = {}, {}
    for row in found.layouts:
        keys = json.loads(row["config"])  # the layout keys
        if row["rejected"] is None and all(config[key] in ("auto", value) for key, value in keys.items() if key in config):
            degree = keys["expert_parallel_degree"]
            least[degree] = min(least.get(degree, float("inf")), max(row["memory_mib"]))
            both = f"{keys['tensor_parallel_degree']},{degree}"
            least_by_tp[both] = min(least_by_tp.get(both, float("inf")), max(row["memory_mib"]))
    print(json.dumps({"model": name, "layout": found.best["layout"], "peak_mib": max(found.best["memory_mib"]),
                      "least_peak_mib_by_tp_ep": least_by_tp,
                      "least_peak_mib_by_ep": least}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--smp", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss", choices=["own", "fn"], default="own")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--lengths", help="comma-separated sequence lengths, one step each (language models), in "
                                          "place of --steps steps of the sample's length")
    parser.add_argument("--short-last", type=int, help="the last step's global batch, smaller than the others")
    parser.add_argument("--eval-samples", help="comma-separated batches to evaluate on (default: --short-last's, "
                                               "else the global batch)")
    parser.add_argument("--plan", type=int, help="print the fastest layout on this many ranks (smp.plan) and exit")
    args = parser.parse_args()
    config = json.loads(args.smp)
    torch.set_num_threads(1)
    if config.get("device") == "cuda" and not torch.cuda.is_available():
        print("skipped: the config asks for a GPU and torch sees none", flush=True)
        sys.exit(77)
    runtime = smp.init(config)
    if args.plan:
        for name in args.models.split(","):
            print_fastest_layout(name, args.plan, config)
        return
    failures = []
    for name in args.models.split(","):
        failures += [f"{name}: {failure}" for failure in train_and_compare(name, args, config, runtime)]
    sys.exit(report.finish(failures))


def train_and_compare(name, args, config, runtime):
    # Under "auto" layout keys the layout is the planner's, known once the model is: until then one rank's share.
    # The job's first model fixes it for the models after it.
    planned = bool(runtime.config.auto_keys)
    microbatches, replicas = (1, runtime.world_size) if planned else (runtime.config.microbatches,
                                                                       runtime.data_parallel_degree)
    global_batch = config["global_batch_size"]
    vision = name in VISION
    own = args.loss == "own" and not vision

    torch.manual_seed(config.get("seed", 0))
    build = (lambda: vision_model(name)) if vision else (lambda: language_model(name))
    if args.meta:
        with torch.device("meta"):
            net, reference = build(), build()
        # Hugging Face models initialize with their own _init_weights; torchvision's modules with reset_parameters(),
        # and what a model holds itself (ViT's class token) from a normal distribution.
        init_fn = (lambda model: model._init_weights) if not vision else (lambda model: initialize_vision_module)
        smp.materialize(reference, "cpu", config.get("seed", 0), init_fn=init_fn(reference))
        net_init = init_fn(net)
    else:
        net = build()
        reference = copy.deepcopy(net)
        net_init = None
    net.train()
    reference.train()
    data = torch.Generator().manual_seed(11)
    sample_inputs, _ = batch(name, global_batch // (replicas * microbatches), torch.Generator().manual_seed(5))

    # Batch norm under data parallelism: each replica's running statistics follow its own share of the batch (as
    # under DDP without SyncBatchNorm), so evaluation, which reads them, differs from one process.
    replica_batch_norm = replicas > 1 and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                              for m in net.modules())
    # The GPU's float32 kernels round otherwise than the CPU's the plain model runs on.
    loss_tolerance = args.rtol if config.get("bf16") or config.get("fp16") or config.get("device") == "cuda" else 1e-5
    model = smp.DistributedModel(net, sample_inputs, init_fn=net_init, plan_optimizer=OPTIMIZER,
                                 dynamic_shapes="batch" if name in BATCH_ALONE_FREE else None)
    failures = []
    if planned:
        microbatches, replicas = runtime.config.microbatches, runtime.data_parallel_degree
        failures += planned_layout_failures(model, runtime, config)
    optimizer = smp.DistributedOptimizer(OPTIMIZER(model.parameters()))
    reference_optimizer = OPTIMIZER(reference.parameters())
    loss = None if own else function_loss(name)
    if runtime.rank == 0:
        print(f"{name}:\n{model.partition_report()}")

    if args.meta:
        # This rank made real exactly the parameters of its own stages; the rest stayed on the meta device.
        real = {path for path, p in net.named_parameters() if not p.is_meta}
        if real != set(dict(model.named_parameters())):
            failures.append(f"real parameters {sorted(real ^ set(dict(model.named_parameters())))[:3]} are not this rank's")
    lengths = [int(length) for length in args.lengths.split(",")] if args.lengths else [SEQUENCE] * args.steps
    for step, length in enumerate(lengths):
        samples = args.short_last if args.short_last and step == len(lengths) - 1 else global_batch
        inputs, targets = batch(name, samples, data, length)
        optimizer.zero_grad()
        result = model.train_step(inputs, None if own else targets, loss)
        optimizer.step()

        # Plain PyTorch: the same microbatches, gradients accumulated over each replica's and averaged over the
        # replicas (the order data parallelism sums in: ResNet's batch norms over two samples turn the other order's
        # rounding into 1e-4 relative after three steps, in plain PyTorch alike), one step. Each microbatch counts by
        # its samples: a batch that does not split evenly has microbatches of two sizes.
        expected = 0.0
        replica_gradients = []
        for share in microbatches_of(samples, replicas, microbatches):
            reference_optimizer.zero_grad()
            for first, rows in share:
                piece = rows_of(inputs, first, rows)
                output = reference(**piece) if isinstance(piece, dict) else reference(piece)
                value = output.loss if own else function_loss(name)(output, targets.narrow(0, first, rows))
                (value * (rows * replicas / samples)).backward()
                expected += value.item() * rows / samples
            replica_gradients.append([p.grad for p in reference.parameters()])
        for parameter, gradients in zip(reference.parameters(), zip(*replica_gradients)):
            present = [g for g in gradients if g is not None]
            parameter.grad = sum(present[1:], present[0]) / replicas if present else None
        reference_optimizer.step()
        if abs(result.loss - expected) > loss_tolerance * max(1.0, abs(expected)):
            failures.append(f"step {step}: loss {result.loss} != {expected}")
        if name in MOE:
            failures += routing_failures(reference, result, len(runtime.replica_slice(torch.arange(samples))) * length *
                                         TOP_K, samples * length * TOP_K, runtime)
        if runtime.rank == 0:
            print(f"{name} step {step} loss {result.loss:.6f} plain {expected:.6f}", flush=True)

    # Validation: eval mode (dropout off, batch norm on its running statistics), the outputs kept on the last stage;
    # on the short last batch's size when there is one (an epoch's last validation batch), or on each of
    # --eval-samples (a batch too short to fill every replica's microbatches evaluates on fewer, and a replica left
    # no sample evaluates none).
    sizes = [int(size) for size in args.eval_samples.split(",")] if args.eval_samples else \
        [args.short_last or global_batch]
    for samples in sizes:
        failures += evaluation_failures(model, reference, name, own, loss, samples, data, replicas, microbatches,
                                        runtime, loss_tolerance, replica_batch_norm, args.rtol)

    if hasattr(net, "save_pretrained") and len(model.stages) < runtime.config.num_stages():
        # This rank's share of the model: saving it as a whole is refused, naming the export, and writes nothing
        # (Hugging Face's wrote its config, then failed on the first released tensor).
        import tempfile
        with tempfile.TemporaryDirectory() as directory:
            try:
                net.save_pretrained(directory)
                failures.append("save_pretrained of this rank's share was not refused")
            except smp.ModelError as error:
                if "smp.export_safetensors" not in str(error) or os.listdir(directory):
                    failures.append(f"save_pretrained: {error}; wrote {os.listdir(directory)}")

    plain = dict(reference.named_parameters())
    experts_shared = runtime.expert_parallel_degree  # the config's, or the planner's for "auto"
    if experts_shared > 1:
        # Expert parallelism: this rank holds its share of every experts tensor, the rest whole.
        held = dict(model.named_parameters())
        divided = {path for path, p in held.items() if hasattr(p, "_smp_expert_shard")}
        stacked = {path for path in held if ".experts." in path and "shared" not in path}
        # A rank whose stages hold only dense layers (DeepSeek-V3's first) divides nothing; some rank must.
        if divided != stacked:
            failures.append(f"expert shards {sorted(divided ^ stacked)[:3]} are not the experts tensors")
        holders = torch.tensor([1.0 if divided else 0.0])
        runtime.all_reduce_sum(holders)
        if holders.item() == 0:
            failures.append("no rank holds a share of the experts")
        for path in divided:
            if held[path].shape[0] * experts_shared != plain[path].shape[0]:
                failures.append(f"{path} holds {held[path].shape[0]} experts")
    if runtime.config.shard_optimizer_state and replicas > 1:  # the adopted layout's, "auto" decided
        # ZeRO-1: of the replicas holding a parameter (the same tensor-parallel shard, the same share of the
        # experts, the same pipeline rank's copy of a tied one), exactly one replica's optimizer keeps its state.
        local = dict(model.named_parameters())
        kept = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names = sorted(plain)
        keepers = torch.tensor([float(name in local and id(local[name]) in kept) for name in names],
                               dtype=torch.float64)
        holders = torch.tensor([float(name in local) for name in names], dtype=torch.float64)
        runtime.all_reduce_sum(keepers)
        runtime.all_reduce_sum(holders)
        for name, count, held_by in zip(names, keepers.tolist(), holders.tolist()):
            # Every rank holding it, over the replicas; a share of the experts is held by its own replicas only.
            expected = held_by / replicas * (experts_shared if ".experts." in name and "shared" not in name else 1)
            if count != expected:
                failures.append(f"{name}: {count:.0f} optimizers keep its state, not {expected:.0f}")
    # The ranks' state_dicts together are the model's: each of its keys on some rank (a tied tensor's every name),
    # and nothing else (no constant the capture lifted out of the forward).
    keys = sorted(reference.state_dict())
    mine = set(model.state_dict())
    if mine - set(keys):
        failures.append(f"state_dict keys the model does not have: {sorted(mine - set(keys))[:3]}")
    held = torch.tensor([float(key in mine) for key in keys], dtype=torch.float64)
    runtime.all_reduce_sum(held)
    if (held == 0).any():
        failures.append(f"state_dict keys on no rank: {[key for key, n in zip(keys, held.tolist()) if n == 0][:3]}")
    checked = 0
    for path, parameter in model.named_parameters():
        if path not in plain:
            failures.append(f"parameter {path} is not the model's")
            continue
        want = smp.tp.local_part(parameter, plain[path].detach())  # a tensor-parallel shard: its part
        difference = (parameter.detach().cpu() - want).abs().max().item()
        if difference > 1e-6 + args.rtol * want.abs().max().item():
            failures.append(f"parameter {path} differs by {difference:.3g}")
        checked += 1
    if checked == 0:
        failures.append("no parameters on this rank")
    return failures


if __name__ == "__main__":
    main()
