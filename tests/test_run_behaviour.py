"""How a run behaves around its steps: Ctrl-C / SIGTERM stop it within moments (a step caught in its forward or
backward pass is abandoned, one caught in its optimizer step is finished), a stopped run writes a checkpoint only
when checkpoints were asked for, long runs print a line at least every PROGRESS_INTERVAL_S, and warm-up steps are
labelled as such.

Signals are real: os.kill from inside a step (in this process), or from the test to a child process."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tinytransformer.training import progress as progress_mod
from tinytransformer.training.checkpoint import files as ckpt_files
from tinytransformer.training.checkpoint.files import list_checkpoints
from tinytransformer.training.checkpoint.loading import read_checkpoint
from tinytransformer.training.progress import Progress
from tinytransformer.training.stopping import StepAbandoned, StopOnSignal, may_abandon
from version1_pytorch_baseline import tiny_llama_v1 as v1

REPO_ROOT = Path(__file__).resolve().parent.parent
NUM_STEPS = 12
TINY = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
        "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
# A cosine schedule and validation: a resumed run must land on the right learning rate and validation history.
RUN = TINY + ["--num-steps", str(NUM_STEPS), "--lr-schedule", "cosine", "--eval-every", "4", "--eval-batches", "2",
              "--log-every", "1"]


def train(tmp_path: Path, *extra, name="metrics") -> tuple[int, dict | None]:
    """Version 1's main() in this process: (exit code, the metrics JSON or None)."""
    out = tmp_path / f"{name}.json"
    code = v1.main(RUN + ["--output-json", str(out)] + [str(e) for e in extra])
    return code, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every stopped-and-resumed run must reproduce."""
    code, metrics = train(tmp_path_factory.mktemp("reference"))
    assert code == 0
    return metrics


# ----------------------------------------------------------------------------------------------------------
# Sending a signal from inside a step
# ----------------------------------------------------------------------------------------------------------
def kill_self(number):
    os.kill(os.getpid(), number)   # the handler runs in this (the main) thread before the next bytecode


def signal_in_forward(monkeypatch, step: int, number, training: bool = True, call: int = 1):
    """Send `number` during a forward pass: of training step `step` (1-based), or with training=False during
    the `call`-th forward pass of the `step`-th validation."""
    forward, calls = v1.TinyLlama.forward, {"train": 0, "eval": 0}

    def patched(self, *args, **kwargs):
        if self.training:
            calls["train"] += 1
            if training and calls["train"] == step:
                kill_self(number)
        else:
            calls["eval"] += 1
            done = calls["train"]   # validation after `done` steps; each validation has 2 batches here
            if not training and done == step and (calls["eval"] - 1) % 2 + 1 == call:
                kill_self(number)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(v1.TinyLlama, "forward", patched)


def signal_in_backward(monkeypatch, step: int, number):
    """Send `number` during the backward pass of training step `step`: a hook on the loss's gradient."""
    forward, calls = v1.TinyLlama.forward, [0]

    def patched(self, *args, **kwargs):
        logits, loss = forward(self, *args, **kwargs)
        if self.training:
            calls[0] += 1
            if calls[0] == step:
                loss.register_hook(lambda grad: kill_self(number))
        return logits, loss

    monkeypatch.setattr(v1.TinyLlama, "forward", patched)


