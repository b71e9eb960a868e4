"""Tables from a PyTorch-profiler trace: operators, kernels, kernels per step and time per model part.

`torch.profiler.profile(...).export_chrome_trace(path)` writes a JSON file in Chrome's trace-event format.
This module reads it (plain or gzip-compressed) with the standard library alone, so a trace recorded on a
GPU machine can be analysed again on a laptop without a GPU:

    python -m tinytransformer.reports trace.json --sort-by self_device_time --limit 15 --output-dir reports/

What a trace holds. Only "complete" events count (ph "X": start "ts" and length "dur", both in microseconds);
"cat" says what kind of event it is:

  host side (pid = process, tid = thread)
    cpu_op            one operator call: aten::mm, an autograd node (MmBackward0), an autograd.Function
    user_annotation   one torch.profiler.record_function range: "attention", "backward", "ProfilerStep#3"
    cuda_runtime      one CUDA or HIP runtime call: cudaLaunchKernel, hipLaunchKernel, cudaMemcpyAsync
    cuda_driver       one CUDA driver call: cuLaunchKernel (how Triton launches its kernels on NVIDIA)
  device side (pid = GPU, tid = stream)
    kernel            one kernel execution
    gpu_memcpy        one copy ("Memcpy HtoD (Pageable -> Device)")
    gpu_memset        one fill ("Memset (Device)")
  memory (only with profile_memory=True): instant events (ph "i") named "[memory]" on the host thread that
    allocated or freed: args "Bytes" (negative for a free) and "Device Type" (0 = CPU, else the GPU)
  ignored: gpu_user_annotation (record_function ranges drawn again on the GPU timeline, which would count
    every kernel twice), python_function, flow arrows (ph "s"/"f", cat ac2g or fwdbwd), metadata (ph "M"),
    other instant events, the "Trace" span, overhead and cuda_sync events.
  Torch 1.8 wrote "Operator", "Runtime", "Kernel", "Memcpy", "Memset"; those are read too. ROCm builds of
  torch use the same categories (the names inside differ: hipLaunchKernel, hipModuleLaunchKernel).

How a kernel is charged to the code that caused it. The device event and the host call that launched it
carry the same args["correlation"]. The launch call sits inside the operator that issued it, on the same
thread, so nesting in time gives its chain of enclosing operators and record_function ranges. When the
launch is missing from the trace, args["External id"] (the same number as the issuing cpu_op's) is used;
a kernel linked to nothing keeps its own start time and is charged to no operator.
"""
from __future__ import annotations

import argparse
import bisect
import csv
import gzip
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

# ----------------------------------------------------------------------------------------------------------
# Vocabulary
# ----------------------------------------------------------------------------------------------------------


class TraceError(Exception):
    """The file cannot be read as a profiler trace. The message is one line, fit to show a user."""


# Trace category (lower-cased) -> the kind of event this module works with.
_KIND_OF_CATEGORY = {
    "cpu_op": "op",
    "operator": "op",  # torch 1.8
    "user_annotation": "range",
    "cuda_runtime": "launch",
    "cuda_driver": "launch",
    "runtime": "launch",  # torch 1.8
    "xpu_runtime": "launch",
    "privateuse1_runtime": "launch",
    "privateuse1_driver": "launch",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",  # torch 1.8
    "gpu_memset": "memset",
    "memset": "memset",  # torch 1.8
}
_HOST_KINDS = ("op", "range", "launch")
_DEVICE_KINDS = ("kernel", "memcpy", "memset")

# The record_function ranges every model version puts around its parts (innermost one wins).
MODEL_PARTS = ("attention", "ffn", "rmsnorm", "rope", "output_head", "loss")
# The rows of the phase split, in the order they are printed.
PHASES = MODEL_PARTS + ("forward_other", "backward", "optimizer", "other")
# What the phases that are not a model part hold (a legend under the table in summary.md).
PHASE_LEGEND = {
    "forward_other": "inside the \"forward\" range but in no named part (embedding, residual adds)",
    "backward": "launched during the backward pass (any thread)",
    "optimizer": "launched inside the \"optimizer\" range",
    "other": "everything else: outside forward/backward/optimizer, or linked to nothing",
}

