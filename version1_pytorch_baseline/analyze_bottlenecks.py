"""A bottleneck report from a PyTorch-profiler trace: where a training step's time goes, and what to fix first.

    python tiny_llama_v1.py --enable-pytorch-profiler --profile-dir pytorch_profiles --num-steps 30
    python analyze_bottlenecks.py --profile-data pytorch_profiles/ --output-report bottlenecks_v1.md

--profile-data is a trace file (trace_v1.json, *.pt.trace.json, .gz too) or a directory holding one (the newest
is used). The tables come from tinytransformer/profiling/analysis.py, the same analysis as
run_pytorch_profiler.py; this script adds the judgement: a prioritised list of optimisation targets, each with
the evidence from the trace and the change that addresses it (and the version of the workshop that makes that
change).

The first question is always whether the GPU is the bottleneck at all. GPU busy = the sum of kernel times per
step / the step's wall time as the host saw it. Far below 100% means the GPU mostly waits for the host to
launch the next kernel: the run is launch-bound, and the cure is fewer launches, whatever each kernel costs.
Only then does it pay to ask which part of the model (attention, feed-forward, norms, ...) takes the most GPU
time. On a CPU trace there is no GPU time: the parts are ranked by the host's time instead.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.checks import ConfigError  # noqa: E402
from tinytransformer.cli import OneLineParser, non_negative_float, positive_int  # noqa: E402
from tinytransformer.outputs import write_atomically, write_json  # noqa: E402
from tinytransformer.paths import prove_outputs, refuse_output_over_input  # noqa: E402
from tinytransformer.profiling import analysis  # noqa: E402
from tinytransformer.profiling.trace import TraceError, load_trace, resolve_trace_argument  # noqa: E402

LAUNCH_BOUND_BUSY = 0.5      # GPU busy below this: launch-bound
MIN_SHARE_PERCENT = 3.0      # parts taking less of the step than this are not listed as targets

# Model part / phase -> (what it is, the change that shrinks it and where the workshop makes it).
REMEDIES = {
    "attention": ("attention (projections, scores, softmax, values)",
                  "one fused QKV GEMM and a flash-attention kernel that never writes the S x S scores "
                  "(F.scaled_dot_product_attention: version 2; a Triton flash attention: version 3)"),
    "ffn": ("SwiGLU feed-forward",
            "one fused gate/up GEMM (version 2) and a single SiLU-times-up kernel reading it in place (version 3)"),
    "rmsnorm": ("RMSNorm",
                "one RMSNorm kernel instead of about six element-wise ones (version 3), fused with the residual "
                "add before it (version 4)"),
    "rope": ("rotary position embedding",
             "one RoPE kernel for q and k (version 3), or rotating q and k inside attention as they are loaded "
             "(version 4)"),
    "output_head": ("output head (LM head GEMM)",
                    "fuse the head with the loss in chunks so the float32 logits never exist (version 4)"),
    "loss": ("cross-entropy loss",
             "fuse the loss into the head (version 4); the gradient is then written during the forward pass"),
    "forward_other": ("rest of the forward pass (embedding, residual adds)",
                      "fold the residual adds into the norm kernels (version 4)"),
    "backward": ("backward pass",
                 "it mirrors the forward pass: every forward fusion that comes with its own backward kernel "
                 "(versions 3 and 4) shrinks it too; rank the forward parts to decide which"),
    "optimizer": ("optimizer (AdamW)",
                  "a fused AdamW, one kernel for all parameters (torch.optim.AdamW(fused=True), or version 4's "
                  "Triton AdamW, which also writes the bfloat16 weight copies), or "
                  "a captured step (CUDA/HIP graph)"),
    "other": ("outside forward, backward and optimizer", "usually small; check the top operators"),
}
LAUNCH_REMEDY = ("fewer launches per step: fused GEMMs and attention (version 2), Triton kernels that each "
                 "replace several PyTorch ops (version 3), and the whole step captured once and replayed as a "
                 "CUDA/HIP graph (version 4; torch.compile(mode='reduce-overhead') does it for version 2)")
# Operator names that point at a known inefficiency, and what they say.
OPERATOR_CLUES = {
    "attention": [("aten::_softmax", "an explicit softmax over the materialised S x S scores"),
                  ("aten::bmm", "batched matmuls for the scores and values")],
    "rmsnorm": [("aten::rsqrt", "RMSNorm written as separate pow / mean / rsqrt / mul kernels")],
    "optimizer": [("aten::_foreach_mul_", "the multi-tensor (foreach) AdamW: several kernels per step")],
    "loss": [("aten::_log_softmax", "a separate log-softmax over the float32 logits")],
}


# ----------------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------------
def step_numbers(trace) -> dict:
    """Per-step headline numbers: host time, GPU time, GPU busy fraction, kernels and operators."""
    summary = analysis.summarize(trace)
    host_us = summary["step_us_mean"]
    gpu_us = summary["device_us_per_step"]
    busy = gpu_us / host_us if (gpu_us is not None and host_us) else None
    return {"steps": summary["steps"], "host_us_per_step": host_us, "gpu_us_per_step": gpu_us, "gpu_busy": busy,
            "kernels_per_step": summary["kernels_per_step"], "operators_per_step": summary["operators_per_step"],
            "has_device": summary["has_device"]}


def kernels_by_phase(trace) -> dict[str, list[tuple[str, float]]]:
    """phase -> [(kernel name, us per profiled step)], longest first (GPU traces only)."""
    steps = max(1, len(analysis.profiler_steps(trace)))
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for kernel in analysis.device_kernels(trace, include_memory_ops=False):
        if kernel["step"] is not None:
            totals[kernel["phase"]][kernel["name"]] += kernel["dur_us"] / steps
    return {phase: sorted(names.items(), key=lambda item: -item[1]) for phase, names in totals.items()}


def launch_target(numbers: dict) -> dict | None:
    """The launch-overhead target, when the GPU is idle for most of the step."""
    busy = numbers["gpu_busy"]
    if busy is None or busy >= LAUNCH_BOUND_BUSY:
        return None
    host_ms = numbers["host_us_per_step"] / 1e3
    kernels = numbers["kernels_per_step"] or 0
    per_kernel = (numbers["host_us_per_step"] - numbers["gpu_us_per_step"]) / kernels if kernels else None
    evidence = (f"the GPU is busy {100 * busy:.0f}% of the {host_ms:.2f} ms step "
                f"({numbers['gpu_us_per_step']:.0f} us of kernels); {kernels:.0f} kernels per step"
                + (f", about {per_kernel:.1f} us of host time per kernel" if per_kernel else "")
                + " (the profiled step includes the profiler's own overhead)")
    return {"target": "launch overhead (the host, not the GPU, sets the pace)", "key": "launch",
            "share_percent": 100 * (1 - busy), "evidence": evidence, "remedy": LAUNCH_REMEDY}


def phase_targets(trace, min_share: float) -> list[dict]:
    """One target per model part / phase above min_share percent, largest first."""
    phases = analysis.phase_split(trace)
    kernels = kernels_by_phase(trace) if phases["basis"] == "device" else {}
    operators = {row["name"] for row in analysis.top_operators(trace, limit=None)}
    unit = "GPU" if phases["basis"] == "device" else "host (CPU self time)"
    targets = []
    for row in sorted(phases["rows"], key=lambda r: -r["us"]):
        if row["pct"] < min_share or row["phase"] == "other":
            continue
        label, remedy = REMEDIES[row["phase"]]
        per_step = row["us_per_step"]
        evidence = [f"{row['pct']:.1f}% of the {unit} time"
                    + (f", {per_step:.0f} us per step" if per_step is not None else "")]
        top = kernels.get(row["phase"], [])[:2]
        if top:
            evidence.append("top kernels: " + ", ".join(f"{shorten(name)} ({us:.0f} us per step)" for name, us in top))
        evidence += [clue for name, clue in OPERATOR_CLUES.get(row["phase"], []) if name in operators]
        targets.append({"target": label, "key": row["phase"], "share_percent": row["pct"],
                        "evidence": "; ".join(evidence), "remedy": remedy})
    return targets


def prioritised_targets(trace, numbers: dict, min_share: float) -> list[dict]:
    """Launch overhead first when the run is launch-bound (no kernel-level change shows until it is fixed),
    then the model parts by their share of the time."""
    launch = launch_target(numbers)
    targets = ([launch] if launch else []) + phase_targets(trace, min_share)
    for rank, target in enumerate(targets, start=1):
        target["rank"] = rank
    return targets


# ----------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------
def shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    def cell(value):
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.1f}"
        return shorten(str(value)).replace("|", "\\|")

    lines = ["| " + " | ".join(header for _, header in columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(cell(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return lines if rows else ["_(none)_"]


def verdict(numbers: dict) -> str:
    if not numbers["has_device"]:
        ops = numbers["operators_per_step"]
        return ("CPU trace: there is no GPU time to compare with. The host dispatches "
                + (f"{ops:.0f} operators per step" if ops is not None else "its operators")
                + "; on a GPU each becomes one or more kernel launches costing microseconds of host time, "
                "so this count is the first number to bring down.")
    busy = numbers["gpu_busy"]
    if busy is None:
        return "No profiler steps in the trace: the GPU-busy fraction is unknown (profile with a schedule)."
    if busy < LAUNCH_BOUND_BUSY:
        return (f"Launch-bound: the GPU works {100 * busy:.0f}% of the step and waits for the host the rest of "
                "the time. Making kernels faster will not show until there are fewer of them.")
    return (f"GPU-bound: the GPU is busy {100 * busy:.0f}% of the step, so the time per kernel matters; start "
            "with the parts below that take the most GPU time.")


def build_report(trace, top: int, min_share: float) -> tuple[str, dict]:
    """(markdown text, the same content as a JSON-serialisable dict)."""
    numbers = step_numbers(trace)
    phases = analysis.phase_split(trace)
    operators = analysis.top_operators(trace, limit=top)
    kernels = analysis.top_kernels(trace, limit=top)
    targets = prioritised_targets(trace, numbers, min_share)

    def value(v, spec, unit=""):
        return "n/a" if v is None else format(v, spec) + unit

    lines = [f"# Bottleneck report: {trace.path.name if trace.path else 'trace'}", "",
             f"Trace: `{trace.path}`", "", "## The step", "",
             f"- profiled steps: {numbers['steps']}",
             f"- host wall time per step: {value(numbers['host_us_per_step'], ',.0f', ' us')} (profiler overhead "
             "included)",
             f"- GPU kernel time per step: {value(numbers['gpu_us_per_step'], ',.0f', ' us')}",
             f"- GPU busy: {value(None if numbers['gpu_busy'] is None else 100 * numbers['gpu_busy'], '.0f', '%')}",
             f"- GPU kernels per step: {value(numbers['kernels_per_step'], '.0f')}",
             f"- top-level operators per step: {value(numbers['operators_per_step'], '.0f')}",
             "", verdict(numbers), "",
             "## Optimisation targets, in priority order", ""]
    if not targets:
        lines.append("_No part of the step stands out (every part is below "
                     f"{min_share:g}% of the time)._")
    for target in targets:
        lines += [f"{target['rank']}. **{target['target']}** ({target['share_percent']:.0f}%)",
                  f"   - evidence: {target['evidence']}", f"   - change: {target['remedy']}"]
    lines += ["", f"## Time per part and phase ({phases['label']})", ""]
    lines += markdown_table(phases["rows"], [("phase", "phase"), ("us_per_step", "us per step"), ("pct", "%"),
                                             ("count", "events")])
    lines += ["", f"## Top {top} operators by {operators.meta['sort_by']}", ""]
    columns = [("name", "operator"), ("calls", "calls"), ("self_cpu_us", "self CPU us")]
    if numbers["has_device"]:
        columns += [("self_device_us", "self GPU us"), ("device_us", "GPU us incl. children")]
    lines += markdown_table(list(operators), columns)
    if numbers["has_device"]:
        lines += ["", f"## Top {top} GPU kernels by total time", ""]
        lines += markdown_table(list(kernels), [("name", "kernel"), ("calls", "calls"), ("total_us", "total us"),
                                                ("mean_us", "mean us"), ("pct_device_time", "% of GPU time")])
    content = {"trace": str(trace.path), "step": numbers, "verdict": verdict(numbers), "targets": targets,
               "phases": phases["rows"]}
    return "\n".join(lines) + "\n", content


def main(argv=None) -> int:
    parser = OneLineParser(
        prog="analyze_bottlenecks.py",
        description="Markdown bottleneck report (top operators, kernels, phases, prioritised optimisation targets) "
                    "from a PyTorch-profiler trace.")
    parser.add_argument("--profile-data", required=True, metavar="TRACE_OR_DIR",
                        help="a trace file, or a profile directory (its newest trace_*.json / *.pt.trace.json)")
    parser.add_argument("--output-report", default="bottlenecks.md", help="markdown report to write")
    parser.add_argument("--output-json", help="also write the numbers and targets as JSON")
    parser.add_argument("--top", type=positive_int, default=10, help="rows of the operator and kernel tables")
    parser.add_argument("--min-share", type=non_negative_float, default=MIN_SHARE_PERCENT,
                        help="smallest share of the step (percent) for a part to become a target")
    args = parser.parse_args(argv)
    try:   # both outputs writable, and neither the trace itself, before the trace is read and analysed
        trace_path, note = resolve_trace_argument(args.profile_data)
        outputs = [("--output-report", args.output_report), ("--output-json", args.output_json)]
        refuse_output_over_input(outputs, [("--profile-data", trace_path)])
        prove_outputs(*[(flag, path, "file") for flag, path in outputs])
        trace = load_trace(trace_path)
    except (ConfigError, TraceError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}")
    text, content = build_report(trace, args.top, args.min_share)
    try:
        write_atomically(args.output_report, lambda file: file.write(text))
        if args.output_json:
            write_json(args.output_json, content)
    except OSError as error:
        print(f"{parser.prog}: error: cannot write the report: {error.strerror or error}", file=sys.stderr)
        return 2
    try:
        print(text)
        print(f"report: {args.output_report}" + (f", {args.output_json}" if args.output_json else ""))
    except BrokenPipeError:   # piped into `head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
