"""The exercises' helper scripts: batch-scaling table, bottleneck report, numerical validation, regression check.

    version1_pytorch_baseline/analyze_batch_scaling.py     version1_pytorch_baseline/analyze_bottlenecks.py
    benchmarks/validate_numerical_accuracy.py              benchmarks/performance_regression_check.py

CPU only and small: real (tiny) training runs where the scripts read what the training scripts write, synthetic
metrics and traces where a test needs numbers it can predict.
"""
import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest

from tinytransformer.equivalence import version_name
from version1_pytorch_baseline import analyze_batch_scaling as scaling
from version1_pytorch_baseline import analyze_bottlenecks as bottlenecks
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

from .trace_samples import build_gpu_trace

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_RUN = ["--device", "cpu", "--vocab-size", "64", "--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1",
            "--intermediate-size", "48", "--seq-len", "16", "--log-every", "100"]


def load_script(relative: str):
    """Import a script that is not inside a package (benchmarks/) as a module."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validate = load_script("benchmarks/validate_numerical_accuracy.py")
regression = load_script("benchmarks/performance_regression_check.py")


@pytest.fixture(scope="module")
def profiled_runs(tmp_path_factory):
    """Two tiny profiled v1 runs (batch 2 and 4), each with its metrics JSON inside its profile directory."""
    root = tmp_path_factory.mktemp("scaling")
    dirs = []
    for batch in (2, 4):
        directory = root / f"scaling_bs{batch}"
        code = v1_main(TINY_RUN + ["--batch-size", str(batch), "--num-steps", "8", "--enable-pytorch-profiler",
                                   "--profile-dir", str(directory), "--output-json", str(directory / "metrics.json")])
        assert code == 0
        dirs.append(directory)
    return dirs


def metrics_like(batch, step_ms, peak_mib=100.0, version="v1", seq=128):
    """The fields of a metrics JSON that the scripts read, with chosen numbers."""
    return {"schema_version": 1, "version": version, "title": "test", "variant": {},
            "model_config": {"vocab_size": 1000, "hidden_dim": 256, "num_layers": 4, "num_heads": 8,
                             "intermediate_size": 512, "max_seq_len": 128},
            "train_config": {"batch_size": batch, "seq_len": seq, "use_amp": False, "amp_dtype": "bfloat16",
                             "data": "markov"},
            "device": {"type": "cuda", "name": "Test GPU", "backend": "CUDA 12", "torch_version": "2.11",
                       "count": 1},
            "precision": "float32", "timing": {"median_ms": step_ms},
            "throughput": {"samples_per_s": batch / (step_ms / 1e3)},
            "memory": {"peak_allocated_mib": peak_mib}, "loss": {"final": 1.5}}


def write_json(path: Path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


# ----------------------------------------------------------------------------------------------------------
# analyze_batch_scaling.py
# ----------------------------------------------------------------------------------------------------------
def test_batch_scaling_reads_profile_directories_of_real_runs(profiled_runs, capsys):
    assert scaling.main(["--profile-dirs", *map(str, profiled_runs)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("v1 ")]
    assert [(row[1], row[2]) for row in rows] == [("2", "16"), ("4", "16")]
    assert all(float(row[4].replace(",", "")) > 0 for row in rows)   # samples/s
    assert "step_ms ~" in out   # two batch sizes: a line is fitted


def test_batch_scaling_falls_back_to_the_trace(profiled_runs, tmp_path):
    """Without a metrics JSON, batch and sequence come from the embedding's input shape in the trace."""
    trace = next(profiled_runs[1].glob("trace_*.json"))
    (tmp_path / trace.name).write_bytes(trace.read_bytes())
    row = scaling.run_from_directory(tmp_path)
    assert (row["version"], row["batch"], row["seq"], row["from_trace"]) == ("v1", 4, 16, True)
    assert row["step_ms"] > 0 and row["peak_mib"] is None


@pytest.mark.parametrize("fixed_ms, per_sample_ms, verdict", [
    (10.0, 0.05, "launch-bound"),    # 10 ms per step whatever the batch: launches dominate
    (0.2, 1.0, "work-bound"),        # the step grows in proportion to the batch
])
def test_batch_scaling_fits_fixed_and_per_sample_cost(tmp_path, capsys, fixed_ms, per_sample_ms, verdict):
    files = [write_json(tmp_path / f"b{b}.json", metrics_like(b, fixed_ms + per_sample_ms * b, 200.0 + 3.0 * b))
             for b in (4, 8, 16, 32)]
    assert scaling.main(["--metrics", *files]) == 0
    out = capsys.readouterr().out
    assert f"step_ms ~ {fixed_ms:.3f} + {per_sample_ms:.4f} x batch" in out
    assert verdict in out
    assert "peak_MiB ~ 200.0 + 3.00 x batch" in out
    assert "32.00x" not in out and "1.00x" in out   # speed-up relative to batch 4


