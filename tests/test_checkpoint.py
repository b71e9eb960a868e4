"""Checkpoints: exact resume (bit-identical on CPU in float32), real SIGKILL / SIGINT / SIGTERM, kills during a
write, cross-version resume, and every kind of bad checkpoint (one line, exit 2, nothing overwritten)."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tinytransformer.training.checkpoint import FORMAT, CheckpointError
from tinytransformer.training.checkpoint import files as ckpt_files
from tinytransformer.training.checkpoint.files import checkpoint_path, list_checkpoints, save_atomically
from tinytransformer.training.checkpoint.loading import read_checkpoint
from tinytransformer.training.checkpoint.state import (load_optimizer_state, optimizer_state, restore_rng_state,
                                                       rng_state)
from tinytransformer.config import ModelConfig
from tinytransformer.weights import canonical_shapes, init_canonical_weights
from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama as TinyLlamaV1
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main
from version2_pytorch_fused.tiny_llama_v2 import TinyLlama as TinyLlamaV2
from version2_pytorch_fused.tiny_llama_v2 import main as v2_main

REPO_ROOT = Path(__file__).resolve().parent.parent
V1_SCRIPT = REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py"
NUM_STEPS = 40
TINY = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
        "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
# A cosine schedule with learning-rate warm-up: a resume must also land on the right learning rate.
RUN = TINY + ["--num-steps", str(NUM_STEPS), "--lr-schedule", "cosine", "--lr-warmup-steps", "4",
              "--log-every", "1000"]
# Validation after every step makes each step slow enough (~30 ms) for a test to signal a run mid-way.
SLOW = ["--eval-every", "1", "--eval-batches", "40"]


def train(main, tmp_path: Path, *extra, name="metrics") -> tuple[int, dict | None]:
    """Run a version's main() in this process; returns (exit code, the metrics JSON or None)."""
    out = tmp_path / f"{name}.json"
    code = main(RUN + ["--output-json", str(out)] + [str(e) for e in extra])
    return code, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every resumed run must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    code, metrics = train(v1_main, tmp, "--eval-every", "10", "--eval-batches", "2")
    assert code == 0
    return metrics


def start_subprocess(checkpoint_dir: Path, *extra) -> subprocess.Popen:
    command = [sys.executable, str(V1_SCRIPT)] + RUN + SLOW + ["--checkpoint-dir", str(checkpoint_dir)] + list(extra)
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended before the test could interrupt it: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("timed out waiting for the run")
        time.sleep(0.005)


def snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())} if directory.exists() else {}


# ----------------------------------------------------------------------------------------------------------
# Exact resume
# ----------------------------------------------------------------------------------------------------------
def test_resume_is_bit_identical_to_the_uninterrupted_run(reference, tmp_path):
    full_dir, resume_dir = tmp_path / "full", tmp_path / "resume"
    code, full = train(v1_main, tmp_path, "--eval-every", "10", "--eval-batches", "2", "--save-every", "8",
                       "--keep-last", "0", "--checkpoint-dir", full_dir, name="full")
    assert code == 0
    assert full["loss"]["history"] == reference["loss"]["history"]   # writing checkpoints changes nothing
    assert [s for s, _ in list_checkpoints(full_dir)] == [8, 16, 24, 32, 40]
    for resume_step in (8, 24):
        shutil.rmtree(resume_dir, ignore_errors=True)
        resume_dir.mkdir()
        shutil.copy(checkpoint_path(full_dir, resume_step), resume_dir)
        code, resumed = train(v1_main, tmp_path, "--eval-every", "10", "--eval-batches", "2", "--save-every",
                              "8", "--checkpoint-dir", resume_dir, "--resume", "auto", name=f"resumed{resume_step}")
        assert code == 0
        assert resumed["loss"]["history"] == reference["loss"]["history"]        # every step, bit for bit
        assert resumed["loss"]["final"] == reference["loss"]["final"]
        assert resumed["eval"]["history"] == reference["eval"]["history"]        # kept in the checkpoint
        assert resumed["checkpoint"]["resumed_at_step"] == resume_step
        assert resumed["lr_schedule"]["final"] == pytest.approx(0.1 * 1e-3)


