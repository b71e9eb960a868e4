"""What a run prints: the header (what runs), a step line, and the summary at the end.

Each function takes the run (the Trainer) and prints through run.log, which only rank 0 does under data
parallel. A step line shows the median time of the TIMED steps since the last line; warm-up and profiled steps
are shown as such, not as throughput.
"""
from __future__ import annotations

import math
import statistics

from ..device import describe
from ..weights import parameter_count
from .schedule import COSINE_FLOOR, schedule_varies


def print_header(run) -> None:
    """What runs: device, model, training settings, data, schedule, validation, checkpoints, a resume."""
    info = describe(run.device)
    cfg, train = run.model_config, run.train
    run.log(f"=== TinyLlama {run.spec.name}: {run.spec.title} ===")
    run.log(f"device      : {info.name} ({info.backend}), torch {info.torch_version}")
    run.log(f"model       : vocab {cfg.vocab_size}, hidden {cfg.hidden_dim}, layers {cfg.num_layers}, "
            f"heads {cfg.num_heads} (head dim {cfg.head_dim}), ffn {cfg.intermediate_size}, "
            f"max seq {cfg.max_seq_len}; {parameter_count(cfg):,} parameters")
    precision = f"AMP {train.amp_dtype}" if train.use_amp else "float32"
    run.log(f"training    : batch {train.batch_size} x seq {train.seq_len}, {train.num_steps} steps "
            f"({train.warmup_steps} warm-up), lr {train.learning_rate}, {precision}, seed {train.seed}")
    if run.dist.enabled:
        world = run.dist.world_size
        mode = (run.gradient_sync.describe(f"{run.spec.name}'s own step") if run.gradient_sync is not None
                else run.dist.describe())
        run.log(f"parallel    : {mode}, global batch {train.batch_size * world} = "
                f"{world} x {train.batch_size} per rank; times are rank 0's")
    for key, value in run.variant_description().items():
        run.log(f"{key:<12}: {value}")
    for note in run.setup_notes:
        run.log(f"note        : {note}")
    run.log(f"data        : {run.corpus.description}")
    if run.corpus.optimum_loss is not None:
        run.log(f"optimum loss: {run.corpus.optimum_loss:.4f} nats (start ~ ln {cfg.vocab_size} = "
                f"{math.log(cfg.vocab_size):.4f})")
    if schedule_varies(train):
        end = COSINE_FLOOR * train.learning_rate if train.lr_schedule == "cosine" else train.learning_rate
        run.log(f"lr schedule : {train.lr_schedule}, {train.lr_warmup_steps} lr warm-up steps, "
                f"peak {train.learning_rate:g} -> {end:g} at the last step")
    if train.eval_every:
        run.log(f"validation  : every {train.eval_every} steps and at the end, on {train.eval_batches} "
                f"fixed held-out batches")
    if train.save_every:
        keep = f"keep last {train.keep_last}" if train.keep_last else "keep all"
        run.log(f"checkpoints : every {train.save_every} steps and at the end, into "
                f"{train.checkpoint_dir}/ ({keep})")
    if run.checkpoints.resumed_from:
        complete = " (the run is already complete)" if run.start_step == train.num_steps else ""
        run.log(f"resumed     : from {run.checkpoints.resumed_from} at step {run.start_step}/{train.num_steps}"
                f"{complete}")
        for note in run.checkpoints.resume_notes:
            run.log(f"note        : {note}")


