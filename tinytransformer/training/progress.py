"""Progress of a long run: the user sees a line at least every PROGRESS_INTERVAL_S seconds.

Two mechanisms, both reading only the host clock (never the device):

  - `due()`: the trainer prints a step line when --log-every says so OR when this many seconds have passed
    since the last step line. Asking costs one clock read per step; the line itself costs what any step line
    costs (reading the loss and the step timer), so a fast run gains one such line per interval at most, and
    a run whose steps each take longer than the interval shows every step.
  - a heartbeat thread: while one step (or one validation) runs longer than the interval without any line,
    as steps of Triton's CPU interpreter do, it prints "still running" at most once per interval. It sleeps
    until the next deadline, so on a fast run it wakes once per interval, finds a recent line and says nothing.
"""
from __future__ import annotations

import contextlib
import threading
import time

PROGRESS_INTERVAL_S = 10.0


class Progress:
    """`log` prints one line and must be safe to call from two threads (Trainer.log holds a lock)."""

    def __init__(self, log, interval_s: float | None = None, clock=time.monotonic):
        self.log, self.clock = log, clock
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.last_line = self.last_step_line = clock()
        self.activity: tuple[str, float] | None = None   # (label, start time) of what runs now; None: nothing
        self.first = True                                 # until the first activity ends or is reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- called by the main thread ---------------------------------------------------------------------------
    def printed(self) -> None:
        """A line was printed (any line: a step, a validation, a checkpoint): the heartbeat waits again."""
        self.last_line = self.clock()

    def step_line_printed(self) -> None:
        self.last_step_line = self.clock()

    def due(self) -> bool:
        """True when a step line is owed: the interval has passed since the last one."""
        return self.clock() - self.last_step_line >= self.interval_s

    def begin(self, label: str) -> None:
        """Something that may take long starts now, e.g. 'step      3/20' (the heartbeat names it)."""
        self.activity = (label, self.clock())

    def activity_name(self) -> str | None:
        """What runs now, for a message: 'step 3/20' (the label without its alignment)."""
        return " ".join(self.activity[0].split()) if self.activity else None

    def end(self) -> None:
        if self.activity is not None:
            self.activity = None
            self.first = False

    @contextlib.contextmanager
    def heartbeat(self):
        """Run the heartbeat thread for the duration of the block."""
        if self.interval_s <= 0:
            yield
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join(timeout=1.0)   # it may be inside a print to a pipe nobody reads: do not hang
            self._thread = None

    # -- the heartbeat thread --------------------------------------------------------------------------------
    def _beat(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            wait = self._speak_if_silent_too_long()

    def _speak_if_silent_too_long(self) -> float:
        """Print "still running" if one activity has run, and no line has appeared, for an interval; returns how
        long to sleep until that could next be true. A step that merely STARTED as the interval ran out (a fast
        run between two time-based step lines) is not worth a line."""
        activity, now = self.activity, self.clock()
        if activity is None:
            return min(1.0, self.interval_s)   # between activities: look again soon
        label, started = activity
        deadline = max(self.last_line, started) + self.interval_s
        if now < deadline:
            return max(0.05, deadline - now)
        self.last_line = now
        # The run's first step also does one-time work: say so once, since it is the first thing a user sees.
        why = " (the first step includes one-time set-up: compiling kernels, allocating memory)" if self.first else ""
        self.first = False
        self.log(f"{label} | still running, {now - started:.0f} s so far{why}")
        return self.interval_s
