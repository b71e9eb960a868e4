"""How do step time, throughput and memory grow with the batch size? One table from several runs.

    for bs in 4 8 16 32; do
        python tiny_llama_v1.py --batch-size $bs --num-steps 30 --output-json scaling_bs$bs/metrics.json \
            --enable-pytorch-profiler --profile-dir scaling_bs$bs
    done
    python analyze_batch_scaling.py --profile-dirs scaling_bs*
    python analyze_batch_scaling.py --metrics run_a.json run_b.json       (metrics JSON files directly)

Each run is read from its metrics JSON (--output-json): batch, sequence length, median step time, samples/s,
peak memory. A profile directory may hold that JSON (any *.json written by --output-json); its PyTorch trace
adds kernels per step and the GPU time per step. Without a metrics JSON the trace alone is used: batch and
sequence from the shapes of the embedding call, and the profiled step time, which includes the profiler's
overhead (marked with *).

What to read in the table. If a step costs a fixed time F (launching hundreds of kernels from Python) plus a
time per sample c (the GPU's actual work), then step_ms = F + c * batch. A least-squares line through the runs
gives F and c: when F dominates, doubling the batch barely changes the step time and throughput almost doubles:
the run is launch-bound, and fusing or graph-capturing kernels is what helps. When c * batch dominates, the GPU
is busy and only faster kernels help. Memory grows by a fixed amount per sample (the activations); the line
through peak memory gives that amount.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.checks import ConfigError  # noqa: E402
from tinytransformer.cli import OneLineParser  # noqa: E402
from tinytransformer.profiling import analysis  # noqa: E402
from tinytransformer.profiling.result_fields import METRICS, check_metrics, read_json_file  # noqa: E402
from tinytransformer.profiling.trace import TraceError, load_trace, newest_trace_in  # noqa: E402

# Fixed cost above this share of the smallest run's step: launch-bound; below the second: compute-bound.
LAUNCH_BOUND_SHARE = 0.5
COMPUTE_BOUND_SHARE = 0.2


class ScalingError(Exception):
    """Input that cannot be analysed; the message is one line."""


# ----------------------------------------------------------------------------------------------------------
# Reading runs
# ----------------------------------------------------------------------------------------------------------
def is_metrics(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("throughput"), dict) and "train_config" in data


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def run_from_metrics(metrics: dict, source: str) -> dict:
    """One table row from a metrics JSON."""
    train = metrics["train_config"]
    return {
        "source": source,
        "version": metrics.get("version", "?"),
        "batch": train["batch_size"],
        "seq": train["seq_len"],
        "step_ms": metrics["timing"].get("median_ms"),
        "samples_per_s": metrics["throughput"].get("samples_per_s"),
        "peak_mib": metrics["memory"].get("peak_allocated_mib"),
        "kernels_per_step": (metrics.get("profile") or {}).get("kernels_per_step"),
        "gpu_us_per_step": None,
        "from_trace": False,
    }


def embedding_shape(trace) -> tuple[int, int] | None:
    """(batch, seq) of the token ids given to the embedding, from a trace recorded with shapes."""
    for event in trace["traceEvents"]:
        if isinstance(event, dict) and event.get("name") in ("aten::embedding", "aten::index"):
            dims = (event.get("args") or {}).get("Input Dims") or []
            if len(dims) >= 2 and isinstance(dims[1], list) and len(dims[1]) == 2:
                return dims[1][0], dims[1][1]
    return None


def add_trace_numbers(row: dict, trace) -> None:
    summary = analysis.summarize(trace)
    row["kernels_per_step"] = summary["kernels_per_step"] if row["kernels_per_step"] is None \
        else row["kernels_per_step"]
    row["gpu_us_per_step"] = summary["device_us_per_step"]


def run_from_directory(directory: Path) -> dict:
    """One table row from a profile directory: its metrics JSON if any, plus its trace."""
    candidates = [p for p in sorted(directory.glob("*.json")) if not p.name.startswith("trace_")]   # not traces
    metrics = [(p, data) for p in candidates if is_metrics(data := read_json(p))]
    trace_path = newest_trace_in(directory)
    trace = load_trace(trace_path) if trace_path else None
    if metrics:
        path, data = max(metrics, key=lambda item: item[0].stat().st_mtime)
        row = run_from_metrics(check_metrics(data, path), str(path))
    elif trace is not None:
        shape = embedding_shape(trace)
        summary = analysis.summarize(trace)
        if shape is None or not summary["step_us_mean"]:
            raise ScalingError(f"{directory}: no metrics JSON, and its trace shows no batch shape or no steps "
                               "(run with --output-json DIR/metrics.json)")
        batch, seq = shape
        step_ms = summary["step_us_mean"] / 1e3
        version = trace_path.name.split(".")[0].removeprefix("trace_") if trace_path.name.startswith("trace_") else "?"
        row = {"source": str(trace_path), "version": version, "batch": batch, "seq": seq, "step_ms": step_ms,
               "samples_per_s": batch / (step_ms / 1e3), "peak_mib": None, "kernels_per_step": None,
               "gpu_us_per_step": None, "from_trace": True}
    else:
        raise ScalingError(f"{directory}: neither a metrics JSON nor a trace_*.json found there")
    if trace is not None:
        add_trace_numbers(row, trace)
    return row


def collect_runs(metrics_files, profile_dirs) -> list[dict]:
    runs = []
    for name in metrics_files:
        runs.append(run_from_metrics(check_metrics(read_json_file(name, METRICS), name), name))
    for name in profile_dirs:
        if not Path(name).is_dir():
            raise ScalingError(f"{name}: not a directory")
        runs.append(run_from_directory(Path(name)))
    return sorted(runs, key=lambda r: (r["version"], r["seq"], r["batch"]))


# ----------------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------------
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope * x; needs two distinct x."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return mean_y - slope * mean_x, slope


def scaling_verdicts(runs: list[dict]) -> list[str]:
    """For each (version, seq) group with two or more batch sizes: the fixed cost, the per-sample cost, memory."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["version"], run["seq"]), []).append(run)
    for (version, seq), group in groups.items():
        timed = [r for r in group if r["step_ms"]]
        batches = sorted({r["batch"] for r in timed})
        label = f"{version}, seq {seq}"
        if len(batches) < 2:
            lines.append(f"{label}: every run has batch size {batches[0] if batches else '?'}; run two or more "
                         "batch sizes to see how the step time scales")
            continue
        fixed_ms, per_sample_ms = fit_line([r["batch"] for r in timed], [r["step_ms"] for r in timed])
        smallest = min(timed, key=lambda r: r["batch"])
        # A slope <= 0 (timing noise larger than the per-sample work) means: all of the step is fixed cost.
        share = 1.0 if per_sample_ms <= 0 else min(1.0, max(0.0, fixed_ms) / smallest["step_ms"])
        sign = "+" if per_sample_ms >= 0 else "-"
        lines.append(f"{label}: step_ms ~ {fixed_ms:.3f} {sign} {abs(per_sample_ms):.4f} x batch  (fixed part = "
                     f"{100 * share:.0f}% of the batch-{smallest['batch']} step)")
        if share >= LAUNCH_BOUND_SHARE:
            lines.append("  -> launch-bound: most of a step does not depend on the batch (Python and kernel "
                         "launches); a bigger batch is almost free, fewer kernels per step would help most")
        elif share <= COMPUTE_BOUND_SHARE:
            lines.append("  -> work-bound: the step time grows with the batch; faster kernels (or less work) help")
        else:
            lines.append("  -> in between: both the fixed launch cost and the per-sample work matter")
        with_memory = [r for r in group if r["peak_mib"] is not None]
        if len({r["batch"] for r in with_memory}) >= 2:
            base_mib, per_sample_mib = fit_line([r["batch"] for r in with_memory], [r["peak_mib"] for r in with_memory])
            lines.append(f"  memory: peak_MiB ~ {base_mib:.1f} + {per_sample_mib:.2f} x batch  (weights, gradients "
                         "and optimizer state, plus activations per sample)")
    return lines


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list[dict]) -> str:
    header = ["version", "batch", "seq", "ms/step", "samples/s", "vs smallest", "peak MiB", "kernels/step",
              "GPU busy", "source"]
    smallest = {}
    for run in runs:
        key = (run["version"], run["seq"])
        if run["samples_per_s"] and (key not in smallest or run["batch"] < smallest[key]["batch"]):
            smallest[key] = run
    rows = [header]
    for run in runs:
        ref = smallest.get((run["version"], run["seq"]))
        gain = run["samples_per_s"] / ref["samples_per_s"] if ref and run["samples_per_s"] else None
        busy = (run["gpu_us_per_step"] / (run["step_ms"] * 1e3)) if run["gpu_us_per_step"] and run["step_ms"] else None
        rows.append([run["version"], str(run["batch"]), str(run["seq"]),
                     fmt(run["step_ms"], ".3f") + ("*" if run["from_trace"] else ""),
                     fmt(run["samples_per_s"], ",.1f"), fmt(gain, ".2f") + ("x" if gain else ""),
                     fmt(run["peak_mib"], ",.1f"), fmt(run["kernels_per_step"], ".0f"),
                     fmt(None if busy is None else 100 * min(busy, 1.0), ".0f") + ("%" if busy else ""),
                     run["source"]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for index, row in enumerate(rows):
        cells = [cell.ljust(w) if i in (0, len(header) - 1) else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = OneLineParser(
        prog="analyze_batch_scaling.py",
        description="Batch size against step time, samples/s, peak memory and kernels per step, from the metrics "
                    "JSON files or profile directories of several runs.")
    parser.add_argument("--metrics", nargs="+", default=[], metavar="FILE",
                        help="metrics JSON files written by --output-json")
    parser.add_argument("--profile-dirs", nargs="+", default=[], metavar="DIR",
                        help="profile directories (--profile-dir), each with a metrics JSON and/or a trace")
    args = parser.parse_args(argv)
    if not args.metrics and not args.profile_dirs:
        parser.error("give --metrics FILE... and/or --profile-dirs DIR...")
    try:
        runs = collect_runs(args.metrics, args.profile_dirs)
    except (ScalingError, TraceError, ConfigError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(table(runs))
    notes = ["vs smallest: samples/s relative to the smallest batch of the same version and sequence length",
             "GPU busy: GPU kernel time per step / step time (from the trace; '-' on a CPU run or without one)"]
    if any(run["from_trace"] for run in runs):
        notes.append("*: step time of the profiled steps, profiler overhead included (no metrics JSON found)")
    print("\n".join(notes))
    print()
    print("\n".join(scaling_verdicts(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
