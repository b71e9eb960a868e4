"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop) within moments, without losing a step.

A training step changes persistent state (the weights, the optimizer's moments, the loss scaler) only in its
optimizer step. Its forward and backward passes only compute gradients, which the next step would overwrite. So:

  - a signal that arrives during the forward or backward pass ABANDONS the step at once: the handler raises
    StepAbandoned in the main thread, the trainer drops the gradients, and the run ends exactly as if it had
    stopped after the last completed step (on the CPU, where Triton's interpreter can spend a minute on one
    step, this is the difference between stopping now and stopping a minute later);
  - a signal that arrives anywhere else (optimizer step, validation, a checkpoint write, the loop's own
    bookkeeping) is only recorded: the trainer stops after the step, once that work has finished;
  - a second Ctrl-C aborts at once (KeyboardInterrupt), for when the user really means it; a checkpoint being
    written then is abandoned (the atomic write leaves the previous one intact, see checkpoint/files.py).

A step marks the part that may be abandoned with `with may_abandon():` (EagerStep does). A step that does not
(version 4's CUDA-graph replay, whose optimizer update is part of the replayed graph) is never abandoned: it is
short anyway. Abandoning is off under data parallel: a rank that left its backward pass half-way would leave the
others waiting in a gradient all-reduce, so there the ranks agree to stop after a step (agreed_stop).
"""
from __future__ import annotations

import contextlib
import signal
import threading


class StepAbandoned(BaseException):
    """Raised by the signal handler inside a `may_abandon()` region. A BaseException, like KeyboardInterrupt, so
    that no `except Exception` in model or library code swallows it."""

    def __init__(self, signal_number: int):
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


_active: StopOnSignal | None = None   # the StopOnSignal whose `with` block is running, if any


class StopOnSignal:
    """Within `with StopOnSignal(abandon_steps) as stop:`, SIGINT and SIGTERM do not kill the run: the handler
    records the signal in `stop.signal_number` and, only inside a `may_abandon()` region and when
    `abandon_steps` is true, raises StepAbandoned. The training loop reads the number after every step.

    Handlers can only be installed from the main thread; elsewhere the signals keep their default behaviour.
    The handler never prints: a print from inside a handler can collide with a print the loop is doing.
    """

    EXIT_CODES = {signal.SIGINT: 0, signal.SIGTERM: 128 + signal.SIGTERM}   # 143: the shell's convention

    def __init__(self, abandon_steps: bool = True):
        self.abandon_steps = abandon_steps
        self.signal_number = None
        self.in_abandonable_region = False
        self._previous = {}

    def __enter__(self):
        global _active
        if threading.current_thread() is threading.main_thread():
            for number in self.EXIT_CODES:
                self._previous[number] = signal.signal(number, self._handle)
            _active = self
        return self

    def __exit__(self, *exc_info):
        global _active
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        if _active is self:
            _active = None
        return False

    def _handle(self, number, frame):
        if self.signal_number is not None:
            if number == signal.SIGINT:
                raise KeyboardInterrupt   # the second Ctrl-C
            return
        self.signal_number = number
        if self.in_abandonable_region:
            self.in_abandonable_region = False   # raise once
            raise StepAbandoned(number)

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal_number).name

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES[self.signal_number]


@contextlib.contextmanager
def may_abandon():
    """The part of a training step that changes no persistent state (zero_grad, forward, backward): a stop
    signal that arrives here (or arrived just before) abandons the step at once by raising StepAbandoned.
    Outside a StopOnSignal block, or when it does not abandon steps, this does nothing."""
    stop = _active
    if stop is None or not stop.abandon_steps:
        yield
        return
    try:
        stop.in_abandonable_region = True
        if stop.signal_number is not None:   # arrived between steps (e.g. during validation): stop now
            stop.in_abandonable_region = False
            raise StepAbandoned(stop.signal_number)
        yield
    finally:
        stop.in_abandonable_region = False


STOP_AGREEMENT_EVERY = 10   # under data parallel, the ranks agree on a stop signal every N steps


def agreed_stop(stop: StopOnSignal, dist, progress, steps_done: int) -> tuple[int | None, bool]:
    """(the signal (SIGINT / SIGTERM number) that ends the run after this step, or None to go on; whether a
    step line is due because PROGRESS_INTERVAL_S passed since the last one, progress.py).

    A single process stops after the step in which the signal arrived (unless the signal abandoned the step).
    Under data parallel a signal reaches the ranks at different moments, but they must stop after the SAME step:
    a rank that went on alone would wait forever in its next gradient all-reduce. And they must print the same
    step lines: a line averages the loss over the ranks, a collective too, while each rank's clock decides alone
    when a line is due. So the ranks agree on both (one all-reduce, max over ranks). That costs a device-host
    synchronisation, hence only every STOP_AGREEMENT_EVERY steps: a data-parallel run stops at most that many
    steps after the signal.
    """
    if not dist.enabled:
        return stop.signal_number, progress.due()
    if steps_done % STOP_AGREEMENT_EVERY:
        return None, False
    signal_number, due = dist.max_over_ranks_each([stop.signal_number or 0, int(progress.due())])
    return signal_number or None, bool(due)
