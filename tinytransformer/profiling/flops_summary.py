"""What run_deepspeed_flops.py prints: DeepSpeed's FLOP count beside the analytic one, achieved TFLOP/s and MFU,
and arithmetic intensity; printed after a run, and again from a saved flops_profile.json (--analyze-results).
"""
from __future__ import annotations

from ..flops import ATTENTION_MATMULS, FFN_MATMULS
from .result_fields import Fields
from .tables import format_table

DEEPSPEED_VS_ANALYTIC = (
    "DeepSpeed counts what passes through the torch functions it intercepts: besides the matrix products "
    "(2 FLOPs per multiply-add, as in the analytic count) it adds one FLOP per element of softmax, SiLU and "
    "torch.mul/add calls, it misses the loss and the Python * and + operators, and it cannot see inside "
    "custom Triton kernels, so a ratio slightly above 1 is expected for a PyTorch model and a ratio well "
    "below 1 means part of the work ran where DeepSpeed cannot look.")


def compare_parts(deepspeed_result: dict, analytic: dict) -> list[dict]:
    """DeepSpeed's FLOPs of a module beside the analytic FLOPs of the same part, where the module exists."""
    per_layer = analytic["per_layer"]
    expected = {
        "layers.0.attention": ("attention of one layer", sum(per_layer[k] for k in ATTENTION_MATMULS)),
        "layers.0.feed_forward": ("feed-forward of one layer", sum(per_layer[k] for k in FFN_MATMULS)),
        "layers.0": ("one layer", analytic["per_layer_total"]),
        "lm_head": ("output head", analytic["output_head"]),
    }
    measured = {row["module"]: row["flops"] for row in deepspeed_result["modules"]}
    rows = [{"part": label, "module": module, "analytic_flops": count, "deepspeed_flops": measured[module],
             "ratio": measured[module] / count if count else None}
            for module, (label, count) in expected.items() if module in measured]
    rows.append({"part": "whole forward pass", "module": "(model)", "analytic_flops": analytic["forward_flops"],
                 "deepspeed_flops": deepspeed_result["forward_flops"],
                 "ratio": deepspeed_result["forward_flops"] / analytic["forward_flops"]})
    return rows


def check_flops_profile(result, file) -> dict:
    """`result` (a flops_profile.json read back from `file`) unchanged, once every field flops_summary prints is
    checked: a file edited by hand or cut short is one line naming the field, not a traceback mid-summary."""
    saved = Fields(result, file, what="a flops_profile.json written by run_deepspeed_flops.py")
    for key in ("version", "title", "precision"):
        saved.text(key)
    saved.section("device").text("name")
    saved.integer("batch_size", 1)
    saved.integer("seq_len", 1)
    _check_deepspeed_part(saved.section("deepspeed"))
    _check_analytic_part(saved.section("analytic"))
    comparison = saved.section("comparison")
    comparison.number("deepspeed_over_analytic", minimum=0.0, optional=True)
    comparison.text("explanation")
    for part in comparison.items("parts", optional=True) or []:
        part.text("part")
        part.text("module")
        part.number("analytic_flops", minimum=0.0)
        part.number("deepspeed_flops", minimum=0.0)
        part.number("ratio", minimum=0.0, optional=True)
    _check_throughput_part(saved.section("timing"), saved.section("throughput"))
    intensity = saved.section("intensity", optional=True)
    if intensity is not None:
        intensity.number("ridge_flops_per_byte", minimum=0.0, optional=True)
        intensity.text("byte_model")
        intensity.number("bytes_per_element", positive=True)
        intensity.items("rows")
    roofline = saved.section("roofline", optional=True)
    if roofline is not None:
        roofline.text("path", optional=True) or roofline.text("message")
    saved.scalars("files", optional=True)
    return result


def _check_deepspeed_part(deepspeed: Fields) -> None:
    if not deepspeed.flag("available"):
        deepspeed.text("message")
        return
    deepspeed.number("forward_flops", minimum=0.0)
    deepspeed.number("forward_macs", minimum=0.0)
    deepspeed.integer("params", 0)
    deepspeed.number("forward_latency_ms", minimum=0.0)
    deepspeed.text("model_profile")
    for row in deepspeed.items("modules"):
        row.text("module")
        for key in ("params", "flops", "macs", "latency_ms"):
            row.number(key, minimum=0.0)


def _check_analytic_part(analytic: Fields) -> None:
    per_layer = analytic.scalars("per_layer")
    for name in per_layer:
        analytic.section("per_layer").number(name, minimum=0.0)
    analytic.number("per_layer_total", positive=True)
    analytic.integer("num_layers", 1)
    for key in ("output_head", "forward_flops", "training_flops"):
        analytic.number(key, positive=True)
    analytic.text("conventions")


def _check_throughput_part(timing: Fields, throughput: Fields) -> None:
    if timing.number("median_ms", positive=True, optional=True) is None:
        return   # no timed steps: the summary says so and prints no figures
    for key in ("p10_ms", "p90_ms"):
        timing.number(key, positive=True)
    timing.integer("count", 1)
    timing.integer("warmup_steps", 0)
    for key in ("training_tflops_per_s", "samples_per_s", "tokens_per_s"):
        throughput.number(key, positive=True)
    if throughput.number("mfu", minimum=0.0, optional=True) is not None:
        throughput.number("peak_tflops", positive=True)


