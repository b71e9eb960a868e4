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
