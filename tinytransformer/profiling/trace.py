"""A PyTorch-profiler trace file: finding it, reading it, and the events in it that the analysis uses.

`torch.profiler.profile(...).export_chrome_trace(path)` writes a JSON file in Chrome's trace-event format.
The profiling package reads it (plain or gzip-compressed) with the standard library alone, so a trace recorded on
a GPU machine can be analysed again on a laptop without a GPU (profiling/report_cli.py).

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
"""
from __future__ import annotations

import glob
import gzip
import json
import math
import os
from pathlib import Path


class TraceError(Exception):
    """The file cannot be read as a profiler trace. The message is one line, fit to show a user."""


# Trace category (lower-cased) -> the kind of event the analysis works with.
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
HOST_KINDS = ("op", "range", "launch")
DEVICE_KINDS = ("kernel", "memcpy", "memset")
STEP_PREFIX = "ProfilerStep#"   # the range a scheduled profiler puts around each step: ProfilerStep#3


class Trace(dict):
    """The decoded trace JSON; remembers where it came from and caches its analysis."""

    path: Path | None = None
    analysis = None   # the TraceAnalysis (profiling/attribution.py), computed once when first asked for


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
    trace = as_trace_dict(data, source=str(path))
    trace.path = path
    return trace


def as_trace_dict(data, source: str) -> Trace:
    """Check that decoded JSON is a trace: {"traceEvents": [...]} or a bare event list, with timed events."""
    if isinstance(data, list):  # Chrome's format also allows a bare array of events
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{source} is JSON but not a profiler trace (no 'traceEvents' list)")
    events = data["traceEvents"]
    if not any(isinstance(ev, dict) and ev.get("ph") == "X" for ev in events):
        raise TraceError(f"{source} is a trace without any timed events (ph 'X'); nothing to analyse")
    # Events the analysis cannot place (no known category, a time that is not a number) are skipped one by one;
    # a trace made only of such events would be reported as all zeros, which reads like a real measurement.
    if not any(_is_usable(raw) for raw in events):
        raise TraceError(f"{source} has no usable operator or kernel event (a ph 'X' event with a known 'cat' "
                         f"and numeric 'ts' and 'dur'); nothing to analyse")
    return data if isinstance(data, Trace) else Trace(data)


def trace_of(trace_or_path) -> Trace:
    """Accept a loaded trace, a plain dict/list of events (e.g. built by a test), or a path."""
    if isinstance(trace_or_path, (str, os.PathLike)):
        return load_trace(trace_or_path)
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    return as_trace_dict(trace_or_path, source="the given trace")


class Event:
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


def _is_usable(raw) -> bool:
    """Whether one JSON event is a timed operator or kernel that the analysis counts."""
    event = parse_event(raw, 0)
    return event is not None and event.kind != "memory"


def parse_event(raw, order: int) -> Event | None:
    """Turn one JSON event into an Event, or None for the events the analysis ignores."""
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
        if not (math.isfinite(start) and math.isfinite(dur)):
            raise ValueError("not a finite time")
    except (KeyError, TypeError, ValueError):
        return None  # an event without a usable time cannot be placed; skip it rather than fail
    args = raw.get("args") if isinstance(raw.get("args"), dict) else {}
    name = str(raw.get("name", ""))
    return Event(name, kind, raw.get("pid"), raw.get("tid"), start, dur, args, order)


# ----------------------------------------------------------------------------------------------------------
# Finding a trace: a file, the newest one in a directory, or a glob pattern
# ----------------------------------------------------------------------------------------------------------
TRACE_PATTERNS = ("trace_*.json", "trace_*.json.gz", "*.pt.trace.json", "*.pt.trace.json.gz")


def newest_trace_in(directory: Path) -> Path | None:
    """The newest trace file directly in `directory`, else in its immediate subdirectories (tensorboard/)."""
    def newest(paths):
        files = [p for p in paths if p.is_file()]
        return max(files, key=lambda p: p.stat().st_mtime) if files else None

    here = newest(p for pattern in TRACE_PATTERNS for p in directory.glob(pattern))
    return here or newest(p for pattern in TRACE_PATTERNS for p in directory.glob(f"*/{pattern}"))


def resolve_trace_argument(text: str) -> tuple[Path, str | None]:
    """(trace file, a note saying how it was chosen) for --analyze-existing's file / directory / glob.

    A glob the shell left unexpanded matched nothing there, so when it matches nothing here either, the
    newest trace in the pattern's directory is used (with a note): the workshop's classic command
    `--analyze-existing pytorch_profiles/profile_*.json` then finds `pytorch_profiles/trace_v1.json`.
    """
    path = Path(text)
    if path.is_dir():
        found = newest_trace_in(path)
        if found is None:
            raise TraceError(f"no trace_*.json or *.pt.trace.json file in directory {path}")
        return found, f"newest trace in {path}/: {found}"
    if path.exists() or not glob.has_magic(text):
        return path, None                     # load_trace reports a missing file in its own words
    matches = [Path(p) for p in glob.glob(text) if Path(p).is_file()]
    if matches:
        newest = max(matches, key=lambda p: p.stat().st_mtime)
        return newest, (f"{len(matches)} files match {text!r}; using the newest: {newest}"
                        if len(matches) > 1 else None)
    parent = path.parent
    if not glob.has_magic(str(parent)) and parent.is_dir():
        found = newest_trace_in(parent)
        if found is not None:
            return found, f"no file matches {text!r}; using the newest trace in {parent}/: {found}"
    raise TraceError(f"no file matches {text!r}")
