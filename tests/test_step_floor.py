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
EVERY_COMMITTED = sorted(COMMITTED.parent.glob("*_step_floor.json"))
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
    # 7 products over S^2 / 2 pairs where the MFU formula counts the forward's 2 over all S^2 pairs (exact for an
    # even S, as here).
    assert step_work.attention_flops(config, batch, seq) * 4 == 7 * config.num_layers * attention


def test_memory_passes_count_each_input_and_output_once():
    """By hand for one size, tensor by tensor (T = 6 tokens, D = 4, F = 8, V = 10, two layers; bf16 = 2 bytes,
    float32 = 4): each pass's inputs read once and outputs written once."""
    config = ModelConfig(vocab_size=10, hidden_dim=4, num_layers=2, num_heads=2, intermediate_size=8)
    passes = step_work.memory_passes(config, batch=2, seq=3)
    td, tf, tv, vd = 6 * 4, 6 * 8, 6 * 10, 10 * 4
    bf16, f32 = 2, 4
    # norms: the embedding's norm, three inside the layers (after layer 0's attention, before and after layer
    # 1's attention), the final one; forward then backward
    first = (td * f32) + (td * f32 + td * bf16) + (td * bf16 + td * f32 + td * f32)
    inside = (td * f32 + td * bf16) + (td * f32 + td * bf16) + (td * bf16 + 2 * td * f32) + (td * f32 + td * bf16)
    final = (td * f32 + td * bf16) + td * bf16 + (td * bf16 + td * f32) + (td * f32 + td * bf16)
    assert passes["norms (add + RMSNorm)"] == first + 3 * inside + final
    swiglu_forward = 2 * tf * bf16 + tf * bf16
    swiglu_backward = (tf + 2 * tf) * bf16 + 2 * tf * bf16
    assert passes["SwiGLU"] == 2 * (swiglu_forward + swiglu_backward)
    assert passes["RoPE"] == 2 * (2 * td * bf16 + 2 * td * bf16)   # q and k in, q and k out, per layer
    assert step_work.rope_pass_bytes(config, 2, 3) == passes["RoPE"]
    assert passes["loss (softmax cross-entropy)"] == tv * bf16 + tv * bf16
    assert passes["embedding gradient"] == vd * f32 + td * f32 + td * f32
    with_copy, without_copy = step_work.parameter_counts(config)
    assert passes["AdamW"] == with_copy * (4 * f32 + 3 * f32 + bf16) + without_copy * (4 * f32 + 3 * f32)


def test_data_sheet_floor_is_the_work_over_the_peaks():
    ceilings = step_floor.data_sheet_ceilings("NVIDIA H100 80GB HBM3", ["small"])
    rows = {row["family"]: row["floor_ms"] for row in step_floor.floor_rows("small", ceilings)}
    config, batch, seq = step_floor.preset_problem("small")
    gemm_flops = sum(g.flops for g in step_work.step_gemms(config, batch, seq))
    assert rows["GEMMs"] == pytest.approx(gemm_flops / 989.4e9)
    assert rows["AdamW"] == pytest.approx(step_work.memory_passes(config, batch, seq)["AdamW"] / 3.35e9)


@pytest.mark.parametrize("path", EVERY_COMMITTED, ids=lambda path: path.name)
def test_committed_floors_follow_from_the_committed_ceilings(path):
    """Each committed file's floors are what this code makes of its ceilings: the file and the counts agree."""
    committed = json.loads(path.read_text())
    assert committed["environment"]["gpu"] and committed["command"].startswith("python benchmarks/step_floor.py")
    assert committed["note"], path.name
    presets = list(committed["floors"])
    ceilings = step_floor.ceilings_from_file(str(path), presets)
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
    (["--preset", "small", "--step-ms", "inf", "--gpu-name", "H100"], "positive"),
    (["--gpu-name", "Z80"], "no data-sheet peak"),
    (["--ceilings-json", "/no/such/file.json"], "cannot read it"),
    (["--ceilings-json", str(REPO / "pyproject.toml")], "cannot read it"),
    (["--gpu-name", "H100", "--output-json", "/dev/null/floor.json"], "--output-json"),
])
def test_bad_input_is_refused_in_one_line(flags, message):
    result = run(flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("step_floor.py: error:") and message in result.stderr, result.stderr


@pytest.mark.parametrize("spoil, message", [
    (lambda c: c.update(bandwidth_tbs=0), "bandwidth_tbs must be a positive number"),
    (lambda c: c.update(bandwidth_tbs=True), "bandwidth_tbs must be a positive number"),
    (lambda c: c.update(presets=[]), "not a file that step_floor.py"),
    (lambda c: c["presets"].update(large="fast"), "no ceilings for preset large"),
    (lambda c: c["presets"]["large"].update(gemm_us=[1, 2]), "no ceilings for preset large"),
    (lambda c: c["presets"]["large"]["gemm_us"].update({"o forward": "12"}), "o forward must be a positive"),
    (lambda c: c["presets"]["large"]["gemm_us"].update({"o forward": float("nan")}), "must be a positive"),
    (lambda c: c["presets"]["large"]["attention_us"].update({"sdpa cudnn_attention": -5}), "must be a positive"),
    (lambda c: c["presets"]["large"].update(attention_us={"sdpa flash_attention": None}), "no attention time"),
])
def test_a_spoilt_ceilings_file_is_refused_in_one_line(spoil, message, tmp_path):
    committed = json.loads(COMMITTED.read_text())
    spoil(committed["ceilings"])
    path = tmp_path / "spoilt.json"
    path.write_text(json.dumps(committed))
    result = run(["--preset", "large", "--ceilings-json", str(path)])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr


def test_a_ceilings_file_without_the_preset_is_refused(tmp_path):
    made = tmp_path / "small_only.json"
    assert run(["--preset", "small", "--gpu-name", "H100", "--output-json", str(made)]).returncode == 0
    result = run(["--preset", "large", "--ceilings-json", str(made)])
    assert result.returncode == 2 and "no ceilings for preset large" in result.stderr, result.stderr
