"""Named ranges: the model's parts (attention, ffn, ...) and the training phases, as the profilers see them.

Each model wraps its parts in `profile_range("attention")` etc. They appear as `record_function` ranges in
PyTorch-profiler traces (the reports split time by them, profiling/attribution.py) and, when NVTX ranges are
switched on (`TT_NVTX=1`, which the nsys/rocprof-sys wrappers set), as NVTX/roctx ranges for the vendor
timeline tools. PyTorch's ROCm build routes `torch.cuda.nvtx` to roctx, so one call serves both vendors.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch.profiler import record_function

RANGE_NAMES = ("attention", "ffn", "rmsnorm", "rope", "output_head", "loss", "forward", "backward", "optimizer")
_NVTX = os.environ.get("TT_NVTX") == "1" and torch.cuda.is_available()


def _pytorch_profiler_recording() -> bool:
    # torch.compile cannot trace the profiler query, and would give up on the whole function; inside compiled
    # code it ignores record_function anyway, so there the answer is simply no.
    if torch.compiler.is_compiling():
        return False
    return torch._C._autograd._profiler_enabled()


@contextlib.contextmanager
def profile_range(name: str):
    """A named region: a record_function range, and an NVTX/roctx range when TT_NVTX=1.

    The record_function range is opened only while a PyTorch profiler records: otherwise nothing would see it,
    and opening one costs the host several microseconds, ~26 times per training step (which matters where the
    step is host-bound, as the eager versions are at the seed size).
    """
    if _NVTX:
        torch.cuda.nvtx.range_push(name)
    try:
        if _pytorch_profiler_recording():
            with record_function(name):
                yield
        else:
            yield
    finally:
        if _NVTX:
            torch.cuda.nvtx.range_pop()