def signal_in_optimizer_step(monkeypatch, step: int, number):
    step_fn, calls = torch.optim.AdamW.step, [0]

    def patched(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            kill_self(number)   # recorded by the handler; the update below still runs in full
        return step_fn(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", patched)


def resume(tmp_path: Path, directory: Path, name="resumed") -> dict:
    code, metrics = train(tmp_path, "--checkpoint-dir", directory, "--resume", "auto", name=name)
    assert code == 0
    return metrics


# ----------------------------------------------------------------------------------------------------------
# Stopping: abandoned in forward/backward, finished in the optimizer step, exact resume either way
# ----------------------------------------------------------------------------------------------------------
def test_signal_in_the_forward_pass_abandons_the_step_and_the_run_resumes_exactly(reference, tmp_path,
                                                                                monkeypatch, capsys):
    directory = tmp_path / "c"
    signal_in_forward(monkeypatch, step=6, number=signal.SIGINT)
    code, stopped = train(tmp_path, "--checkpoint-dir", directory, name="stopped")
    out = capsys.readouterr().out
    assert code == 0
    assert "SIGINT received during step 6/12, abandoned: stopping after step 5, writing a checkpoint" in out
    assert f"stopped by SIGINT after step 5/{NUM_STEPS}; checkpoint: " in out and "--resume auto" in out
    assert "step      5/12 | loss" in out and "step      6/12 | loss" not in out
    assert stopped["steps_completed"] == 5 and stopped["status"] == "stopped by SIGINT"
    assert stopped["loss"]["history"] == reference["loss"]["history"][:5]
    assert [s for s, _ in list_checkpoints(directory)] == [5]
    monkeypatch.undo()
    resumed = resume(tmp_path, directory)
    assert resumed["loss"]["history"] == reference["loss"]["history"]   # bit for bit
    assert resumed["eval"]["history"] == reference["eval"]["history"]


def test_sigterm_in_the_backward_pass_abandons_the_step(reference, tmp_path, monkeypatch, capsys):
    directory = tmp_path / "c"
    signal_in_backward(monkeypatch, step=3, number=signal.SIGTERM)
    code, stopped = train(tmp_path, "--checkpoint-dir", directory, name="stopped")
    assert code == 143
    assert "SIGTERM received during step 3/12, abandoned: stopping after step 2" in capsys.readouterr().out
    assert [s for s, _ in list_checkpoints(directory)] == [2]
    monkeypatch.undo()
    assert resume(tmp_path, directory)["loss"]["history"] == reference["loss"]["history"]


def test_signal_in_the_optimizer_step_finishes_that_step(reference, tmp_path, monkeypatch, capsys):
    directory = tmp_path / "c"
    signal_in_optimizer_step(monkeypatch, step=7, number=signal.SIGINT)
    code, stopped = train(tmp_path, "--checkpoint-dir", directory, name="stopped")
    out = capsys.readouterr().out
    assert code == 0
    assert "SIGINT received: stopping after step 7, writing a checkpoint" in out and "abandoned" not in out
    assert stopped["loss"]["history"] == reference["loss"]["history"][:7]
    assert [s for s, _ in list_checkpoints(directory)] == [7]
    monkeypatch.undo()
    assert resume(tmp_path, directory)["loss"]["history"] == reference["loss"]["history"]


def test_signal_during_validation_abandons_it_and_the_resumed_run_computes_it(reference, tmp_path, monkeypatch,
                                                                             capsys):
    directory = tmp_path / "c"
    signal_in_forward(monkeypatch, step=8, number=signal.SIGINT, training=False, call=2)
    code, stopped = train(tmp_path, "--checkpoint-dir", directory, name="stopped")
    assert code == 0
    assert "SIGINT received during eval 8/12, abandoned: stopping after step 8" in capsys.readouterr().out
    assert [e["step"] for e in stopped["eval"]["history"]] == [4]   # the one after step 8 was abandoned
    assert [s for s, _ in list_checkpoints(directory)] == [8]
    monkeypatch.undo()
    resumed = resume(tmp_path, directory)
    assert "eval      8/12 | validation loss" in capsys.readouterr().out
    assert resumed["eval"]["history"] == reference["eval"]["history"]
    assert resumed["loss"]["history"] == reference["loss"]["history"]


def test_second_ctrl_c_during_the_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    """The first Ctrl-C abandons step 5; while the run writes the checkpoint of step 4, a second one aborts: the
    half-written file is removed, the checkpoint of step 3 is intact, the exit is one line and code 130."""
    directory = tmp_path / "c"
    signal_in_forward(monkeypatch, step=5, number=signal.SIGINT)
    write, writes = ckpt_files._write_payload, [0]

    def interrupted_write(payload, file):
        writes[0] += 1
        if writes[0] == 2:   # the stop's checkpoint (the first write was --save-every's, at step 3)
            file.write(b"PK\x03\x04 part of a checkpoint")
            kill_self(signal.SIGINT)
        write(payload, file)

    monkeypatch.setattr(ckpt_files, "_write_payload", interrupted_write)
    code, _ = train(tmp_path, "--checkpoint-dir", directory, "--save-every", "3", "--keep-last", "0")
    captured = capsys.readouterr()
    assert code == 130
    assert "interrupted while writing" in captured.out and "earlier checkpoints are intact" in captured.out
    assert "Traceback" not in captured.err and "interrupted" in captured.err
    assert sorted(p.name for p in directory.iterdir()) == ["ckpt_step00000003.pt"]   # no temporary file
    read_checkpoint(directory / "ckpt_step00000003.pt")


def test_temporary_files_of_a_killed_write_are_removed_at_the_next_start(tmp_path, capsys):
    directory = tmp_path / "c"
    directory.mkdir()
    leftover = directory / ".ckpt_step00000007.pt.tmp-999999"
    leftover.write_bytes(b"PK\x03\x04 half")
    code, _ = train(tmp_path, "--checkpoint-dir", directory, "--num-steps", "2")
    assert code == 0 and not leftover.exists()
    assert "removed 1 temporary file(s) of an interrupted checkpoint write" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# No file where none was asked for
# ----------------------------------------------------------------------------------------------------------
def test_a_stopped_run_without_checkpoint_flags_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    signal_in_forward(monkeypatch, step=3, number=signal.SIGINT)
    assert v1.main(RUN) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []   # no checkpoints/ in the working directory
    assert "stopping after step 2; no checkpoint written (none was asked for)" in out
    assert "stopped by SIGINT after step 2/12; no checkpoint written" in out and "--checkpoint-dir DIR" in out
    assert "resume with" not in out


def test_a_whole_run_with_default_flags_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert v1.main(TINY + ["--num-steps", "3", "--eval-every", "2", "--eval-batches", "1"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_save_every_uses_the_default_checkpoint_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert v1.main(TINY + ["--num-steps", "2", "--save-every", "2"]) == 0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["ckpt_step00000002.pt"]


# ----------------------------------------------------------------------------------------------------------
# A real Ctrl-C / SIGTERM from outside, in the middle of a step that would take a minute
# ----------------------------------------------------------------------------------------------------------
SLOW_THIRD_STEP = """
import sys, time
sys.path.insert(0, {root!r})
from tinytransformer.training import progress
progress.PROGRESS_INTERVAL_S = 0.5
from version1_pytorch_baseline import tiny_llama_v1 as v1
forward, calls = v1.TinyLlama.forward, []
def slow_forward(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:   # the third step: a minute of Python work, as in Triton's CPU interpreter
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sum(range(1000))
    return forward(self, *args, **kwargs)
v1.TinyLlama.forward = slow_forward
sys.exit(v1.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("number, exit_code", [(signal.SIGINT, 0), (signal.SIGTERM, 143)])
def test_a_signal_stops_a_long_step_within_seconds(tmp_path, number, exit_code):
    driver = SLOW_THIRD_STEP.format(root=str(REPO_ROOT))
    process = subprocess.Popen([sys.executable, "-c", driver] + TINY + ["--num-steps", "5", "--log-every", "1"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, deadline = [], time.monotonic() + 120
    while "step      3/5 | still running" not in (lines[-1] if lines else ""):   # the heartbeat
        assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
        lines.append(process.stdout.readline())
    sent = time.monotonic()
    process.send_signal(number)
    out, err = process.communicate(timeout=60)
    took = time.monotonic() - sent
    out = "".join(lines) + out
    assert took < 10, f"{took:.1f} s from the signal to the end of the run"   # not the minute the step takes
    assert process.returncode == exit_code, err
    assert "Traceback" not in err
    name = signal.Signals(number).name
    assert f"{name} received during step 3/5, abandoned: stopping after step 2" in out
    assert "the first step includes one-time set-up" not in out.split("step      3/5")[1]   # only for step 1
    assert "native call" not in out   # the main thread handled the signal: the watcher had nothing to say
    assert list(tmp_path.iterdir()) == []   # no checkpoint was asked for


# ----------------------------------------------------------------------------------------------------------
# A signal while the main thread waits inside a native call (on a GPU: the backward pass, on the autograd
# engine's thread, compiling its kernels). Python cannot run the handler until the call returns.
# ----------------------------------------------------------------------------------------------------------
IN_A_NATIVE_CALL = """
import ctypes, hashlib, sys
sys.path.insert(0, {root!r})
from tinytransformer.training.stopping import StopOnSignal
with StopOnSignal(log=lambda text: print(text, flush=True), grace_s=0.5) as stop:
    {call}
print("the call returned, stop requested by", stop.name, flush=True)
"""
# libc's system() waits for its child in C and retries the wait after a SIGTERM: like the main thread of a GPU
# run inside loss.backward(), it does not return to Python until the child is done. The child says when it runs
# (so the signal cannot land before the call), and does not hold our pipes open after the driver ends.
SYSTEM_CALL = "ctypes.CDLL(None).system(b'echo waiting; exec sleep {seconds} > /dev/null 2>&1')"
# system() ignores SIGINT while it waits; a long key derivation holds the main thread in C without doing so.
HASH_CALL = "print('waiting', flush=True); hashlib.pbkdf2_hmac('sha256', b'x', b'y', 400_000_000)"
NOTICE = "received while the main thread waits inside a native call"


def start_in_a_native_call(call: str) -> subprocess.Popen:
    driver = IN_A_NATIVE_CALL.format(root=str(REPO_ROOT), call=call)
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)   # its own group: cleaned up by end_group
    assert process.stdout.readline() == "waiting\n", process.stderr.read()
    return process


def end_group(process: subprocess.Popen) -> None:
    """Kill whatever is left of the driver's process group: the `sleep` of SYSTEM_CALL, or a driver that a
    failed check left running."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(os.name != "posix", reason="the watcher uses a POSIX pipe as the wakeup descriptor")
@pytest.mark.parametrize("number, call, exit_code", [(signal.SIGTERM, SYSTEM_CALL.format(seconds=60), 143),
                                                     (signal.SIGINT, HASH_CALL, 130)])
def test_a_second_signal_ends_a_run_whose_main_thread_is_out_of_reach(number, call, exit_code):
    process = start_in_a_native_call(call)
    try:
        time.sleep(0.5)   # into the call (system() is in it already: its child spoke)
        process.send_signal(number)
        said = process.stdout.readline()   # within the grace period (0.5 s), not when the call ends
        name = signal.Signals(number).name
        assert said.startswith(f"{name} {NOTICE}"), said
        assert ("press Ctrl-C again" if number == signal.SIGINT else "send SIGTERM again") in said
        sent = time.monotonic()
        process.send_signal(number)
        out, err = process.communicate(timeout=30)
        assert time.monotonic() - sent < 15
        assert process.returncode == exit_code, err
        assert f"{name} again while the main thread is still inside that call: interrupted" in err
        assert "the call returned" not in out and "Traceback" not in err
    finally:
        end_group(process)


@pytest.mark.skipif(os.name != "posix", reason="the watcher uses a POSIX pipe as the wakeup descriptor")
def test_two_signals_at_once_are_one_request():
    """A scheduler's SIGTERM that comes twice (torchrun under Slurm sends its own after Slurm's), or a quick
    double Ctrl-C, lands before the user could read the watcher's line: the run still stops the graceful way."""
    process = start_in_a_native_call(SYSTEM_CALL.format(seconds=4))
    try:
        process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert out.count(NOTICE) == 1 and "interrupted" not in err
        assert "the call returned, stop requested by SIGTERM" in out
    finally:
        end_group(process)


@pytest.mark.skipif(os.name != "posix", reason="the watcher uses a POSIX pipe as the wakeup descriptor")
def test_a_closed_output_does_not_silence_the_watcher():
    """`python train.py | tee log`: the Ctrl-C that reaches the group ends tee too. The watcher's line then has
    nowhere to go, and the second signal must still end the process."""
    process = start_in_a_native_call(SYSTEM_CALL.format(seconds=60))
    try:
        process.stdout.close()
        process.send_signal(signal.SIGTERM)
        time.sleep(3)   # past the grace period: the line was tried (and failed) by now
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 143, process.stderr.read()
        assert "Traceback" not in process.stderr.read()
    finally:
        end_group(process)


GPU_BACKWARD_THAT_TAKES_A_WHILE = """
import sys, time, torch
sys.path.insert(0, {root!r})
from tinytransformer.training.stopping import StepAbandoned, StopOnSignal, may_abandon

class SlowBackward(torch.autograd.Function):   # as the first step's backward pass compiling its kernels
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        print("in the backward pass", flush=True)
        time.sleep({seconds})
        return grad * 2

x = torch.ones(4, device="cuda", requires_grad=True)
with StopOnSignal(log=lambda text: print(text, flush=True), grace_s=0.5):
    try:
        with may_abandon():
            SlowBackward.apply(x).sum().backward()
        print("the step went on", flush=True)
    except StepAbandoned:
        print("abandoned", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(os.name != "posix", reason="the watcher uses a POSIX pipe as the wakeup descriptor")
@pytest.mark.parametrize("signals, seconds", [(1, 4), (2, 30)])
def test_a_signal_during_a_gpu_backward_pass(signals, seconds):
    """On a GPU the backward pass runs on the autograd engine's device thread while the main thread waits in
    C++: the handler cannot run until it returns. One signal: the watcher says so, and the step is abandoned when
    the backward pass returns. Two: the process ends at once."""
    driver = GPU_BACKWARD_THAT_TAKES_A_WHILE.format(root=str(REPO_ROOT), seconds=seconds)
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "in the backward pass\n", process.stderr.read()
        process.send_signal(signal.SIGTERM)
        said = process.stdout.readline()
        assert said.startswith("SIGTERM received while the main thread waits inside a native call"), said
        sent = time.monotonic()
        if signals == 2:
            process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        if signals == 1:
            assert out == "abandoned\n" and process.returncode == 0, err
        else:
            assert time.monotonic() - sent < 10 and process.returncode == 143, err
            assert "interrupted" in err and "abandoned" not in out
    finally:
        process.kill() if process.poll() is None else None


@pytest.mark.skipif(os.name != "posix", reason="the watcher uses a POSIX pipe as the wakeup descriptor")
def test_the_watcher_leaves_a_wakeup_descriptor_it_does_not_own():
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd)   # as asyncio does
        with StopOnSignal() as stop:
            assert stop._watcher._thread is None
            assert signal.set_wakeup_fd(write_fd) == write_fd   # still there, untouched
        assert signal.set_wakeup_fd(-1) == write_fd
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read_fd), os.close(write_fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")   # the child only writes and leaves
def test_a_forked_child_does_not_write_into_the_watchers_pipe():
    """A Ctrl-C reaches the whole process group: a forked child still holding the wakeup descriptor would make
    one Ctrl-C look like two to the watcher."""
    with StopOnSignal():
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:   # the child reports what its wakeup descriptor is, and leaves
            os.write(write_fd, str(signal.set_wakeup_fd(-1)).encode())
            os._exit(0)
        os.waitpid(child, 0)
        reported = os.read(read_fd, 16).decode()
        os.close(read_fd), os.close(write_fd)
    assert reported == "-1"


def test_under_jupyter_the_watcher_never_ends_the_process(monkeypatch):
    """A second "interrupt kernel" must not throw away the notebook's state: there the line only says to wait."""
    monkeypatch.setitem(sys.modules, "ipykernel", sys)   # any module: only its presence is read
    said = []
    watcher = StopOnSignal(log=said.append)._watcher
    assert not watcher.may_end_the_process
    watcher._say_what_the_run_waits_for(signal.SIGINT)
    assert NOTICE in said[0] and "again" not in said[0]


def test_the_watcher_stops_with_the_run_and_gives_the_descriptor_back():
    with StopOnSignal() as stop:
        watcher = stop._watcher._thread
        assert os.name != "posix" or watcher.is_alive()
        kill_self(signal.SIGTERM)   # handled at once by the main thread: the watcher says nothing
    assert signal.set_wakeup_fd(-1) == -1
    assert watcher is None or not watcher.is_alive()


# ----------------------------------------------------------------------------------------------------------
# The signal machinery on its own
# ----------------------------------------------------------------------------------------------------------
def test_a_signal_abandons_only_inside_a_may_abandon_region():
    with StopOnSignal() as stop:
        kill_self(signal.SIGTERM)              # outside: recorded only
        assert stop.signal_number == signal.SIGTERM
        with pytest.raises(StepAbandoned):     # entering a region with a signal pending: abandoned at once
            with may_abandon():
                pass
    with StopOnSignal() as stop:
        with pytest.raises(StepAbandoned) as caught:
            with may_abandon():
                kill_self(signal.SIGINT)
                time.sleep(1)                  # not reached
        assert caught.value.signal_number == signal.SIGINT and not stop.in_abandonable_region
        with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C aborts, wherever it lands
            kill_self(signal.SIGINT)


def test_under_data_parallel_no_step_is_abandoned():
    """A rank that left its backward pass would leave the others waiting in the gradient all-reduce: with
    abandon_steps=False (the trainer's choice under torchrun) a signal is only recorded."""
    with StopOnSignal(abandon_steps=False) as stop:
        with may_abandon():
            kill_self(signal.SIGTERM)
            kill_self(signal.SIGTERM)   # a second SIGTERM changes nothing either
        assert stop.signal_number == signal.SIGTERM and stop.exit_code == 143


def test_may_abandon_outside_a_run_does_nothing():
    with may_abandon():
        pass


# ----------------------------------------------------------------------------------------------------------
# Progress: a line at least every interval, a heartbeat during one long step
# ----------------------------------------------------------------------------------------------------------
def test_progress_due_follows_the_host_clock():
    now = [100.0]
    progress = Progress(lambda text: None, interval_s=10, clock=lambda: now[0])
    assert not progress.due()
    now[0] += 9.9
    assert not progress.due()
    now[0] += 0.2
    assert progress.due()
    progress.printed()   # a line that is not a step line: the heartbeat waits, a step line is still owed
    assert progress.due()
    progress.step_line_printed()
    assert not progress.due()


def test_heartbeat_speaks_only_while_something_runs_longer_than_the_interval():
    lines = []
    progress = Progress(lines.append, interval_s=0.2)
    with progress.heartbeat():
        time.sleep(0.5)   # nothing running: nothing to say
        assert lines == []
        progress.begin("step      1/9")
        time.sleep(0.55)
        progress.end()
        progress.begin("step      2/9")
        time.sleep(0.3)
        progress.end()
    assert 1 <= len(lines) <= 5, lines   # ~3; fewer only if this thread is starved on a loaded machine
    assert lines[0].startswith("step      1/9 | still running, ") and "one-time set-up" in lines[0]
    assert all("one-time" not in line for line in lines[1:])   # said once


def test_heartbeat_is_quiet_on_a_fast_run_without_lines():
    """Many short steps and no line for several intervals (a large --log-every): the step lines by time are the
    trainer's job; the heartbeat speaks only of a single step that has run for a whole interval."""
    lines = []
    progress = Progress(lines.append, interval_s=0.3)
    with progress.heartbeat():
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            progress.begin("step")
            time.sleep(0.002)
            progress.end()
    assert lines == []


STEP_LINE = re.compile(r"^step +(\d+/\d+) \| loss", re.MULTILINE)


def test_a_slow_run_prints_step_lines_by_time_as_well(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress_mod, "PROGRESS_INTERVAL_S", 0.25)
    forward = v1.TinyLlama.forward

    def slow(self, *args, **kwargs):
        time.sleep(0.1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(v1.TinyLlama, "forward", slow)
    assert v1.main(TINY + ["--num-steps", "12", "--log-every", "1000"]) == 0
    steps = [match.group(1) for match in STEP_LINE.finditer(capsys.readouterr().out)]
    assert steps[0] == "1/12" and steps[-1] == "12/12"
    assert len(steps) >= 3, steps   # lines by time, though --log-every asks for none in between


def test_a_fast_run_prints_no_heartbeat_and_no_extra_lines(tmp_path, capsys):
    assert v1.main(TINY + ["--num-steps", "6", "--log-every", "1000"]) == 0
    out = capsys.readouterr().out
    assert "still running" not in out
    assert [match.group(1) for match in STEP_LINE.finditer(out)] == ["1/6", "6/6"]


# ----------------------------------------------------------------------------------------------------------
# Warm-up steps say so; a resumed run's default warm-up counts its own steps
# ----------------------------------------------------------------------------------------------------------
def test_warm_up_step_lines_say_they_are_not_timed(tmp_path, capsys):
    assert v1.main(TINY + ["--num-steps", "5", "--warmup-steps", "2", "--log-every", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if STEP_LINE.match(line)]
    assert all("warm-up step, not timed (" in line and "samples/s" not in line for line in lines[:2])
    assert all("samples/s" in line and "ms/step" in line and "warm-up" not in line for line in lines[2:])


def test_resumed_run_excludes_its_own_warm_up_steps(tmp_path, capsys):
    directory = tmp_path / "c"
    code, _ = train(tmp_path, "--save-every", "8", "--checkpoint-dir", directory)
    assert code == 0
    (directory / "ckpt_step00000012.pt").unlink()
    capsys.readouterr()
    resumed = resume(tmp_path, directory)   # 4 steps left: default warm-up min(5, (4 - 1) // 2) = 1
    out = capsys.readouterr().out
    assert "12 steps (1 warm-up)" in out
    assert "step      9/12 | loss" in out and "warm-up step, not timed" in out.split("step      9/12")[1][:40]
    assert "samples/s" in out.split("step     10/12")[1].splitlines()[0]
    assert resumed["timing"]["warmup_steps"] == 1 and resumed["timing"]["count"] == 3
    code, explicit = train(tmp_path, "--checkpoint-dir", directory, "--resume", "auto", "--warmup-steps", "2",
                           name="explicit")
    assert code == 0 and explicit["timing"]["warmup_steps"] == 2 and explicit["timing"]["count"] == 2
