"""DeepSpeed's FLOPS profiler around one forward pass: the one place the harness talks to it.

DeepSpeed counts FLOPs by intercepting torch functions (F.linear, matmul, softmax, ...) while a forward pass runs:
work done inside custom Triton kernels is invisible to it, which is why the analytic count (tinytransformer/flops.py)
is always printed beside it. DeepSpeed is optional: deepspeed_import_problem() says in one line why it cannot be
used, and callers print that line instead of a profile.

Used by a training run's --enable-deepspeed-flops (training/tools.py) and by run_deepspeed_flops.py
(profiling/deepspeed_flops_cli.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

DEEPSPEED_MISSING = ("DeepSpeed is not installed: pip install deepspeed "
                     "(the FLOPS profiler needs no compiled ops)")


def deepspeed_import_problem() -> str | None:
    """None when DeepSpeed's FLOPS profiler imports; else the line to show the user."""
    try:
        from deepspeed.profiling.flops_profiler import FlopsProfiler  # noqa: F401
    except ImportError as error:
        if (error.name or "deepspeed").split(".")[0] == "deepspeed":
            return DEEPSPEED_MISSING
        return f"DeepSpeed is installed but does not import on this machine ({type(error).__name__}: {error})"
    except Exception as error:  # DeepSpeed probes the accelerator at import time; that can fail too
        return f"DeepSpeed is installed but does not import on this machine ({type(error).__name__}: {error})"
    return None


def profile_forward(model, forward: Callable[[], None], output_file: Path | None = None) -> dict:
    """Run `forward()` once under DeepSpeed's FlopsProfiler; its per-module tree goes to `output_file` (None: printed).

    Returns the totals (forward_flops, forward_macs, params, forward_latency_s, deepspeed_version) and `modules`:
    FLOPs / MACs / parameters / latency of the modules down to depth 2 (embed_tokens, layers.0, lm_head, ...) and of
    the first layer's children (layers.0.attention, ...). DeepSpeed patches torch functions while it profiles; the
    `finally` puts them back even if the forward pass fails.
    """
    import deepspeed
    from deepspeed.profiling.flops_profiler import FlopsProfiler
    from deepspeed.profiling.flops_profiler.profiler import get_module_duration, get_module_flops, get_module_macs

    profiler = FlopsProfiler(model)
    profiler.start_profile()
    try:
        forward()
        profiler.stop_profile()
        modules = []
        for name, module in model.named_modules():
            parts = name.split(".") if name else []
            if 1 <= len(parts) <= 2 or (len(parts) == 3 and parts[1] == "0"):
                modules.append({"module": name, "params": int(getattr(module, "__params__", 0)),
                                "flops": int(get_module_flops(module)), "macs": int(get_module_macs(module)),
                                "latency_ms": 1e3 * get_module_duration(module)})
        result = {"deepspeed_version": deepspeed.__version__, "forward_flops": int(profiler.get_total_flops()),
                  "forward_macs": int(profiler.get_total_macs()), "params": int(profiler.get_total_params()),
                  "forward_latency_s": profiler.get_total_duration(), "modules": modules}
        profiler.print_model_profile(profile_step=1, module_depth=-1, top_modules=3, detailed=True,
                                     output_file=None if output_file is None else str(output_file))
    finally:
        profiler.end_profile()
    return result
