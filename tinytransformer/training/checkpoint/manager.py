"""What a run does with checkpoints: find the one to resume from, restore it, save every --save-every steps and
when stopped, and print the command that resumes a stopped run.

Checkpoints are written only where the user asked for them: --save-every, --resume, or a --checkpoint-dir of their
own. A run without any of these writes no file when it is interrupted, and says how to get one next time.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

from ...config import ModelConfig, TrainConfig
from ...distributed import is_main_process
from ..divergence import check_losses
from ..timing import default_warmup_steps
from . import CheckpointError
from .files import (checkpoint_path, planned_checkpoints_present, remove_old_checkpoints,
                    remove_temporary_files, save_atomically)
from .loading import find_checkpoint_to_resume
from .lock import DirectoryLock
from .state import build_checkpoint, corpus_fingerprint, restore_training_state, setting_differences


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


class CheckpointManager:
    """The checkpoints of one run. `run` (the Trainer) provides the state to save: its model, optimizer, step
    function (the loss scaler), losses, validation history and training corpus."""

    def __init__(self, version: str, train: TrainConfig, dist, log, argv: list[str]):
        self.version, self.train, self.dist, self.log, self.argv = version, train, dist, log, argv
        self.resumed_from: str | None = None
        self.resume_notes: list[str] = []
        self.last_path: str | None = None      # the last checkpoint this process wrote
        self.last_step: int | None = None
        self._fingerprint: str | None = None
        self.lock = DirectoryLock(train.checkpoint_dir, log)

    @property
    def requested(self) -> bool:
        return checkpoints_requested(self.train)

    def find_resume(self, model_config: ModelConfig) -> tuple[Path, dict] | None:
        """The validated checkpoint to resume from (None: start at step 0). A bad --resume fails first: one line,
        before anything is built or written. Temporary files of interrupted writes are removed here."""
        train = self.train
        if self.requested and self.dist.is_main:   # one run per directory, before anything is read or written
            self.lock.acquire()
        found = (find_checkpoint_to_resume(train.resume, train.checkpoint_dir, model_config, self.log)
                 if train.resume else None)
        if self.requested and self.dist.is_main:
            self._check_planned_paths(found[1]["step"] if found else 0)
        if self.requested and self.dist.is_main:
            removed = remove_temporary_files(train.checkpoint_dir)   # not checkpoints, only litter of a killed run
            if removed:
                self.log(f"note: removed {len(removed)} temporary file(s) of an interrupted checkpoint write from "
                         f"{train.checkpoint_dir}/")
        return found

    def _check_planned_paths(self, first_step: int) -> None:
        """Every checkpoint this run will write must be writable as a file: one that cannot (a directory of that
        name) fails now, not after the training whose state it was to keep."""
        train = self.train
        for step, path in planned_checkpoints_present(train.checkpoint_dir, train.num_steps, train.save_every,
                                                      first_step):
            if not path.is_file():
                raise CheckpointError(f"{path} exists and is not a file (a directory?), but this run writes its "
                                      f"checkpoint of step {step} there; remove it or choose another "
                                      f"--checkpoint-dir")

    def release(self) -> None:
        """The end of the run, however it ends: the directory is free again."""
        self.lock.release()

    def corpus_fingerprint(self, tokens) -> str:
        if self._fingerprint is None:
            self._fingerprint = corpus_fingerprint(tokens)
        return self._fingerprint

    def restore(self, path, checkpoint: dict, model, optimizer, corpus_tokens) -> None:
        """Weights and optimizer state from a validated checkpoint, in place; notes on what differs from the run
        that wrote it. (The caller takes the step, the histories and the RNG states from `checkpoint`.)"""
        train = self.train
        if checkpoint["step"] > train.num_steps:
            raise CheckpointError(f"{path} is at step {checkpoint['step']}, beyond --num-steps "
                                  f"{train.num_steps} (the run's total); raise --num-steps")
        restore_training_state(checkpoint, model, optimizer)
        self.resumed_from = str(path)
        self.resume_notes = setting_differences(checkpoint, train, self.dist.world_size)
        if checkpoint.get("corpus") and checkpoint["corpus"] != self.corpus_fingerprint(corpus_tokens):
            self.resume_notes.append("the training data differs from the checkpoint's (another file, or "
                                     "text:stdlib of another Python version)")
        if checkpoint["version"] != self.version:
            self.resume_notes.append(f"written by {checkpoint['version']}, continued by {self.version} "
                                     f"(canonical weights and optimizer state)")
        if not given_explicitly(train, "warmup_steps"):   # the default counts this process's steps
            train.warmup_steps = default_warmup_steps(train.num_steps - checkpoint["step"])

    def save(self, run, steps_done: int) -> None:
        """Rank 0 writes the checkpoint of the state after `steps_done` steps, then drops the oldest ones."""
        if self.dist.engine == "deepspeed":   # --save-every/--resume are refused; a signal lands here
            self.log("note: no checkpoint under --deepspeed (the optimizer state lives in DeepSpeed's engine)")
            return
        train = self.train
        losses = run.losses[:steps_done].tolist()
        # A checkpoint of diverged weights would overwrite the last good one in the rotation: stop before it. Every
        # rank checks (its own losses: the weights are the same everywhere), so that all of them stop together.
        check_losses(losses[run.interval_start:], run.interval_start, train, self.resumed_from)
        if not is_main_process():
            return
        started = time.perf_counter()
        path = checkpoint_path(train.checkpoint_dir, steps_done)
        try:
            payload = build_checkpoint(
                version=self.version, step=steps_done, model=run.model, optimizer=run.optimizer,
                scaler=getattr(run.step_fn, "scaler", None), model_config=run.model_config, train_config=train,
                losses=losses, evals=run.validation.history,
                corpus=self.corpus_fingerprint(run.corpus.tokens), world_size=self.dist.world_size)
            save_atomically(payload, path)
        except KeyboardInterrupt:   # a second Ctrl-C: save_atomically has removed its temporary file
            if not path.exists():
                self.log(f"interrupted while writing {path}: not written; earlier checkpoints are intact")
            raise
        remove_old_checkpoints(train.checkpoint_dir, train.keep_last)
        self.last_path, self.last_step = str(path), steps_done
        seconds = time.perf_counter() - started   # includes copying GPU tensors to the host and the fsync
        size_mb = Path(path).stat().st_size / 1e6
        self.log(f"checkpoint  : {path} (step {steps_done}, {size_mb:.1f} MB, saved in {seconds:.2f} s)")

    def stop(self, run, signal_name: str, steps_done: int, abandoned: str | None) -> None:
        """Say why the run stops, and write the checkpoint of the state after `steps_done` steps if checkpoints were
        asked for (checkpoints_requested) and it is not already on disk."""
        line = f"{signal_name} received" + (f" during {abandoned}, abandoned" if abandoned else "")
        line += f": stopping after step {steps_done}"
        if not self.requested:
            self.log(f"{line}; no checkpoint written (none was asked for)")
        elif steps_done == run.start_step:
            self.log(f"{line}; no checkpoint written (no step completed in this run)")
        elif self.last_step == steps_done:
            self.log(f"{line}; its checkpoint is already written")
        else:
            self.log(f"{line}, writing a checkpoint")
            self.save(run, steps_done)

    def print_resume_hint(self, signal_name: str, steps_done: int) -> None:
        stopped = f"stopped by {signal_name} after step {steps_done}/{self.train.num_steps}"
        if self.last_path is None:
            if not self.requested:
                self.log(f"{stopped}; no checkpoint written. To resume an interrupted run, start it with "
                         f"--checkpoint-dir DIR (a checkpoint when stopped) or --save-every N")
            return
        args, given = [], iter(self.argv)
        for arg in given:   # the same command, with any earlier --resume replaced
            if arg == "--resume":
                next(given, None)   # and its value
            elif not arg.startswith("--resume="):
                args.append(arg)
        script = sys.argv[0] if sys.argv[0].endswith(".py") else f"tiny_llama_{self.version}.py"
        self.log(f"{stopped}; checkpoint: {self.last_path}")
        launcher = "python"
        if self.dist.enabled:   # the same launch: processes per node as now (multi-node: see the sbatch script)
            launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', self.dist.world_size)}"
        self.log(f"resume with: {launcher} {shlex.join([script] + args + ['--resume', 'auto'])}")

    def metrics(self, first_step: int) -> dict:
        """What the metrics JSON says about this run's checkpoints."""
        return {"resumed_from": self.resumed_from, "resumed_at_step": first_step if self.resumed_from else None,
                "last_written": self.last_path}