_STEP_PREFIX = "ProfilerStep#"
# Every backward node the autograd engine runs is wrapped in an op with this name prefix.
_AUTOGRAD_NODE_PREFIX = "autograd::engine::evaluate_function"

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
_MEMORY_FIELDS = tuple(SORT_KEYS[key] for key in _MEMORY_KEYS)

OPERATOR_COLUMNS = ("name", "calls", "self_cpu_us", "cpu_us", "self_device_us", "device_us",
                    "self_cpu_mem_bytes", "cpu_mem_bytes", "self_device_mem_bytes", "device_mem_bytes")
KERNEL_COLUMNS = ("name", "category", "calls", "total_us", "mean_us", "min_us", "max_us", "pct_device_time")
PHASE_COLUMNS = ("phase", "us", "pct", "count", "us_per_step")


class ReportFiles(dict):
    """File name -> Path of what write_reports wrote, with `summary` (the summarize() dict) beside it."""

    def __init__(self, paths: Mapping[str, Path], summary: dict):
        super().__init__(paths)
        self.summary = summary


class ReportRows(list):
    """A list of row dicts with a `meta` dict beside it (how the rows were chosen and sorted)."""

    def __init__(self, rows: Iterable[dict] = (), meta: dict | None = None):
        super().__init__(rows)
        self.meta = dict(meta or {})


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


class Trace(dict):
    """The decoded trace JSON; remembers where it came from and caches its analysis."""

    path: Path | None = None
    _analysis: "_Analysis | None" = None


def load_trace(path) -> Trace:
    """Read a Chrome trace written by torch.profiler (.json, or gzip-compressed like .json.gz).

    Raises TraceError with a one-line message when the file is missing, unreadable, not JSON, or JSON that
    is not a profiler trace.
    """
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    if path.is_dir():
        raise TraceError(f"expected a trace file but got a directory: {path}")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise TraceError(f"cannot read {path}: {err.strerror or err}") from None
    if raw[:2] == b"\x1f\x8b":  # gzip's magic number; tensorboard_trace_handler(use_gzip=True) writes these
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise TraceError(f"{path} looks gzip-compressed but cannot be decompressed: {err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not a text (JSON) file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        cut_short = err.pos >= len(text.rstrip())  # the parser ran out of text mid-way
        hint = ": the file ends too early (a trace cut short while being written?)" if cut_short else ""
        raise TraceError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}){hint}") from None
    trace = _as_trace_dict(data, source=str(path))
    trace.path = path
    return trace


def _as_trace_dict(data, source: str) -> Trace:
    """Check that decoded JSON is a trace: {"traceEvents": [...]} or a bare event list, with timed events."""
    if isinstance(data, list):  # Chrome's format also allows a bare array of events
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{source} is JSON but not a profiler trace (no 'traceEvents' list)")
    events = data["traceEvents"]
    if not any(isinstance(ev, dict) and ev.get("ph") == "X" for ev in events):
        raise TraceError(f"{source} is a trace without any timed events (ph 'X'); nothing to analyse")
    return data if isinstance(data, Trace) else Trace(data)


def _trace_of(trace_or_path) -> Trace:
    """Accept a loaded trace, a plain dict/list of events (e.g. built by a test), or a path."""
    if isinstance(trace_or_path, (str, os.PathLike)):
        return load_trace(trace_or_path)
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    return _as_trace_dict(trace_or_path, source="the given trace")


# ----------------------------------------------------------------------------------------------------------
# Parsing events and linking them
# ----------------------------------------------------------------------------------------------------------


