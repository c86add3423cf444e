"""smp.plan in one process (run under `smprun -n 1`): an unmodified Hugging Face Llama (4 layers) planned for 4
ranks; every layout is one of 4 ranks, fitting ones come fastest first, and a memory limit under the fastest's peak
rejects it, naming the limit, and chooses one that fits. Exits 0 when every check holds; prints each failure."""

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
    if "chosen: " + found.best["layout"] not in str(found):
        failures.append("the report does not name the choice")
    svg = found.timeline_svg or ""
    if not svg.startswith("<svg") or "planned: " + found.best["layout"] not in svg:
        failures.append(f"the best layout's simulated timeline is no SVG naming it: {svg[:120]!r}")
    if any(layout["timeline_svg"] for layout in found.layouts[1:]):
        failures.append("a timeline drawn for a layout other than the best")

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
    sys.exit(report.finish(failures, label="plan_check"))


if __name__ == "__main__":
    main()
