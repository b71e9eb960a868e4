"""One training step: forward, backward, optimizer, in the precision the run asked for.

EagerStep is the step as written in PyTorch, the one versions 1-3 use. A version may supply its own through
VersionSpec.make_step (version 4: the whole step replayed from a CUDA/HIP graph); under --deepspeed the engine
runs the step (deepspeed_engine.DeepSpeedStep). Every step returns the loss without synchronising the device.
"""
from __future__ import annotations

import contextlib

import torch

from ..config import TrainConfig
from ..profiling.ranges import profile_range
from .stopping import may_abandon
from .timing import StepTimer


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