class _Event:
    """One complete event, plus what the analysis learns about it."""

    __slots__ = (
        "name", "kind", "pid", "tid", "start", "dur", "args", "order",
        "parent", "children_us", "device_self_us", "device_total_us", "memory",  # host events
        "anchor", "owner", "phase", "step",  # device events
    )

    def __init__(self, name, kind, pid, tid, start, dur, args, order):
        self.name, self.kind = name, kind
        self.pid, self.tid = pid, tid
        self.start, self.dur = start, dur
        self.args, self.order = args, order
        self.parent = None
        self.children_us = 0.0
        self.device_self_us = 0.0
        self.device_total_us = 0.0
        self.memory = None  # {"self_cpu_mem_bytes": ..., ...} once an allocation is charged to it
        self.anchor = self.owner = self.phase = self.step = None

    @property
    def end(self) -> float:
        return self.start + self.dur

    def chain(self):
        """This event, then its enclosing events on the same thread, innermost first."""
        event = self
        while event is not None:
            yield event
            event = event.parent


def _parse_event(raw, order: int) -> _Event | None:
    """Turn one JSON event into an _Event, or None for events this module ignores."""
    if not isinstance(raw, dict):
        return None
    if raw.get("ph") == "i" and raw.get("name") == "[memory]":
        kind = "memory"
    elif raw.get("ph") == "X":
        kind = _KIND_OF_CATEGORY.get(str(raw.get("cat", "")).lower())
    else:
        return None
    if kind is None:
        return None
    try:
        start = float(raw["ts"])
        dur = max(0.0, float(raw.get("dur", 0.0)))
    except (KeyError, TypeError, ValueError):
        return None  # an event without a usable time cannot be placed; skip it rather than fail
    args = raw.get("args") if isinstance(raw.get("args"), dict) else {}
    name = str(raw.get("name", ""))
    return _Event(name, kind, raw.get("pid"), raw.get("tid"), start, dur, args, order)


