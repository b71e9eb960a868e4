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

Python runs a signal handler only in the main thread, between two of its bytecodes. While the main thread waits
inside one long native call, the handler waits too. The call that matters: on a GPU, `loss.backward()` runs the
backward pass on the autograd engine's own device thread while the main thread waits in C++, and the first step's
backward pass compiles its kernels there (Triton's, or torch.compile's: minutes in max-autotune mode). So a
watcher thread hears every stop signal as it arrives (through `signal.set_wakeup_fd`) and, when the main thread
has not handled it within a grace period, says what the run is waiting for; a signal sent after that line, while
the main thread is still out of reach, ends the process at once, as the second Ctrl-C does elsewhere (details in
MainThreadWatcher). What the user had survives it: a checkpoint caught half-written (a long copy from the GPU) is
a hidden temporary file beside the previous one, which the next run removes (checkpoint/files.py).

A step marks the part that may be abandoned with `with may_abandon():` (EagerStep does). A step that does not
(version 4's CUDA-graph replay, whose optimizer update is part of the replayed graph) is never abandoned: it is
short anyway. Abandoning is off under data parallel: a rank that left its backward pass half-way would leave the
others waiting in a gradient all-reduce, so there the ranks agree to stop after a step (agreed_stop).
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time


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

    def __init__(self, abandon_steps: bool = True, log=None, grace_s: float = 2.0):
        self.abandon_steps = abandon_steps
        self.signal_number = None
        self.in_abandonable_region = False
        self.last_handled_at = None   # monotonic time of the handler's last run (main thread); the watcher reads it
        self._previous = {}
        self._watcher = MainThreadWatcher(self, log, grace_s)

    def __enter__(self):
        global _active
        if threading.current_thread() is threading.main_thread():
            for number in self.EXIT_CODES:
                self._previous[number] = signal.signal(number, self._handle)
            self._watcher.start()
            _active = self
        return self

    def __exit__(self, *exc_info):
        global _active
        try:
            self._watcher.stop()   # a Ctrl-C during its short join must not leave our handlers installed
        finally:
            for number, handler in self._previous.items():
                signal.signal(number, handler)
            if _active is self:
                _active = None
        return False

    def _handle(self, number, frame):
        self.last_handled_at = time.monotonic()
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


class MainThreadWatcher:
    """A thread that hears SIGINT and SIGTERM as they arrive (Python writes each signal's number to the wakeup
    file descriptor from its C-level handler, whatever the main thread is doing) and checks that the main thread
    runs the handler within `grace_s`. When it has not:
      - it prints one line saying what the run waits for, and how to end it now;
      - a signal that arrives AFTER that line, while the handler has still not run, ends the process at once with
        the exit code of an interrupted run (130 for SIGINT, 143 for SIGTERM).
    Signals already waiting in the pipe when the line is printed do not count: a scheduler that sends SIGTERM
    twice (torchrun under Slurm does) or a quick double Ctrl-C is one request, and the run still stops the
    graceful way when the main thread comes back. Under Jupyter (ipykernel loaded) it never ends the process:
    that would throw away the notebook's state. It does nothing where another part of the program owns the
    wakeup descriptor (asyncio, for one), or where Python offers none for pipes (Windows)."""

    CLOSING = b"\0"        # not a signal number: written by stop() to end the thread
    HANDLER_SLACK_S = 1.0   # the handler may run just BEFORE this thread reads the byte of the same signal

    def __init__(self, stop: StopOnSignal, log, grace_s: float):
        self.stop_signals, self.log, self.grace_s = stop, log, grace_s
        self.may_end_the_process = "ipykernel" not in sys.modules
        self._fds = None
        self._thread = None

    def start(self) -> None:
        """Called by the main thread (set_wakeup_fd is only allowed there)."""
        if os.name != "posix":
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)   # a full pipe must never block the signal handler
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:   # somebody else's: give it back and go without
            signal.set_wakeup_fd(previous)
            os.close(read_fd), os.close(write_fd)
            return
        self._fds = (read_fd, write_fd)
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="stop-signal-watcher",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop hearing signals first (so no new byte follows CLOSING), then end the thread. The join waits a
        little longer than one grace period, the longest the thread can be busy with one signal."""
        if self._fds is None:
            return
        signal.set_wakeup_fd(-1)
        read_fd, write_fd = self._fds
        self._fds = None
        try:
            os.write(write_fd, self.CLOSING)
        except BlockingIOError:   # a pipe full of signal numbers: the thread reaches CLOSING later, or never
            pass
        self._thread.join(timeout=self.grace_s + 1.0)
        if not self._thread.is_alive():   # else it may still read: leave both ends open (a daemon, gone at exit)
            os.close(read_fd), os.close(write_fd)
        self._thread = None

    def forget_in_child(self) -> None:
        """In a forked child: this process is not the watched one. Close its copies of the pipe, so that nothing
        it does (leaving a `with StopOnSignal` block of its own) can write into the parent's pipe."""
        if self._fds is not None:
            os.close(self._fds[0]), os.close(self._fds[1])
            self._fds = self._thread = None

    def _watch(self, read_fd: int) -> None:
        told = False   # the line was printed, and the main thread has not run the handler since
        while True:
            numbers = self._read(read_fd)
            if not numbers or self.CLOSING[0] in numbers:
                return
            for number in numbers:
                if number not in StopOnSignal.EXIT_CODES:
                    continue
                if self._handler_ran_since(time.monotonic() - self.HANDLER_SLACK_S):
                    told = False   # the main thread is back: the trainer does the rest
                elif not told:
                    self._say_what_the_run_waits_for(number)
                    told = True
                    if self._closing_among_waiting_bytes(read_fd):   # they came before the line: one request
                        return
                    break
                elif self.may_end_the_process:
                    self._end_the_process(number)

    def _closing_among_waiting_bytes(self, read_fd: int) -> bool:
        """Read and drop every byte already in the pipe; True if stop() asked the thread to end."""
        dropped = b""
        while select.select([read_fd], [], [], 0)[0]:
            more = self._read(read_fd)
            if not more:
                return True
            dropped += more
        return self.CLOSING[0] in dropped

    @staticmethod
    def _read(read_fd: int) -> bytes:
        try:
            return os.read(read_fd, 64)
        except OSError:   # closed under us: the run is over
            return b""

    def _handler_ran_since(self, moment: float) -> bool:
        """Whether the main thread runs the handler (or ran it after `moment`) within one grace period."""
        give_up_at = time.monotonic() + self.grace_s
        while True:
            ran_at = self.stop_signals.last_handled_at
            if ran_at is not None and ran_at >= moment:
                return True
            if time.monotonic() >= give_up_at:
                return False
            time.sleep(0.05)

    def _say_what_the_run_waits_for(self, number: int) -> None:
        name = signal.Signals(number).name
        again = "press Ctrl-C again" if number == signal.SIGINT else "send SIGTERM again"
        then = f"; {again} to end it now, without a checkpoint" if self.may_end_the_process else ""
        self._print(f"{name} received while the main thread waits inside a native call (on a GPU, the backward "
                    f"pass runs on the autograd engine's own thread, and its first run compiles kernels): the run "
                    f"stops when that call returns{then}")

    def _end_the_process(self, number: int) -> None:
        name = signal.Signals(number).name
        try:
            self._print(f"{name} again while the main thread is still inside that call: interrupted", sys.stderr)
            sys.stdout.flush()
        finally:   # a closed pipe (`| tee`, whose Ctrl-C ended it too) must not keep the process alive
            os._exit(128 + number)   # the shell's code for a process ended by that signal: 130, 143

    def _print(self, text: str, file=None) -> None:
        """One line; an output that is gone (a reader that left the pipe) must not end the watcher."""
        try:
            if file is None and self.log is not None:
                self.log(text)   # the trainer's log: one lock for both threads, and only rank 0 prints
            else:
                print(text, file=file or sys.stdout, flush=True)
        except (OSError, ValueError):
            pass


def _forget_the_watcher() -> None:
    """In a child forked without exec (multiprocessing's fork, a forked data-loader worker), which would inherit
    the wakeup descriptor and the pipe: the Ctrl-C that reaches the whole process group would then write its number
    into the pipe twice, from the watched process and from the child, and look like a second Ctrl-C."""
    if _active is None or _active._watcher._fds is None:   # ours is not set: leave any other owner's alone
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:   # not this interpreter's main thread: nothing was set here
        pass
    _active._watcher.forget_in_child()


if hasattr(os, "register_at_fork"):   # POSIX; a no-op in every child forked while no watcher runs
    os.register_at_fork(after_in_child=_forget_the_watcher)


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
