"""run_deepspeed_flops.py (tinytransformer/profiling/deepspeed_flops_cli.py), on the CPU: DeepSpeed's count beside
the analytic one for versions 1 and 2, --analyze-results, a run without DeepSpeed, bad input (one line, exit 2);
and its pieces: arithmetic intensity (tinytransformer/flops.py), the roofline, the peak-bandwidth table.
DeepSpeed (only its FLOPS profiler, pure Python) is installed for the tests."""
import csv
import json
import sys
from pathlib import Path

import pytest

from tinytransformer.config import ModelConfig
from tinytransformer.device import peak_bandwidth_tbs
from tinytransformer.flops import forward_flops, forward_flops_per_layer, intensity_rows
from tinytransformer.profiling.deepspeed_flops import DEEPSPEED_MISSING
from tinytransformer.profiling.deepspeed_flops_cli import deepspeed_flops_main, roofline_result
from version1_pytorch_baseline.tiny_llama_v1 import SPEC as V1
from version2_pytorch_fused.tiny_llama_v2 import SPEC as V2

from .profiler_commands import FLOPS_FLAGS, SIZES, assert_one_line_error, run_main, write


def extra_deepspeed_flops(spec_name: str) -> int:
    """FLOPs DeepSpeed adds to the matrix products for these sizes, by its counting rules (0.14 to 0.19).

    It intercepts F.softmax and F.silu and counts one FLOP per element of their inputs; it does not see
    the Python * and + operators (RMSNorm, RoPE, SiLU * up, residuals) nor F.cross_entropy. Its matrix
    products (F.linear, torch.matmul, F.scaled_dot_product_attention) are counted as 2 FLOPs per multiply-add
    over the full S x S attention, exactly like tinytransformer/flops.py. So:
      v1: softmax over [B, H, S, S] + SiLU over [B, S, F] per layer;
      v2 (flash attention on): scaled_dot_product_attention hides the softmax, only SiLU remains.
    For the tiny test model this is 0.4% (v1) and 0.2% (v2) of the analytic count: a ratio just above 1.
    """
    s = SIZES
    silu = s["batch"] * s["seq"] * s["ffn"]
    softmax = s["batch"] * s["heads"] * s["seq"] * s["seq"] if spec_name == "v1" else 0
    return s["layers"] * (softmax + silu)


