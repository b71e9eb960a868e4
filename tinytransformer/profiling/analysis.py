"""What a trace says, as numbers and rows: steps, kernels and operators per step, top operators and kernels, the
split of time between the model's parts and the training phases, device time per kernel family, and a summary
to keep beside a run's metrics.

Every function takes a loaded trace (profiling/trace.py), a path, or events built in code (tests), and reads the
attribution of profiling/attribution.py, computed once per trace. Rendering the rows is profiling/tables.py's job.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

from .attribution import (MEMORY_FIELDS, PHASES, analysis_of, enclosing, is_dispatched_operator,
                          is_operator_row)
from .kernel_names import family_of
from .trace import Event, trace_of

# Sort keys of top_operators -> the row field they sort on.
SORT_KEYS = {
    "self_device_time": "self_device_us",
    "device_time": "device_us",
    "self_cpu_time": "self_cpu_us",
    "cpu_time": "cpu_us",
    "count": "calls",
    "self_cpu_memory_usage": "self_cpu_mem_bytes",
    "cpu_memory_usage": "cpu_mem_bytes",
    "self_device_memory_usage": "self_device_mem_bytes",
    "device_memory_usage": "device_mem_bytes",
}
# The names torch's own key_averages().table(sort_by=...) uses, mapped onto ours.
SORT_KEY_ALIASES = {
    "self_cuda_time_total": "self_device_time",
    "self_device_time_total": "self_device_time",
    "cuda_time_total": "device_time",
    "device_time_total": "device_time",
    "self_cpu_time_total": "self_cpu_time",
    "cpu_time_total": "cpu_time",
    "calls": "count",
    "self_cuda_memory_usage": "self_device_memory_usage",
    "cuda_memory_usage": "device_memory_usage",
}
# On a trace without device activity, a device key falls back to its CPU twin.
_CPU_TWIN = {
    "self_device_time": "self_cpu_time",
    "device_time": "cpu_time",
    "self_device_memory_usage": "self_cpu_memory_usage",
    "device_memory_usage": "cpu_memory_usage",
}
_MEMORY_KEYS = ("self_cpu_memory_usage", "cpu_memory_usage",
                "self_device_memory_usage", "device_memory_usage")


class ReportRows(list):
    """A list of row dicts with a `meta` dict beside it (how the rows were chosen and sorted)."""

    def __init__(self, rows: Iterable[dict] = (), meta: dict | None = None):
        super().__init__(rows)
        self.meta = dict(meta or {})


def profiler_steps(trace) -> list[tuple[str, float, float]]:
    """The "ProfilerStep#N" ranges a scheduled profiler records: [(name, start_us, end_us)] by start."""
    return list(analysis_of(trace).steps)


def has_device_activity(trace) -> bool:
    """True when the trace holds GPU kernels, copies or fills (a GPU trace)."""
    return bool(analysis_of(trace).device)


def device_kernels(trace, include_memory_ops: bool = True) -> list[dict]:
    """Every device event of the recording as a flat record, in file order (not the work launched before the
    recording began: profiling/attribution.py).

    Fields: name, category (kernel / gpu_memcpy / gpu_memset), start_us, dur_us, correlation, launch (the
    host call that launched it, or None), issued_us (when it was launched; its own start if unknown),
    operator (the op charged with its self device time, or None), phase, step (step name or None).
    """
    rows = []
    for dev in analysis_of(trace).device:
        if dev.kind != "kernel" and not include_memory_ops:
            continue
        launch = dev.anchor if dev.anchor is not None and dev.anchor.kind == "launch" else None
        rows.append({
            "name": dev.name,
            "category": _device_category(dev),
            "start_us": dev.start,
            "dur_us": dev.dur,
            "correlation": dev.args.get("correlation"),
            "launch": launch.name if launch is not None else None,
            "issued_us": dev.anchor.start if dev.anchor is not None else dev.start,
            "operator": dev.owner.name if dev.owner is not None else None,
            "phase": dev.phase,
            "step": dev.step,
        })
    return rows


def _device_category(dev: Event) -> str:
    return {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset"}[dev.kind]


def kernels_per_step(trace) -> float | None:
    """GPU kernels launched inside a profiler step, divided by the number of steps.

    Copies and fills are not kernels and are not counted. None when the trace has no kernels (a CPU trace)
    or no "ProfilerStep#N" ranges (profiled without a schedule: there is no step to divide by).
    """
    analysis = analysis_of(trace)
    kernels = [dev for dev in analysis.device if dev.kind == "kernel"]
    if not kernels or not analysis.steps:
        return None
    return sum(1 for dev in kernels if dev.step is not None) / len(analysis.steps)


def operators_per_step(trace) -> float | None:
    """Top-level dispatched operators (aten::...) started inside a profiler step, per step.

    "Top-level" means not called from inside another dispatched operator: aten::linear counts, the aten::mm
    it calls does not. Autograd nodes are not operators, so in the backward pass the aten ops they call are
    the top-level ones. Meaningful on CPU traces too. None without "ProfilerStep#N" ranges.
    """
    analysis = analysis_of(trace)
    if not analysis.steps:
        return None
    count = 0
    for ev in analysis.host:
        if not is_dispatched_operator(ev) or analysis.step_of(ev.start) is None:
            continue
        if not any(is_dispatched_operator(outer) for outer in enclosing(ev)):
            count += 1
    return count / len(analysis.steps)


def canonical_sort_key(sort_by: str) -> str:
    """Map a sort key or one of torch's names for it onto ours; ValueError for an unknown key."""
    key = SORT_KEY_ALIASES.get(sort_by, sort_by)
    if key not in SORT_KEYS:
        known = ", ".join(list(SORT_KEYS) + list(SORT_KEY_ALIASES))
        raise ValueError(f"unknown sort key {sort_by!r}; use one of: {known}")
    return key


