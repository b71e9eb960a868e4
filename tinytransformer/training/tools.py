"""The optional tools a run can switch on: the PyTorch profiler over a few steps (--enable-pytorch-profiler),
TensorBoard scalars (--tensorboard-dir) and DeepSpeed's FLOPS profile of one forward pass (--enable-deepspeed-flops).

Under data parallel, rank 0 alone uses them (one trace, one directory). The profiled steps are excluded from the
timing: the profiler's own overhead would otherwise count as step time.
"""
from __future__ import annotations

import torch

from .. import flops
from ..config import TrainConfig
from ..profiling.analysis import kernels_per_step, operators_per_step
from ..profiling.deepspeed_flops import deepspeed_import_problem, profile_forward
from ..profiling.session import PyTorchProfilerSession
from ..profiling.tables import write_reports
from ..profiling.trace import load_trace
from .step import autocast_context


def profiler_window(num_steps: int, warmup_steps: int, profile_steps: int) -> tuple[int, int, int, int]:
    """(first step, wait, warm-up, active) of the PyTorch profiler: right after the timing warm-up if the run
    is long enough, else as late as possible; shrunk to fit very short runs."""
    active = min(profile_steps, num_steps)
    room = num_steps - active
    wait, warm = (1 if room >= 2 else 0), (1 if room >= 1 else 0)
    first = max(0, min(warmup_steps, num_steps - (wait + warm + active)))
    return first, wait, warm, active


class RunProfiler:
    """The PyTorch profiler over a window of this process's steps, then the trace's tables (profiling/tables.py).
    `result` holds what the metrics JSON says about the profile once it is finished."""

    def __init__(self, train: TrainConfig, start_step: int, version: str, device: torch.device, is_main: bool,
                 log):
        self.train, self.log = train, log
        self.session, self.first, self.result = None, -1, None
        self.steps = range(0)   # the steps the profiler sees: excluded from the timing
        remaining = train.num_steps - start_step   # a resumed run profiles its own steps
        if not train.enable_pytorch_profiler or remaining == 0 or not is_main:
            return
        first, wait, warm, active = profiler_window(remaining, train.warmup_steps, train.profile_steps)
        self.first = first + start_step
        self.steps = range(self.first, self.first + wait + warm + active)
        self.session = PyTorchProfilerSession(train.profile_dir, version, active, device, train.profile_memory,
                                              wait_steps=wait, warmup_steps=warm)
        recorded = self.first + wait + warm
        log(f"PyTorch profiler: steps {recorded + 1}..{recorded + active} recorded into {self.session.dir}/ "
            f"(these steps are excluded from the timing)")

    @property
    def recording(self) -> bool:
        return self.session is not None and self.session.steps_done < self.session.total_steps

    def before_step(self, step: int) -> None:
        if self.session is not None and step == self.first:
            self.session.start()

    def after_step(self, step: int) -> None:
        if self.recording and self.first <= step and self.session.step():
            self.finish()

    def close(self) -> None:
        """The run ended before the profiler's window did (a short or stopped run)."""
        if self.recording:
            self.session.stop()
            self.finish()

    def finish(self) -> None:
        session, train = self.session, self.train
        result = {"trace": str(session.trace_path), "active_steps": session.active_steps}
        if not session.trace_path.exists():
            self.log("note: the profiler recorded no active step; no trace written")
            self.result = result
            return
        memory_timeline = session.export_memory_timeline()
        if memory_timeline:
            result["memory_timeline"] = str(memory_timeline)
        trace = load_trace(session.trace_path)
        result["kernels_per_step"] = kernels_per_step(trace)
        result["operators_per_step"] = operators_per_step(trace)
        written = write_reports(trace, session.dir, sort_by=train.sort_by, limit=20)
        result["reports"] = {k: str(v) for k, v in written.items()} if isinstance(written, dict) else written
        if train.profile_operators:
            self.log(f"--- top operators (sorted by {train.sort_by}) ---")
            self.log(session.operator_table(train.sort_by, limit=15))
        kps = result["kernels_per_step"]
        self.log(f"profile: trace {session.trace_path}; "
                 + (f"{kps:.0f} GPU kernels per training step" if kps is not None
                    else f"{result['operators_per_step']:.0f} operators per training step (CPU)"))
        self.result = result


def tensorboard_writer(train: TrainConfig, is_main: bool, log):
    """A SummaryWriter for --tensorboard-dir (rank 0 only), or None."""
    if not train.tensorboard_dir or not is_main:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        log("note: TensorBoard is not installed (pip install tensorboard); --tensorboard-dir ignored")
        return None
    return SummaryWriter(train.tensorboard_dir)


def deepspeed_flops_profile(model, model_config, train: TrainConfig, stream, device: torch.device, log) -> dict:
    """DeepSpeed's FLOPS profile of one forward pass of the first batch, beside the analytic count."""
    analytic = flops.forward_flops(model_config, train.batch_size, train.seq_len)
    problem = deepspeed_import_problem()
    if problem is not None:
        log(f"note: {problem}")
        return {"available": False, "reason": problem, "analytic_forward_flops": analytic}
    inputs, targets = stream.batch(0)

    def forward():
        with torch.no_grad(), autocast_context(device, train):
            model(inputs, targets)

    log("--- DeepSpeed FLOPS profile (one forward pass) ---")
    counted = profile_forward(model, forward)   # DeepSpeed prints its per-module tree
    return {"flops": counted["forward_flops"], "macs": counted["forward_macs"], "params": counted["params"],
            "forward_latency_s": counted["forward_latency_s"], "available": True, "analytic_forward_flops": analytic}
