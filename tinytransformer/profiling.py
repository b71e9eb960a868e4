"""Profiling glue shared by every version: named ranges, the PyTorch profiler, DeepSpeed's FLOPS profiler.

Named ranges. Each model wraps its parts in `profile_range("attention")` etc. They appear as
`record_function` ranges in PyTorch-profiler traces (the reports split time by them) and, when NVTX ranges
are switched on (`TT_NVTX=1`, which the nsys/rocprof-sys wrappers set), as NVTX/roctx ranges for the vendor
timeline tools. PyTorch's ROCm build routes `torch.cuda.nvtx` to roctx, so one call serves both vendors.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function

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


# Sort keys accepted by --sort-by. torch renamed cuda_* to device_*; both spellings are accepted.
SORT_KEYS = ("self_device_time_total", "device_time_total", "self_cpu_time_total", "cpu_time_total",
             "self_cuda_time_total", "cuda_time_total", "count", "self_cpu_memory_usage",
             "self_device_memory_usage")


def key_averages_sort_key(sort_by: str, on_gpu: bool) -> str:
    """Map a --sort-by choice to a key that torch's key_averages().table() accepts on this machine."""
    key = sort_by.replace("cuda_", "device_")
    if not on_gpu and "device" in key:
        key = key.replace("device", "cpu")
    return key


class PyTorchProfilerSession:
    """torch.profiler over a few training steps (wait, warm-up, active), then traces and tables.

    Writes into `profile_dir`:
      trace_<version>.json      Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing)
      tensorboard/              the same trace for TensorBoard (`tensorboard --logdir <profile_dir>/tensorboard`)
      memory_timeline_<version>.html   with --profile-memory
      operators.csv, kernels.csv, phases.csv, summary.md   via tinytransformer.reports
    """

    def __init__(self, profile_dir: str, version: str, active_steps: int, device: torch.device,
                 profile_memory: bool = False, wait_steps: int = 1, warmup_steps: int = 1):
        self.dir = Path(profile_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.version, self.device, self.profile_memory = version, device, profile_memory
        self.active_steps = active_steps
        self.total_steps = wait_steps + warmup_steps + active_steps
        self.trace_path = self.dir / f"trace_{version}.json"
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)

        def on_trace_ready(prof):
            prof.export_chrome_trace(str(self.trace_path))
            # torch exports a recorded trace only once ("Trace is already saved"), so TensorBoard gets a
            # copy of the file, under the name its profiler plugin looks for (*.pt.trace.json).
            self.copy_trace_for_tensorboard()

        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait_steps, warmup=warmup_steps, active=active_steps, repeat=1),
            on_trace_ready=on_trace_ready,
            record_shapes=True,
            profile_memory=profile_memory,
            with_stack=profile_memory,   # the memory timeline needs stacks; traces stay small otherwise
        )
        self.steps_done = 0

    def copy_trace_for_tensorboard(self) -> Path:
        """Copy the Chrome trace to <profile_dir>/tensorboard/<host>_<pid>.<ns>.pt.trace.json."""
        tensorboard_dir = self.dir / "tensorboard"
        tensorboard_dir.mkdir(parents=True, exist_ok=True)
        target = tensorboard_dir / f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"
        shutil.copyfile(self.trace_path, target)
        return target

    def start(self):
        self.profiler.start()

    def step(self) -> bool:
        """Advance the schedule after a training step; returns True once the profile is complete."""
        self.profiler.step()
        self.steps_done += 1
        if self.steps_done >= self.total_steps:
            self.profiler.stop()
            return True
        return False

    def stop(self):
        """Stop early (the run ended before the schedule did)."""
        if self.steps_done < self.total_steps:
            self.profiler.stop()
            self.steps_done = self.total_steps

    def export_memory_timeline(self) -> Path | None:
        """memory_timeline_<version>.html: memory over time by category (parameters, gradients, activations,
        optimizer state), from the allocations this profile recorded.

        torch marks profile.export_memory_timeline deprecated (a FutureWarning since 2.9) and points to
        torch.cuda.memory._record_memory_history / _export_memory_snapshot. That replacement is not the same
        artefact: it records CUDA allocations only (nothing on the CPU), needs recording switched on before the
        allocations happen, and writes a pickle for pytorch.org/memory_viz instead of this categorised plot. So
        we keep the timeline while torch has it and silence that one warning here, where we call it knowingly;
        a torch without it gets one note.
        """
        if not self.profile_memory:
            return None
        if not hasattr(self.profiler, "export_memory_timeline"):
            print("note: memory timeline not exported: this torch no longer has profile.export_memory_timeline")
            return None
        path = self.dir / f"memory_timeline_{self.version}.html"
        device_name = "cuda:0" if self.device.type == "cuda" else "cpu"
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*export_memory_timeline.*deprecated",
                                        category=FutureWarning)
                self.profiler.export_memory_timeline(str(path), device=device_name)
        except Exception as error:  # the exporter is experimental in torch: report, do not fail the run
            print(f"note: memory timeline not exported ({type(error).__name__}: {error})")
            return None
        return path

    def operator_table(self, sort_by: str, limit: int = 20) -> str:
        key = key_averages_sort_key(sort_by, self.device.type == "cuda")
        return self.profiler.key_averages().table(sort_by=key, row_limit=limit)


class DeepSpeedFlopsSession:
    """DeepSpeed's FLOPS profiler around one training step's forward pass.

    DeepSpeed is optional: when it is missing, `available` is False and `reason` says how to install it.
    It counts FLOPs by intercepting torch functions (F.linear, matmul, softmax, ...): work done inside custom
    Triton kernels is invisible to it, which is why the analytic count is printed beside it.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        try:
            from deepspeed.profiling.flops_profiler import FlopsProfiler
        except Exception as error:  # ImportError, or a DeepSpeed that fails to import on this machine
            self.available = False
            self.reason = (f"DeepSpeed is not available ({type(error).__name__}); "
                           f"install it with `pip install deepspeed` to get the FLOPS profile")
            return
        self.available = True
        self.reason = ""
        self.profiler = FlopsProfiler(model)
        self.started_at = 0.0

    def start(self):
        self.profiler.start_profile()
        self.started_at = time.perf_counter()

    def stop_and_report(self, output_file: str | None = None) -> dict:
        self.profiler.stop_profile()
        result = {
            "flops": self.profiler.get_total_flops(),
            "macs": self.profiler.get_total_macs(),
            "params": self.profiler.get_total_params(),
            "forward_latency_s": self.profiler.get_total_duration(),
        }
        self.profiler.print_model_profile(profile_step=1, module_depth=-1, top_modules=3, detailed=True,
                                          output_file=output_file)
        self.profiler.end_profile()
        return result
