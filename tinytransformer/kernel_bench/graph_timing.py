"""Timing a kernel that takes microseconds: a CUDA/HIP graph of back-to-back launches, replayed in turns.

A Python launch of a Triton kernel (argument packing, allocations) can take longer on the host than a small
kernel takes on the GPU, so a timer per call (triton.testing.do_bench) may measure the host. Captured in a graph,
the launches run back to back on the GPU, and one replay timed with device events divided by the number of
launches is the kernel's own time. The candidates of a tuner take turns (time_interleaved), so that a clock
change or a neighbour slows every candidate of a round, not one. The tuners of version 4
(tune_norm_backward.py, tune_qk_rotation.py, tune_adamw.py, tune_cross_entropy.py, tune_attention_tiles.py) and
compare_attention_backends.py time this way.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

from tinytransformer.kernel_bench.timing import l2_cache_bytes


def captured_launches(run: Callable[[], object], launches: int) -> torch.cuda.CUDAGraph:
    """A graph of `launches` back-to-back calls of run() (after three eager ones on a side stream, which compile
    the kernel and let the allocator settle before the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            run()
    return graph


def graph_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Milliseconds of one replay, timed with device events."""
    graph.replay()   # once untimed: the first replay after another graph may wait on clocks or caches
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def rounds_in_turns(runs: dict, rounds: int) -> dict:
    """{name: [run()'s milliseconds in each round]}, the runs taking turns within each round. Each round starts one
    run later than the round before, so that no run is always the first after a pause (which may find the clocks
    lower) or always the one after a given neighbour."""
    names = list(runs)
    times = {name: [] for name in names}
    for round_index in range(rounds):
        start = round_index % len(names) if names else 0
        for name in names[start:] + names[:start]:
            times[name].append(runs[name]())
    return times


def time_interleaved(runs: dict, rounds: int) -> dict:
    """{name: median over rounds of run()'s milliseconds}, the runs taking turns (rounds_in_turns)."""
    return {name: statistics.median(values) for name, values in rounds_in_turns(runs, rounds).items()}


def buffer_count(bytes_read: int) -> int:
    """How many copies of a kernel's input a graph's launches should take turns on, for launches that each read
    `bytes_read`: enough that together they hold three times the L2 cache, so that a launch reads what the cache
    no longer holds (one buffer used over and over stays partly in the cache: the RoPE kernel's timings at the
    medium preset came out above an H200's data-sheet bandwidth that way); at least 2."""
    return max(2, math.ceil(3 * l2_cache_bytes(torch.device("cuda")) / bytes_read))
