"""smp.plan in one process (run under `smprun -n 1`): an unmodified Hugging Face Llama (4 layers) planned for 4
ranks; every layout is one of 4 ranks, fitting ones come fastest first, and a memory limit under the fastest's peak
rejects it, naming the limit, and chooses one that fits. Exits 0 when every check holds; prints each failure."""

import functools
import json
import sys

import torch

import report
import smp


def main():
    import transformers as hf
    torch.set_num_threads(1)
    torch.manual_seed(0)
    smp.init({"global_batch_size": 16})
    net = hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    ids = torch.randint(0, 256, (2, 32))
    sample = {"input_ids": ids, "labels": ids}
    failures = []

    # Arguments a plan cannot take fail at once, naming the argument, before the model is profiled.
    for bad, named in ((dict(world_size=0), "world_size 0"), (dict(global_batch_size=2**31 - 1), "global_batch_size"),
                       (dict(device_speeds=[1, 1]), "2 speeds for a world of 4"),
                       (dict(device_speeds="measure"), "device_speeds 'measure'"), (dict(compute_scale=0), "compute_scale"),
                       (dict(optimizer="sgd"), "optimizer 'sgd'"),
                       (dict(memory_limit_mb=float("inf")), "memory_limit_mb inf"),
                       (dict(memory_limit_mb=True), "memory_limit_mb True")):
        try:
            smp.plan(net, sample, **{"world_size": 4, **bad})
            failures.append(f"smp.plan accepted {bad}")
        except smp.ConfigError as error:
            if named not in str(error):
                failures.append(f"smp.plan({bad}): {error} does not name {named!r}")

    found = smp.plan(net, sample, world_size=4)
    print(found, flush=True)
    fitting = [layout for layout in found.layouts if layout["rejected"] is None]
    if not fitting or found.best is not fitting[0]:
        failures.append(f"best {found.best} is not the first fitting layout")
    if any(a["step_ms"] > b["step_ms"] for a, b in zip(fitting, fitting[1:])):
        failures.append("fitting layouts are not in order of predicted step")
    for layout in found.layouts:
        keys = json.loads(layout["config"])
        if "partitions" not in keys or not layout["layout"].startswith("pp "):
            failures.append(f"layout {layout} lacks its config")
        pp, dp = (int(part.split()[1]) for part in layout["layout"].split(",")[0].split(" x "))
        if pp * dp != 4 or len(layout["memory_mib"]) != pp:
            failures.append(f"{layout['layout']}: not 4 ranks, or memory of {len(layout['memory_mib'])} ranks")
    # Captured on 2 rows, export's range says at least 2 (it keeps sizes 0 and 1 apart), which its programs do not
    # enforce: layouts of 1-sample microbatches are planned (16 samples over 4 replicas of 4 microbatches).
    ones = [layout for layout in found.layouts if layout["layout"] == "pp 1 x dp 4, gpipe, m 4"]
    if not ones or ones[0]["rejected"] is not None:
        failures.append(f"no layout of 1-sample microbatches planned: {[l['layout'] for l in found.layouts][:8]}, "
                        f"{ones[0]['rejected'] if ones else ''}")
    if "chosen: " + found.best["layout"] not in str(found):
        failures.append("the report does not name the choice")
    svg = found.timeline_svg or ""
    if not svg.startswith("<svg") or "planned: " + found.best["layout"] not in svg:
        failures.append(f"the best layout's simulated timeline is no SVG naming it: {svg[:120]!r}")
    if any(layout["timeline_svg"] for layout in found.layouts[1:]):
        failures.append("a timeline drawn for a layout other than the best")

    # The job's optimizer, timed and sized as it keeps its state: SGD with momentum holds one moment, not AdamW's
    # two, so the one-stage layout's rank needs a parameter's worth less (one plan, of one tensor-parallel degree;
    # a pipeline's cut may move with its stages' memory).
    adamw = smp.plan(net, sample, world_size=4, tensor_parallel_degrees=[1])
    sgd = smp.plan(net, sample, world_size=4, tensor_parallel_degrees=[1],
                   optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    parameter_mib = sum(p.numel() * 4 for p in net.parameters()) / 2**20
    with_sgd = {layout["layout"]: layout for layout in sgd.layouts}
    compared = [layout for layout in adamw.layouts if layout["layout"] == "pp 1 x dp 4, gpipe, m 1"]
    for first in compared:
        saved = sum(first["memory_mib"]) - sum(with_sgd[first["layout"]]["memory_mib"])
        if abs(saved - parameter_mib) > 0.01 * parameter_mib:
            failures.append(f"{first['layout']}: SGD with momentum needs {saved:.3f} MiB less than AdamW over its "
                            f"stages, not one parameter's worth ({parameter_mib:.3f} MiB)")
    if not compared:
        failures.append(f"no one-stage layout among {[layout['layout'] for layout in adamw.layouts]}")

    # A frozen backbone (all but the head, as LoRA's base weights): its parameters are held without gradients or
    # Adam's moments, so the one-stage layout's rank needs at least the two moments' worth less.
    for parameter in net.model.parameters():
        parameter.requires_grad_(False)
    frozen = smp.plan(net, sample, world_size=4, tensor_parallel_degrees=[1])
    for parameter in net.model.parameters():
        parameter.requires_grad_(True)
    frozen_mib = sum(p.numel() * 4 for p in net.model.parameters()) / 2**20
    with_frozen = {layout["layout"]: layout for layout in frozen.layouts}
    for first in compared:
        saved = sum(first["memory_mib"]) - sum(with_frozen[first["layout"]]["memory_mib"])
        if saved < 2 * frozen_mib:
            failures.append(f"{first['layout']}: a frozen backbone of {frozen_mib:.3f} MiB needs {saved:.3f} MiB "
                            f"less than the model trained whole, under its optimizer state's {2 * frozen_mib:.3f}")

    limit = max(found.best["memory_mib"]) - 0.01
    limited = smp.plan(net, sample, world_size=4, memory_limit_mb=limit)
    if limited.best is None or max(limited.best["memory_mib"]) > limit:
        failures.append(f"under {limit:.2f} MiB the choice {limited.best} does not fit")
    # Each layout fits the limit or is rejected naming memory, and some are (the second plan profiles again: a
    # pipeline's cut, and so its ranks' memory, may move with the timings, so the first plan's best need not be).
    rejected = [layout for layout in limited.layouts if layout["rejected"] is not None]
    if not any("memory" in layout["rejected"] for layout in rejected):
        failures.append(f"no layout rejected for memory under {limit:.2f} MiB")
    for layout in limited.layouts:
        if layout["rejected"] is None and max(layout["memory_mib"]) > limit:
            failures.append(f"{layout['layout']} needs {max(layout['memory_mib']):.2f} MiB, over the limit "
                            f"{limit:.2f}, and is not rejected")
        elif layout["rejected"] is not None and "memory" not in layout["rejected"]:
            failures.append(f"{layout['layout']} rejected for another reason: {layout['rejected']}")

    # Tensor parallelism among the layouts: each degree's copy sharded by Llama's own plan and profiled alone; 4 does
    # not divide its 2 key-value heads and is left out, saying why.
    sharded = smp.plan(net, sample, world_size=4, tensor_parallel_degrees=[2, 4])
    print(sharded, flush=True)
    degrees = {}
    for layout in sharded.layouts:
        keys = json.loads(layout["config"])
        degree = keys["tensor_parallel_degree"]
        degrees[degree] = degrees.get(degree, 0) + 1
        replicas = layout["layout"].split(" x dp ")[1].split(",")[0]
        if degree * keys["partitions"] * int(replicas) != 4:
            failures.append(f"{layout['layout']}: not 4 ranks")
        if degree > 1 and not layout["layout"].startswith(f"tp {degree} x pp "):
            failures.append(f"{layout['layout']}: does not name its tensor-parallel degree {degree}")
    if set(degrees) != {2}:
        failures.append(f"layouts of tensor-parallel degrees {sorted(degrees)}, not 2 alone")
    if "2 key/value heads (num_key_value_heads) do not divide" not in sharded.unplanned_degrees.get(4, "") or "tp 4: not planned" not in str(sharded):
        failures.append(f"degree 4 is not left out naming the heads: {sharded.unplanned_degrees}")
    # A shard holds half of the sharded layers' parameters, state and activations: recomputing microbatches of the
    # same 4 samples (one held at a time), a tp 2 layout's ranks hold less than the whole model's.
    whole = next(layout for layout in found.layouts if layout["layout"] == "pp 1 x dp 4, gpipe, m 1, recompute")
    halves = next(layout for layout in sharded.layouts
                  if layout["layout"] == "tp 2 x pp 1 x dp 2, gpipe, m 2, recompute")
    if not max(halves["memory_mib"]) < max(whole["memory_mib"]):
        failures.append(f"tp 2 needs {halves['memory_mib']} MiB, not less than one process's {whole['memory_mib']}")

    # Three stages of Linear, ReLU, Linear leave one rank without parameters, whose optimizer torch.optim refuses:
    # those layouts are out, saying so.
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    three = smp.plan(tiny, torch.randn(2, 8), world_size=3, global_batch_size=6)
    for layout in three.layouts:
        if layout["layout"].startswith("pp 3 ") and "would hold no parameters (" not in (layout["rejected"] or ""):
            failures.append(f"{layout['layout']} leaves a rank without parameters: {layout['rejected']}")
    if three.best is None or not three.best["layout"].startswith("pp 1 "):
        failures.append(f"3 ranks of Linear, ReLU, Linear: chose {three.best and three.best['layout']}")
    sys.exit(report.finish(failures, label="plan_check"))


if __name__ == "__main__":
    main()