def top_operators(trace, sort_by: str = "self_device_time", limit: int | None = 20) -> ReportRows:
    """Per operator name: calls, self/total CPU time and self/total device time (us), sorted, top `limit`.

    Rows cover cpu_op events and launch calls (cudaLaunchKernel, hipLaunchKernel, cuLaunchKernel: their
    count and CPU time show the cost of launching). Self CPU time is the event's duration minus that of
    the host events directly inside it; self device time is the time of the kernels whose launch's
    innermost enclosing op is this one; total device time adds the kernels of everything it calls. The
    memory columns (bytes allocated minus bytes freed, self and total) are filled only for traces recorded
    with profile_memory=True.
    `meta` says which key was used: on a trace without device activity a device key falls back to its CPU
    twin (self_device_time -> self_cpu_time, device_time -> cpu_time, device memory -> CPU memory), and a
    memory key on a trace without memory events falls back to self_device_time; `meta["note"]` says so.
    """
    analysis = analysis_of(trace)
    requested = canonical_sort_key(sort_by)
    used, note = requested, None
    if requested in _MEMORY_KEYS and not analysis.memory:
        used = "self_device_time"
        note = (f"the trace has no memory events (record with profile_memory=True): sorted by {used} "
                f"instead of {requested}")
    if not analysis.device and used in _CPU_TWIN:
        twin = _CPU_TWIN[used]
        note = (note + f", then by {twin}" if note else
                f"the trace has no device activity (CPU trace): sorted by {twin} instead of {used}")
        used = twin

    totals: dict[str, dict] = {}
    for ev in analysis.host:
        if not is_operator_row(ev):
            continue
        row = totals.setdefault(ev.name, {
            "name": ev.name, "calls": 0, "self_cpu_us": 0.0, "cpu_us": 0.0,
            "self_device_us": 0.0, "device_us": 0.0, **dict.fromkeys(MEMORY_FIELDS, 0),
        })
        row["calls"] += 1
        row["cpu_us"] += ev.dur
        row["self_cpu_us"] += max(0.0, ev.dur - ev.children_us)
        row["self_device_us"] += ev.device_self_us
        row["device_us"] += ev.device_total_us
        for field, size in (ev.memory or {}).items():
            row[field] += size
    field = SORT_KEYS[used]
    rows = sorted(totals.values(), key=lambda row: (-row[field], row["name"]))
    meta = {
        "requested_sort_by": requested,
        "sort_by": used,
        "note": note,
        "has_device": bool(analysis.device),
        "has_memory": bool(analysis.memory),
        "operators": len(rows),
        "unattributed_device_us": analysis.unattributed_device_us,
    }
    return ReportRows(first_rows(rows, limit), meta)


def top_kernels(trace, limit: int | None = 20) -> ReportRows:
    """Per device-event name: calls, total/mean/min/max us and % of the recording's device time (without the work
    launched before it began), longest total first.

    Copies and fills (gpu_memcpy, gpu_memset) are included since they occupy the device too; the
    `category` column tells them apart. Empty on a CPU trace.
    """
    devices = analysis_of(trace).device
    grand_total = sum(dev.dur for dev in devices)
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for dev in devices:
        groups[(dev.name, _device_category(dev))].append(dev.dur)
    rows = []
    for (name, category), durations in groups.items():
        total = sum(durations)
        rows.append({
            "name": name,
            "category": category,
            "calls": len(durations),
            "total_us": total,
            "mean_us": total / len(durations),
            "min_us": min(durations),
            "max_us": max(durations),
            "pct_device_time": 100.0 * total / grand_total if grand_total > 0 else 0.0,
        })
    rows.sort(key=lambda row: (-row["total_us"], row["name"]))
    meta = {"device_time_us": grand_total, "kernel_names": len(rows)}
    return ReportRows(first_rows(rows, limit), meta)