@pytest.fixture(scope="module")
def v1_flops(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("flops") / "flops_analysis"
    code, out, err = run_main(deepspeed_flops_main, V1, FLOPS_FLAGS + ["--output-dir", out_dir,
                                                                       "--computational-intensity",
                                                                       "--generate-roofline"])
    assert code == 0, err
    return out_dir, out


def analytic_forward_flops() -> int:
    s = SIZES
    config = ModelConfig(vocab_size=s["vocab"], hidden_dim=s["hidden"], num_layers=s["layers"],
                         num_heads=s["heads"], intermediate_size=s["ffn"])
    return forward_flops(config, s["batch"], s["seq"])


def check_flops_outputs(out_dir: Path, out: str, spec_name: str) -> dict:
    for name in ("flops_profile.json", "model_profile.txt", "mfu_analysis.csv"):
        assert (out_dir / name).is_file(), name
    result = json.loads((out_dir / "flops_profile.json").read_text())
    assert result["version"] == spec_name and result["device"]["type"] == "cpu"
    analytic = result["analytic"]["forward_flops"]
    assert analytic == analytic_forward_flops()
    assert result["analytic"]["training_flops"] == 3 * analytic
    ds = result["deepspeed"]
    assert ds["available"] and ds["params"] == 14_432
    # DeepSpeed counts the same matrix products plus a little element-wise work (see extra_deepspeed_flops)
    ratio = result["comparison"]["deepspeed_over_analytic"]
    assert 1.0 <= ratio < 1.05, ratio
    assert ds["forward_flops"] - analytic == extra_deepspeed_flops(spec_name)
    assert "DeepSpeed Flops Profiler" in (out_dir / "model_profile.txt").read_text()
    assert "layers.0.attention" in {row["module"] for row in ds["modules"]}
    # the CPU has no data-sheet peak: no MFU, and no invented number
    assert result["throughput"]["mfu"] is None and result["throughput"]["training_tflops_per_s"] > 0
    assert "MFU: unknown (no peak for this device)" in out
    assert "DeepSpeed / analytic = " in out and "--- (c) training throughput ---" in out
    assert result["timing"]["count"] == 2 and result["timing"]["warmup_steps"] == 1
    with open(out_dir / "mfu_analysis.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 1 and rows[0]["version"] == spec_name and rows[0]["mfu_percent"] == ""
    assert int(rows[0]["analytic_training_flops_per_step"]) == 3 * analytic
    return result


def test_v1_flops_run(v1_flops):
    out_dir, out = v1_flops
    result = check_flops_outputs(out_dir, out, "v1")
    # --computational-intensity: a row per matrix product of a layer, and no bound without a known ridge
    assert "--- (d) arithmetic intensity" in out and "attention fused (flash" in out
    assert [row["bound"] for row in result["intensity"]["rows"]] == ["-"] * 11
    # --generate-roofline on a CPU: the peaks are unknown, so it says why there is no plot
    assert result["roofline"]["path"] is None and "no roofline" in out


def test_v2_flops_run(tmp_path):
    """Also: the training script's profiler flags, which this command does not use, are named in a note, and no
    trace is written."""
    code, out, err = run_main(deepspeed_flops_main, V2, FLOPS_FLAGS + ["--output-dir", tmp_path,
                                                                       "--profile-dir", tmp_path / "traces",
                                                                       "--enable-pytorch-profiler"])
    assert code == 0, err
    result = check_flops_outputs(tmp_path, out, "v2")
    assert result["intensity"] is None and result["roofline"] is None   # only on request
    assert "note: --enable-pytorch-profiler, --profile-dir not used here" in out
    assert not any((tmp_path / "traces").glob("*.json"))


def test_analyze_results_round_trip(v1_flops):
    out_dir, run_out = v1_flops
    code, out, err = run_main(deepspeed_flops_main, V1, ["--analyze-results", out_dir / "flops_profile.json"])
    assert code == 0, err
    summary = out.strip()
    assert summary.startswith("=== FLOPs and MFU: v1") and summary in run_out
    # a bare file name is also looked for in --output-dir
    code, again, err = run_main(deepspeed_flops_main, V1, ["--analyze-results", "flops_profile.json",
                                                           "--output-dir", out_dir])
    assert code == 0 and again == out, err


def test_without_deepspeed_reports_analytic_count_and_mfu(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")] + ["deepspeed"]:
        monkeypatch.setitem(sys.modules, name, None)    # None in sys.modules: the import fails
    code, out, err = run_main(deepspeed_flops_main, V1, FLOPS_FLAGS + ["--output-dir", tmp_path])
    assert code == 0, err
    assert DEEPSPEED_MISSING in out
    assert "DeepSpeed is not installed: pip install deepspeed (the FLOPS profiler needs no compiled ops)" in out
    assert "--- (b) analytic count" in out and "MFU: unknown (no peak for this device)" in out
    assert not (tmp_path / "model_profile.txt").exists()
    result = json.loads((tmp_path / "flops_profile.json").read_text())
    assert result["deepspeed"]["available"] is False and result["comparison"]["deepspeed_over_analytic"] is None
    assert result["analytic"]["forward_flops"] == analytic_forward_flops()


FLOPS_BAD_INPUTS = {
    "missing results file": lambda t: ["--analyze-results", t / "nope.json"],
    "results not JSON": lambda t: ["--analyze-results", write(t / "x.json", bytes(range(256)))],
    "results of another tool": lambda t: ["--analyze-results", write(t / "m.json", b'{"version": "v1"}')],
    "results are a list": lambda t: ["--analyze-results", write(t / "l.json", b"[1, 2]")],
    "zero timing steps": lambda t: FLOPS_FLAGS[:-4] + ["--timing-steps", "0"],
    "--output-dir is a file": lambda t: FLOPS_FLAGS + ["--output-dir", write(t / "f", b"x")],
    "bad model size": lambda t: FLOPS_FLAGS + ["--hidden-dim", "0"],
}


@pytest.mark.parametrize("case", sorted(FLOPS_BAD_INPUTS))
def test_flops_bad_input_is_one_line_and_exit_2(case, tmp_path):
    code, _, err = run_main(deepspeed_flops_main, V1, FLOPS_BAD_INPUTS[case](tmp_path))
    assert_one_line_error(code, err)


def test_intensity_rows_match_the_analytic_flops_and_byte_model():
    config = ModelConfig(hidden_dim=256, num_heads=8, intermediate_size=512, vocab_size=1000)
    rows = {row["matmul"]: row for row in intensity_rows(config, 8, 128, 2, ridge=295.0)}
    for name, count in forward_flops_per_layer(config, 8, 128).items():
        assert rows[name]["flops"] == count, name
    q = rows["q_proj"]   # [1024 x 256] @ [256 x 256] in bf16: 2 bytes per element
    assert q["bytes"] == (1024 * 256 + 256 * 256 + 1024 * 256) * 2
    assert q["flops_per_byte"] == pytest.approx(2 * 1024 * 256 * 256 / q["bytes"])
    fused = rows["attention fused (flash: Q,K,V in, O out)"]
    assert fused["bytes"] == 4 * 8 * 128 * 256 * 2          # Q, K, V read, O written; no S x S matrix
    assert fused["flops_per_byte"] > rows["attention_scores"]["flops_per_byte"]
    assert all(row["bound"] == "memory" for row in rows.values())   # tiny matrices on an H100's bf16 ridge


def test_roofline_plot_or_the_reason_there_is_none(tmp_path):
    config = ModelConfig()
    result = {"version": "v1", "throughput": {"peak_tflops": 989.4, "peak_bandwidth_tbs": 3.35,
                                              "training_tflops_per_s": 12.0},
              "intensity": {"rows": intensity_rows(config, 8, 128, 2, ridge=989.4 / 3.35)}}
    outcome = roofline_result(tmp_path, result, "NVIDIA H100 80GB HBM3", "bfloat16")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert outcome == {"path": None,
                           "message": "no roofline: matplotlib is not installed (pip install matplotlib)"}
    else:
        assert outcome["path"] and Path(outcome["path"]).read_bytes()[:4] == b"\x89PNG"
    unknown = dict(result, throughput={**result["throughput"], "peak_bandwidth_tbs": None})
    assert roofline_result(tmp_path, unknown, "Some GPU", "float32")["message"].startswith("no roofline")


def test_peak_bandwidth_table():
    assert peak_bandwidth_tbs("NVIDIA H100 80GB HBM3") == 3.35
    assert peak_bandwidth_tbs("NVIDIA H100 PCIe") == 2.0
    assert peak_bandwidth_tbs("NVIDIA H200") == 4.8
    assert peak_bandwidth_tbs("NVIDIA A100-SXM4-80GB") == 2.0
    assert peak_bandwidth_tbs("AMD Instinct MI300X") == 5.3
    assert peak_bandwidth_tbs("AMD Instinct MI250X") == 3.2
    assert peak_bandwidth_tbs("AMD Instinct MI210") == 1.6
    assert peak_bandwidth_tbs("x86_64") is None