def test_checkpoint_contents_and_size(tmp_path):
    code, _ = train(v1_main, tmp_path, "--save-every", "20", "--checkpoint-dir", tmp_path / "c")
    assert code == 0
    path = checkpoint_path(tmp_path / "c", 20)
    payload = torch.load(path, weights_only=True)   # only tensors and plain python values
    assert payload["format"] == FORMAT and payload["version"] == "v1" and payload["step"] == 20
    config = ModelConfig(**payload["model_config"])
    assert set(payload["model"]) == set(canonical_shapes(config))
    assert set(payload["optimizer"]["per_parameter"]) == {"exp_avg", "exp_avg_sq"}
    assert float(payload["optimizer"]["scalars"]["step"]) == 20
    assert payload["train_config"]["lr_schedule"] == "cosine" and len(payload["history"]["train_loss"]) == 20
    assert {"torch", "cuda", "numpy", "python"} <= set(payload["rng"])
    assert path.stat().st_size < 600_000   # ~30k parameters: weights + two AdamW moments, float32


def test_every_random_number_generator_is_restored():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    saved = rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    restore_rng_state(saved)
    again = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all() and first[2:] == again[2:]


def test_keep_last_removes_the_oldest(tmp_path):
    code, _ = train(v1_main, tmp_path, "--save-every", "5", "--keep-last", "2", "--checkpoint-dir", tmp_path / "c")
    assert code == 0
    assert [s for s, _ in list_checkpoints(tmp_path / "c")] == [35, 40]


def test_newest_planned_saves_follow_the_trainers_rule_without_walking_every_step():
    for num_steps in range(1, 40):
        for save_every in range(0, 12):
            every = [step for step in range(num_steps, 0, -1)
                     if ckpt_files.is_planned_save(step, num_steps, save_every)]
            for count in range(0, 5):
                assert ckpt_files.newest_planned_saves(num_steps, save_every, count) == every[:count]
    # The largest run a flag allows: its newest saves, not two billion steps walked.
    assert ckpt_files.newest_planned_saves(2**31 - 1, 1000, 3) == [2**31 - 1, 2147483000, 2147482000]


def test_listing_a_directory_removed_meanwhile(tmp_path, monkeypatch):
    """A run starting in another process creates the directory for its writability probe and removes it again: a
    listing that saw the directory and then finds it gone lists nothing, it does not fail."""
    class RemovedAfterTheCheck(type(Path())):
        def is_dir(self):
            return True   # the directory was there when checked; it is gone when listed

    monkeypatch.setattr(ckpt_files, "Path", RemovedAfterTheCheck)
    assert list_checkpoints(tmp_path / "gone") == []


def test_only_rank_0_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    code, _ = train(v1_main, tmp_path, "--save-every", "5", "--checkpoint-dir", tmp_path / "c")
    assert code == 0 and not (tmp_path / "c").exists()


def test_resume_auto_without_checkpoints_starts_from_step_0(reference, tmp_path, capsys):
    code, metrics = train(v1_main, tmp_path, "--resume", "auto", "--checkpoint-dir", tmp_path / "empty")
    assert code == 0 and "no checkpoint" in capsys.readouterr().out
    assert metrics["loss"]["history"] == reference["loss"]["history"]


