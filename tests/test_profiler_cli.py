"""run_pytorch_profiler.py and run_deepspeed_flops.py (tinytransformer/profiler_cli.py), on the CPU.

The scripts' main functions run in-process on a one-layer model of width 32, so a whole profiled training
run takes a second or two. DeepSpeed (only its FLOPS profiler, pure Python) is installed for the tests.
"""
import contextlib
import csv
import io
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinytransformer import flops, reports
from tinytransformer.config import ModelConfig
from tinytransformer.device import peak_bandwidth_tbs
from tinytransformer.profiler_cli import (DEEPSPEED_MISSING, deepspeed_flops_main, intensity_rows,
                                          pytorch_profiler_main, roofline_result)
from version1_pytorch_baseline.tiny_llama_v1 import SPEC as V1
from version2_pytorch_fused.tiny_llama_v2 import SPEC as V2

REPO = Path(__file__).resolve().parent.parent
FIXTURE_TRACE = REPO / "tests" / "fixtures" / "cpu_trace.json.gz"
SIZES = dict(batch=2, seq=16, hidden=32, heads=2, layers=1, ffn=64, vocab=64)
MODEL_FLAGS = ["--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--hidden-dim", "32",
               "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64", "--vocab-size", "64"]
TRAIN_FLAGS = MODEL_FLAGS + ["--num-steps", "4"]
FLOPS_FLAGS = MODEL_FLAGS + ["--timing-steps", "2", "--warmup-steps", "1"]
PHASES = ("attention", "ffn", "rmsnorm", "rope", "output_head", "loss", "backward", "optimizer", "other")


def run_main(main, spec, argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one in-process run."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(spec, [str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}, stderr {err!r}"
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------
# run_pytorch_profiler.py
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v1_profile(tmp_path_factory):
    """One profiled v1 run shared by the tests that analyse its trace: (profile dir, stdout)."""
    profile_dir = tmp_path_factory.mktemp("v1") / "pytorch_profiles"
    code, out, err = run_main(pytorch_profiler_main, V1, TRAIN_FLAGS + ["--profile-dir", profile_dir, "--limit",
                                                                        "5", "--generate-report"])
    assert code == 0, err
    return profile_dir, out


def assert_cpu_tables(out: str, sort_key: str = "self_cpu_time"):
    assert "--- Time per phase" in out and f"--- Top operators by {sort_key} ---" in out
    assert "Operators per step (top-level aten ops" in out
    assert "Top GPU kernels" not in out          # a CPU trace has none
    phase_table = out.split("--- Time per phase")[1].split("--- Top operators")[0]
    for phase in PHASES:
        assert f"\n{phase} " in phase_table, phase


def test_v1_profiler_run_writes_traces_reports_and_prints_tables(v1_profile):
    profile_dir, out = v1_profile
    for name in ("trace_v1.json", "operators.csv", "kernels.csv", "phases.csv", "summary.md",
                 "profile_report_v1.md"):
        assert (profile_dir / name).is_file(), name
    assert list((profile_dir / "tensorboard").glob("*.pt.trace.json")), "no TensorBoard copy of the trace"
    assert_cpu_tables(out)
    # --limit 5: five operator rows under the table's two header lines
    operator_table = out.split("--- Top operators")[1].split("\n\n")[0].splitlines()
    assert len([line for line in operator_table if line.startswith("aten::")]) <= 5
    assert f"Chrome trace        : {profile_dir / 'trace_v1.json'}" in out
    assert f"TensorBoard traces  : {profile_dir / 'tensorboard'}" in out
    report = (profile_dir / "profile_report_v1.md").read_text()
    assert "# PyTorch profiler report: v1" in report and "--- Time per phase" in report
    with open(profile_dir / "phases.csv") as handle:
        assert [row["phase"] for row in csv.DictReader(handle)] == list(reports.PHASES)


def test_v2_profiler_run_and_memory_timeline_line(tmp_path):
    profile_dir = tmp_path / "profiles"
    code, out, err = run_main(pytorch_profiler_main, V2, TRAIN_FLAGS + ["--profile-dir", profile_dir,
                                                                        "--profile-memory"])
    assert code == 0, err
    assert (profile_dir / "trace_v2.json").is_file() and (profile_dir / "summary.md").is_file()
    assert "=== TinyLlama v2" in out          # the shared trainer ran the version's own model
    assert_cpu_tables(out)
    assert "Memory timeline     : " in out     # a path, or why the experimental exporter gave none


def test_analyze_existing_trace_of_a_run(v1_profile, tmp_path):
    profile_dir, run_out = v1_profile
    code, out, err = run_main(pytorch_profiler_main, V1, ["--analyze-existing", profile_dir / "trace_v1.json",
                                                          "--profile-dir", tmp_path, "--limit", "5"])
    assert code == 0, err
    assert_cpu_tables(out)
    for name in ("operators.csv", "kernels.csv", "phases.csv", "summary.md"):
        assert (tmp_path / name).is_file()
    # the same trace gives the same tables as the run printed
    assert out.split("--- Time per phase")[1].split("--- Files")[0] in run_out


def test_analyze_existing_fixture_trace_and_count_sort(tmp_path):
    code, out, err = run_main(pytorch_profiler_main, V1, ["--analyze-existing", FIXTURE_TRACE, "--profile-dir",
                                                          tmp_path, "--sort-by", "count", "--generate-report"])
    assert code == 0, err
    assert "Profiled steps: 2" in out
    assert "Operators per step (top-level aten ops; a CPU trace has no GPU kernels to count): 271.0" in out
    assert_cpu_tables(out, sort_key="count")
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "profile_report_v1.md").is_file()


