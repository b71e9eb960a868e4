"""Edges of the training scripts' inputs: each bad input is one line on stderr (`prog: error: ...`), exit status 2,
no traceback, and the user's files are left as they were."""
import os
from pathlib import Path

import pytest
import torch

from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main
from version2_pytorch_fused.tiny_llama_v2 import main as v2_main

SIZES = ["--vocab-size", "64", "--hidden-dim", "32", "--num-layers", "1", "--num-heads", "2",
         "--intermediate-size", "64", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
TINY = SIZES + ["--max-seq-len", "16"]


def refused(capsys, main, *flags) -> str:
    """`main(flags)` exits with 2 and exactly one line on stderr, `...: error: ...`; returns that line. (A bad flag
    ends the process through argparse, SystemExit here.)"""
    try:
        code = main([*flags])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and ": error: " in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of a 2-step run."""
    directory = tmp_path_factory.mktemp("ck")
    assert v1_main(TINY + ["--num-steps", "2", "--save-every", "2", "--checkpoint-dir", str(directory),
                           "--log-every", "1"]) == 0
    return directory / "ckpt_step00000002.pt"


def test_config_setting_names_must_be_text(tmp_path, capsys):
    config = tmp_path / "k.yaml"
    config.write_text("1: 2\n")
    assert "setting names are text" in refused(capsys, v1_main, *TINY, "--config", str(config))


def test_config_nested_too_deeply_is_one_line(tmp_path, capsys):
    config = tmp_path / "deep.yaml"
    config.write_text("num_steps: " + "[" * 20000 + "]" * 20000 + "\n")
    assert "nested too deeply" in refused(capsys, v1_main, *TINY, "--config", str(config))


def test_inputs_must_be_regular_files_of_sane_size(tmp_path, capsys):
    assert "not a regular file" in refused(capsys, v1_main, *TINY, "--config", os.devnull)
    assert "not a regular file" in refused(capsys, v1_main, *SIZES, "--vocab-size", "256", "--data",
                                           f"text:{os.devnull}")
    huge = tmp_path / "huge.yaml"
    huge.write_text("# padding\n" * 500_000)   # 5 MB: no config file is this large
    assert "at most" in refused(capsys, v1_main, *TINY, "--config", str(huge))


def test_memory_estimate_counts_the_position_tables(tmp_path, capsys):
    config = tmp_path / "long.yaml"
    config.write_text("max_seq_len: 2000000000\n")
    assert "position tables" in refused(capsys, v1_main, *SIZES, "--config", str(config))


DAMAGES = {
    "numpy kind": lambda p: p["rng"]["numpy"].update(kind="FOO"),
    "numpy has_gauss missing": lambda p: p["rng"]["numpy"].pop("has_gauss"),
    "numpy pos out of range": lambda p: p["rng"]["numpy"].update(pos=10**6),
    "python version": lambda p: p["rng"]["python"].update(version=99),
    "python words too large": lambda p: p["rng"]["python"].update(internal=[2**40] * 625),
    "python gauss_next text": lambda p: p["rng"]["python"].update(gauss_next="x"),
    "torch state too short": lambda p: p["rng"].update(torch=torch.zeros(5, dtype=torch.uint8)),
    "torch state content": lambda p: p["rng"].update(torch=torch.zeros(5056, dtype=torch.uint8)),
    "optimizer step text": lambda p: p["optimizer"]["scalars"].update(step="abc"),
    "non-finite losses": lambda p: p["history"].update(train_loss=[float("nan")] * 2),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_restored_checkpoint_fields_are_validated(checkpoint, tmp_path, capsys, damage):
    payload = torch.load(checkpoint, weights_only=True)
    DAMAGES[damage](payload)
    damaged = tmp_path / "damaged.pt"
    torch.save(payload, damaged)
    line = refused(capsys, v1_main, *TINY, "--num-steps", "3", "--resume", str(damaged))
    assert f"{damaged} is not a valid checkpoint" in line


def test_lock_file_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "L" / ".run.lock").mkdir(parents=True)
    line = refused(capsys, v1_main, *TINY, "--num-steps", "1", "--save-every", "1", "--checkpoint-dir",
                   str(tmp_path / "L"))
    assert ".run.lock exists and is not a file" in line


def test_deepspeed_config_sections_are_type_checked(tmp_path, capsys):
    config = tmp_path / "z.json"
    config.write_text('{"zero_optimization": 5}')
    assert "zero_optimization" in refused(capsys, v1_main, *TINY, "--num-steps", "1", "--deepspeed-config",
                                          str(config))


def test_outputs_never_replace_inputs(checkpoint, tmp_path, capsys):
    resume = tmp_path / "X.pt"
    resume.write_bytes(checkpoint.read_bytes())
    config = tmp_path / "c.yaml"
    config.write_text("num_steps: 2\n")
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 8)
    before = {path: path.read_bytes() for path in (resume, config, text)}
    for flags in (["--num-steps", "3", "--resume", str(resume), "--output-json", str(resume)],
                  ["--config", str(config), "--output-json", str(config)],
                  ["--vocab-size", "256", "--num-steps", "2", "--data", f"text:{text}", "--output-json", str(text)]):
        assert "reads; write the output elsewhere" in refused(capsys, v1_main, *TINY, *flags)
    assert {path: path.read_bytes() for path in before} == before


def test_inputs_among_the_checkpoints_that_keep_last_deletes_are_refused(checkpoint, tmp_path, capsys):
    directory = tmp_path / "R"
    directory.mkdir()
    data = directory / "ckpt_step00000001.pt"   # read as text data, but named like a checkpoint of the directory
    data.write_bytes(checkpoint.read_bytes())
    # The run writes the checkpoints of steps 2 and 4: keeping the last 1 or 2 deletes step 1's file, 3 keeps it.
    flags = [*SIZES, "--max-seq-len", "16", "--vocab-size", "256", "--data", f"text:{data}", "--num-steps", "4",
             "--save-every", "2", "--checkpoint-dir", str(directory)]
    for keep in ("1", "2"):
        line = refused(capsys, v1_main, *flags, "--keep-last", keep)
        assert f"--keep-last {keep} deletes" in line and data.exists()
    assert v1_main([*flags, "--keep-last", "3"]) == 0 and data.exists()
    capsys.readouterr()


def test_outputs_of_one_run_are_distinct_files(tmp_path, capsys):
    checkpoints, profiles = tmp_path / "C", tmp_path / "P"
    line = refused(capsys, v1_main, *TINY, "--num-steps", "2", "--save-every", "1", "--checkpoint-dir",
                   str(checkpoints), "--output-json", str(checkpoints / "ckpt_step00000009.pt"))
    assert "checkpoint's name" in line
    line = refused(capsys, v1_main, *TINY, "--num-steps", "2", "--enable-pytorch-profiler", "--profile-dir",
                   str(profiles), "--output-json", str(profiles / "summary.md"))
    assert "also the file --output-json writes" in line
    assert not checkpoints.exists() and not profiles.exists()


def test_planned_checkpoint_path_that_is_a_directory_fails_before_training(tmp_path, capsys):
    (tmp_path / "D" / "ckpt_step00000002.pt").mkdir(parents=True)
    metrics = tmp_path / "D.json"
    line = refused(capsys, v1_main, *TINY, "--num-steps", "2", "--save-every", "2", "--checkpoint-dir",
                   str(tmp_path / "D"), "--output-json", str(metrics))
    assert "checkpoint of step 2" in line and not metrics.exists()


def test_absurd_counts_and_ignored_flags_are_refused(capsys):
    assert "--eval-batches" in refused(capsys, v1_main, *TINY, "--num-steps", "2", "--eval-every", "1",
                                       "--eval-batches", "1000000000")
    assert "at most" in refused(capsys, v2_main, *TINY, "--graph-warmup-steps", "99999999999")
    assert "--enable-torch-compile" in refused(capsys, v2_main, *TINY, "--torch-compile-mode", "max-autotune")
