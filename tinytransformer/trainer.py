"""The training loop every version shares: data, optimizer, mixed precision, honest timing, metrics.

Timing. GPU work is asynchronous: a Python timer around `loss.backward()` measures how long it took to
*queue* the work, not to do it. Each step is therefore bracketed by device events (on the CPU, which is
synchronous, by a host clock). Events are read only at log points, so timing adds no synchronisation to
the loop. The first --warmup-steps steps (allocator growth, cuBLAS/Triton compilation, torch.compile) are
excluded, and the summary reports the MEDIAN step time with its spread.

Long runs. `--eval-every` measures the validation loss (outside the timed regions), `--lr-schedule` shapes the
learning rate, `--save-every` writes checkpoints (tinytransformer/checkpoint.py) and `--resume` continues a
run exactly where it stopped: step t's batch and learning rate are functions of t, and the checkpoint holds
everything else (weights, optimizer state, random-number states, the loss history). Ctrl-C or SIGTERM stops the
run at once: a step caught in its forward or backward pass is abandoned (it has changed nothing yet), one caught
in its optimizer step is finished (tinytransformer/stopping.py). The run then writes a checkpoint if checkpoints
were asked for (--checkpoint-dir, --save-every or --resume) and prints how to resume.

Progress. A step line is printed every --log-every steps and also at the end of the first step that ends
PROGRESS_INTERVAL_S (10 s) or more after the last step line; a step that alone runs longer (Triton's CPU
interpreter) gets "still running" lines from a heartbeat thread (tinytransformer/progress.py). Both read only the
host clock. Warm-up and profiled steps are shown as such, not as throughput.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import deepspeed_engine, distributed
from . import flops as flops_mod
from .config import ConfigError, ModelConfig, TrainConfig
from .data import BatchStream, build_corpora
from .device import describe, peak_memory_mb, peak_tflops, reset_peak_memory, resolve_device, synchronize
from .outputs import write_json
from .precision import tf32_enabled
from .profiling.analysis import kernels_per_step, operators_per_step
from .profiling.deepspeed_flops import deepspeed_import_problem, profile_forward
from .profiling.ranges import profile_range
from .profiling.session import PyTorchProfilerSession
from .profiling.tables import write_reports
from .profiling.trace import load_trace
from .progress import Progress
from .stopping import StepAbandoned, StopOnSignal, may_abandon
from .weights import init_canonical_weights, parameter_count


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------
# One training step
# ----------------------------------------------------------------------------------------------------------
def autocast_context(device: torch.device, train: TrainConfig):
    if not train.use_amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, train.amp_dtype))


def default_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; a version may provide `model.configure_optimizer(train)` instead (v4 uses its Triton AdamW)."""
    if hasattr(model, "configure_optimizer"):
        return model.configure_optimizer(train)
    return torch.optim.AdamW(model.parameters(), lr=train.learning_rate, betas=(0.9, 0.95),
                             weight_decay=train.weight_decay)


class EagerStep:
    """forward -> backward -> optimizer, as written. Returns the (detached, unsynchronised) loss."""

    supports_breakdown = True

    def __init__(self, model, optimizer, device, train: TrainConfig, timer: StepTimer | None = None):
        self.model, self.optimizer, self.device, self.train = model, optimizer, device, train
        self.scaler = None
        if train.use_amp and train.amp_dtype == "float16":
            # float16 has a narrow exponent range: scale the loss so small gradients do not flush to zero.
            self.scaler = torch.amp.GradScaler(device.type)
        self.phase_timer = timer   # set for --timing-breakdown: adds marks between the phases

    def __call__(self, inputs, targets):
        marks = [self.phase_timer.mark()] if self.phase_timer else None
        # Until the optimizer step nothing persistent changes: a stop signal here abandons the step at once.
        with may_abandon():
            self.optimizer.zero_grad(set_to_none=True)
            with profile_range("forward"), autocast_context(self.device, self.train):
                _, loss = self.model(inputs, targets)
            if marks is not None:
                marks.append(self.phase_timer.mark())
            with profile_range("backward"):
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            if marks is not None:
                marks.append(self.phase_timer.mark())
        with profile_range("optimizer"):
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        if marks is not None:
            marks.append(self.phase_timer.mark())
            self.phase_timer.add(tuple(marks))
        return loss.detach()


# ----------------------------------------------------------------------------------------------------------
# Learning-rate schedule and validation loss
# ----------------------------------------------------------------------------------------------------------
STOP_AGREEMENT_EVERY = 10   # under data parallel, the ranks agree on a stop signal every N steps
COSINE_FLOOR = 0.1   # the cosine schedule decays to 10% of the peak learning rate


