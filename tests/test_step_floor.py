"""Tests of the step floor (benchmarks/step_work.py: the step's work counted from the sizes; step_floor.py: that
work over a GPU's ceilings). The counts are checked against the model's own parameters and the MFU formula's
FLOPs, the floors against the committed ceilings, and the command's refusals are one line each."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import step_floor, step_work
from tinytransformer import flops
from tinytransformer.config import ModelConfig
from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "benchmarks" / "results" / "kernel_time" / "h200_step_floor.json"
SIZES = [ModelConfig(), ModelConfig(vocab_size=300, hidden_dim=96, num_layers=3, num_heads=3, intermediate_size=160)]


@pytest.mark.parametrize("config", SIZES, ids=["seed", "odd"])
def test_parameters_with_and_without_a_16_bit_copy_are_the_models(config):
    with_copy, without_copy = step_work.parameter_counts(config)
    assert with_copy + without_copy == sum(p.numel() for p in TinyLlama(config).parameters())


@pytest.mark.parametrize("config", SIZES, ids=["seed", "odd"])
def test_gemm_flops_are_three_times_the_forward_products(config):
    """Forward, input gradient and weight gradient of every projection: 3x the MFU formula's forward products
    without attention (which step_work counts apart, over the causal half)."""
    batch, seq = 3, 40
    per_layer = flops.forward_flops_per_layer(config, batch, seq)
    attention = per_layer["attention_scores"] + per_layer["attention_values"]
    forward_products = flops.forward_flops(config, batch, seq) - config.num_layers * attention
    assert sum(g.flops for g in step_work.step_gemms(config, batch, seq)) == 3 * forward_products
    # 7 products over S^2 / 2 pairs where the MFU formula counts the forward's 2 over all S^2 pairs.
    assert step_work.attention_flops(config, batch, seq) * 4 == 7 * config.num_layers * attention


def test_memory_passes_count_each_input_and_output_once():
    """By hand for one size: tokens T = 6, D = 4, F = 8, V = 10, two layers."""
    config = ModelConfig(vocab_size=10, hidden_dim=4, num_layers=2, num_heads=2, intermediate_size=8)
    passes = step_work.memory_passes(config, batch=2, seq=3)
    tokens, d, f, v = 6, 4, 8, 10
    assert passes["SwiGLU"] == 2 * tokens * f * (6 + 10)
    assert passes["norms (add + RMSNorm)"] == tokens * d * (4 * 12 + 10 + 4 * 16 + 10)
    assert passes["loss (softmax cross-entropy)"] == tokens * v * 6
    with_copy, without_copy = step_work.parameter_counts(config)
    assert passes["AdamW"] == 30 * with_copy + 28 * without_copy


def test_data_sheet_floor_is_the_work_over_the_peaks():
    ceilings = step_floor.data_sheet_ceilings("NVIDIA H100 80GB HBM3", ["small"])
    rows = {row["family"]: row["floor_ms"] for row in step_floor.floor_rows("small", ceilings)}
    config, batch, seq = step_floor.preset_problem("small")
    gemm_flops = sum(g.flops for g in step_work.step_gemms(config, batch, seq))
    assert rows["GEMMs"] == pytest.approx(gemm_flops / 989.4e9)
    assert rows["AdamW"] == pytest.approx(step_work.memory_passes(config, batch, seq)["AdamW"] / 3.35e9)


def test_committed_floors_follow_from_the_committed_ceilings():
    """The committed file's floors are what this code makes of its ceilings: the file and the counts agree."""
    committed = json.loads(COMMITTED.read_text())
    assert committed["environment"]["gpu"] and committed["command"].startswith("python benchmarks/step_floor.py")
    presets = list(committed["floors"])
    ceilings = step_floor.ceilings_from_file(str(COMMITTED), presets)
    for name in presets:
        remade = sum(row["floor_ms"] for row in step_floor.floor_rows(name, ceilings))
        assert remade == pytest.approx(committed["floors"][name]["floor_ms"], rel=1e-9), name


def run(flags, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_floor.py"), *flags], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_the_table_from_committed_ceilings_names_each_family_and_the_target(tmp_path):
    result = run(["--preset", "large", "--ceilings-json", str(COMMITTED), "--step-ms", "87.06", "--target-ms",
                  "80.2", "--output-json", str(tmp_path / "floor.json")])
    assert result.returncode == 0, result.stderr
    for text in ("GEMMs", "attention", "AdamW", "floor: the sum", "measured step", "target"):
        assert text in result.stdout
    written = json.loads((tmp_path / "floor.json").read_text())
    assert list(written["floors"]) == ["large"] and written["ceilings"]["bandwidth_tbs"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--preset", "huge"], "invalid choice"),
    (["--preset", "small", "small"], "each preset once"),
    (["--preset", "small", "medium", "--target-ms", "3"], "one --preset"),
    (["--preset", "small", "--step-ms", "-1", "--gpu-name", "H100"], "positive"),
    (["--gpu-name", "Z80"], "no data-sheet peak"),
    (["--ceilings-json", "/no/such/file.json"], "cannot read it"),
    (["--ceilings-json", str(REPO / "pyproject.toml")], "cannot read it"),
    (["--gpu-name", "H100", "--output-json", "/dev/null/floor.json"], "--output-json"),
])
def test_bad_input_is_refused_in_one_line(flags, message):
    result = run(flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("step_floor.py: error:") and message in result.stderr, result.stderr


def test_a_ceilings_file_without_the_preset_is_refused(tmp_path):
    made = tmp_path / "small_only.json"
    assert run(["--preset", "small", "--gpu-name", "H100", "--output-json", str(made)]).returncode == 0
    result = run(["--preset", "large", "--ceilings-json", str(made)])
    assert result.returncode == 2 and "no ceilings for preset large" in result.stderr, result.stderr
