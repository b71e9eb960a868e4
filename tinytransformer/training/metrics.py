"""The metrics of a run: the dictionary the summary prints and --output-json writes (schema_version 1).

Throughput counts the GLOBAL batch (all ranks); MFU is per GPU: one rank's FLOPs over one GPU's peak. Memory is rank
0's GPU under data parallel. The loss history holds every step's loss, averaged over the ranks.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path

from .. import flops
from ..device import describe, peak_memory_mb, peak_tflops
from ..precision import tf32_enabled
from ..weights import parameter_count
from .schedule import learning_rate_at
from .timing import phase_breakdown, summarize_times


def collect_metrics(run, first: int, steps_done: int, stopped_by: str | None, wall_seconds: float) -> dict:
    """The metrics of a run that has done its steps (the optional tools add theirs after this)."""
    train = run.train
    loss_values = run.losses[:steps_done].tolist()
    if not all(math.isfinite(v) for v in loss_values):
        first_bad = next(i for i, v in enumerate(loss_values) if not math.isfinite(v))
        run.log(f"warning: the loss became non-finite at step {first_bad} (diverged)")
    step_ms = sorted(run.step_ms.items())
    timed = [ms for s, ms in step_ms if s not in run.untimed]
    note = None
    if not timed:  # a very short run: everything was warm-up or profiled; time it anyway, and say so
        timed = ([ms for s, ms in step_ms if s >= min(first + train.warmup_steps, train.num_steps - 1)]
                 or [ms for _, ms in step_ms])
        note = "every step was warm-up or profiled; the times include that overhead"
    metrics = build_metrics(run, loss_values, timed, wall_seconds, note)
    metrics.update(long_run_metrics(run, first, steps_done, stopped_by))
    if run.phase_timer is not None:
        metrics["timing_breakdown"] = phase_breakdown(run.phase_timer, train.warmup_steps)
    return metrics


def build_metrics(run, loss_values: list[float], timed_ms: list[float], wall_seconds: float,
                  note: str | None) -> dict:
    """Everything about the run but its schedule, validation and checkpoints (long_run_metrics)."""
    cfg, train = run.model_config, run.train
    times = summarize_times(timed_ms)
    median_s = times["median_ms"] / 1e3 if times["median_ms"] else None
    samples_per_s = run.global_batch / median_s if median_s else None
    info = describe(run.device)
    precision = train.amp_dtype if train.use_amp else "float32"
    peak = peak_tflops(info.name, precision, tf32=tf32_enabled()) if run.device.type == "cuda" else None
    finite = [v for v in loss_values if math.isfinite(v)]
    return {
        "schema_version": 1,
        "version": run.spec.name,
        "title": run.spec.title,
        "variant": run.variant_description(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "model_config": asdict(cfg),
        "parameters": parameter_count(cfg),
        "train_config": {k: v for k, v in asdict(train).items() if k != "extra"},
        "device": info.as_dict(),
        "precision": precision,
        "timing": {**times, "warmup_steps": train.warmup_steps, "wall_seconds": wall_seconds, "note": note},
        "throughput": {
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * train.seq_len if samples_per_s else None,
            "training_tflops_per_s": (flops.training_flops(cfg, run.global_batch, train.seq_len)
                                      / median_s / 1e12) if median_s else None,
            "mfu": flops.mfu(cfg, train.batch_size, train.seq_len, median_s, peak) if median_s else None,
            "peak_tflops": peak,
        },
        "memory": {"peak_allocated_mib": peak_memory_mb(run.device)},   # rank 0's GPU under data parallel
        "distributed": {"engine": run.dist.engine, "world_size": run.dist.world_size,
                        "backend": run.dist.backend, "batch_size_per_rank": train.batch_size,
                        "global_batch_size": run.global_batch,
                        # who averages the gradients: DDP's wrapper, DeepSpeed's engine, or the version's own step
                        # (version 4's graph: gradient_sync.py); None in a single process
                        "gradients_averaged_by": (None if not run.dist.enabled else "step" if run.gradient_sync
                                                  else run.dist.engine),
                        "zero_stage": (run.engine.zero_optimization_stage()
                                       if run.dist.engine == "deepspeed" else None),
                        # the dtype the ranks' gradients were summed in (--grad-reduce-dtype); None in one process
                        # and under DeepSpeed (its own communication_data_type decides)
                        "grad_reduce_dtype": (run.dist.grad_reduce_dtype if run.dist.engine == "ddp" else None)},
        "loss": {
            "first": loss_values[0] if loss_values else None,
            "final": loss_values[-1] if loss_values else None,
            "min": min(finite) if finite else None,
            "optimum": run.corpus.optimum_loss,
            "history": loss_values,
        },
        "kernels_per_step": None,
    }


def long_run_metrics(run, first: int, steps_done: int, stopped_by: str | None) -> dict:
    """What the JSON says about the schedule, validation and checkpoints of this run."""
    train = run.train
    status = f"stopped by {stopped_by}" if stopped_by else "completed"
    return {
        "steps_completed": steps_done,
        "status": status,
        "lr_schedule": {"kind": train.lr_schedule, "peak": train.learning_rate,
                        "warmup_steps": train.lr_warmup_steps,
                        "final": learning_rate_at(max(0, steps_done - 1), train)},
        "eval": run.validation.metrics(),
        "checkpoint": run.checkpoints.metrics(first),
    }