def learning_rate_at(step: int, train: TrainConfig) -> float:
    """The learning rate of step `step` (0-based). A pure function of the step, so a resumed run needs no
    scheduler state. Linear warm-up over --lr-warmup-steps (step 0 already learns: peak / warm-up steps), then
    either constant or a cosine decay that reaches COSINE_FLOOR * peak at the run's last step."""
    peak, warmup = train.learning_rate, train.lr_warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if train.lr_schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, train.num_steps - 1 - warmup))
    floor = COSINE_FLOOR * peak
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write the learning rate into every param_group['lr'] (the trainer does this before a step).

    A float is replaced. A TENSOR learning rate, which a CUDA/HIP-graph-captured optimizer step needs (see
    make_learning_rate_a_tensor), is updated in place: the captured graph re-reads that very tensor on every
    replay, while a new Python float would never reach it.
    """
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def schedule_varies(train: TrainConfig) -> bool:
    return train.lr_schedule != "constant" or train.lr_warmup_steps > 0


def make_learning_rate_a_tensor(optimizer: torch.optim.Optimizer) -> None:
    """A capturable optimizer (one whose step a CUDA/HIP graph may capture) gets its learning rate as a 0-dim
    tensor on the parameters' device: a graph bakes a Python float in at capture time, but re-reads a tensor
    at every replay. torch's AdamW accepts a tensor lr when capturable=True or fused=True."""
    for group in optimizer.param_groups:
        if group.get("capturable") and not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=group["params"][0].device)