# ----------------------------------------------------------------------------------------------------------
# Real faults: SIGKILL, SIGINT, SIGTERM, a kill during a checkpoint write
# ----------------------------------------------------------------------------------------------------------
def test_sigkill_mid_run_then_resume_auto(reference, tmp_path):
    directory = tmp_path / "c"
    process = start_subprocess(directory, "--save-every", "4")
    # The run creates the directory to probe it, removes it, and creates it again for its lock: the listing
    # copes with a directory that comes and goes (test_listing_a_directory_removed_meanwhile).
    wait_for(lambda: len(list_checkpoints(directory)) >= 2, process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    written = [s for s, _ in list_checkpoints(directory)]
    assert written[-1] < NUM_STEPS, "the run finished before the kill"
    code, resumed = train(v1_main, tmp_path, "--save-every", "4", "--checkpoint-dir", directory, "--resume", "auto")
    assert code == 0 and resumed["checkpoint"]["resumed_at_step"] == written[-1]
    assert resumed["loss"]["history"] == reference["loss"]["history"]


@pytest.mark.parametrize("signal_number, exit_code", [(signal.SIGINT, 0), (signal.SIGTERM, 143)])
def test_signal_writes_a_resumable_checkpoint(reference, tmp_path, signal_number, exit_code):
    directory = tmp_path / "c"
    process = start_subprocess(directory, "--log-every", "1")   # no --save-every: only the signal saves
    lines = []
    wait_for(lambda: lines.append(process.stdout.readline()) or "step      3/" in lines[-1], process)
    process.send_signal(signal_number)
    out, err = process.communicate(timeout=120)
    out = "".join(lines) + out
    assert process.returncode == exit_code, err
    assert "Traceback" not in err
    written = list_checkpoints(directory)
    assert len(written) == 1
    step, path = written[0]
    assert 3 <= step < NUM_STEPS
    assert f"stopped by {signal.Signals(signal_number).name} after step {step}/{NUM_STEPS}" in out
    assert f"checkpoint: {path}" in out and "--resume auto" in out
    code, resumed = train(v1_main, tmp_path, "--checkpoint-dir", directory, "--resume", "auto")
    assert code == 0 and resumed["checkpoint"]["resumed_at_step"] == step
    assert resumed["loss"]["history"] == reference["loss"]["history"]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """An exception (or Ctrl-C) half-way through a write: the old file is untouched, no temporary is left."""
    path = tmp_path / "ckpt_step00000001.pt"
    save_atomically({"value": torch.arange(1000)}, path)
    before = path.read_bytes()

    def write_half_then_fail(payload, file):
        file.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_files, "_write_payload", write_half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        save_atomically({"value": torch.zeros(1000)}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    monkeypatch.undo()

    def refuse(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_files.os, "replace", refuse)
    with pytest.raises(CheckpointError, match="No space left"):
        save_atomically({"value": torch.zeros(1000)}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


KILL_IN_SECOND_WRITE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tinytransformer.training.checkpoint import files as checkpoint
writes = []
def write(payload, file):
    writes.append(1)
    if len(writes) == 2:              # the second checkpoint: write part of it, then die like a power cut
        file.write(b"PK\\x03\\x04" + bytes(5000))
        file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.torch.save(payload, file)
checkpoint._write_payload = write
from version1_pytorch_baseline.tiny_llama_v1 import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_inside_a_checkpoint_write_keeps_the_previous_one(reference, tmp_path):
    directory = tmp_path / "c"
    driver = KILL_IN_SECOND_WRITE.format(root=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", driver] + RUN + ["--save-every", "5", "--checkpoint-dir",
                                                                    str(directory)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL
    assert [s for s, _ in list_checkpoints(directory)] == [5]
    leftovers = list(directory.glob(".ckpt_step00000010.pt.tmp-*"))
    assert len(leftovers) == 1                                   # the half-written file never got the name
    read_checkpoint(checkpoint_path(directory, 5))    # the previous checkpoint is intact
    code, resumed = train(v1_main, tmp_path, "--save-every", "5", "--checkpoint-dir", directory, "--resume", "auto")
    assert code == 0 and resumed["checkpoint"]["resumed_at_step"] == 5
    assert resumed["loss"]["history"] == reference["loss"]["history"]
    assert not leftovers[0].exists()                             # cleaned up by the next successful write


# ----------------------------------------------------------------------------------------------------------
# Cross-version resume: the canonical layout carries weights AND optimizer state between versions
# ----------------------------------------------------------------------------------------------------------
def test_optimizer_state_round_trips_exactly_through_the_fused_layout():
    config = ModelConfig(vocab_size=50, hidden_dim=16, num_layers=2, num_heads=2, intermediate_size=24,
                         max_seq_len=16)
    v1, v2 = TinyLlamaV1(config), TinyLlamaV2(config)
    weights = init_canonical_weights(config, seed=3)
    v1.load_canonical(weights)
    opt1 = torch.optim.AdamW(v1.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (2, 9))
    for _ in range(2):
        v1(ids[:, :-1], ids[:, 1:])[1].backward()
        opt1.step()
    saved = optimizer_state(v1, opt1)
    v2.load_canonical(v1.canonical_state_dict())
    opt2 = torch.optim.AdamW(v2.parameters(), lr=1e-2)
    load_optimizer_state(v2, opt2, saved)
    again = optimizer_state(v2, opt2)
    for key in ("exp_avg", "exp_avg_sq"):
        for name, tensor in saved["per_parameter"][key].items():
            assert torch.equal(again["per_parameter"][key][name], tensor), (key, name)
    assert float(again["scalars"]["step"]) == 2
    for name, tensor in v1.canonical_state_dict().items():   # the borrowed parameters were put back
        assert torch.equal(v2.canonical_state_dict()[name], tensor)
    # Each parameter got its own step counter (a shared one would be incremented once per parameter).
    steps = [opt2.state[p]["step"] for p in v2.parameters()]
    assert len({id(s) for s in steps}) == len(steps)


def test_v1_checkpoint_resumes_in_v2_and_back(reference, tmp_path):
    v1_dir, v2_dir, back_dir = tmp_path / "v1", tmp_path / "v2", tmp_path / "back"
    code, _ = train(v1_main, tmp_path, "--save-every", "10", "--keep-last", "0", "--checkpoint-dir", v1_dir,
                    name="v1")
    assert code == 0
    v2_dir.mkdir()
    shutil.copy(checkpoint_path(v1_dir, 10), v2_dir)
    code, in_v2 = train(v2_main, tmp_path, "--save-every", "20", "--checkpoint-dir", v2_dir, "--resume", "auto",
                        name="v2")
    assert code == 0
    expected = reference["loss"]["history"]
    assert in_v2["loss"]["history"][:10] == expected[:10]
    # The next loss after the switch: same weights, same batch; only v2's fused kernels round differently.
    assert in_v2["loss"]["history"][10] == pytest.approx(expected[10], rel=1e-5)
    assert in_v2["loss"]["history"] == pytest.approx(expected, rel=1e-4)
    payload = read_checkpoint(checkpoint_path(v2_dir, 20))
    assert payload["version"] == "v2" and set(payload["model"]) == set(reference_model_names())
    back_dir.mkdir()
    shutil.copy(checkpoint_path(v2_dir, 20), back_dir)
    code, back = train(v1_main, tmp_path, "--checkpoint-dir", back_dir, "--resume", "auto", name="back")
    assert code == 0
    assert back["loss"]["history"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.interpreter
def test_v1_checkpoint_resumes_in_v4_and_back(tmp_path):
    """Version 4 (Triton kernels; the CPU runs them in Triton's interpreter, so only two steps)."""
    v4 = pytest.importorskip("version4_triton_ultra.tiny_llama_v4")
    short = TINY + ["--num-steps", "9", "--save-every", "3", "--keep-last", "0"]   # constant lr: any length
    out = tmp_path / "v1.json"
    assert v1_main(short + ["--checkpoint-dir", str(tmp_path / "v1"), "--output-json", str(out)]) == 0
    expected = json.loads(out.read_text())["loss"]["history"]
    for source, target, main, start in (("v1", "v4", v4.main, 6), ("v4", "back", v1_main, 8)):
        (tmp_path / target).mkdir()
        shutil.copy(checkpoint_path(tmp_path / source, start), tmp_path / target)
        out = tmp_path / f"{target}.json"
        stop = ["--num-steps", "8"] if target == "v4" else []
        assert main(short + stop + ["--checkpoint-dir", str(tmp_path / target), "--resume", "auto",
                                    "--output-json", str(out)]) == 0
        history = json.loads(out.read_text())["loss"]["history"]
        assert history[:6] == expected[:6]                                  # as written by version 1
        assert history == pytest.approx(expected[:len(history)], rel=1e-4)  # continued by another version


def reference_model_names():
    return canonical_shapes(ModelConfig(vocab_size=300, hidden_dim=32, num_layers=1, num_heads=2,
                                        intermediate_size=64))


# ----------------------------------------------------------------------------------------------------------
# Bad checkpoints: one line on stderr, exit code 2, nothing written
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    assert train(v1_main, tmp, "--num-steps", "6", "--save-every", "6", "--checkpoint-dir", tmp / "c")[0] == 0
    return checkpoint_path(tmp / "c", 6)


def flip_bytes(data: bytes, where: float) -> bytes:
    data = bytearray(data)
    start = int(len(data) * where)
    for i in range(start, start + 64):
        data[i] ^= 0xFF
    return bytes(data)


class Unsafe:   # a class torch.load(weights_only=True) must refuse to build
    pass


def make_bad(kind: str, good: Path, tmp: Path) -> str:
    path = tmp / f"{kind}.pt"
    data = good.read_bytes()
    payload = torch.load(good, weights_only=True)
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "empty file":
        path.write_bytes(b"")
    elif kind == "text file":
        path.write_text("step: 10\nloss: 1.0\n")
    elif kind == "flipped bits in the weights":
        path.write_bytes(flip_bytes(data, 0.5))
    elif kind == "plain state dict":
        torch.save(payload["model"], path)
    elif kind == "arbitrary object":
        torch.save({"x": Unsafe()}, path)
    elif kind == "another model config":
        return str(good)   # the run below asks for a wider model
    elif kind == "missing field":
        del payload["optimizer"]
        torch.save(payload, path)
    elif kind == "wrong history length":
        payload["history"]["train_loss"] = payload["history"]["train_loss"][:2]
        torch.save(payload, path)
    elif kind == "mis-shaped weight":
        payload["model"]["norm.weight"] = torch.ones(7)
        torch.save(payload, path)
    elif kind == "missing path":
        return str(tmp / "no" / "such.pt")
    elif kind == "a directory":
        return str(tmp)
    elif kind == "beyond --num-steps":
        payload["step"] = 10_000
        payload["history"]["train_loss"] = [1.0] * 10_000
        torch.save(payload, path)
    return str(path)


BAD_KINDS = ["truncated", "random bytes", "empty file", "text file", "flipped bits in the weights",
             "plain state dict", "arbitrary object", "another model config", "missing field",
             "wrong history length", "mis-shaped weight", "missing path", "a directory", "beyond --num-steps"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_checkpoint_is_one_line_exit_2_and_writes_nothing(kind, good_checkpoint, tmp_path, capsys):
    bad = make_bad(kind, good_checkpoint, tmp_path)
    directory = tmp_path / "c"
    directory.mkdir()
    shutil.copy(good_checkpoint, directory)   # must survive untouched
    before = snapshot(directory)
    out_json = tmp_path / "metrics.json"
    size = ["--hidden-dim", "64"] if kind == "another model config" else []
    code = v1_main(RUN + size + ["--resume", bad, "--save-every", "1", "--keep-last", "1", "--checkpoint-dir",
                                 str(directory), "--output-json", str(out_json), "--tensorboard-dir",
                                 str(tmp_path / "tb")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{kind}: exit code {code}, stderr {err!r}"
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, lines
    assert snapshot(directory) == before
    assert not out_json.exists() and not (tmp_path / "tb").exists()


def test_bad_checkpoint_in_a_real_process(good_checkpoint, tmp_path):
    bad = make_bad("truncated", good_checkpoint, tmp_path)
    result = subprocess.run([sys.executable, str(V1_SCRIPT)] + RUN + ["--resume", bad], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "truncated" in result.stderr and "Traceback" not in result.stderr


def test_resume_auto_skips_a_damaged_newest_checkpoint(good_checkpoint, tmp_path, capsys):
    directory = tmp_path / "c"
    directory.mkdir()
    shutil.copy(good_checkpoint, directory)
    damaged = checkpoint_path(directory, 9)
    damaged.write_bytes(good_checkpoint.read_bytes()[:1000])
    code = v1_main(RUN + ["--checkpoint-dir", str(directory), "--resume", "auto"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"skips {damaged}" in out and f"resumed     : from {checkpoint_path(directory, 6)}" in out


def test_resume_auto_with_only_damaged_checkpoints_is_exit_2(good_checkpoint, tmp_path, capsys):
    directory = tmp_path / "c"
    directory.mkdir()
    checkpoint_path(directory, 9).write_bytes(os.urandom(2000))
    before = snapshot(directory)
    code = v1_main(RUN + ["--checkpoint-dir", str(directory), "--resume", "auto", "--save-every", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "none of the 1 checkpoint" in err[0]
    assert snapshot(directory) == before

