"""Timing training steps honestly, and summarising the times.

GPU work is asynchronous: a Python timer around `loss.backward()` measures how long it took to *queue* the work,
not to do it. Each step is therefore bracketed by device events (on the CPU, which is synchronous, by a host
clock). Events are read only at log points, so timing adds no synchronisation to the loop. The first
--warmup-steps steps (allocator growth, cuBLAS/Triton compilation, torch.compile) are excluded, and the summary
reports the MEDIAN step time with its spread.
"""
from __future__ import annotations

import statistics
import time

import torch


class StepTimer:
    """Times regions with device events on a GPU, with the host clock on the CPU. Read lazily with collect()."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.pending: list[tuple] = []

    def mark(self):
        """A point in time: an event queued on the GPU stream, or the host clock on the CPU."""
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, marks: tuple) -> None:
        self.pending.append(marks)

    def collect(self) -> list[list[float]]:
        """Milliseconds between consecutive marks of each pending region (synchronises once)."""
        if self.on_gpu and self.pending:
            self.pending[-1][-1].synchronize()
        out = []
        for marks in self.pending:
            if self.on_gpu:
                out.append([a.elapsed_time(b) for a, b in zip(marks, marks[1:])])
            else:
                out.append([(b - a) * 1e3 for a, b in zip(marks, marks[1:])])
        self.pending.clear()
        return out


def summarize_times(ms: list[float]) -> dict:
    if not ms:
        return {"median_ms": None, "p10_ms": None, "p90_ms": None, "count": 0}
    ordered = sorted(ms)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median_ms": statistics.median(ordered), "p10_ms": pick(0.1), "p90_ms": pick(0.9),
            "count": len(ordered)}


def default_warmup_steps(steps_to_run: int) -> int:
    """The timing warm-up when --warmup-steps is not given: up to 5 steps, never more than half of the steps
    this process runs (a resumed run counts its own steps, not the run's total)."""
    return min(5, max(0, (steps_to_run - 1) // 2))


def phase_breakdown(phase_timer: StepTimer, warmup_steps: int) -> dict:
    """--timing-breakdown: the median forward, backward and optimizer time (ms) of the steps after the warm-up;
    EagerStep put a mark between the phases of every step."""
    rows = phase_timer.collect()[warmup_steps:]
    if not rows:
        return {}
    names = ("forward", "backward", "optimizer")
    return {name: statistics.median(r[i] for r in rows) for i, name in enumerate(names)}


def time_training_steps(step_fn, stream, device: torch.device, warmup_steps: int, timing_steps: int) -> dict:
    """Median step time of `timing_steps` steps after `warmup_steps`, timed as the Trainer times them."""
    timer = StepTimer(device)
    for step in range(warmup_steps + timing_steps):
        inputs, targets = stream.batch(step)
        start = timer.mark()
        step_fn(inputs, targets)
        timer.add((start, timer.mark()))
    step_ms = [marks[0] for marks in timer.collect()][warmup_steps:]   # collect() synchronises once
    return {**summarize_times(step_ms), "warmup_steps": warmup_steps}
