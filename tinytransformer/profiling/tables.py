"""The tables of a trace as text: fixed-width console tables, markdown, CSV, and the report files of a profile.

write_reports writes operators.csv, kernels.csv, phases.csv, families.csv (every row) and summary.md (the top
rows) beside a trace; the trainer calls it after a profiled run, the profiler commands and the report command on
request.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Mapping, Sequence

from .analysis import family_split, first_rows, phase_split, summarize, top_kernels, top_operators
from .trace import trace_of

OPERATOR_COLUMNS = ("name", "calls", "self_cpu_us", "cpu_us", "self_device_us", "device_us",
                    "self_cpu_mem_bytes", "cpu_mem_bytes", "self_device_mem_bytes", "device_mem_bytes")
KERNEL_COLUMNS = ("name", "category", "calls", "total_us", "mean_us", "min_us", "max_us", "pct_device_time")
PHASE_COLUMNS = ("phase", "us", "pct", "count", "us_per_step")
FAMILY_COLUMNS = ("family", "calls", "us", "pct", "us_per_step")
# What the phases that are not a model part hold (a legend under the table in summary.md).
PHASE_LEGEND = {
    "forward_other": "inside the \"forward\" range but in no named part (embedding, residual adds)",
    "backward": "launched during the backward pass (any thread)",
    "optimizer": "launched inside the \"optimizer\" range",
    "other": "everything else: outside forward/backward/optimizer, or linked to nothing",
}


class ReportFiles(dict):
    """File name -> Path of what write_reports wrote, with `summary` (the summarize() dict) beside it."""

    def __init__(self, paths: Mapping[str, Path], summary: dict):
        super().__init__(paths)
        self.summary = summary


def operator_columns(meta: dict) -> tuple[str, ...]:
    """Printed operator columns, without those that would be all zeros (device on CPU, memory unrecorded)."""
    columns = ("name", "calls", "self_cpu_us", "cpu_us")
    if meta["has_device"]:
        columns += ("self_device_us", "device_us")
    if meta["has_memory"]:
        columns += ("self_cpu_mem_bytes",) + (("self_device_mem_bytes",) if meta["has_device"] else ())
    return columns


def _column_spec(columns) -> list[tuple[str, str]]:
    """Columns given as keys or (key, header) pairs -> [(key, header)]."""
    return [(col, col) if isinstance(col, str) else (col[0], col[1]) for col in columns]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(rows: Sequence[Mapping], columns=None, max_width: int = 60) -> str:
    """A fixed-width text table: text columns left-aligned (cut to max_width), numbers right-aligned.

    columns: keys, or (key, header) pairs; by default the keys of the first row.
    """
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    spec = _column_spec(columns)
    if not spec:
        return ""
    cells = [[_shorten(_cell(row.get(key)), max_width) for key, _ in spec] for row in rows]
    numeric = [
        all(isinstance(row.get(key), (int, float)) or row.get(key) is None for row in rows) and bool(rows)
        for key, _ in spec
    ]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (_, header) in enumerate(spec)]

    def line(values):
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line([header for _, header in spec]), line(["-" * w for w in widths])]
    out += [line(values) for values in cells]
    if not rows:
        out.append("(no rows)")
    return "\n".join(out)


def _markdown_table(rows: Sequence[Mapping], columns) -> str:
    spec = _column_spec(columns)
    if not rows:
        return "_(no rows)_"

    def cell(value):
        return _cell(value).replace("|", "\\|")

    out = ["| " + " | ".join(header for _, header in spec) + " |"]
    out.append("|" + "|".join("---:" if key != spec[0][0] else "---" for key, _ in spec) + "|")
    out += ["| " + " | ".join(cell(row.get(key)) for key, _ in spec) + " |" for row in rows]
    return "\n".join(out)


def _write_csv(path: Path, rows: Sequence[Mapping], columns: Sequence[str]):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row.get(c) is None else
                             round(row[c], 3) if isinstance(row.get(c), float) else row[c] for c in columns])


def headline(summary: dict) -> list[str]:
    """The summary numbers as lines of text (shared by the console and summary.md)."""
    steps = summary["steps"]
    lines = [f"Profiler steps: {steps}" + (f" (mean {summary['step_us_mean']:,.1f} us each)" if steps else
                                           " (no ProfilerStep#N ranges: profile with a schedule)")]
    if summary["kernels_per_step"] is not None:
        lines.append(f"Kernels per step: {summary['kernels_per_step']:,.1f}")
    elif not summary["has_device"]:
        lines.append("Kernels per step: n/a (no device kernels: this is a CPU trace)")
    elif not steps:
        lines.append("Kernels per step: n/a (no steps to divide by)")
    else:
        lines.append("Kernels per step: n/a (only copies and fills on the device, no kernels)")
    if summary["operators_per_step"] is not None:
        lines.append(f"Operators per step (top-level aten ops): {summary['operators_per_step']:,.1f}")
    if summary["device_us_per_step"] is not None:
        lines.append(f"Device time per step: {summary['device_us_per_step']:,.1f} us")
    return lines


# The files write_reports writes into its directory.
REPORT_NAMES = ("operators.csv", "kernels.csv", "phases.csv", "families.csv", "summary.md")


def write_reports(trace_or_path, out_dir, sort_by: str = "self_device_time",
                  limit: int | None = 20) -> ReportFiles:
    """Write operators.csv, kernels.csv, phases.csv, families.csv (every row) and summary.md (top `limit` rows)
    to out_dir.

    Returns {"operators.csv": Path, "kernels.csv": Path, "phases.csv": Path, "families.csv": Path,
    "summary.md": Path}; its
    `.summary` attribute holds summarize(...) plus "sort_by", the operator sort key actually used.
    """
    trace = trace_of(trace_or_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    operators = top_operators(trace, sort_by=sort_by, limit=None)
    kernels = top_kernels(trace, limit=None)
    phases = phase_split(trace)
    families = family_split(trace)
    summary = summarize(trace)
    summary["sort_by"] = operators.meta["sort_by"]

    paths = {name: out_dir / name for name in REPORT_NAMES}
    _write_csv(paths["operators.csv"], operators, OPERATOR_COLUMNS)
    _write_csv(paths["kernels.csv"], kernels, KERNEL_COLUMNS)
    _write_csv(paths["phases.csv"], phases["rows"], PHASE_COLUMNS)
    _write_csv(paths["families.csv"], families, FAMILY_COLUMNS)

    md = [f"# Profile summary: {trace.path.name if trace.path else 'trace'}", ""]
    md += [f"- {line}" for line in headline(summary)]
    md += ["", f"## Time per phase ({phases['label']})", ""]
    md += [_markdown_table(phases["rows"], PHASE_COLUMNS), ""]
    md += [f"- `{phase}`: {meaning}" for phase, meaning in PHASE_LEGEND.items()]
    if families:
        md += ["", "## Device time per kernel family (by kernel name)", ""]
        md += [_markdown_table(families, FAMILY_COLUMNS), ""]
    md += ["", f"## Top operators by {operators.meta['sort_by']}", ""]
    if operators.meta["note"]:
        md += [f"_Note: {operators.meta['note']}._", ""]
    md += [_markdown_table(first_rows(operators, limit), operator_columns(operators.meta))]
    md += ["", "## Top kernels by total device time", ""]
    md += [_markdown_table(first_rows(kernels, limit), KERNEL_COLUMNS) if kernels else
           "_No device kernels in this trace (CPU trace)._", ""]
    paths["summary.md"].write_text("\n".join(md))
    return ReportFiles(paths, summary)


def trace_tables(trace, sort_by: str, limit: int) -> list[str]:
    """run_pytorch_profiler.py's console report of one trace: per-step counts (in ms), the phase split, top
    operators, top GPU kernels."""
    summary = summarize(trace)
    phases = phase_split(trace)
    families = family_split(trace)
    operators = top_operators(trace, sort_by=sort_by, limit=limit)
    kernels = top_kernels(trace, limit=limit)
    steps = summary["steps"]
    lines = [f"Trace: {trace.path}"]
    lines.append(f"Profiled steps: {steps}" + (f" (mean {summary['step_us_mean'] / 1e3:.2f} ms each)" if steps
                                               else " (no ProfilerStep#N ranges: nothing to divide by)"))
    if summary["has_device"]:
        per_step = summary["kernels_per_step"]
        lines.append("GPU kernels per step: " + (f"{per_step:.1f}" if per_step is not None else "n/a"))
        if summary["device_us_per_step"] is not None:
            lines.append(f"GPU time per step: {summary['device_us_per_step'] / 1e3:.3f} ms")
    if summary["operators_per_step"] is not None:
        where = "" if summary["has_device"] else "; a CPU trace has no GPU kernels to count"
        lines.append(f"Operators per step (top-level aten ops{where}): {summary['operators_per_step']:.1f}")

    lines += ["", f"--- Time per phase ({phases['label']}) ---"]
    lines.append(format_table(phases["rows"], [("phase", "phase"), ("us", "total_us"), ("pct", "%"),
                                               ("count", "events"), ("us_per_step", "us_per_step")]))
    if families:
        lines += ["", "--- GPU time per kernel family (by kernel name) ---"]
        lines.append(format_table(families, [("family", "family"), ("us", "total_us"), ("pct", "%"),
                                             ("calls", "kernels"), ("us_per_step", "us_per_step")]))
    lines += ["", f"--- Top operators by {operators.meta['sort_by']} ---"]
    if operators.meta["note"]:
        lines.append(f"(note: {operators.meta['note']})")
    lines.append(format_table(operators, operator_columns(operators.meta)))
    if summary["has_device"]:
        lines += ["", "--- Top GPU kernels by total time ---"]
        lines.append(format_table(kernels, ["name", "category", "calls", "total_us", "mean_us", "pct_device_time"]))
    return lines
