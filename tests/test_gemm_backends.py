"""benchmarks/compare_gemm_backends.py: which GEMMs it times (the step's, in the step's layouts), its flags, its totals.

The timing itself needs an NVIDIA GPU (the gpu-marked test runs the command at the tiny preset); on the CPU the
command refuses in one line.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import compare_gemm_backends as cgb
from benchmarks.step_work import step_gemms
from tinytransformer.config import ModelConfig, preset_settings

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_gemm_backends.py"


def assert_refused_in_one_line(flags: list, message: str) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("compare_gemm_backends.py: error:") and message in result.stderr, result.stderr


def preset_gemms(name):
    model, train = preset_settings(name)
    config = ModelConfig(**model)
    return config, train, cgb.as_the_step_runs_them(config, train["batch_size"], train["seq_len"], torch.bfloat16)


@pytest.mark.parametrize("preset", ["tiny", "medium", "large"])
def test_the_step_gemms_in_the_step_layouts(preset):
    config, train, gemms = preset_gemms(preset)
    tokens = train["batch_size"] * train["seq_len"]
    by_name = {gemm.name: gemm for gemm in gemms}
    layer = [gemm for gemm in gemms if not gemm.name.startswith("head")]
    assert len(layer) == 12 and all(gemm.count == config.num_layers for gemm in layer)
    forward, input_gradient, weight_gradient = (by_name[f"gate_up {kind}"] for kind in
                                                ("forward", "input gradient", "weight gradient"))
    assert (forward.a_transposed, forward.b_transposed, forward.float32_output) == (False, True, False)   # x @ W.T
    assert (input_gradient.a_transposed, input_gradient.b_transposed) == (False, False)                  # dy @ W
    assert (weight_gradient.a_transposed, weight_gradient.float32_output) == (True, True)                # dy.T @ x
    assert (weight_gradient.m, weight_gradient.n, weight_gradient.k) == (2 * config.intermediate_size,
                                                                         config.hidden_dim, tokens)
    # The head, in the fused head's chunks: every token's row once, in each of its three GEMMs.
    head_forward = [gemm for gemm in gemms if gemm.name.startswith("head forward")]
    head_weight = [gemm for gemm in gemms if gemm.name.startswith("head weight gradient")]
    assert sum(gemm.m * gemm.count for gemm in head_forward) == tokens
    assert sum(gemm.k * gemm.count for gemm in head_weight) == tokens
    assert all(gemm.n == config.vocab_size for gemm in head_forward)
    # Nothing lost against the count of the step's work (benchmarks/step_work.py).
    flops = sum(2 * gemm.m * gemm.n * gemm.k * gemm.count for gemm in gemms)
    counted = step_gemms(config, train["batch_size"], train["seq_len"])
    assert flops == sum(2 * g.m * g.n * g.k * g.count for g in counted)


def test_head_chunks_cover_the_batch():
    assert cgb.head_chunks(8192, 32000, torch.bfloat16) == {4160: 1, 4032: 1}
    assert cgb.head_chunks(1024, 32000, torch.bfloat16) == {1024: 1}
    assert sum(rows * count for rows, count in cgb.head_chunks(20000, 32000, torch.bfloat16).items()) == 20000


def test_candidates_are_checked():
    assert cgb.candidate("128,256,64,8,3") == (128, 256, 64, 8, 3)
    assert cgb.candidate("128,128,64,4,5") == (128, 128, 64, 4, 5)
    for bad in ("128,256,64,8", "128,96,64,8,3", "8,256,64,8,3", "128,512,64,8,3", "128,128,64,32,3", "128,128,64,4,9",
                "128,128,64,4,0", "a,b,c,d,e"):
        with pytest.raises(ValueError):
            cgb.candidate(bad)


def test_rows_when_triton_cannot_run():
    """Where the TMA GEMM cannot run, its rows carry the reason and cuBLAS is still a row."""
    operands = object.__new__(cgb.Operands)          # no GPU needed: the rows only keep a reference to it
    operands.out_dtype = torch.bfloat16
    gemm = cgb.StepGemm("o forward", 64, 64, 64, 1, False, True, False)
    rows = cgb.rows_of(operands, gemm, cgb.DEFAULT_CANDIDATES, "no TMA here")
    assert set(rows) == {"cuBLAS", "Triton (table launch)"} and callable(rows["cuBLAS"])
    assert rows["Triton (table launch)"] == "no TMA here"


def test_a_candidate_that_is_the_table_launch_is_timed_once(monkeypatch):
    monkeypatch.setattr(cgb.tg, "interpreter_active", lambda: False)
    monkeypatch.setattr(cgb.tg, "multiprocessor_count", lambda device: 132)
    operands = object.__new__(cgb.Operands)
    operands.out_dtype = torch.bfloat16
    gemm = cgb.StepGemm("gate_up forward", 8192, 5632, 1024, 12, False, True, False)   # the table: 128 x 256
    rows = cgb.rows_of(operands, gemm, cgb.DEFAULT_CANDIDATES, None)
    assert "Triton (128, 256, 64, 8, 3)" not in rows and "Triton (128, 128, 64, 4, 4)" in rows
    assert len(rows) == 1 + len(cgb.DEFAULT_CANDIDATES)


def test_totals_weigh_each_gemm_by_its_count():
    gemms = [cgb.StepGemm("a", 1, 1, 1, 2, False, False, False), cgb.StepGemm("b", 1, 1, 1, 3, False, False, False)]
    ok = {"check": "ok"}
    measured = {"a": {"cuBLAS": {"us": 100.0, **ok}, "Triton (table launch)": {"us": 90.0, **ok}},
                "b": {"cuBLAS": {"us": 200.0, **ok}, "Triton (table launch)": {"us": 250.0, **ok},
                      "Triton (128, 128, 64, 4, 4)": {"us": 150.0, "check": "WRONG"}}}
    totals = cgb.step_totals(gemms, measured)
    assert totals == {"cuBLAS": 0.8, "Triton (table launch)": 0.93, "fastest row per GEMM": 0.78}
    assert cgb.fastest_triton(measured["b"]) == "Triton (table launch)"   # a WRONG row is never the fastest
    measured["b"]["Triton (table launch)"] = {"unavailable": "too much shared memory"}
    assert cgb.step_totals(gemms, measured)["Triton (table launch)"] is None
    measured["a"]["cuBLAS"]["check"] = "WRONG"   # timed, but wrong: in no total
    totals = cgb.step_totals(gemms, measured)
    assert totals["cuBLAS"] is None and totals["fastest row per GEMM"] == (90.0 * 2 + 200.0 * 3) / 1000


def test_a_gemm_without_a_cublas_time_is_reported_in_one_line(capsys):
    gemm = cgb.StepGemm("o weight gradient", 64, 64, 64, 1, True, False, True)
    cgb.print_gemm(gemm, {"cuBLAS": {"unavailable": "no float32-output GEMM"},
                          "Triton (table launch)": {"unavailable": "no TMA here"}})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "cuBLAS: no float32-output GEMM" in out


def test_refused_without_a_gpu_and_for_bad_flags(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run")
    assert_refused_in_one_line(["--preset", "tiny"], "needs a GPU")
    assert_refused_in_one_line(["--candidates", "3,4"], "--candidates")
    assert_refused_in_one_line(["--output-json", str(tmp_path)],
                               "--output-json")


@pytest.mark.gpu
def test_the_command_at_the_tiny_preset(tmp_path):
    """Every row of every GEMM of the tiny step passes its check, and the JSON holds them."""
    out = tmp_path / "gemms.json"
    assert cgb.main(["--preset", "tiny", "--candidates", "128,128,64,4,4", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["gemms"]) == len(preset_gemms("tiny")[2])
    for gemm in result["gemms"]:
        assert gemm["rows"]["cuBLAS"]["check"] == "ok"
        assert all(row.get("check", "ok") == "ok" for row in gemm["rows"].values())
    assert result["step_gemm_ms"]["cuBLAS"] > 0


def test_why_a_row_is_unavailable_in_one_line():
    """The reason both kernel comparisons print for a row that could not run (tuner_cli.why_unavailable)."""
    from tinytransformer.kernel_bench.tuner_cli import why_unavailable
    assert why_unavailable(RuntimeError("out of resource: shared memory\n  source excerpt")) == \
        "out of resource: shared memory"
    assert why_unavailable(RuntimeError("x" * 200)) == "x" * 120
    assert why_unavailable(RuntimeError("  ")) == "RuntimeError"
