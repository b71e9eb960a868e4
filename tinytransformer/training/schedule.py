"""The learning-rate schedule: a pure function of the step, so a resumed run needs no scheduler state.

Linear warm-up over --lr-warmup-steps, then constant or a cosine decay to COSINE_FLOOR x peak (--lr-schedule).
The trainer writes the step's rate into the optimizer before the step, only when it changes.
"""
from __future__ import annotations

import math

import torch

from ..config import TrainConfig

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
    filled = set()   # groups may share one tensor (make_learning_rate_a_tensor): fill it once
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            if id(group["lr"]) not in filled:
                group["lr"].fill_(lr)
                filled.add(id(group["lr"]))
        else:
            group["lr"] = lr


def schedule_varies(train: TrainConfig) -> bool:
    return train.lr_schedule != "constant" or train.lr_warmup_steps > 0


def make_learning_rate_a_tensor(optimizer: torch.optim.Optimizer) -> None:
    """A capturable optimizer (one whose step a CUDA/HIP graph may capture) gets its learning rate as a 0-dim
    tensor on the parameters' device: a graph bakes a Python float in at capture time, but re-reads a tensor
    at every replay. torch's AdamW accepts a tensor lr when capturable=True or fused=True. Groups with the same
    learning rate on the same device share one tensor, so that setting it is one fill per step, not one per
    group (version 4 has a group per layer)."""
    shared = {}   # (lr, device) -> its tensor
    for group in optimizer.param_groups:
        if group.get("capturable") and not isinstance(group["lr"], torch.Tensor):
            device = group["params"][0].device
            key = (group["lr"], device)
            if key not in shared:
                shared[key] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
            group["lr"] = shared[key]