def test_analyze_existing_writes_next_to_the_trace_by_default(tmp_path):
    trace = tmp_path / "copy.json.gz"
    trace.write_bytes(FIXTURE_TRACE.read_bytes())
    code, _, err = run_main(pytorch_profiler_main, V1, ["--analyze-existing", trace])
    assert code == 0, err
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "operators.csv").is_file()


def test_analyze_existing_gpu_trace_prints_kernel_tables(tmp_path):
    from tests.test_reports import build_gpu_trace   # the synthetic GPU trace of the reports tests
    trace = tmp_path / "trace_gpu.json"
    trace.write_text(json.dumps(build_gpu_trace()))
    code, out, err = run_main(pytorch_profiler_main, V1, ["--analyze-existing", trace, "--profile-dir",
                                                          tmp_path / "reports"])
    assert code == 0, err
    assert "GPU kernels per step: " in out and "--- Top GPU kernels by total time ---" in out
    assert "gemm" in out and "--- Top operators by self_device_time ---" in out


def test_analyze_existing_directory_and_glob_forms(v1_profile, tmp_path):
    profile_dir, _ = v1_profile
    trace = profile_dir / "trace_v1.json"
    forms = {
        "directory": str(profile_dir),
        "matching glob": str(profile_dir / "trace_*.json"),
        "glob matching nothing, traces beside it": str(profile_dir / "profile_*.json"),
    }
    for form, argument in forms.items():
        code, out, err = run_main(pytorch_profiler_main, V1, ["--analyze-existing", argument,
                                                              "--profile-dir", tmp_path / "r"])
        assert code == 0, f"{form}: {err}"
        assert f"Trace: {trace}" in out, form


def test_directory_form_prefers_the_newest_trace(tmp_path):
    older, newer = tmp_path / "trace_old.json.gz", tmp_path / "trace_new.json.gz"
    for path in (older, newer):
        path.write_bytes(FIXTURE_TRACE.read_bytes())
    past = time.time() - 100
    os.utime(older, (past, past))
    code, out, err = run_main(pytorch_profiler_main, V1, ["--analyze-existing", tmp_path,
                                                          "--profile-dir", tmp_path / "r"])
    assert code == 0, err
    assert f"Trace: {newer}" in out


