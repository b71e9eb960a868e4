"""Validation during a run (--eval-every): the loss on fixed held-out batches, measured outside the timed steps.

The validation batches are the first --eval-batches of the validation stream: the same batches every time (a
function of the seed), so the numbers of one run, and of a resumed run, compare directly.
"""
from __future__ import annotations

import time

import torch

from ..config import ConfigError, TrainConfig
from ..data import BatchStream
from .step import autocast_context
from .stopping import may_abandon

DEFAULT_EVAL_BATCHES = TrainConfig.eval_batches   # the dataclass default: 8


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


def check_eval_batches(train: TrainConfig, stream: BatchStream, world_size: int) -> None:
    """--eval-batches may ask for as many batches as the validation split has windows (more would repeat the same
    windows: no new information, only time), or for the default number, whatever the split's size."""
    global_batch = train.batch_size * world_size
    covering = -(-stream.num_positions // global_batch)   # batches that hold every window once
    limit = max(covering, DEFAULT_EVAL_BATCHES)
    if train.eval_batches > limit:
        raise ConfigError(f"--eval-batches {train.eval_batches} is more than the validation split holds: its "
                          f"{stream.num_positions:,} windows of --seq-len {train.seq_len} fill {covering:,} "
                          f"batch(es) of {global_batch}; use at most {limit:,}")


class Validation:
    """When validation is due, the measurement itself, and its history ([step, loss] pairs, kept in checkpoints)."""

    def __init__(self, model, stream: BatchStream, train: TrainConfig, device, dist, optimum: float | None):
        self.model, self.stream, self.train, self.device, self.dist = model, stream, train, device, dist
        self.optimum = optimum              # the data's optimum loss, when it is known (Markov data)
        self.history: list[list] = []
        self.seconds = 0.0                  # spent validating in this process
        if train.eval_every:
            check_eval_batches(train, stream, dist.world_size)

    def due(self, steps_done: int) -> bool:
        train = self.train
        return bool(train.eval_every) and (steps_done % train.eval_every == 0 or steps_done == train.num_steps)

    def missing_at(self, step: int, resumed: bool) -> bool:
        """A resumed run whose checkpoint was written by a run stopped before the validation of its last step
        computes that validation first: the validation history then matches the uninterrupted run's."""
        return resumed and step > 0 and self.due(step) and all(s != step for s, _ in self.history)

    def run(self, steps_done: int, log, progress, writer) -> None:
        started = time.perf_counter()
        progress.begin(f"eval {steps_done:>6}/{self.train.num_steps}")
        with may_abandon():   # changes nothing but the history, below: a stop signal may abandon it
            value = validation_loss(self.model, self.stream, self.train.eval_batches, self.device, self.train)
        progress.end()
        value = self.dist.average(value)   # each rank measured its slice of the same validation batches
        self.seconds += time.perf_counter() - started
        self.history.append([steps_done, value])
        gap = f" (optimum {self.optimum:.4f}, gap {value - self.optimum:.4f} nats)" if self.optimum is not None else ""
        log(f"eval {steps_done:>6}/{self.train.num_steps} | validation loss {value:.4f}{gap}")
        if writer is not None:
            writer.add_scalar("eval/loss", value, steps_done)

    def metrics(self) -> dict:
        """What the metrics JSON says about validation."""
        train = self.train
        return {"every": train.eval_every, "batches": train.eval_batches,
                "history": [{"step": s, "loss": v} for s, v in self.history],
                "final": self.history[-1][1] if self.history else None,
                "optimum": self.optimum, "seconds_this_process": self.seconds}
