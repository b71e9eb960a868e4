"""The stop-signal watcher (tinytransformer/training/stopping.py, MainThreadWatcher): a Ctrl-C or SIGTERM that
arrives while the main thread waits inside a native call (on a GPU: loss.backward(), whose pass runs on the autograd
engine's own thread) is heard at once, said so in one line, and a second one after that line ends the process.

The CPU tests hold a child process's main thread in C (libc's system(), a long key derivation) and signal it from
outside; the GPU tests use a CUDA backward pass that takes seconds."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinytransformer.training.stopping import StopOnSignal

REPO_ROOT = Path(__file__).resolve().parent.parent
POSIX_ONLY = pytest.mark.skipif(
    os.name != "posix", reason="the watcher uses a POSIX pipe as the wakeup descriptor")


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


@POSIX_ONLY
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


@POSIX_ONLY
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


@POSIX_ONLY
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
@POSIX_ONLY
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
        assert said.startswith(f"SIGTERM {NOTICE}"), said
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


@POSIX_ONLY
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
        os.kill(os.getpid(), signal.SIGTERM)   # handled at once by the main thread: the watcher is silent
    assert signal.set_wakeup_fd(-1) == -1
    assert watcher is None or not watcher.is_alive()


# ----------------------------------------------------------------------------------------------------------
# The whole run on a GPU: a real training step whose backward pass takes long, stopped from outside
# ----------------------------------------------------------------------------------------------------------
SLOW_BACKWARD_IN_STEP_3 = """
import sys, time
sys.path.insert(0, {root!r})
from version1_pytorch_baseline import tiny_llama_v1 as v1
forward, calls = v1.TinyLlama.forward, []

def forward_whose_backward_takes_long(self, *args, **kwargs):
    logits, loss = forward(self, *args, **kwargs)
    calls.append(1)
    if len(calls) == 3:   # step 3: its backward pass waits as a first step's kernel compilation does
        def slow(grad):   # runs on the autograd engine's device thread
            print("in the backward pass of step 3", flush=True)
            time.sleep(15)
            return grad
        logits.register_hook(slow)
    return logits, loss

v1.TinyLlama.forward = forward_whose_backward_takes_long
sys.exit(v1.main(sys.argv[1:]))
"""
GPU_RUN = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
           "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--num-steps", "5", "--log-every", "1",
           "--device", "cuda"]


@pytest.mark.gpu
@POSIX_ONLY
def test_a_run_whose_gpu_backward_pass_takes_long_says_so_and_stops_after_it(tmp_path):
    driver = SLOW_BACKWARD_IN_STEP_3.format(root=str(REPO_ROOT))
    process = subprocess.Popen([sys.executable, "-c", driver] + GPU_RUN, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "in the backward pass of step 3\n":
            assert process.poll() is None, "".join(lines) + process.stderr.read()
            lines.append(process.stdout.readline())
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        while NOTICE not in lines[-1]:   # the trainer's log, from the watcher thread, well before the pass ends
            lines.append(process.stdout.readline())
            assert lines[-1], "".join(lines) + process.stderr.read()
        assert time.monotonic() - sent < 10
        out, err = process.communicate(timeout=60)   # after the 15 s pass: the step is abandoned, not finished
        assert process.returncode == 143, err
        assert "SIGTERM received during step 3/5, abandoned: stopping after step 2" in out, "".join(lines) + out
        assert "Traceback" not in err
    finally:
        process.kill() if process.poll() is None else None
