"""Who caused each piece of work in a trace: event nesting, kernel-to-operator links, steps and phases.

How a kernel is charged to the code that caused it. The device event and the host call that launched it
carry the same args["correlation"]. The launch call sits inside the operator that issued it, on the same
thread, so nesting in time gives its chain of enclosing operators and record_function ranges. When the
launch is missing from the trace, args["External id"] (the same number as the issuing cpu_op's) is used;
a kernel of the recording linked to nothing keeps its own start time and is charged to no operator.

Work launched before the recording began is left out. The host runs ahead of the GPU: when the profiler starts
recording, the GPU may still be running what the host launched a step earlier (for a graph-captured step, a
whole replay). Its launches are not in the trace, and its correlation numbers, which the runtime hands out in
increasing order to its API calls (launches among them), are below the first recorded launch's. Such events, when
no recorded operator's External id claims them either, are no part of the profiled steps: they are set aside
(TraceAnalysis.before_recording) instead of being charged to the first step's time and phases, and the phase
table's title says how many. This reads one process's trace, as the rest of this module does (correlation
numbers count per process), and it relies on the launch calls being recorded (torch.profiler records the
runtime's and the driver's, Triton's launches included); a trace without any launch call keeps every event.

Steps and phases are decided by when the work was ISSUED (the GPU runs it later): a kernel belongs to the
"ProfilerStep#N" range and to the model part (profiling/ranges.py) around its launch. The kernels of a CUDA/HIP
graph replayed outside every range (version 4's captured step) have no range around their launch: they are
charged by kernel name and order instead (profiling/kernel_names.py). TraceAnalysis does all of this once per
trace; profiling/analysis.py turns it into tables.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Iterable

from .kernel_names import is_graph_launch, replay_phases
from .trace import DEVICE_KINDS, HOST_KINDS, STEP_PREFIX, Event, parse_event, trace_of

# The record_function ranges every model version puts around its parts (innermost one wins).
MODEL_PARTS = ("attention", "ffn", "rmsnorm", "rope", "output_head", "loss")
# The rows of the phase split, in the order they are printed.
PHASES = MODEL_PARTS + ("forward_other", "backward", "optimizer", "other")
# Every backward node the autograd engine runs is wrapped in an op with this name prefix.
AUTOGRAD_NODE_PREFIX = "autograd::engine::evaluate_function"
# An operator's memory columns: bytes allocated minus bytes freed, by itself (self_) and with what it calls.
MEMORY_FIELDS = ("self_cpu_mem_bytes", "cpu_mem_bytes", "self_device_mem_bytes", "device_mem_bytes")


class Windows:
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


class TraceAnalysis:
    """Everything the analysis functions need, computed once per trace."""

    def __init__(self, raw_events: list):
        parsed = (parse_event(raw, order) for order, raw in enumerate(raw_events))
        events = [ev for ev in parsed if ev is not None]
        self.host = [ev for ev in events if ev.kind in HOST_KINDS]
        self.device, self.before_recording = self._split_work_launched_before_recording(
            [ev for ev in events if ev.kind in DEVICE_KINDS])
        self.memory = [ev for ev in events if ev.kind == "memory"]
        self._nest_host_events_per_thread()
        self._charge_memory_to_operators()
        self.steps = self._find_steps()
        self._step_starts = [start for _, start, _ in self.steps]
        self.backward_windows = Windows((ev.start, ev.end) for ev in self.host if ev.name == "backward")
        self.optimizer_windows = Windows((ev.start, ev.end) for ev in self.host if ev.name == "optimizer")
        self.unattributed_device_us = 0.0
        self._link_device_events()
        self.replayed_by_name = self._charge_graph_replays_by_name()

    # -- host side -------------------------------------------------------------------------------------------

    def _nest_host_events_per_thread(self):
        """Give every host event its innermost enclosing host event on the same thread (its parent)."""
        threads = defaultdict(list)
        for ev in self.host + self.memory:
            threads[(ev.pid, ev.tid)].append(ev)
        for events in threads.values():
            # Outer events first: earlier start, then longer; the file order breaks the remaining ties.
            events.sort(key=lambda ev: (ev.start, -ev.dur, ev.order))
            open_events: list[Event] = []
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
            operators = [ev for ev in enclosing(mem) if is_operator_row(ev)]
            for depth, op in enumerate(operators):
                if op.memory is None:
                    op.memory = dict.fromkeys(MEMORY_FIELDS, 0)
                op.memory[f"{where}_mem_bytes"] += size
                if depth == 0:
                    op.memory[f"self_{where}_mem_bytes"] += size

    def _find_steps(self) -> list[tuple[str, float, float]]:
        seen = {}
        for ev in self.host:  # host only: the same names on the GPU timeline are gpu_user_annotation
            if ev.name.startswith(STEP_PREFIX) and ev.name not in seen:
                seen[ev.name] = (ev.name, ev.start, ev.end)
        return sorted(seen.values(), key=lambda step: step[1])

    def step_of(self, t: float) -> str | None:
        i = bisect.bisect_right(self._step_starts, t) - 1
        if i >= 0 and t <= self.steps[i][2]:
            return self.steps[i][0]
        return None

    # -- device side -----------------------------------------------------------------------------------------

    def _split_work_launched_before_recording(self, device: list[Event]) -> tuple[list[Event], list[Event]]:
        """(device events of the recording, device events launched before it began): see the module docstring.
        A trace without launch calls (a CPU trace, or one recorded without the host side) keeps every event, and
        so does an event without a correlation number (0 or none: its origin is unknown)."""
        recorded = [ev.args["correlation"] for ev in self.host
                    if ev.kind == "launch" and isinstance(ev.args.get("correlation"), int)]
        if not recorded:
            return device, []
        first = min(recorded)
        # Operators' External ids are numbered apart from correlations: each is compared with its own kind only.
        operator_ids = {ev.args["External id"] for ev in self.host if "External id" in ev.args}

        recording, before = [], []
        for dev in device:
            correlation = dev.args.get("correlation")
            launched_before = (isinstance(correlation, int) and 0 < correlation < first
                               and dev.args.get("External id") not in operator_ids)
            (before if launched_before else recording).append(dev)
        return recording, before

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

    def _charge_graph_replays_by_name(self) -> int:
        """Kernels of a CUDA/HIP graph replayed outside every phase range: phases by kernel name and order
        (profiling/kernel_names.py says why and how). Returns how many device events were charged so."""
        replays = defaultdict(list)   # the replay's launch call -> its device events
        for dev in self.device:
            if dev.phase == "other" and dev.anchor is not None and is_graph_launch(dev.anchor.name):
                replays[id(dev.anchor)].append(dev)
        for events in replays.values():
            events.sort(key=lambda dev: (dev.start, dev.order))   # the order the device started them
            for dev, phase in zip(events, replay_phases([dev.name for dev in events])):
                dev.phase = phase
        return sum(len(events) for events in replays.values())

    def _charge_to_operators(self, dev: Event):
        """Self device time goes to the innermost enclosing operator; total device time to all of them."""
        chain = list(dev.anchor.chain()) if dev.anchor is not None else []
        operators = [ev for ev in chain if ev.kind == "op" and is_operator_row(ev)]
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

    def phase_of(self, anchor: Event | None, t: float) -> str:
        """Which phase work issued at time t by `anchor` (and the events enclosing it) belongs to.

        backward: the autograd engine may run the backward pass on its own thread (one per GPU), where the
        "backward" range of the main thread does not enclose it. The main thread waits inside that range
        until the backward pass is done, so its time window on *any* thread is backward; work wrapped in
        an autograd evaluate_function op is backward too (this catches traces without a "backward" range).
        Backward wins over the model parts so that recomputation (activation checkpointing) counts there.
        """
        chain = list(anchor.chain()) if anchor is not None else []
        if t in self.backward_windows or any(ev.name.startswith(AUTOGRAD_NODE_PREFIX) for ev in chain):
            return "backward"
        if t in self.optimizer_windows:
            return "optimizer"
        for ev in chain:  # innermost first, so a nested part wins over the part around it
            if ev.name in MODEL_PARTS:
                return ev.name
        if any(ev.name == "forward" for ev in chain):
            return "forward_other"
        return "other"


def is_operator_row(ev: Event) -> bool:
    """Ops and launch calls get rows in the operator table; step ranges (a cpu_op in old torch) do not."""
    return ev.kind in ("op", "launch") and not ev.name.startswith(STEP_PREFIX)


def is_dispatched_operator(ev: Event) -> bool:
    """An operator the dispatcher ran (aten::mm, mylib::op), not an autograd node or Function wrapper."""
    return (
        ev.kind == "op"
        and "::" in ev.name
        and not ev.name.startswith(("autograd::", "torch::autograd::"))
    )


def analysis_of(trace_or_path) -> TraceAnalysis:
    """The analysis of a trace (a loaded trace, events built by a test, or a path), computed once per trace."""
    trace = trace_of(trace_or_path)
    if trace.analysis is None:
        trace.analysis = TraceAnalysis(trace["traceEvents"])
    return trace.analysis


def enclosing(ev: Event):
    """The events enclosing `ev` on its thread, innermost first."""
    chain = ev.chain()
    next(chain)  # skip the event itself
    return chain