class _Windows:
    """Time intervals (possibly from several threads) merged so one bisect answers 'is t inside any?'."""

    def __init__(self, intervals: Iterable[tuple[float, float]]):
        merged: list[list[float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self._starts, t) - 1
        return i >= 0 and t <= self._ends[i]


class _Analysis:
    """Everything the report functions need, computed once per trace."""

    def __init__(self, raw_events: list):
        parsed = (_parse_event(raw, order) for order, raw in enumerate(raw_events))
        events = [ev for ev in parsed if ev is not None]
        self.host = [ev for ev in events if ev.kind in _HOST_KINDS]
        self.device = [ev for ev in events if ev.kind in _DEVICE_KINDS]
        self.memory = [ev for ev in events if ev.kind == "memory"]
        self._nest_host_events_per_thread()
        self._charge_memory_to_operators()
        self.steps = self._find_steps()
        self._step_starts = [start for _, start, _ in self.steps]
        self.backward_windows = _Windows((ev.start, ev.end) for ev in self.host if ev.name == "backward")
        self.optimizer_windows = _Windows((ev.start, ev.end) for ev in self.host if ev.name == "optimizer")
        self.unattributed_device_us = 0.0
        self._link_device_events()

    # -- host side -------------------------------------------------------------------------------------------

    def _nest_host_events_per_thread(self):
        """Give every host event its innermost enclosing host event on the same thread (its parent)."""
        threads = defaultdict(list)
        for ev in self.host + self.memory:
            threads[(ev.pid, ev.tid)].append(ev)
        for events in threads.values():
            # Outer events first: earlier start, then longer; the file order breaks the remaining ties.
            events.sort(key=lambda ev: (ev.start, -ev.dur, ev.order))
            open_events: list[_Event] = []
            for ev in events:
                # An event that ends before this one starts cannot enclose it. Checking only the start
                # (not the end) tolerates the rounding of ts and dur to 1 ns in the file.
                while open_events and open_events[-1].end <= ev.start:
                    open_events.pop()
                if open_events:
                    ev.parent = open_events[-1]
                    ev.parent.children_us += ev.dur
                if ev.kind != "memory":  # an allocation is a point in time: it encloses nothing
                    open_events.append(ev)

    def _charge_memory_to_operators(self):
        """As in torch's table: self memory to the innermost enclosing operator, total to all of them."""
        for mem in self.memory:
            try:
                size = int(mem.args.get("Bytes", 0))
            except (TypeError, ValueError):
                continue
            where = "cpu" if mem.args.get("Device Type", 0) == 0 else "device"
            operators = [ev for ev in _enclosing(mem) if _is_operator_row(ev)]
            for depth, op in enumerate(operators):
                if op.memory is None:
                    op.memory = dict.fromkeys(_MEMORY_FIELDS, 0)
                op.memory[f"{where}_mem_bytes"] += size
                if depth == 0:
                    op.memory[f"self_{where}_mem_bytes"] += size

    def _find_steps(self) -> list[tuple[str, float, float]]:
        seen = {}
        for ev in self.host:  # host only: the same names on the GPU timeline are gpu_user_annotation
            if ev.name.startswith(_STEP_PREFIX) and ev.name not in seen:
                seen[ev.name] = (ev.name, ev.start, ev.end)
        return sorted(seen.values(), key=lambda step: step[1])

    def step_of(self, t: float) -> str | None:
        i = bisect.bisect_right(self._step_starts, t) - 1
        if i >= 0 and t <= self.steps[i][2]:
            return self.steps[i][0]
        return None

    # -- device side -----------------------------------------------------------------------------------------

    def _link_device_events(self):
        launches = {}
        for ev in self.host:
            if ev.kind == "launch" and "correlation" in ev.args:
                launches[ev.args["correlation"]] = ev
        by_external_id = {}
        for ev in self.host:
            if ev.kind in ("op", "range") and "External id" in ev.args:
                by_external_id.setdefault(ev.args["External id"], ev)
        for dev in self.device:
            dev.anchor = launches.get(dev.args.get("correlation"))
            if dev.anchor is None:
                dev.anchor = by_external_id.get(dev.args.get("External id"))
            # Steps and phases are decided by when the work was *issued*: the GPU runs it later.
            issued_at = dev.anchor.start if dev.anchor is not None else dev.start
            dev.step = self.step_of(issued_at)
            dev.phase = self.phase_of(dev.anchor, issued_at)
            self._charge_to_operators(dev)

    def _charge_to_operators(self, dev: _Event):
        """Self device time goes to the innermost enclosing operator; total device time to all of them."""
        chain = list(dev.anchor.chain()) if dev.anchor is not None else []
        operators = [ev for ev in chain if ev.kind == "op" and _is_operator_row(ev)]
        for op in operators:
            op.device_total_us += dev.dur
        if operators:
            dev.owner = operators[0]
        elif dev.anchor is not None and dev.anchor.kind == "launch":
            # Launched straight from Python (e.g. a Triton kernel outside any op): the launch call owns it.
            dev.owner = dev.anchor
            dev.anchor.device_total_us += dev.dur
        if dev.owner is None:
            self.unattributed_device_us += dev.dur
        else:
            dev.owner.device_self_us += dev.dur

    # -- phases ----------------------------------------------------------------------------------------------

    def phase_of(self, anchor: _Event | None, t: float) -> str:
        """Which phase work issued at time t by `anchor` (and the events enclosing it) belongs to.

        backward: the autograd engine may run the backward pass on its own thread (one per GPU), where the
        "backward" range of the main thread does not enclose it. The main thread waits inside that range
        until the backward pass is done, so its time window on *any* thread is backward; work wrapped in
        an autograd evaluate_function op is backward too (this catches traces without a "backward" range).
        Backward wins over the model parts so that recomputation (activation checkpointing) counts there.
        """
        chain = list(anchor.chain()) if anchor is not None else []
        if t in self.backward_windows or any(ev.name.startswith(_AUTOGRAD_NODE_PREFIX) for ev in chain):
            return "backward"
        if t in self.optimizer_windows:
            return "optimizer"
        for ev in chain:  # innermost first, so a nested part wins over the part around it
            if ev.name in MODEL_PARTS:
                return ev.name
        if any(ev.name == "forward" for ev in chain):
            return "forward_other"
        return "other"


def _is_operator_row(ev: _Event) -> bool:
    """Ops and launch calls get rows in the operator table; step ranges (a cpu_op in old torch) do not."""
    return ev.kind in ("op", "launch") and not ev.name.startswith(_STEP_PREFIX)


def _is_dispatched_operator(ev: _Event) -> bool:
    """An operator the dispatcher ran (aten::mm, mylib::op), not an autograd node or Function wrapper."""
    return (
        ev.kind == "op"
        and "::" in ev.name
        and not ev.name.startswith(("autograd::", "torch::autograd::"))
    )


def _analysis(trace_or_path) -> _Analysis:
    trace = _trace_of(trace_or_path)
    if trace._analysis is None:
        trace._analysis = _Analysis(trace["traceEvents"])
    return trace._analysis


# ----------------------------------------------------------------------------------------------------------
# Public analysis functions
# ----------------------------------------------------------------------------------------------------------


def profiler_steps(trace) -> list[tuple[str, float, float]]:
    """The "ProfilerStep#N" ranges a scheduled profiler records: [(name, start_us, end_us)] by start."""
    return list(_analysis(trace).steps)


def has_device_activity(trace) -> bool:
    """True when the trace holds GPU kernels, copies or fills (a GPU trace)."""
    return bool(_analysis(trace).device)


def device_kernels(trace, include_memory_ops: bool = True) -> list[dict]:
    """Every device event as a flat record, in file order.

    Fields: name, category (kernel / gpu_memcpy / gpu_memset), start_us, dur_us, correlation, launch (the
    host call that launched it, or None), issued_us (when it was launched; its own start if unknown),
    operator (the op charged with its self device time, or None), phase, step (step name or None).
    """
    rows = []
    for dev in _analysis(trace).device:
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


def _device_category(dev: _Event) -> str:
    return {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset"}[dev.kind]


def kernels_per_step(trace) -> float | None:
    """GPU kernels launched inside a profiler step, divided by the number of steps.

    Copies and fills are not kernels and are not counted. None when the trace has no kernels (a CPU trace)
    or no "ProfilerStep#N" ranges (profiled without a schedule: there is no step to divide by).
    """
    analysis = _analysis(trace)
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
    analysis = _analysis(trace)
    if not analysis.steps:
        return None
    count = 0
    for ev in analysis.host:
        if not _is_dispatched_operator(ev) or analysis.step_of(ev.start) is None:
            continue
        if not any(_is_dispatched_operator(outer) for outer in _enclosing(ev)):
            count += 1
    return count / len(analysis.steps)


def _enclosing(ev: _Event):
    chain = ev.chain()
    next(chain)  # skip the event itself
    return chain


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
    analysis = _analysis(trace)
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
        if not _is_operator_row(ev):
            continue
        row = totals.setdefault(ev.name, {
            "name": ev.name, "calls": 0, "self_cpu_us": 0.0, "cpu_us": 0.0,
            "self_device_us": 0.0, "device_us": 0.0, **dict.fromkeys(_MEMORY_FIELDS, 0),
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
    return ReportRows(_first(rows, limit), meta)


def top_kernels(trace, limit: int | None = 20) -> ReportRows:
    """Per device-event name: calls, total/mean/min/max us and % of all device time, longest total first.

    Copies and fills (gpu_memcpy, gpu_memset) are included since they occupy the device too; the
    `category` column tells them apart. Empty on a CPU trace.
    """
    devices = _analysis(trace).device
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
    return ReportRows(_first(rows, limit), meta)


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
    analysis = _analysis(trace)
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
    else:
        label = "CPU self time of host ops and launch calls, by where they ran"
        for ev in analysis.host:
            if not _is_operator_row(ev):
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


def summarize(trace) -> dict:
    """The few numbers worth keeping next to a run's metrics (JSON-serialisable)."""
    t = _trace_of(trace)
    analysis = _analysis(t)
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


def _first(rows: list, limit: int | None) -> list:
    return rows if limit is None or limit <= 0 else rows[:limit]


# ----------------------------------------------------------------------------------------------------------
# Output: console tables, CSV, markdown
# ----------------------------------------------------------------------------------------------------------


def _operator_columns(meta: dict) -> tuple[str, ...]:
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


def _headline(summary: dict) -> list[str]:
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


def write_reports(trace_or_path, out_dir, sort_by: str = "self_device_time",
                  limit: int | None = 20) -> ReportFiles:
    """Write operators.csv, kernels.csv, phases.csv (every row) and summary.md (top `limit` rows) to out_dir.

    Returns {"operators.csv": Path, "kernels.csv": Path, "phases.csv": Path, "summary.md": Path}; its
    `.summary` attribute holds summarize(...) plus "sort_by", the operator sort key actually used.
    """
    trace = _trace_of(trace_or_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    operators = top_operators(trace, sort_by=sort_by, limit=None)
    kernels = top_kernels(trace, limit=None)
    phases = phase_split(trace)
    summary = summarize(trace)
    summary["sort_by"] = operators.meta["sort_by"]

    paths = {name: out_dir / name for name in ("operators.csv", "kernels.csv", "phases.csv", "summary.md")}
    _write_csv(paths["operators.csv"], operators, OPERATOR_COLUMNS)
    _write_csv(paths["kernels.csv"], kernels, KERNEL_COLUMNS)
    _write_csv(paths["phases.csv"], phases["rows"], PHASE_COLUMNS)

    md = [f"# Profile summary: {trace.path.name if trace.path else 'trace'}", ""]
    md += [f"- {line}" for line in _headline(summary)]
    md += ["", f"## Time per phase ({phases['label']})", ""]
    md += [_markdown_table(phases["rows"], PHASE_COLUMNS), ""]
    md += [f"- `{phase}`: {meaning}" for phase, meaning in PHASE_LEGEND.items()]
    md += ["", f"## Top operators by {operators.meta['sort_by']}", ""]
    if operators.meta["note"]:
        md += [f"_Note: {operators.meta['note']}._", ""]
    md += [_markdown_table(_first(operators, limit), _operator_columns(operators.meta))]
    md += ["", "## Top kernels by total device time", ""]
    md += [_markdown_table(_first(kernels, limit), KERNEL_COLUMNS) if kernels else
           "_No device kernels in this trace (CPU trace)._", ""]
    paths["summary.md"].write_text("\n".join(md))
    return ReportFiles(paths, summary)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def _positive_or_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0 shows every row)")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tinytransformer.reports",
        description="Operator, kernel and phase tables from a torch.profiler trace (.json or .json.gz).",
    )
    parser.add_argument("trace", help="trace written by torch.profiler's export_chrome_trace")
    parser.add_argument("--sort-by", default="self_device_time", metavar="KEY",
                        choices=list(SORT_KEYS) + list(SORT_KEY_ALIASES),
                        help="operator sort key: %(choices)s (default: %(default)s)")
    parser.add_argument("--limit", type=_positive_or_zero, default=20,
                        help="rows per table, 0 for all (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="also write operators.csv, kernels.csv, phases.csv and summary.md here")
    return parser


def _fail(parser: argparse.ArgumentParser, message: str):
    """argparse's error format and exit status 2, without the usage block: the options were fine."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables for one trace. Bad input: one line on stderr and exit status 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
        operators = top_operators(trace, sort_by=args.sort_by, limit=args.limit)
        kernels = top_kernels(trace, limit=args.limit)
        phases = phase_split(trace)
        summary = summarize(trace)
    except TraceError as err:
        _fail(parser, str(err))

    out = [f"Trace: {trace.path}"] + _headline(summary)
    out += ["", f"Time per phase ({phases['label']}):", format_table(phases["rows"], PHASE_COLUMNS)]
    out += ["", f"Top operators by {operators.meta['sort_by']}:"]
    if operators.meta["note"]:
        out.append(f"(note: {operators.meta['note']})")
    out.append(format_table(operators, _operator_columns(operators.meta)))
    if kernels:
        out += ["", "Top kernels by total device time:", format_table(kernels, KERNEL_COLUMNS)]

    if args.output_dir is not None:
        try:
            paths = write_reports(trace, args.output_dir, sort_by=args.sort_by, limit=args.limit)
        except OSError as err:
            _fail(parser, f"cannot write reports to {args.output_dir}: {err.strerror or err}")
        out += ["", "Wrote: " + ", ".join(str(path) for path in paths.values())]
    try:
        print("\n".join(out))
    except BrokenPipeError:  # piped into `head`: the reader has what it wanted; silence the exit flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