def phase_split(trace, basis: str = "auto") -> dict:
    """Time per model part and training phase.

    basis "device" (the default on GPU traces): device time (kernels, copies, fills), each event charged to
    the phase where it was launched. basis "cpu" (the default on CPU traces): the self time of host ops and
    launch calls, charged where they ran. Phases, in order: the model parts (attention, ffn, rmsnorm,
    rope, output_head, loss; the innermost enclosing range wins), forward_other (inside "forward" but in no
    named part), backward, optimizer, other (everything else). See _Analysis.phase_of for the rules.

    Returns {"basis", "label", "total_us", "steps", "rows": [{"phase", "us", "pct", "count",
    "us_per_step"}], "us": {phase: us}, "pct": {phase: pct}}.
    """
    analysis = analysis_of(trace)
    if basis == "auto":
        basis = "device" if analysis.device else "cpu"
    if basis not in ("device", "cpu"):
        raise ValueError(f"basis must be 'auto', 'device' or 'cpu', not {basis!r}")

    us = dict.fromkeys(PHASES, 0.0)
    count = dict.fromkeys(PHASES, 0)
    if basis == "device":
        label = "device time of kernels, copies and fills, by where they were launched"
        for dev in analysis.device:
            us[dev.phase] += dev.dur
            count[dev.phase] += 1
        if analysis.replayed_by_name:
            label += (f"; {analysis.replayed_by_name} events of CUDA/HIP graph replays by kernel name and order "
                      f"(a replay hides the ranges)")
        if analysis.before_recording:
            left_out_ms = sum(dev.dur for dev in analysis.before_recording) / 1e3
            label += (f"; left out: {len(analysis.before_recording)} events ({left_out_ms:.1f} ms) launched "
                      f"before the recording began, the step before's work still running")
    else:
        label = "CPU self time of host ops and launch calls, by where they ran"
        for ev in analysis.host:
            if not is_operator_row(ev):
                continue
            phase = analysis.phase_of(ev, ev.start)
            us[phase] += max(0.0, ev.dur - ev.children_us)
            count[phase] += 1

    total = sum(us.values())
    steps = len(analysis.steps)
    rows = [{
        "phase": phase,
        "us": us[phase],
        "pct": 100.0 * us[phase] / total if total > 0 else 0.0,
        "count": count[phase],
        "us_per_step": us[phase] / steps if steps else None,
    } for phase in PHASES]
    return {
        "basis": basis,
        "label": label,
        "total_us": total,
        "steps": steps,
        "rows": rows,
        "us": {row["phase"]: row["us"] for row in rows},
        "pct": {row["phase"]: row["pct"] for row in rows},
    }


def family_split(trace) -> list[dict]:
    """Device time per kernel family (profiling/kernel_names.py: gemm, attention, rmsnorm, ..., copies and fills
    as "copy / layout"), largest first: [{"family", "calls", "us", "pct", "us_per_step"}]. Empty on a CPU trace.
    Unlike the phase split it needs no ranges, so it reads the same with or without a graph-captured step."""
    analysis = analysis_of(trace)
    us, calls = defaultdict(float), defaultdict(int)
    for dev in analysis.device:
        family = family_of(dev.name)
        us[family] += dev.dur
        calls[family] += 1
    total, steps = sum(us.values()), len(analysis.steps)
    rows = [{"family": family, "calls": calls[family], "us": us[family],
             "pct": 100.0 * us[family] / total if total > 0 else 0.0,
             "us_per_step": us[family] / steps if steps else None} for family in us]
    return sorted(rows, key=lambda row: (-row["us"], row["family"]))


def summarize(trace) -> dict:
    """The few numbers worth keeping next to a run's metrics (JSON-serialisable)."""
    t = trace_of(trace)
    analysis = analysis_of(t)
    steps = analysis.steps
    device_us_in_steps = sum(dev.dur for dev in analysis.device if dev.step is not None)
    phases = phase_split(t)
    return {
        "trace": str(t.path) if t.path is not None else None,
        "has_device": bool(analysis.device),
        "steps": len(steps),
        "step_us_mean": sum(end - start for _, start, end in steps) / len(steps) if steps else None,
        "kernels_per_step": kernels_per_step(t),
        "operators_per_step": operators_per_step(t),
        # Like kernels per step: only the work issued inside a step, so the two numbers go together.
        "device_us_per_step": device_us_in_steps / len(steps) if steps and analysis.device else None,
        "phase_basis": phases["basis"],
        "phase_us": phases["us"],
        "phase_pct": phases["pct"],
    }


def compare_traces(traces: Mapping[str, object]) -> list[dict]:
    """One row per labelled trace (e.g. {"v1": path1, "v2": path2}): steps, kernels and ops per step,
    device time per step and time per phase per step, so the versions can be put side by side."""
    rows = []
    for label, trace in traces.items():
        summary = summarize(trace)
        row = {
            "version": label,
            "steps": summary["steps"],
            "kernels_per_step": summary["kernels_per_step"],
            "operators_per_step": summary["operators_per_step"],
            "device_us_per_step": summary["device_us_per_step"],
            "phase_basis": summary["phase_basis"],
        }
        for phase, us in summary["phase_us"].items():
            row[f"{phase}_us_per_step"] = us / summary["steps"] if summary["steps"] else None
        rows.append(row)
    return rows


def first_rows(rows: list, limit: int | None) -> list:
    """The first `limit` rows; all of them for None or 0."""
    return rows if limit is None or limit <= 0 else rows[:limit]