def log_step(run, step: int, interval_start: int) -> None:
    """One step line: the loss of `step` and the median time of the TIMED steps since the last line. When all
    of them were warm-up or profiled steps, the line says so and shows the step's time as what it is."""
    value = run.losses[step].item()
    step_ms = run.step_ms
    timed = [step_ms[s] for s in range(interval_start, step + 1) if s in step_ms and s not in run.untimed]
    line = f"step {step + 1:>6}/{run.train.num_steps} | loss {value:.4f} | "
    samples_per_s = None
    if timed:
        ms = statistics.median(timed)
        samples_per_s = run.global_batch / (ms / 1e3) if ms > 0 else float("nan")
        line += f"{samples_per_s:10.1f} samples/s | {ms:8.2f} ms/step"
    else:
        kind = "warm-up" if step < run.start_step + run.train.warmup_steps else "profiled"
        line += f"{kind} step, not timed ({step_ms.get(step, float('nan')):.2f} ms)"
    run.log(line + (f" | lr {run.current_lr:.2e}" if schedule_varies(run.train) else ""))
    if run.writer is not None:
        run.writer.add_scalar("train/loss", value, step + 1)
        if samples_per_s is not None:
            run.writer.add_scalar("train/samples_per_s", samples_per_s, step + 1)
        run.writer.add_scalar("train/lr", run.current_lr, step + 1)


def log_ranks_agree(run, m: dict) -> None:
    """Under data parallel: whether the ranks ended with the same weights (DistributedContext.weights_identical)."""
    identical, ranks = m["distributed"].get("weights_identical_across_ranks"), m["distributed"]["world_size"]
    if identical is not None:
        run.log(f"ranks       : the weights are the same bits on all {ranks} ranks" if identical else
                f"ranks       : WARNING: the weights differ between the {ranks} ranks (each rank should apply the "
                f"same averaged gradient; a gradient sum that is not the same bits everywhere drifts them apart)")


def print_summary(run, m: dict) -> None:
    """The end of a run: step time, throughput, MFU, peak memory, loss against the optimum, kernels per step."""
    t, tp, loss = m["timing"], m["throughput"], m["loss"]
    run.log(f"=== Summary ({run.spec.name}: {run.spec.title}) ===")
    log_ranks_agree(run, m)
    if t["median_ms"] is None:
        run.log("no timed steps")
        return
    run.log(f"timed steps : {t['count']} (excluding {run.train.warmup_steps} warm-up"
            + (" and profiled" if run.train.enable_pytorch_profiler else "") + " steps)")
    if t.get("note"):
        run.log(f"note        : {t['note']}")
    run.log(f"step time   : median {t['median_ms']:.2f} ms (p10 {t['p10_ms']:.2f}, p90 {t['p90_ms']:.2f})")
    ranks = m["distributed"]["world_size"]
    run.log(f"throughput  : {tp['samples_per_s']:.1f} samples/s, {tp['tokens_per_s']:,.0f} tokens/s, "
            f"{tp['training_tflops_per_s']:.2f} TFLOP/s" + (f" (all {ranks} ranks)" if ranks > 1 else ""))
    if tp["mfu"] is not None:
        run.log(f"MFU         : {100 * tp['mfu']:.1f}% of {tp['peak_tflops']:.0f} TFLOP/s "
                f"({m['precision']} peak of this device)")
    elif m["device"]["type"] == "cuda":
        run.log("MFU         : unknown (this device is not in the peak-FLOPs table)")
    mem = m["memory"]["peak_allocated_mib"]
    per_gpu = " per GPU (rank 0)" if ranks > 1 else ""
    run.log(f"peak memory : {mem:.1f} MiB allocated{per_gpu}" if mem is not None else "peak memory : n/a on CPU")
    if m.get("timing_breakdown"):
        b = m["timing_breakdown"]
        run.log("breakdown   : " + ", ".join(f"{k} {v:.2f} ms" for k, v in b.items()))
    line = f"loss        : first {loss['first']:.4f} -> final {loss['final']:.4f}"
    if loss["optimum"] is not None:
        line += f" (optimum {loss['optimum']:.4f}, gap {loss['final'] - loss['optimum']:.4f} nats)"
    run.log(line)
    profile = m.get("profile") or {}
    if profile.get("kernels_per_step") is not None:
        run.log(f"kernels     : {profile['kernels_per_step']:.0f} GPU kernels per step (profiled)")
