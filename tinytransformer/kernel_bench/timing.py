"""Timing one op, forward and backward, with triton.testing.do_bench on cold caches.

How the times are taken
  * triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"): the same signature in
    Triton 3.6 and 3.9. warmup and rep are milliseconds of running fn (do_bench turns them into call counts
    from a first estimate), not numbers of calls. Each call is timed by a pair of device events; the median
    ignores the odd call slowed by a clock change or by another process on the GPU.
  * Cold caches. Before every timed call do_bench zeroes a 256 MB buffer, which evicts the inputs from the
    L2 cache (50 MB on an H100, 4 MB per XCD on an MI300X), so each call reads its inputs from HBM as the byte
    model assumes. We also rotate inputs: when the data one call reads (its inputs; for a backward also the
    incoming gradients and the tensors the forward saved) is smaller than the L2 cache, the timed function
    cycles through enough independent input sets to fill twice the L2 size (at most MAX_INPUT_SETS), so a
    call does not find the data of the calls just before it in L2 even where that flush would fall short.
    At the seed size an input set is about 1 MB, far below an H100's L2: without these guards a kernel would
    be timed at L2 bandwidth and its "GB/s" could exceed what the HBM can deliver.
  * Forward: the op with autograd recording (the inputs require grad), as in a training step; the outputs
    are dropped at once.
  * Backward: the forward runs once per input set OUTSIDE the timed function, and the timed function is
    torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True). Why retain_graph and not "run the
    forward again, outside the timed region": do_bench times everything fn does, and offers no untimed step
    between calls (other than resetting .grad), so a fresh forward before each backward would need a
    hand-written timing loop. retain_graph=True keeps the saved tensors alive, so one graph can be
    differentiated again and again; each call launches exactly the kernels of a normal backward, reading
    the same saved tensors. autograd.grad returns new gradient tensors instead of adding them into .grad,
    so no accumulation kernel creeps into the second and later calls.
  * Launch overhead: the times are GPU event times. While the GPU zeroes the flush buffer (about 80 us on
    an H100) the host has already queued the timed call, so Python's launch overhead stays hidden unless
    the host side of one call takes longer than that.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch

from ..triton_support import interpreter_active
from .ops import BenchShape, InputSet, OpBench, as_tuple

WARMUP_MS = 25          # do_bench: milliseconds of untimed calls before timing
REP_MS = 100            # do_bench: milliseconds of timed calls; the median of them is reported
MAX_INPUT_SETS = 64     # at most this many rotating input sets (memory: a backward keeps every set's graph)


def input_set_count(call_bytes: int, l2_bytes: int) -> int:
    """How many input sets to rotate through, for calls that each read `call_bytes`: one when that exceeds
    the L2 cache, else enough sets to fill twice the L2 size (at most MAX_INPUT_SETS)."""
    if l2_bytes <= 0 or call_bytes >= l2_bytes:
        return 1
    return max(2, min(MAX_INPUT_SETS, math.ceil(2 * l2_bytes / max(call_bytes, 1))))


def l2_cache_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def make_input_sets(op: OpBench, shape: BenchShape, device: torch.device) -> list[InputSet]:
    """As many input sets as the forward could use (each with its random grad_outputs drawn)."""
    first = op.make_inputs(shape, device)
    count = input_set_count(first.nbytes(), l2_cache_bytes(device))
    input_sets = [first] + [op.make_inputs(shape, device) for _ in range(count - 1)]
    for inputs in input_sets:
        with torch.no_grad():   # only the outputs' shapes are wanted here, not a graph
            outputs = as_tuple(op.triton(*inputs.args()))
        inputs.grad_outputs = [torch.randn_like(o) for o in outputs]
    return input_sets


def timing_available() -> bool:
    """Timing needs a GPU and compiled kernels: under the interpreter it would time NumPy, not the GPU."""
    return torch.cuda.is_available() and not interpreter_active()


def median_ms(fn) -> float:
    import triton.testing  # imported here: the scripts must choose the interpreter before triton loads
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def rotating(calls: list[Callable]) -> Callable:
    """One function that makes the next call of the list each time it runs (round robin)."""
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def timed_call(fn, inputs: InputSet, direction: str) -> Callable:
    """The zero-argument function do_bench times for one input set (see the module docstring)."""
    if direction == "fwd":
        return lambda: fn(*inputs.args())
    if direction == "bwd":
        outputs = as_tuple(fn(*inputs.args()))   # forward outside the timed function; graph kept below
        return lambda: torch.autograd.grad(outputs, inputs.differentiable, inputs.grad_outputs,
                                           retain_graph=True)
    if direction == "fwd+bwd":
        return lambda: torch.autograd.grad(as_tuple(fn(*inputs.args())), inputs.differentiable,
                                           inputs.grad_outputs)
    raise ValueError(f"unknown direction {direction!r}")


def time_us(fn, input_sets: list[InputSet], direction: str) -> tuple[float, int]:
    """Median microseconds per call, and the number of input sets the calls rotated through.

    A backward reads the incoming gradients and the tensors its graph saved, not just the inputs: the
    memory the first graph holds is added to the bytes one call reads before choosing the number of sets.
    This also bounds memory: all retained graphs together stay near twice the L2 size.
    """
    device = input_sets[0].grad_outputs[0].device
    before = allocated_bytes(device)
    calls = [timed_call(fn, input_sets[0], direction)]
    call_bytes = input_sets[0].nbytes() + (allocated_bytes(device) - before)
    if direction != "fwd":
        call_bytes += sum(g.nbytes for g in input_sets[0].grad_outputs)
    count = min(len(input_sets), input_set_count(call_bytes, l2_cache_bytes(device)))
    calls += [timed_call(fn, inputs, direction) for inputs in input_sets[1:count]]
    return 1000.0 * median_ms(rotating(calls)), count


def time_op(op: OpBench, shape: BenchShape, device: torch.device) -> list[dict]:
    """One row per direction and PyTorch implementation."""
    torch.manual_seed(0)
    input_sets = make_input_sets(op, shape, device)
    rows = []
    for direction in op.directions:
        triton_us, triton_sets = time_us(op.triton, input_sets, direction)
        bytes_moved = op.bytes_moved(shape, direction)
        for label, fn in op.pytorch.items():
            pytorch_us, pytorch_sets = time_us(fn, input_sets, direction)
            rows.append(dict(op=op.name, direction=direction, pytorch=label, pytorch_us=pytorch_us,
                             triton_us=triton_us, speedup=pytorch_us / triton_us, bytes=bytes_moved,
                             triton_gbps=bytes_moved / triton_us / 1e3,
                             pytorch_input_sets=pytorch_sets, triton_input_sets=triton_sets))
    del input_sets
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the retained graphs' memory back before the next op
    return rows
