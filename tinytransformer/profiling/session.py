"""The PyTorch profiler over a few training steps of a run: its schedule, the traces it writes, torch's table.

The trainer (training/tools.py) opens a session when a run asks for --enable-pytorch-profiler, steps it after
every training step, and hands the finished trace to the report writer (profiling/tables.py).
"""
from __future__ import annotations

import os
import shutil
import socket
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from .tables import REPORT_NAMES


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


def trace_name(version: str) -> str:
    return f"trace_{version}.json"


def memory_timeline_name(version: str) -> str:
    return f"memory_timeline_{version}.html"


def profile_files(profile_dir, version: str, profile_memory: bool) -> list[Path]:
    """The files a session of `version` writes into `profile_dir` under names known before it starts (the
    TensorBoard copy's name holds the time it is written, so no existing file has it)."""
    names = [trace_name(version), *REPORT_NAMES]
    if profile_memory:
        names.append(memory_timeline_name(version))
    return [Path(profile_dir) / name for name in names]


class PyTorchProfilerSession:
    """torch.profiler over a few training steps (wait, warm-up, active), then traces and tables.

    Writes into `profile_dir`:
      trace_<version>.json      Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing)
      tensorboard/              the same trace for TensorBoard (`tensorboard --logdir <profile_dir>/tensorboard`)
      memory_timeline_<version>.html   with --profile-memory
      operators.csv, kernels.csv, phases.csv, families.csv, summary.md   via profiling/tables.py
    """

    def __init__(self, profile_dir: str, version: str, active_steps: int, device: torch.device,
                 profile_memory: bool = False, wait_steps: int = 1, warmup_steps: int = 1):
        self.dir = Path(profile_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.version, self.device, self.profile_memory = version, device, profile_memory
        self.active_steps = active_steps
        self.total_steps = wait_steps + warmup_steps + active_steps
        self.trace_path = self.dir / trace_name(version)
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
        path = self.dir / memory_timeline_name(self.version)
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
