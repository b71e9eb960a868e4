"""The training run every version shares: build the model, data and step, then train, measure and report.

    Trainer(spec, model_config, train_config, args).run()  ->  RunResult(metrics, losses, exit_code)

The run, in order: set up the device and the process group (__init__), build the model from the canonical
weights, the optimizer, the data streams and the step, restoring a checkpoint on --resume (build), print what runs
(console.py), train step by step (train_steps), and report: the summary and the metrics JSON (metrics.py). Each
concern lives in its own file of this package:

    step.py         one training step (EagerStep), autocast, the default optimizer
    timing.py       device-event timing, warm-up, medians          schedule.py     the learning rate of step t
    validation.py   --eval-every                                   checkpoint/     --save-every, --resume
    stopping.py     Ctrl-C / SIGTERM stop at once                  progress.py     a line at least every 10 s
    tools.py        the PyTorch profiler, TensorBoard, DeepSpeed's FLOPS profile
    console.py      the header, step lines and summary             metrics.py      the metrics dictionary
    preflight.py    output paths and memory, before anything       divergence.py   a NaN/Inf loss stops the run

Step t's batch and learning rate are functions of t, and a checkpoint holds everything else, so a resumed run
continues exactly where it stopped.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import deepspeed_engine, distributed
from ..config import ConfigError, ModelConfig, TrainConfig
from ..data import BatchStream, build_corpora
from ..device import reset_peak_memory, resolve_device, synchronize
from ..gradient_sync import GradientAllReduce
from ..outputs import write_json
from ..weights import init_canonical_weights
from .checkpoint.files import is_planned_save
from .checkpoint.manager import CheckpointManager
from .checkpoint.state import restore_rng_state, restore_scaler
from .console import log_step, print_header, print_summary
from .divergence import check_losses
from .metrics import collect_metrics
from .preflight import check_run_fits, prove_run_outputs, settings_files
from .progress import Progress
from .schedule import learning_rate_at, make_learning_rate_a_tensor, schedule_varies, set_learning_rate
from .step import EagerStep, default_optimizer
from .stopping import StepAbandoned, StopOnSignal, agreed_stop
from .timing import StepTimer
from .tools import RunProfiler, deepspeed_flops_profile, tensorboard_writer
from .validation import Validation


@dataclass
class RunResult:
    metrics: dict
    losses: list[float] = field(default_factory=list)
    exit_code: int = 0           # 0, or 143 when SIGTERM stopped the run (SIGINT stops it with 0)


class Trainer:
    def __init__(self, spec, model_config: ModelConfig, train: TrainConfig, args, out=None,
                 argv: list[str] | None = None):
        self.spec, self.model_config, self.train, self.args = spec, model_config, train, args
        self.out = out if out is not None else sys.stdout   # looked up now, so that tests can capture it
        argv = list(sys.argv[1:] if argv is None else argv)   # to print the command that resumes the run
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
        self.deepspeed_config = (deepspeed_engine.prepare_deepspeed(train, self.device) if train.uses_deepspeed
                                 else None)
        if distributed.is_main_process():   # before any work: an output that cannot be written is one line now
            prove_run_outputs(train, spec.name, settings_files(args))
        # Data parallel: join the job torchrun started (a no-op otherwise); each rank then uses its own GPU.
        self.dist = distributed.setup(train, self.device)
        self.device = self.dist.device
        check_run_fits(spec.name, model_config, train, self.device, self.dist.world_size)
        note = distributed.graph_capture_note(args, self.device, self.dist, spec.averages_gradients)
        self.setup_notes = [note] if note else []
        if train.grad_reduce_dtype != "float32" and not self.dist.enabled:
            self.setup_notes.append(f"--grad-reduce-dtype {train.grad_reduce_dtype} has no effect in a single "
                                    f"process: there is nothing to sum (start with torchrun)")
        self.checkpoints = CheckpointManager(spec.name, train, self.dist, self.log, argv)

    def log(self, text: str = "") -> None:
        if not self.dist.is_main:   # under data parallel only rank 0 prints
            return
        with self._log_lock:
            print(text, file=self.out, flush=True)
        self.progress.printed()

    # -- set-up --------------------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, train = self.model_config, self.train
        resume = self.checkpoints.find_resume(cfg)   # a bad --resume fails first, before anything is built
        torch.manual_seed(train.seed)
        self.model = self.spec.build_model(cfg, self.args)
        self.model.load_canonical(init_canonical_weights(cfg, train.seed))
        self.model.to(self.device)
        self.optimizer = default_optimizer(self.model, train)
        self.corpus, valid_corpus = build_corpora(train.data, cfg.vocab_size, train.seq_len, train.seed, self.device)
        # Rank r reads its contiguous slice of each global batch (batch_size per rank x world_size ranks).
        rank, world = self.dist.rank, self.dist.world_size
        self.stream = BatchStream(self.corpus, train.seq_len, train.batch_size, train.seed, rank, world)
        eval_stream = BatchStream(valid_corpus, train.seq_len, train.batch_size, train.seed, rank, world)
        self.validation = Validation(self.model, eval_stream, train, self.device, self.dist, valid_corpus.optimum_loss)
        self.start_step, self.loss_history, self.rng_to_restore = 0, [], None
        if resume is not None:
            path, checkpoint = resume
            self.checkpoints.restore(path, checkpoint, self.model, self.optimizer, self.corpus.tokens)
            self.start_step = checkpoint["step"]
            self.loss_history = list(checkpoint["history"]["train_loss"])
            self.validation.history = [list(pair) for pair in checkpoint["history"]["eval"]]
            self.rng_to_restore = checkpoint["rng"]   # restored just before the loop
        self.dist.check_same(self.start_step, "the step to resume from",
                             " (is --checkpoint-dir on a file system that every node sees?)")
        if schedule_varies(train):
            make_learning_rate_a_tensor(self.optimizer)
        # After the restore: a step that captures a CUDA/HIP graph must see the restored tensors.
        self.phase_timer = StepTimer(self.device) if train.timing_breakdown else None
        # self.model stays the UNWRAPPED model (load_canonical, checkpoints, validation); the step calls
        # self.train_model: DDP around it under torchrun, the model itself in a single process (or when the
        # version's own step averages the gradients).
        self.gradient_sync = None   # set when the version's own step averages the gradients (no DDP wrapper)
        if self.dist.engine == "deepspeed":
            self.engine = deepspeed_engine.initialize_deepspeed(self.model, self.optimizer, self.deepspeed_config,
                                                                self.dist)
            self.step_fn = deepspeed_engine.DeepSpeedStep(self.engine)
            self.train_model = self.engine
        else:
            # Under DDP a version's own step may average the gradients itself (v4's graph: gradient_sync.py);
            # then the model is not wrapped, and the step gets the all-reduce to use.
            self.gradient_sync = (GradientAllReduce(self.dist) if self.dist.engine == "ddp"
                                  and self.spec.averages_gradients is not None
                                  and self.spec.averages_gradients(self.args, self.device) else None)
            self.train_model = (self.model if self.gradient_sync is not None
                                else distributed.wrap_for_data_parallel(self.model, self.dist))
            # A version may supply its own step (v4: a captured graph); None from its hook means the default.
            custom = (self.spec.make_step(self.train_model, self.optimizer, self.device, train, self.args,
                                          gradient_sync=self.gradient_sync)
                      if self.spec.make_step is not None else None)
            if self.gradient_sync is not None and getattr(custom, "gradient_sync", None) is not self.gradient_sync:
                # Without DDP nothing else would average the gradients: the ranks would silently drift apart.
                raise RuntimeError(f"{self.spec.name}'s averages_gradients hook said its step averages the "
                                   f"gradients, but make_step returned a step that does not use gradient_sync")
            self.step_fn = custom or EagerStep(self.train_model, self.optimizer, self.device, train,
                                               self.phase_timer)
        if resume is not None:
            restore_scaler(resume[1], getattr(self.step_fn, "scaler", None))
        if train.timing_breakdown and not getattr(self.step_fn, "supports_breakdown", False):
            self.log("note: --timing-breakdown is not available for this step implementation; ignored")
            self.phase_timer = None

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks (--batch-size is per rank)."""
        return self.train.batch_size * self.dist.world_size

    def variant_description(self) -> dict:
        return self.spec.describe(self.args) if self.spec.describe else {}

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            return self._run()
        finally:
            self.checkpoints.release()   # the checkpoint directory's lock, whatever ended the run

    def _run(self) -> RunResult:
        self.build()
        print_header(self)
        train = self.train
        first = self.start_step    # 0, or the step a resumed run continues from
        # Per-step records, read from the device only when a line is printed (print_step_line).
        self.timer = StepTimer(self.device)
        self.losses = torch.full((train.num_steps,), float("nan"), device=self.device)
        if first:
            self.losses[:first] = torch.tensor(self.loss_history, dtype=self.losses.dtype)
        self.step_ms: dict[int, float] = {}
        self.interval_start = first   # the first step not yet shown in a line
        self.profiler = RunProfiler(train, first, self.spec.name, self.device, self.dist.is_main, self.log)
        # Warm-up and profiled steps are not timed (their step lines say so).
        self.untimed = set(range(first, first + train.warmup_steps)) | set(self.profiler.steps)
        self.writer = tensorboard_writer(train, self.dist.is_main, self.log)
        reset_peak_memory(self.device)
        if self.rng_to_restore is not None:
            restore_rng_state(self.rng_to_restore)
        self.current_lr = None
        run_started = time.perf_counter()
        steps_done, stopped_by, exit_code = self.train_steps()
        self.profiler.close()
        synchronize(self.device)
        metrics = collect_metrics(self, first, steps_done, stopped_by, time.perf_counter() - run_started)
        # Every rank, at the same point (a collective): are the ranks' weights still the same bits?
        metrics["distributed"]["weights_identical_across_ranks"] = self.dist.weights_identical(self.model.parameters())
        if train.enable_deepspeed_flops and self.dist.is_main:
            if stopped_by:   # one more forward pass (a minute in Triton's CPU interpreter) is not what was asked
                self.log("note: DeepSpeed FLOPS profile skipped: the run was stopped")
            else:
                metrics["deepspeed_flops"] = deepspeed_flops_profile(self.model, self.model_config, train,
                                                                     self.stream, self.device, self.log)
        if self.profiler.result:
            metrics["profile"] = self.profiler.result
            if self.profiler.result.get("kernels_per_step") is not None:
                metrics["kernels_per_step"] = self.profiler.result["kernels_per_step"]
        print_summary(self, metrics)
        if self.writer is not None:
            self.writer.close()
        if train.output_json and self.dist.is_main:
            write_json(train.output_json, metrics)
            self.log(f"metrics JSON: {train.output_json}")
        if stopped_by:
            self.checkpoints.print_resume_hint(stopped_by, steps_done)
        return RunResult(metrics, metrics["loss"]["history"], exit_code=exit_code)

    def train_steps(self) -> tuple[int, str | None, int]:
        """The steps of this process, until the end or a stop signal: (steps done, the signal's name or None,
        the exit code)."""
        train = self.train
        steps_done = self.start_step
        stop_signal, abandoned = None, None
        # One process abandons a step that a signal catches in its forward or backward pass (stopping.py). Under
        # data parallel it must not: a rank that left its backward pass half-way would leave the others waiting
        # in the gradient all-reduce. There the ranks agree to stop after a step (agreed_stop).
        with StopOnSignal(abandon_steps=not self.dist.enabled, log=self.log) as stop, self.heartbeat():
            try:
                if self.validation.missing_at(steps_done, resumed=self.checkpoints.resumed_from is not None):
                    self.validation.run(steps_done, self.log, self.progress, self.writer)
                for step in range(self.start_step, train.num_steps):
                    self.profiler.before_step(step)
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
                    self.profiler.after_step(step)
                    # Read once: signals come any time.
                    stop_signal, line_due = agreed_stop(stop, self.dist, self.progress, steps_done)
                    if (steps_done % train.log_every == 0 or step == self.start_step
                            or steps_done == train.num_steps or stop_signal is not None or line_due):
                        self.print_step_line(step)
                    if stop_signal is not None:
                        break   # no validation now: a resumed run computes the one it misses (Validation.missing_at)
                    # Validation and checkpoints run between the timed regions: they never count as step time.
                    if self.validation.due(steps_done):
                        self.validation.run(steps_done, self.log, self.progress, self.writer)
                    if is_planned_save(steps_done, train.num_steps, train.save_every):
                        self.checkpoints.save(self, steps_done)
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
            self.checkpoints.stop(self, name, steps_done, abandoned)
            return steps_done, name, StopOnSignal.EXIT_CODES[stop_signal]

    def heartbeat(self):
        """Rank 0's "still running" lines while a long step runs (progress.py); the other ranks print nothing."""
        return self.progress.heartbeat() if self.dist.is_main else contextlib.nullcontext()

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
        log_step(self, step, self.interval_start)
        if self.train.stop_on_nan:   # the values are on the host's side of this synchronisation already
            check_losses(self.losses[self.interval_start:steps_done].tolist(), self.interval_start, self.train,
                         self.checkpoints.resumed_from)
        self.progress.step_line_printed()
        self.interval_start = steps_done