@torch.no_grad()
def validation_loss(model, stream: BatchStream, num_batches: int, device, train: TrainConfig) -> float:
    """Mean loss of the first `num_batches` batches of the validation stream: the same batches every time (a
    function of the seed), under the run's autocast setting, without gradients."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    with autocast_context(device, train):
        for index in range(num_batches):
            inputs, targets = stream.batch(index)
            _, loss = model(inputs, targets)
            total += loss.float()
    model.train(was_training)
    return (total / num_batches).item()


# ----------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    metrics: dict
    losses: list[float] = field(default_factory=list)
    exit_code: int = 0           # 0, or 143 when SIGTERM stopped the run (SIGINT stops it with 0)


def default_warmup_steps(steps_to_run: int) -> int:
    """The timing warm-up when --warmup-steps is not given: up to 5 steps, never more than half of the steps
    this process runs (a resumed run counts its own steps, not the run's total)."""
    return min(5, max(0, (steps_to_run - 1) // 2))


def given_explicitly(train: TrainConfig, name: str) -> bool:
    """Was setting `name` chosen by the user (a flag or a config file) rather than left at its default?
    cli.resolve_configs records the chosen names in `train.given_settings`; a TrainConfig built in code has no
    such record and counts as chosen in full."""
    given = getattr(train, "given_settings", None)
    return given is None or name in given


def checkpoints_requested(train: TrainConfig) -> bool:
    """Checkpoints are written only where the user asked for them: --save-every, --resume, or a --checkpoint-dir
    of their own. A run without any of these writes no file when it is interrupted."""
    return bool(train.save_every or train.resume or given_explicitly(train, "checkpoint_dir"))


def profiler_window(num_steps: int, warmup_steps: int, profile_steps: int) -> tuple[int, int, int, int]:
    """(first step, wait, warm-up, active) of the PyTorch profiler: right after the timing warm-up if the run
    is long enough, else as late as possible; shrunk to fit very short runs."""
    active = min(profile_steps, num_steps)
    room = num_steps - active
    wait, warm = (1 if room >= 2 else 0), (1 if room >= 1 else 0)
    first = max(0, min(warmup_steps, num_steps - (wait + warm + active)))
    return first, wait, warm, active


class Trainer:
    def __init__(self, spec, model_config: ModelConfig, train: TrainConfig, args, out=None,
                 argv: list[str] | None = None):
        self.spec, self.model_config, self.train, self.args = spec, model_config, train, args
        self.out = out if out is not None else sys.stdout   # looked up now, so that tests can capture it
        self.argv = list(sys.argv[1:] if argv is None else argv)   # to print the command that resumes the run
        self.device = resolve_device(train.device)
        self._log_lock = threading.Lock()   # the progress heartbeat prints from a second thread
        self.progress = Progress(self.log)
        # Before anything imports DeepSpeed (--deepspeed, --validate-setup, the FLOPS profiles): no guess, no warning.
        deepspeed_engine.choose_deepspeed_accelerator(self.device)
        if train.use_amp and self.device.type == "cpu" and train.amp_dtype == "float16":
            raise ConfigError("--use-amp with --amp-dtype float16 is not supported on the CPU; "
                              "use --amp-dtype bfloat16 or a GPU")
        if spec.check_arguments:
            spec.check_arguments(args, self.device)
        # --deepspeed: DeepSpeed missing or a bad config file is one line, before any process waits for another.
        self.deepspeed_config = deepspeed_engine.prepare_deepspeed(train, self.device) if train.uses_deepspeed else None
        # Data parallel: join the job torchrun started (a no-op otherwise); each rank then uses its own GPU.
        self.dist = distributed.setup(train, self.device)
        self.device = self.dist.device
        self.setup_notes = [note for note in [distributed.graph_capture_note(args, self.device, self.dist)] if note]

    def log(self, text: str = "") -> None:
        if not self.dist.is_main:   # under data parallel only rank 0 prints
            return
        with self._log_lock:
            print(text, file=self.out, flush=True)
        self.progress.printed()

    # -- set-up --------------------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, train = self.model_config, self.train
        # A bad --resume fails first: one line, before anything is built or written.
        resume = (ckpt.find_checkpoint_to_resume(train.resume, train.checkpoint_dir, cfg, self.log)
                  if train.resume else None)
        if checkpoints_requested(train) and self.dist.is_main:
            self.remove_interrupted_writes()
        torch.manual_seed(train.seed)
        self.model = self.spec.build_model(cfg, self.args)
        self.model.load_canonical(init_canonical_weights(cfg, train.seed))
        self.model.to(self.device)
        self.optimizer = default_optimizer(self.model, train)
        train_corpus, valid_corpus = build_corpora(train.data, cfg.vocab_size, train.seq_len, train.seed,
                                                   self.device)
        self.corpus, self.valid_corpus = train_corpus, valid_corpus
        # Rank r reads its contiguous slice of each global batch (batch_size per rank x world_size ranks).
        rank, world = self.dist.rank, self.dist.world_size
        self.stream = BatchStream(train_corpus, train.seq_len, train.batch_size, train.seed, rank, world)
        self.eval_stream = BatchStream(valid_corpus, train.seq_len, train.batch_size, train.seed, rank, world)
        self.start_step, self.loss_history, self.eval_history = 0, [], []
        self.resumed_from, self.resume_notes, self.rng_to_restore = None, [], None
        self._corpus_fingerprint = None
        if resume is not None:
            self.resume_from_checkpoint(*resume)
            if not given_explicitly(train, "warmup_steps"):   # the default counts this process's steps
                train.warmup_steps = default_warmup_steps(train.num_steps - self.start_step)
        self.dist.check_same(self.start_step, "the step to resume from",
                             " (is --checkpoint-dir on a file system that every node sees?)")
        if schedule_varies(train):
            make_learning_rate_a_tensor(self.optimizer)
        # After the restore: a step that captures a CUDA/HIP graph must see the restored tensors.
        self.phase_timer = StepTimer(self.device) if train.timing_breakdown else None
        # self.model stays the UNWRAPPED model (load_canonical, checkpoints, validation); the step calls
        # self.train_model: DDP around it under torchrun, the model itself in a single process.
        if self.dist.engine == "deepspeed":
            self.engine = deepspeed_engine.initialize_deepspeed(self.model, self.optimizer, self.deepspeed_config,
                                                           self.dist)
            self.step_fn = deepspeed_engine.DeepSpeedStep(self.engine)
            self.train_model = self.engine
        else:
            self.train_model = distributed.wrap_for_data_parallel(self.model, self.dist)
            # A version may supply its own step (v4: a captured graph); None from its hook means the default.
            custom = (self.spec.make_step(self.train_model, self.optimizer, self.device, train, self.args)
                      if self.spec.make_step is not None else None)
            self.step_fn = custom or EagerStep(self.train_model, self.optimizer, self.device, train,
                                               self.phase_timer)
        if resume is not None:
            ckpt.restore_scaler(resume[1], getattr(self.step_fn, "scaler", None))
        if train.timing_breakdown and not getattr(self.step_fn, "supports_breakdown", False):
            self.log("note: --timing-breakdown is not available for this step implementation; ignored")
            self.phase_timer = None

    def resume_from_checkpoint(self, path, checkpoint: dict) -> None:
        """Weights, optimizer state and history from a validated checkpoint (RNG states just before the loop)."""
        if checkpoint["step"] > self.train.num_steps:
            raise ckpt.CheckpointError(f"{path} is at step {checkpoint['step']}, beyond --num-steps "
                                       f"{self.train.num_steps} (the run's total); raise --num-steps")
        ckpt.restore_training_state(checkpoint, self.model, self.optimizer)
        self.start_step = checkpoint["step"]
        self.loss_history = list(checkpoint["history"]["train_loss"])
        self.eval_history = [list(pair) for pair in checkpoint["history"]["eval"]]
        self.rng_to_restore = checkpoint["rng"]
        self.resumed_from = str(path)
        self.resume_notes = ckpt.setting_differences(checkpoint, self.train, self.dist.world_size)
        if checkpoint.get("corpus") and checkpoint["corpus"] != self.corpus_fingerprint():
            self.resume_notes.append("the training data differs from the checkpoint's (another file, or "
                                     "text:stdlib of another Python version)")
        if checkpoint["version"] != self.spec.name:
            self.resume_notes.append(f"written by {checkpoint['version']}, continued by {self.spec.name} "
                                     f"(canonical weights and optimizer state)")

    def remove_interrupted_writes(self) -> None:
        """Temporary files of checkpoint writes that never finished (a killed run): not checkpoints, only litter."""
        removed = ckpt.remove_temporary_files(self.train.checkpoint_dir)
        if removed:
            self.log(f"note: removed {len(removed)} temporary file(s) of an interrupted checkpoint write from "
                     f"{self.train.checkpoint_dir}/")

    def corpus_fingerprint(self) -> str:
        if self._corpus_fingerprint is None:
            self._corpus_fingerprint = ckpt.corpus_fingerprint(self.corpus.tokens)
        return self._corpus_fingerprint

    def print_header(self) -> None:
        info = describe(self.device)
        cfg, train = self.model_config, self.train
        self.log(f"=== TinyLlama {self.spec.name}: {self.spec.title} ===")
        self.log(f"device      : {info.name} ({info.backend}), torch {info.torch_version}")
        self.log(f"model       : vocab {cfg.vocab_size}, hidden {cfg.hidden_dim}, layers {cfg.num_layers}, "
                 f"heads {cfg.num_heads} (head dim {cfg.head_dim}), ffn {cfg.intermediate_size}, "
                 f"max seq {cfg.max_seq_len}; {parameter_count(cfg):,} parameters")
        precision = f"AMP {train.amp_dtype}" if train.use_amp else "float32"
        self.log(f"training    : batch {train.batch_size} x seq {train.seq_len}, {train.num_steps} steps "
                 f"({train.warmup_steps} warm-up), lr {train.learning_rate}, {precision}, seed {train.seed}")
        if self.dist.enabled:
            world = self.dist.world_size
            self.log(f"parallel    : {self.dist.describe()}, global batch {train.batch_size * world} = "
                     f"{world} x {train.batch_size} per rank; times are rank 0's")
        for key, value in self.variant_description().items():
            self.log(f"{key:<12}: {value}")
        for note in self.setup_notes:
            self.log(f"note        : {note}")
        self.log(f"data        : {self.corpus.description}")
        if self.corpus.optimum_loss is not None:
            self.log(f"optimum loss: {self.corpus.optimum_loss:.4f} nats (start ~ ln {cfg.vocab_size} = "
                     f"{math.log(cfg.vocab_size):.4f})")
        if schedule_varies(train):
            end = COSINE_FLOOR * train.learning_rate if train.lr_schedule == "cosine" else train.learning_rate
            self.log(f"lr schedule : {train.lr_schedule}, {train.lr_warmup_steps} lr warm-up steps, "
                     f"peak {train.learning_rate:g} -> {end:g} at the last step")
        if train.eval_every:
            self.log(f"validation  : every {train.eval_every} steps and at the end, on {train.eval_batches} "
                     f"fixed held-out batches")
        if train.save_every:
            keep = f"keep last {train.keep_last}" if train.keep_last else "keep all"
            self.log(f"checkpoints : every {train.save_every} steps and at the end, into "
                     f"{train.checkpoint_dir}/ ({keep})")
        if self.resumed_from:
            complete = " (the run is already complete)" if self.start_step == train.num_steps else ""
            self.log(f"resumed     : from {self.resumed_from} at step {self.start_step}/{train.num_steps}{complete}")
            for note in self.resume_notes:
                self.log(f"note        : {note}")

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks (--batch-size is per rank)."""
        return self.train.batch_size * self.dist.world_size

    def variant_description(self) -> dict:
        return self.spec.describe(self.args) if self.spec.describe else {}

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        self.build()
        self.print_header()
        train = self.train
        first = self.start_step    # 0, or the step a resumed run continues from
        # Per-step records, read from the device only when a line is printed (print_step_line).
        self.timer = StepTimer(self.device)
        self.losses = torch.full((train.num_steps,), float("nan"), device=self.device)
        if first:
            self.losses[:first] = torch.tensor(self.loss_history, dtype=self.losses.dtype)
        self.step_ms: dict[int, float] = {}
        self.interval_start = first   # the first step not yet shown in a line
        excluded: set[int] = set(range(first, first + train.warmup_steps))
        profiler, profile_first = self.make_profiler(excluded)
        self.untimed = excluded   # warm-up and profiled steps: their step lines say so
        self.writer = self.make_tensorboard_writer()
        reset_peak_memory(self.device)
        if self.rng_to_restore is not None:
            ckpt.restore_rng_state(self.rng_to_restore)
        self.current_lr = None
        self.eval_seconds = 0.0
        self.last_checkpoint, self.last_checkpoint_step = None, None
        run_started = time.perf_counter()
        steps_done, stopped_by, exit_code = self.train_steps(profiler, profile_first)
        if profiler is not None and profiler.steps_done < profiler.total_steps:
            profiler.stop()
            self.finish_profile(profiler)
        synchronize(self.device)
        wall_seconds = time.perf_counter() - run_started

        loss_values = self.losses[:steps_done].tolist()
        if not all(math.isfinite(v) for v in loss_values):
            first_bad = next(i for i, v in enumerate(loss_values) if not math.isfinite(v))
            self.log(f"warning: the loss became non-finite at step {first_bad} (diverged)")
        step_ms = sorted(self.step_ms.items())
        timed = [ms for s, ms in step_ms if s not in excluded]
        note = None
        if not timed:  # a very short run: everything was warm-up or profiled; time it anyway, and say so
            timed = ([ms for s, ms in step_ms if s >= min(first + train.warmup_steps, train.num_steps - 1)]
                     or [ms for _, ms in step_ms])
            note = "every step was warm-up or profiled; the times include that overhead"
        metrics = self.build_metrics(loss_values, timed, wall_seconds, note)
        metrics.update(self.long_run_metrics(first, steps_done, stopped_by))
        if self.phase_timer is not None:
            metrics["timing_breakdown"] = self.phase_breakdown()
        if train.enable_deepspeed_flops and self.dist.is_main:
            if stopped_by:   # one more forward pass (a minute in Triton's CPU interpreter) is not what was asked
                self.log("note: DeepSpeed FLOPS profile skipped: the run was stopped")
            else:
                metrics["deepspeed_flops"] = self.run_deepspeed_flops()
        if self.profile_result:
            metrics["profile"] = self.profile_result
            if self.profile_result.get("kernels_per_step") is not None:
                metrics["kernels_per_step"] = self.profile_result["kernels_per_step"]
        self.print_summary(metrics)
        if self.writer is not None:
            self.writer.close()
        if train.output_json and self.dist.is_main:
            write_json(train.output_json, metrics)
            self.log(f"metrics JSON: {train.output_json}")
        if stopped_by:
            self.print_resume_hint(stopped_by, steps_done)
        return RunResult(metrics, loss_values, exit_code=exit_code)

    def train_steps(self, profiler, profile_first: int) -> tuple[int, str | None, int]:
        """The steps of this process, until the end or a stop signal: (steps done, the signal's name or None,
        the exit code)."""
        train = self.train
        steps_done = self.start_step
        stop_signal, abandoned = None, None
        # One process abandons a step that a signal catches in its forward or backward pass (stopping.py). Under
        # data parallel it must not: a rank that left its backward pass half-way would leave the others waiting
        # in the gradient all-reduce. There the ranks agree to stop after a step (agreed_stop).
        with StopOnSignal(abandon_steps=not self.dist.enabled) as stop, self.heartbeat():
            try:
                if self.validation_missing_at(steps_done):
                    self.run_validation(steps_done)
                for step in range(self.start_step, train.num_steps):
                    if profiler is not None and step == profile_first:
                        profiler.start()
                    self.apply_learning_rate(step)
                    inputs, targets = self.stream.batch(step)
                    # Under data parallel every rank times its own steps; the summary reports rank 0's (the ranks
                    # wait for each other in every gradient all-reduce, so their step times agree closely).
                    self.progress.begin(f"step {step + 1:>6}/{train.num_steps}")
                    start = self.timer.mark()
                    loss = self.step_fn(inputs, targets)
                    self.timer.add((start, self.timer.mark()))
                    self.progress.end()
                    self.losses[step] = loss
                    steps_done = step + 1
                    if profiler is not None and profile_first <= step and profiler.steps_done < profiler.total_steps:
                        if profiler.step():
                            self.finish_profile(profiler)
                    stop_signal, line_due = self.agreed_stop(stop, steps_done)   # read once: signals come any time
                    if (steps_done % train.log_every == 0 or step == self.start_step
                            or steps_done == train.num_steps or stop_signal is not None or line_due):
                        self.print_step_line(step)
                    if stop_signal is not None:
                        break   # no validation now: a resumed run computes the one it misses (validation_missing_at)
                    # Validation and checkpoints run between the timed regions: they never count as step time.
                    if self.validation_due(steps_done):
                        self.run_validation(steps_done)
                    if train.save_every and (steps_done % train.save_every == 0 or steps_done == train.num_steps):
                        self.save_checkpoint(steps_done)
            except StepAbandoned as caught:
                # The run ends as if it had stopped after the last completed step: the abandoned step's gradients
                # are dropped, its loss and time were never recorded.
                stop_signal, abandoned = caught.signal_number, self.progress.activity_name()
                self.progress.end()
                self.optimizer.zero_grad(set_to_none=True)
                if self.interval_start < steps_done:
                    self.print_step_line(steps_done - 1)
            if stop_signal is None:
                return steps_done, None, 0
            name = signal.Signals(stop_signal).name
            self.stop_run(name, steps_done, abandoned)
            return steps_done, name, StopOnSignal.EXIT_CODES[stop_signal]

    def agreed_stop(self, stop: StopOnSignal, steps_done: int) -> tuple[int | None, bool]:
        """(the signal (SIGINT / SIGTERM number) that ends the run after this step, or None to go on; whether a
        step line is due because PROGRESS_INTERVAL_S passed since the last one).

        A single process stops after the step in which the signal arrived (unless the signal abandoned the step,
        see stopping.py). Under data parallel a signal reaches the ranks at different moments, but they must stop
        after the SAME step: a rank that went on alone would wait forever in its next gradient all-reduce. And
        they must print the same step lines: a line averages the loss over the ranks, a collective too, while
        each rank's clock decides alone when a line is due. So the ranks agree on both (one all-reduce, max over
        ranks). That costs a device-host synchronisation, hence only every STOP_AGREEMENT_EVERY steps: a
        data-parallel run stops at most that many steps after the signal.
        """
        if not self.dist.enabled:
            return stop.signal_number, self.progress.due()
        if steps_done % STOP_AGREEMENT_EVERY:
            return None, False
        signal_number, due = self.dist.max_over_ranks_each([stop.signal_number or 0, int(self.progress.due())])
        return signal_number or None, bool(due)

    def heartbeat(self):
        """Rank 0's "still running" lines while a long step runs (progress.py); the other ranks print nothing."""
        return self.progress.heartbeat() if self.dist.is_main else contextlib.nullcontext()

    def validation_due(self, steps_done: int) -> bool:
        train = self.train
        return bool(train.eval_every) and (steps_done % train.eval_every == 0 or steps_done == train.num_steps)

    def validation_missing_at(self, step: int) -> bool:
        """A resumed run whose checkpoint was written by a run stopped before the validation of its last step
        computes that validation first: the validation history then matches the uninterrupted run's."""
        return (self.resumed_from is not None and step > 0 and self.validation_due(step)
                and all(s != step for s, _ in self.eval_history))

    def apply_learning_rate(self, step: int) -> None:
        """Set the schedule's learning rate before the step, only when it changes (a tensor lr costs a kernel)."""
        lr = learning_rate_at(step, self.train)
        if lr != self.current_lr:
            set_learning_rate(self.optimizer, lr)
            self.current_lr = lr

    def print_step_line(self, step: int) -> None:
        """Collect the losses and times of the steps since the last line (one device synchronisation) and print
        the line of `step`."""
        steps_done = step + 1
        # Each rank's loss is its slice's; the mean over the ranks is the global batch's loss.
        self.dist.average_(self.losses[self.interval_start:steps_done])
        for offset, (ms,) in enumerate(self.timer.collect()):
            self.step_ms[self.interval_start + offset] = ms
        self.log_step(step, self.interval_start)
        self.progress.step_line_printed()
        self.interval_start = steps_done

    def log_step(self, step: int, interval_start: int) -> None:
        """One step line: the loss of `step` and the median time of the TIMED steps since the last line. When all
        of them were warm-up or profiled steps, the line says so and shows the step's time as what it is."""
        value = self.losses[step].item()
        step_ms = self.step_ms
        timed = [step_ms[s] for s in range(interval_start, step + 1) if s in step_ms and s not in self.untimed]
        line = f"step {step + 1:>6}/{self.train.num_steps} | loss {value:.4f} | "
        samples_per_s = None
        if timed:
            ms = statistics.median(timed)
            samples_per_s = self.global_batch / (ms / 1e3) if ms > 0 else float("nan")
            line += f"{samples_per_s:10.1f} samples/s | {ms:8.2f} ms/step"
        else:
            kind = "warm-up" if step < self.start_step + self.train.warmup_steps else "profiled"
            line += f"{kind} step, not timed ({step_ms.get(step, float('nan')):.2f} ms)"
        self.log(line + (f" | lr {self.current_lr:.2e}" if schedule_varies(self.train) else ""))
        if self.writer is not None:
            self.writer.add_scalar("train/loss", value, step + 1)
            if samples_per_s is not None:
                self.writer.add_scalar("train/samples_per_s", samples_per_s, step + 1)
            self.writer.add_scalar("train/lr", self.current_lr, step + 1)

    def run_validation(self, steps_done: int) -> None:
        started = time.perf_counter()
        self.progress.begin(f"eval {steps_done:>6}/{self.train.num_steps}")
        with may_abandon():   # changes nothing but eval_history, below: a stop signal may abandon it
            value = validation_loss(self.model, self.eval_stream, self.train.eval_batches, self.device, self.train)
        self.progress.end()
        value = self.dist.average(value)   # each rank measured its slice of the same validation batches
        self.eval_seconds += time.perf_counter() - started
        self.eval_history.append([steps_done, value])
        optimum = self.valid_corpus.optimum_loss
        gap = f" (optimum {optimum:.4f}, gap {value - optimum:.4f} nats)" if optimum is not None else ""
        self.log(f"eval {steps_done:>6}/{self.train.num_steps} | validation loss {value:.4f}{gap}")
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", value, steps_done)

    def save_checkpoint(self, steps_done: int) -> None:
        """Rank 0 writes the checkpoint of the state after `steps_done` steps, then drops the oldest ones."""
        if self.dist.engine == "deepspeed":   # --save-every/--resume are refused; a signal lands here
            self.log("note: no checkpoint under --deepspeed (the optimizer state lives in DeepSpeed's engine)")
            return
        if not distributed.is_main_process():
            return
        train = self.train
        started = time.perf_counter()
        path = ckpt.checkpoint_path(train.checkpoint_dir, steps_done)
        try:
            payload = ckpt.build_checkpoint(
                version=self.spec.name, step=steps_done, model=self.model, optimizer=self.optimizer,
                scaler=getattr(self.step_fn, "scaler", None), model_config=self.model_config, train_config=train,
                losses=self.losses[:steps_done].tolist(), evals=self.eval_history, corpus=self.corpus_fingerprint(),
                world_size=self.dist.world_size)
            ckpt.save_atomically(payload, path)
        except KeyboardInterrupt:   # a second Ctrl-C: save_atomically has removed its temporary file
            if not path.exists():
                self.log(f"interrupted while writing {path}: not written; earlier checkpoints are intact")
            raise
        ckpt.remove_old_checkpoints(train.checkpoint_dir, train.keep_last)
        self.last_checkpoint, self.last_checkpoint_step = str(path), steps_done
        seconds = time.perf_counter() - started   # includes copying GPU tensors to the host and the fsync
        size_mb = Path(path).stat().st_size / 1e6
        self.log(f"checkpoint  : {path} (step {steps_done}, {size_mb:.1f} MB, saved in {seconds:.2f} s)")

    def stop_run(self, signal_name: str, steps_done: int, abandoned: str | None) -> None:
        """Say why the run stops, and write the checkpoint of the state after `steps_done` steps if checkpoints were
        asked for (checkpoints_requested) and it is not already on disk."""
        line = f"{signal_name} received" + (f" during {abandoned}, abandoned" if abandoned else "")
        line += f": stopping after step {steps_done}"
        if not checkpoints_requested(self.train):
            self.log(f"{line}; no checkpoint written (none was asked for)")
        elif steps_done == self.start_step:
            self.log(f"{line}; no checkpoint written (no step completed in this run)")
        elif self.last_checkpoint_step == steps_done:
            self.log(f"{line}; its checkpoint is already written")
        else:
            self.log(f"{line}, writing a checkpoint")
            self.save_checkpoint(steps_done)

    def print_resume_hint(self, signal_name: str, steps_done: int) -> None:
        stopped = f"stopped by {signal_name} after step {steps_done}/{self.train.num_steps}"
        if self.last_checkpoint is None:
            if not checkpoints_requested(self.train):
                self.log(f"{stopped}; no checkpoint written. To resume an interrupted run, start it with "
                         f"--checkpoint-dir DIR (a checkpoint when stopped) or --save-every N")
            return
        args, given = [], iter(self.argv)
        for arg in given:   # the same command, with any earlier --resume replaced
            if arg == "--resume":
                next(given, None)   # and its value
            elif not arg.startswith("--resume="):
                args.append(arg)
        script = sys.argv[0] if sys.argv[0].endswith(".py") else f"tiny_llama_{self.spec.name}.py"
        self.log(f"{stopped}; checkpoint: {self.last_checkpoint}")
        launcher = "python"
        if self.dist.enabled:   # the same launch: processes per node as now (multi-node: see the sbatch script)
            launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', self.dist.world_size)}"
        self.log(f"resume with: {launcher} {shlex.join([script] + args + ['--resume', 'auto'])}")

    def long_run_metrics(self, first: int, steps_done: int, stopped_by: str | None) -> dict:
        """What the JSON says about the schedule, validation and checkpoints of this run."""
        train = self.train
        status = f"stopped by {stopped_by}" if stopped_by else "completed"
        return {
            "steps_completed": steps_done,
            "status": status,
            "lr_schedule": {"kind": train.lr_schedule, "peak": train.learning_rate,
                            "warmup_steps": train.lr_warmup_steps,
                            "final": learning_rate_at(max(0, steps_done - 1), train)},
            "eval": {
                "every": train.eval_every, "batches": train.eval_batches,
                "history": [{"step": s, "loss": v} for s, v in self.eval_history],
                "final": self.eval_history[-1][1] if self.eval_history else None,
                "optimum": self.valid_corpus.optimum_loss,
                "seconds_this_process": self.eval_seconds,
            },
            "checkpoint": {"resumed_from": self.resumed_from,
                           "resumed_at_step": first if self.resumed_from else None,
                           "last_written": self.last_checkpoint},
        }

    # -- optional tools ---------------------------------------------------------------------------------------
    def make_profiler(self, excluded: set[int]):
        self.profile_result = None
        remaining = self.train.num_steps - self.start_step   # a resumed run profiles its own steps
        if not self.train.enable_pytorch_profiler or remaining == 0 or not self.dist.is_main:
            return None, -1   # under data parallel rank 0 alone records a trace (one trace, one directory)
        first, wait, warm, active = profiler_window(remaining, self.train.warmup_steps, self.train.profile_steps)
        first += self.start_step
        excluded.update(range(first, first + wait + warm + active))  # profiler overhead stays out of timing
        session = PyTorchProfilerSession(self.train.profile_dir, self.spec.name, active, self.device,
                                         self.train.profile_memory, wait_steps=wait, warmup_steps=warm)
        self.log(f"PyTorch profiler: steps {first + wait + warm + 1}..{first + wait + warm + active} recorded "
                 f"into {session.dir}/ (these steps are excluded from the timing)")
        return session, first

    def finish_profile(self, session: PyTorchProfilerSession) -> None:
        result = {"trace": str(session.trace_path), "active_steps": session.active_steps}
        if not session.trace_path.exists():
            self.log("note: the profiler recorded no active step; no trace written")
            self.profile_result = result
            return
        memory_timeline = session.export_memory_timeline()
        if memory_timeline:
            result["memory_timeline"] = str(memory_timeline)
        trace = load_trace(session.trace_path)
        result["kernels_per_step"] = kernels_per_step(trace)
        result["operators_per_step"] = operators_per_step(trace)
        written = write_reports(trace, session.dir, sort_by=self.train.sort_by, limit=20)
        result["reports"] = {k: str(v) for k, v in written.items()} if isinstance(written, dict) else written
        if self.train.profile_operators:
            self.log(f"--- top operators (sorted by {self.train.sort_by}) ---")
            self.log(session.operator_table(self.train.sort_by, limit=15))
        kps = result["kernels_per_step"]
        self.log(f"profile: trace {session.trace_path}; "
                 + (f"{kps:.0f} GPU kernels per training step" if kps is not None
                    else f"{result['operators_per_step']:.0f} operators per training step (CPU)"))
        self.profile_result = result

    def make_tensorboard_writer(self):
        if not self.train.tensorboard_dir or not self.dist.is_main:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:
            self.log("note: TensorBoard is not installed (pip install tensorboard); --tensorboard-dir ignored")
            return None
        return SummaryWriter(self.train.tensorboard_dir)

    def phase_breakdown(self) -> dict:
        rows = self.phase_timer.collect()[self.train.warmup_steps:]
        if not rows:
            return {}
        names = ("forward", "backward", "optimizer")
        return {name: statistics.median(r[i] for r in rows) for i, name in enumerate(names)}

    def run_deepspeed_flops(self) -> dict:
        analytic = flops_mod.forward_flops(self.model_config, self.train.batch_size, self.train.seq_len)
        problem = deepspeed_import_problem()
        if problem is not None:
            self.log(f"note: {problem}")
            return {"available": False, "reason": problem, "analytic_forward_flops": analytic}
        inputs, targets = self.stream.batch(0)

        def forward():
            with torch.no_grad(), autocast_context(self.device, self.train):
                self.model(inputs, targets)

        self.log("--- DeepSpeed FLOPS profile (one forward pass) ---")
        counted = profile_forward(self.model, forward)   # DeepSpeed prints its per-module tree
        return {"flops": counted["forward_flops"], "macs": counted["forward_macs"], "params": counted["params"],
                "forward_latency_s": counted["forward_latency_s"], "available": True,
                "analytic_forward_flops": analytic}

    # -- the summary ------------------------------------------------------------------------------------------
    def build_metrics(self, loss_values, timed_ms, wall_seconds, note) -> dict:
        cfg, train = self.model_config, self.train
        times = summarize_times(timed_ms)
        median_s = times["median_ms"] / 1e3 if times["median_ms"] else None
        # Throughput counts the GLOBAL batch (all ranks); MFU is per GPU: one rank's FLOPs over one GPU's peak.
        samples_per_s = self.global_batch / median_s if median_s else None
        info = describe(self.device)
        precision = train.amp_dtype if train.use_amp else "float32"
        peak = peak_tflops(info.name, precision, tf32=tf32_enabled()) if self.device.type == "cuda" else None
        finite = [v for v in loss_values if math.isfinite(v)]
        return {
            "schema_version": 1,
            "version": self.spec.name,
            "title": self.spec.title,
            "variant": self.variant_description(),
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
                "training_tflops_per_s": (flops_mod.training_flops(cfg, self.global_batch, train.seq_len)
                                          / median_s / 1e12) if median_s else None,
                "mfu": flops_mod.mfu(cfg, train.batch_size, train.seq_len, median_s, peak) if median_s else None,
                "peak_tflops": peak,
            },
            "memory": {"peak_allocated_mib": peak_memory_mb(self.device)},   # rank 0's GPU under data parallel
            "distributed": {"engine": self.dist.engine, "world_size": self.dist.world_size,
                            "backend": self.dist.backend, "batch_size_per_rank": train.batch_size,
                            "global_batch_size": self.global_batch,
                            "zero_stage": (self.engine.zero_optimization_stage()
                                           if self.dist.engine == "deepspeed" else None)},
            "loss": {
                "first": loss_values[0] if loss_values else None,
                "final": loss_values[-1] if loss_values else None,
                "min": min(finite) if finite else None,
                "optimum": self.corpus.optimum_loss,
                "history": loss_values,
            },
            "kernels_per_step": None,
        }

    def print_summary(self, m: dict) -> None:
        t, tp, loss = m["timing"], m["throughput"], m["loss"]
        self.log(f"=== Summary ({self.spec.name}: {self.spec.title}) ===")
        if t["median_ms"] is None:
            self.log("no timed steps")
            return
        self.log(f"timed steps : {t['count']} (excluding {self.train.warmup_steps} warm-up"
                 + (" and profiled" if self.train.enable_pytorch_profiler else "") + " steps)")
        if t.get("note"):
            self.log(f"note        : {t['note']}")
        self.log(f"step time   : median {t['median_ms']:.2f} ms (p10 {t['p10_ms']:.2f}, p90 {t['p90_ms']:.2f})")
        ranks = m["distributed"]["world_size"]
        self.log(f"throughput  : {tp['samples_per_s']:.1f} samples/s, {tp['tokens_per_s']:,.0f} tokens/s, "
                 f"{tp['training_tflops_per_s']:.2f} TFLOP/s" + (f" (all {ranks} ranks)" if ranks > 1 else ""))
        if tp["mfu"] is not None:
            self.log(f"MFU         : {100 * tp['mfu']:.1f}% of {tp['peak_tflops']:.0f} TFLOP/s "
                     f"({m['precision']} peak of this device)")
        elif m["device"]["type"] == "cuda":
            self.log("MFU         : unknown (this device is not in the peak-FLOPs table)")
        mem = m["memory"]["peak_allocated_mib"]
        per_gpu = " per GPU (rank 0)" if ranks > 1 else ""
        self.log(f"peak memory : {mem:.1f} MiB allocated{per_gpu}" if mem is not None else "peak memory : n/a on CPU")
        if m.get("timing_breakdown"):
            b = m["timing_breakdown"]
            self.log("breakdown   : " + ", ".join(f"{k} {v:.2f} ms" for k, v in b.items()))
        line = f"loss        : first {loss['first']:.4f} -> final {loss['final']:.4f}"
        if loss["optimum"] is not None:
            line += f" (optimum {loss['optimum']:.4f}, gap {loss['final'] - loss['optimum']:.4f} nats)"
        self.log(line)
        profile = m.get("profile") or {}
        if profile.get("kernels_per_step") is not None:
            self.log(f"kernels     : {profile['kernels_per_step']:.0f} GPU kernels per step (profiled)")