def gflop(count: float | None) -> str:
    return "n/a" if count is None else f"{count / 1e9:.4f} GFLOP"


def flops_summary(result: dict) -> list[str]:
    """The printed summary of a flops_profile.json: (a) DeepSpeed's count, (b) the analytic count and the two
    compared, (c) achieved TFLOP/s and MFU, (d) arithmetic intensity and the roofline, then the files."""
    ds, analytic, comparison = result["deepspeed"], result["analytic"], result["comparison"]
    t, tp = result["timing"], result["throughput"]
    lines = [f"=== FLOPs and MFU: {result['version']} ({result['title']}) on {result['device']['name']}, "
             f"{result['precision']}, batch {result['batch_size']} x seq {result['seq_len']} ==="]

    lines += ["", "--- (a) DeepSpeed FLOPS profiler, one forward pass ---"]
    if ds["available"]:
        lines.append(f"forward FLOPs {gflop(ds['forward_flops'])}, MACs {ds['forward_macs'] / 1e9:.4f} G, "
                     f"parameters {ds['params']:,}, forward latency {ds['forward_latency_ms']:.2f} ms "
                     f"(with DeepSpeed's per-module synchronisation)")
        shown = [{**row, "latency_us": 1e3 * row["latency_ms"]} for row in ds["modules"]]
        lines.append(format_table(shown, ["module", "params", "flops", "macs", "latency_us"]))
        lines.append(f"every module in detail: {ds['model_profile']}")
    else:
        lines.append(ds["message"])

    lines += ["", "--- (b) analytic count (tinytransformer/flops.py: " + analytic["conventions"] + ") ---"]
    per_layer = analytic["per_layer_total"]
    rows = [{"matmul": name, "flops": value, "pct_of_layer": 100 * value / per_layer}
            for name, value in analytic["per_layer"].items()]
    lines.append(format_table(rows, ["matmul", "flops", "pct_of_layer"]))
    lines.append(f"one layer {gflop(per_layer)} x {analytic['num_layers']} layers + output head "
                 f"{gflop(analytic['output_head'])} = forward {gflop(analytic['forward_flops'])}; "
                 f"training step (3 x forward) {gflop(analytic['training_flops'])}")
    if comparison["deepspeed_over_analytic"] is not None:
        ratio = comparison["deepspeed_over_analytic"]
        lines.append(f"DeepSpeed / analytic = {ratio:.4f}")
        if comparison.get("parts"):
            shown = [{**row, "ratio": "-" if row["ratio"] is None else f"{row['ratio']:.4f}"}
                     for row in comparison["parts"]]   # four decimals: the differences are small
            lines.append(format_table(shown, ["part", "module", "analytic_flops", "deepspeed_flops",
                                              ("ratio", "deepspeed/analytic")]))
        lines.append(comparison["explanation"])
        if ratio < 0.9:
            lines.append("note: DeepSpeed sees less than the matrix products alone: part of this model runs "
                         "in code it cannot intercept (custom Triton kernels, or a compiled graph)")

    lines += ["", "--- (c) training throughput ---"]
    if t["median_ms"] is None:
        lines.append("no timed steps")
    else:
        lines.append(f"step time: median {t['median_ms']:.3f} ms (p10 {t['p10_ms']:.3f}, p90 {t['p90_ms']:.3f}) "
                     f"over {t['count']} steps after {t['warmup_steps']} warm-up")
        lines.append(f"achieved: {tp['training_tflops_per_s']:.4f} TFLOP/s (analytic training FLOPs / median "
                     f"step time), {tp['samples_per_s']:.1f} samples/s, {tp['tokens_per_s']:,.0f} tokens/s")
        if tp["mfu"] is not None:
            lines.append(f"MFU: {100 * tp['mfu']:.2f}% of {tp['peak_tflops']:g} TFLOP/s "
                         f"({result['precision']} data-sheet peak of this device)")
        else:
            lines.append("MFU: unknown (no peak for this device)")

    intensity = result.get("intensity")
    if intensity:
        ridge = intensity["ridge_flops_per_byte"]
        lines += ["", "--- (d) arithmetic intensity of one layer's matrix products (forward) ---"]
        lines.append(f"byte model: {intensity['byte_model']}; {intensity['bytes_per_element']} bytes per "
                     f"element ({result['precision']})")
        lines.append(format_table(intensity["rows"], ["matmul", "shape", "flops", "bytes", "flops_per_byte",
                                                      "bound"]))
        lines.append(f"ridge point: {ridge:.1f} FLOP/byte (peak FLOP/s / memory bandwidth); below it a product "
                     "is memory-bound" if ridge else
                     "ridge point: unknown (no peak FLOP/s or bandwidth for this device), so no bound column")
    roofline = result.get("roofline")
    if roofline:
        lines.append(f"roofline: {roofline['path']}" if roofline["path"] else roofline["message"])
    if result.get("files"):
        lines += ["", "--- Files ---"] + [f"{name:<18}: {path}" for name, path in result["files"].items()]
    return lines
