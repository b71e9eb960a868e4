"""A diverged run stops: a NaN or infinite loss ends training with one line, instead of a summary of "final nan".

The check reads losses only where the loop already reads them from the device (a step line, a checkpoint, the end
of the run), so it adds no host synchronisation to the timed steps, nor to version 4's captured graph. What it
finds is the first non-finite loss since the last check: the line names that step and the range checked.
`--no-stop-on-nan` (TrainConfig.stop_on_nan = False) keeps training, for the exercises that show divergence.
"""
from __future__ import annotations

import math

EXIT_DIVERGED = 1


class Diverged(Exception):
    """The loss became non-finite; the message is one line for the user. The run writes no summary and no
    metrics JSON (their numbers would be NaN), and keeps its last checkpoint written before the divergence."""


def check_losses(losses: list[float], first_step: int, train, resumed_from: str | None = None) -> None:
    """Raise Diverged when one of `losses` (those of steps first_step+1, first_step+2, ...) is not finite."""
    if not train.stop_on_nan:
        return
    for offset, value in enumerate(losses):
        if math.isfinite(value):
            continue
        step = first_step + offset + 1
        checked = (f"step {step}" if len(losses) == 1
                   else f"step {step} (first of steps {first_step + 1}-{first_step + len(losses)} checked now)")
        causes = [f"a learning rate too high (--learning-rate {train.learning_rate:g})"]
        if train.use_amp:
            causes.append(f"overflow in {train.amp_dtype} (try without --use-amp, or bfloat16)")
        if resumed_from:
            causes.append(f"bad weights in the checkpoint it resumed from ({resumed_from})")
        else:
            causes.append("bad weights or data")
        raise Diverged(f"training diverged: the loss is {value} at {checked}; likely cause: "
                       f"{', or '.join(causes)}. Stopped; --no-stop-on-nan trains on")