def test_batch_scaling_says_when_there_is_nothing_to_fit(tmp_path, capsys):
    files = [write_json(tmp_path / f"run{i}.json", metrics_like(8, 12.0 + i)) for i in range(2)]
    assert scaling.main(["--metrics", *files]) == 0
    assert "every run has batch size 8" in capsys.readouterr().out


def test_batch_scaling_bad_input(tmp_path, capsys):
    assert scaling.main(["--profile-dirs", str(tmp_path)]) == 2
    assert "neither a metrics JSON nor a trace" in capsys.readouterr().err
    not_metrics = write_json(tmp_path / "x.json", {"hello": 1})
    assert scaling.main(["--metrics", not_metrics]) == 2
    with pytest.raises(SystemExit) as stop:
        scaling.main([])
    assert stop.value.code == 2


# ----------------------------------------------------------------------------------------------------------
# analyze_bottlenecks.py
# ----------------------------------------------------------------------------------------------------------
def test_bottlenecks_on_a_launch_bound_gpu_trace(tmp_path, capsys):
    trace = write_json(tmp_path / "trace_v1.json", build_gpu_trace())
    report, data = tmp_path / "out" / "bottlenecks.md", tmp_path / "targets.json"
    assert bottlenecks.main(["--profile-data", trace, "--output-report", str(report),
                             "--output-json", str(data)]) == 0
    text = report.read_text()
    assert "Launch-bound" in text and "GPU busy: 15%" in text
    targets = json.loads(data.read_text())["targets"]
    keys = [t["key"] for t in targets]
    # The synthetic trace: 148 us of kernels per 1000 us step; attention 75, backward 30, ffn 15 us per step.
    assert keys[0] == "launch"
    assert keys[1:4] == ["attention", "backward", "ffn"]
    assert [t["rank"] for t in targets] == list(range(1, len(targets) + 1))
    assert "softmax" in targets[1]["evidence"]    # the aten::_softmax clue
    assert "other" not in keys
    assert "## Top 10 GPU kernels" in text and text in capsys.readouterr().out


def test_bottlenecks_on_the_cpu_fixture_accepts_a_directory(tmp_path):
    (tmp_path / "trace_v1.json.gz").write_bytes((FIXTURES / "cpu_trace.json.gz").read_bytes())
    report = tmp_path / "report.md"
    assert bottlenecks.main(["--profile-data", str(tmp_path), "--output-report", str(report)]) == 0
    text = report.read_text()
    assert "CPU trace" in text and "launch overhead" not in text
    assert "GPU kernels" not in text.split("## Top")[-1]   # no kernel table on a CPU trace


def test_bottlenecks_min_share_filters_targets(tmp_path):
    trace = bottlenecks.load_trace(write_json(tmp_path / "t.json", build_gpu_trace()))
    numbers = bottlenecks.step_numbers(trace)
    assert [t["key"] for t in bottlenecks.prioritised_targets(trace, numbers, min_share=40)] == ["launch",
                                                                                                 "attention"]


def test_bottlenecks_bad_input(tmp_path, capsys):
    assert bottlenecks.main(["--profile-data", str(tmp_path / "missing.json")]) == 2
    assert "error" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# validate_numerical_accuracy.py
# ----------------------------------------------------------------------------------------------------------
SMALL_MODEL = ["--vocab-size", "101", "--hidden-dim", "64", "--num-layers", "2", "--num-heads", "4",
               "--intermediate-size", "96", "--batch-size", "2", "--seq-len", "37", "--device", "cpu"]


@pytest.mark.parametrize("text, name", [("v2", "v2"), ("V3", "v3"), ("4", "v4"),
                                        ("../version1_pytorch_baseline/tiny_llama_v1.py", "v1")])
def test_version_names(text, name):
    assert version_name(text) == name