PROFILER_BAD_INPUTS = {
    "missing trace": lambda t: ["--analyze-existing", t / "nope.json"],
    "not JSON": lambda t: ["--analyze-existing", write(t / "junk.json", bytes(range(256)))],
    "JSON but not a trace": lambda t: ["--analyze-existing", write(t / "other.json", b'{"a": 1}')],
    "empty directory": lambda t: ["--analyze-existing", mkdir(t / "empty")],
    "glob matching nothing": lambda t: ["--analyze-existing", str(mkdir(t / "empty") / "x_*.json")],
    "negative --limit": lambda t: ["--analyze-existing", FIXTURE_TRACE, "--limit", "-1"],
    "unknown sort key": lambda t: ["--analyze-existing", FIXTURE_TRACE, "--sort-by", "speed"],
    "--profile-dir is a file": lambda t: TRAIN_FLAGS + ["--profile-dir", write(t / "f", b"x")],
    "bad model size": lambda t: TRAIN_FLAGS + ["--num-heads", "7"],
    "unknown flag": lambda t: ["--frobnicate"],
}


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def mkdir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


@pytest.mark.parametrize("case", sorted(PROFILER_BAD_INPUTS))
def test_profiler_bad_input_is_one_line_and_exit_2(case, tmp_path):
    code, _, err = run_main(pytorch_profiler_main, V1, PROFILER_BAD_INPUTS[case](tmp_path))
    assert_one_line_error(code, err)


# ------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py
# ------------------------------------------------------------------------------------------------
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
    return flops.forward_flops(config, s["batch"], s["seq"])


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
    code, out, err = run_main(deepspeed_flops_main, V2, FLOPS_FLAGS + ["--output-dir", tmp_path])
    assert code == 0, err
    result = check_flops_outputs(tmp_path, out, "v2")
    assert result["intensity"] is None and result["roofline"] is None   # only on request


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


# ------------------------------------------------------------------------------------------------
# Pieces: intensity, roofline, bandwidth table, the thin scripts
# ------------------------------------------------------------------------------------------------
def test_intensity_rows_match_the_analytic_flops_and_byte_model():
    config = ModelConfig(hidden_dim=256, num_heads=8, intermediate_size=512, vocab_size=1000)
    rows = {row["matmul"]: row for row in intensity_rows(config, 8, 128, 2, ridge=295.0)}
    for name, count in flops.forward_flops_per_layer(config, 8, 128).items():
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


@pytest.mark.parametrize("version_dir, spec_name", [("version1_pytorch_baseline", "v1"),
                                                    ("version2_pytorch_fused", "v2")])
@pytest.mark.parametrize("script", ["run_pytorch_profiler.py", "run_deepspeed_flops.py"])
def test_thin_scripts_load_their_version(version_dir, spec_name, script):
    namespace = runpy.run_path(str(REPO / version_dir / script), run_name="imported")
    assert namespace["SPEC"].name == spec_name


def test_script_runs_from_its_own_directory(tmp_path):
    """The script as a user starts it: python run_pytorch_profiler.py ... from the version directory."""
    result = subprocess.run([sys.executable, "run_pytorch_profiler.py", "--analyze-existing", str(FIXTURE_TRACE),
                             "--profile-dir", str(tmp_path), "--limit", "3"],
                            cwd=REPO / "version2_pytorch_fused", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Profiled steps: 2" in result.stdout


def test_profile_range_opens_a_record_function_range_only_while_the_profiler_records(monkeypatch):
    import torch
    from torch.profiler import profile

    from tinytransformer import profiling

    with profile() as prof:
        with profiling.profile_range("attention"):
            torch.ones(4).add_(1)
    assert "attention" in [event.name for event in prof.events()]

    def must_not_open(name):
        raise AssertionError(f"record_function({name!r}) opened with no profiler recording")
    monkeypatch.setattr(profiling, "record_function", must_not_open)
    with profiling.profile_range("attention"):
        torch.ones(4).add_(1)


def test_profile_range_leaves_torch_compile_one_graph(graph_counting_backend):
    """Inside torch.compile the range must be traceable: an untraceable call would make torch.compile give up
    on the function (a --enable-torch-compile run would silently run eager, launch by launch)."""
    import torch

    from tinytransformer.profiling import profile_range

    counting_backend, graphs = graph_counting_backend

    def two_ranges(x):
        with profile_range("attention"):
            x = x * 2
        with profile_range("ffn"):
            x = x + 1
        return x.sin()

    compiled = torch.compile(two_ranges, backend=counting_backend)
    x = torch.randn(4)
    assert torch.allclose(compiled(x), two_ranges(x))
    assert len(graphs) == 1