def test_validate_v2_against_v1_passes(capsys):
    assert validate.main(["--baseline", "v1", "--optimized", "v2", *SMALL_MODEL]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "logits" in out and "loss" in out


def test_validate_fails_below_the_rounding_error(capsys):
    """v2 adds in another order: its errors are ~1e-7, not 0, so a 1e-12 tolerance must fail (exit 1)."""
    assert validate.main(["--optimized", "v2", "--tolerance", "1e-12", *SMALL_MODEL]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.interpreter
def test_validate_triton_version_in_the_interpreter_uses_a_small_model(capsys):
    assert validate.main(["--optimized", "../version3_triton/tiny_llama_v3.py", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "small model" in out and "PASS" in out


def test_validate_rows_flag_missing_and_nan_gradients():
    errors = {"logits": 1e-7, "loss": 0.0, "a.weight": None, "b.weight": math.inf, "c.weight": 1e-8}
    rows, passed = validate.result_rows(errors, tolerance=1e-4, show=1)
    verdicts = {name: verdict for name, _, verdict in rows}
    assert not passed
    assert verdicts["grad a.weight"] == "MISSING" and verdicts["grad b.weight"] == "FAIL"


def test_validate_bad_input(capsys):
    with pytest.raises(SystemExit) as stop:
        validate.main(["--optimized", "v7"])
    assert stop.value.code == 2
    assert validate.main(["--optimized", "v2", "--hidden-dim", "30", "--num-heads", "4", "--device", "cpu"]) == 2
    assert "must divide" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# performance_regression_check.py
# ----------------------------------------------------------------------------------------------------------
def test_regression_check_passes_and_fails_on_the_threshold(tmp_path, capsys):
    base = write_json(tmp_path / "base.json", metrics_like(8, 10.0))
    slower = write_json(tmp_path / "slower.json", metrics_like(8, 10.0 / 0.9))   # 10% fewer samples/s
    assert regression.main(["--baseline", base, "--current", slower]) == 1
    assert "REGRESSION: samples/s dropped by 10.0%" in capsys.readouterr().out
    assert regression.main(["--baseline", base, "--current", slower, "--max-drop-percent", "15"]) == 0
    assert "OK: speed-up 0.90x" in capsys.readouterr().out


def test_regression_check_min_speedup(tmp_path, capsys):
    base = write_json(tmp_path / "v1.json", metrics_like(8, 10.0))
    faster = write_json(tmp_path / "v2.json", metrics_like(8, 8.0, version="v2"))   # 1.25x
    assert regression.main(["--baseline", base, "--current", faster, "--min-speedup", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "versions v1 -> v2" in out and "NOTE" not in out
    assert regression.main(["--baseline", base, "--current", faster, "--min-speedup", "1.5"]) == 1
    assert "below the required 1.5x" in capsys.readouterr().out


def test_regression_check_lists_every_difference(tmp_path, capsys):
    base = metrics_like(8, 10.0)
    other = copy.deepcopy(base)
    other["train_config"]["batch_size"] = 32
    other["device"]["name"] = "Another GPU"
    other["precision"] = "bfloat16"
    other["model_config"]["hidden_dim"] = 512
    code = regression.main(["--baseline", write_json(tmp_path / "a.json", base),
                            "--current", write_json(tmp_path / "b.json", other)])
    out = capsys.readouterr().out
    assert code == 0   # same samples/s: not slower; the differences are reported, not failed
    for expected in ("batch_size: 8 -> 32", "device name: Test GPU -> Another GPU", "precision: float32 -> bfloat16",
                     "model hidden_dim: 256 -> 512"):
        assert expected in out


def test_regression_check_reads_a_real_metrics_json(tmp_path, capsys):
    path = tmp_path / "run.json"
    assert v1_main(TINY_RUN + ["--batch-size", "2", "--num-steps", "3", "--output-json", str(path)]) == 0
    capsys.readouterr()
    assert regression.main(["--baseline", str(path), "--current", str(path)]) == 0
    assert "OK: speed-up 1.00x" in capsys.readouterr().out


def test_regression_check_bad_input(tmp_path, capsys):
    good = write_json(tmp_path / "good.json", metrics_like(8, 10.0))
    assert regression.main(["--baseline", str(tmp_path / "missing.json"), "--current", good]) == 2
    assert regression.main(["--baseline", write_json(tmp_path / "bad.json", [1, 2]), "--current", good]) == 2
    assert "not a metrics JSON" in capsys.readouterr().err


def test_bottlenecks_on_the_committed_h100_trace(tmp_path):
    """A real version 1 trace from an H100: launch-bound, and the backward pass is the largest part."""
    report, data = tmp_path / "h100.md", tmp_path / "h100.json"
    assert bottlenecks.main(["--profile-data", str(FIXTURES / "gpu_trace_v1_h100.json.gz"), "--output-report",
                             str(report), "--output-json", str(data)]) == 0
    content = json.loads(data.read_text())
    assert content["step"]["gpu_busy"] < 0.1 and content["step"]["kernels_per_step"] > 500
    keys = [t["key"] for t in content["targets"]]
    assert keys[:3] == ["launch", "backward", "attention"]
    assert "Launch-bound" in report.read_text()
