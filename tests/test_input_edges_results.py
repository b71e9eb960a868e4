"""Scripts that read other runs' files (metrics JSON, benchmark results, kernel reports, traces): a bad value in
such a file, or a bad flag, is ONE line on stderr and exit status 2, never a traceback; no input is overwritten."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))

# A training run's --output-json, reduced to what the comparison scripts read.
METRICS = {
    "version": "v1", "title": "PyTorch baseline", "variant": {}, "precision": "float32",
    "model_config": {"vocab_size": 64, "hidden_dim": 32},
    "train_config": {"batch_size": 2, "seq_len": 16, "use_amp": False, "amp_dtype": "bfloat16", "data": "markov"},
    "device": {"name": "x86_64", "backend": "CPU", "torch_version": "2", "count": 1},
    "timing": {"median_ms": 450.0}, "throughput": {"samples_per_s": 4.4}, "memory": {"peak_allocated_mib": None},
    "loss": {"final": 4.15},
}


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


def assert_one_line_error(result, prog: str = "") -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and ": error: " in lines[0] and lines[0].startswith(prog)


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def edited(data, edit):
    copy = json.loads(json.dumps(data))
    edit(copy)
    return copy


BAD_METRICS = [
    lambda d: d["throughput"].update(samples_per_s="fast"), lambda d: d.pop("timing"), lambda d: d.pop("memory"),
    lambda d: d.update(train_config=[1]), lambda d: d.update(model_config=[1]), lambda d: d.update(variant=["a"]),
    lambda d: d["loss"].update(final="x"), lambda d: d.update(device="gpu"),
    lambda d: d["throughput"].update(samples_per_s=-5),
]


@pytest.mark.parametrize("edit", BAD_METRICS)
def test_regression_check_refuses_bad_metrics(tmp_path, edit):
    good, bad = write(tmp_path / "good.json", METRICS), write(tmp_path / "bad.json", edited(METRICS, edit))
    assert_one_line_error(run(REPO / "benchmarks/performance_regression_check.py", "--baseline", good,
                              "--current", bad), "performance_regression_check.py")


@pytest.mark.parametrize("flags", [["--max-drop-percent", "nan"], ["--bogus"]])
def test_regression_check_flags_one_line(tmp_path, flags):
    good = write(tmp_path / "good.json", METRICS)
    assert_one_line_error(run(REPO / "benchmarks/performance_regression_check.py", "--baseline", good,
                              "--current", good, *flags))


@pytest.mark.parametrize("edit", [BAD_METRICS[0], BAD_METRICS[-1]])
def test_batch_scaling_refuses_bad_metrics(tmp_path, edit):
    good, bad = write(tmp_path / "good.json", METRICS), write(tmp_path / "bad.json", edited(METRICS, edit))
    assert_one_line_error(run(REPO / "version1_pytorch_baseline/analyze_batch_scaling.py", "--metrics", good, bad),
                          "analyze_batch_scaling.py")


def test_batch_scaling_bad_flag_one_line():
    assert_one_line_error(run(REPO / "version1_pytorch_baseline/analyze_batch_scaling.py", "--bogus"))


# -- make_readme_table.py: the results directory is a copy in tmp_path -------------------------------------------
def seed_results():
    return json.loads((RESULTS / "h100_seed_float32.json").read_text())


@pytest.mark.parametrize("make", [
    lambda d: (d / "zz.json").write_text('{"command": "x", "rows": ['),
    lambda d: write(d / "zz.json", edited(seed_results(), lambda r: r.pop("environment"))),
    lambda d: write(d / "zz.json", edited(seed_results(), lambda r: r.update(rows=[]))),
    lambda d: (d / "zz.json").mkdir(),
    lambda d: write(d / "scaling" / "zz.json", []),
])
def test_readme_table_refuses_bad_results(tmp_path, monkeypatch, capsys, make):
    import make_readme_table
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("kernels", "docs", "reruns"))
    make(results)
    monkeypatch.setattr(make_readme_table, "RESULTS_DIR", results)
    assert make_readme_table.main(["--check"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make_readme_table.py: error: ")


def test_readme_table_missing_markers_one_line(tmp_path, monkeypatch, capsys):
    import make_readme_table
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    monkeypatch.setattr(make_readme_table, "README", readme)
    assert make_readme_table.main(["--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("make_readme_table.py: error: README.md has no generated-table")
    assert readme.read_text() == "no markers here\n"


def test_readme_table_bad_flag_one_line():
    assert_one_line_error(run(REPO / "benchmarks/make_readme_table.py", "--bogus"), "make_readme_table.py")


# -- merge_presets.py and compare_versions.py --resume ------------------------------------------------------------
def preset_part(preset: str) -> dict:
    joined = json.loads((RESULTS / "h100_presets_bfloat16.json").read_text())
    part = {k: v for k, v in joined.items() if k not in ("runs", "parts")}
    part["rows"] = [dict(r, preset=preset) for r in joined["rows"] if r["preset"] == "tiny"]
    return part


@pytest.mark.parametrize("edit", [lambda p: p["rows"][0].update(preset=["small"]), lambda p: p.update(note=["x"]),
                                  lambda p: p.update(loss_agreement_problems=5)])
def test_merge_presets_refuses_bad_part(tmp_path, edit):
    tiny = write(tmp_path / "part_tiny.json", preset_part("tiny"))
    bad = write(tmp_path / "bad.json", edited(preset_part("small"), edit))
    result = run(REPO / "benchmarks/merge_presets.py", tiny, bad, "--output", tmp_path / "x.json")
    assert_one_line_error(result, "merge_presets.py")
    assert not (tmp_path / "x.json").exists()


def test_merge_presets_output_over_a_part_refused(tmp_path):
    tiny = write(tmp_path / "part_tiny.json", preset_part("tiny"))
    small = write(tmp_path / "part_small.json", preset_part("small"))
    before = small.read_text()
    assert_one_line_error(run(REPO / "benchmarks/merge_presets.py", tiny, small, "--output", small))
    assert small.read_text() == before


@pytest.mark.parametrize("edit", [
    lambda f: [], lambda f: f.update(rows=["abc"]), lambda f: f.update(runs="abc"),
    lambda f: f["rows"][0].pop("variant"), lambda f: f["rows"][0].update(samples_per_s="fast"),
    lambda f: f.update(resumed_by="abc"),
])
def test_compare_versions_resume_refuses_bad_file(tmp_path, edit):
    part = preset_part("tiny")
    results = edit(part)
    output = write(tmp_path / "F.json", part if results is None else results)
    before = output.read_text()
    result = run(REPO / "benchmarks/compare_versions.py", "--variants", "v1", "--num-steps", "2", "--warmup-steps",
                 "1", "--no-profile", "--device", "cpu", "--resume", "--output", output)
    assert_one_line_error(result, "compare_versions.py")
    assert output.read_text() == before


def test_compare_versions_two_outputs_in_one_file_refused(tmp_path):
    output = write(tmp_path / "F.json", preset_part("tiny"))
    before = output.read_text()
    result = run(REPO / "benchmarks/compare_versions.py", "--variants", "v1", "--num-steps", "2", "--warmup-steps",
                 "1", "--no-profile", "--device", "cpu", "--resume", "--output", output, "--plot",
                 tmp_path / "." / "F.json")
    assert_one_line_error(result, "compare_versions.py")
    assert "also the file --output writes" in result.stderr and output.read_text() == before


@pytest.mark.parametrize("batch_size", ["[2]", "0"])
def test_preset_values_checked_like_training_configs(tmp_path, monkeypatch, batch_size):
    from tinytransformer import config
    from tinytransformer.checks import ConfigError
    from training_runs import checked_preset
    (tmp_path / "bad.yaml").write_text(f"train:\n  batch_size: {batch_size}\n  seq_len: 16\n")
    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path)
    with pytest.raises(ConfigError, match="preset bad .*batch_size"):
        checked_preset("bad")


# -- kernel report, traces, bounded flags ---------------------------------------------------------------------
@pytest.mark.parametrize("edit", [lambda d: d["rows"][0].pop("status"), lambda d: d.update(rows=["x"]),
                                  lambda d: d["rows"][0].update(shared_bytes="x")])
def test_kernel_report_refuses_bad_report(tmp_path, edit):
    report = json.loads((RESULTS / "kernels" / "kernel_report.json").read_text())
    bad = write(tmp_path / "bad.json", edited(report, edit))
    assert_one_line_error(run("-m", "benchmarks.kernel_report", "--from-json", bad))


def test_kernel_report_markdown_not_text_refused_unchanged(tmp_path):
    markdown = tmp_path / "README.md"
    markdown.write_bytes(b"\xff\xfe\x00 not text")
    result = run("-m", "benchmarks.kernel_report", "--from-json", RESULTS / "kernels" / "kernel_report.json",
                 "--markdown", markdown)
    assert_one_line_error(result)
    assert markdown.read_bytes() == b"\xff\xfe\x00 not text"


UNUSABLE_TRACES = [{"traceEvents": [{"ph": "X"}]},
                   {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": "abc"},
                                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": "abc"}]}]


@pytest.mark.parametrize("trace", UNUSABLE_TRACES)
def test_trace_without_usable_events_is_one_line(tmp_path, trace):
    path = write(tmp_path / "T.json", trace)
    assert_one_line_error(run("-m", "tinytransformer.profiling.report_cli", path))
    assert_one_line_error(run(REPO / "version1_pytorch_baseline/analyze_bottlenecks.py", "--profile-data", path,
                              "--output-report", tmp_path / "r.md"))


def test_report_cli_bad_sort_key_one_line(tmp_path):
    path = write(tmp_path / "T.json", UNUSABLE_TRACES[0])
    assert_one_line_error(run("-m", "tinytransformer.profiling.report_cli", path, "--sort-by", "bogus"))


@pytest.mark.parametrize("flags", [["--output-json", "{trace}"], ["--output-json", "{report}"], ["--top", "-3"],
                                   ["--min-share", "nan"], ["--top", "abc"]])
def test_analyze_bottlenecks_flags(tmp_path, flags):
    trace = write(tmp_path / "T.json", UNUSABLE_TRACES[1])
    before = trace.read_text()
    flags = [flag.format(trace=trace, report=tmp_path / "r.md") for flag in flags]
    assert_one_line_error(run(REPO / "version1_pytorch_baseline/analyze_bottlenecks.py", "--profile-data", trace,
                              "--output-report", tmp_path / "r.md", *flags))
    assert trace.read_text() == before


@pytest.mark.parametrize("flags", [["--seed", "-5"], ["--show", "-5"]])
def test_numerical_accuracy_bounded_flags(flags):
    assert_one_line_error(run(REPO / "benchmarks/validate_numerical_accuracy.py", "--optimized", "v2", *flags))


# A flops_profile.json of run_deepspeed_flops.py (a CPU run without DeepSpeed's counts), reduced to what its
# summary prints.
FLOPS_PROFILE = {
    "kind": "flops_profile", "version": "v1", "title": "PyTorch baseline", "precision": "float32",
    "device": {"name": "x86_64"}, "batch_size": 2, "seq_len": 16,
    "deepspeed": {"available": False, "message": "DeepSpeed is not installed"},
    "analytic": {"per_layer": {"q_proj": 65536, "o_proj": 65536}, "per_layer_total": 131072, "num_layers": 1,
                 "output_head": 131072, "forward_flops": 262144, "training_flops": 786432,
                 "conventions": "matrix products only"},
    "comparison": {"deepspeed_over_analytic": None, "explanation": "why the two counts differ", "parts": []},
    "timing": {"median_ms": 450.0, "p10_ms": 440.0, "p90_ms": 460.0, "count": 20, "warmup_steps": 1},
    "throughput": {"samples_per_s": 4.4, "tokens_per_s": 70.4, "training_tflops_per_s": 5e-6, "mfu": None,
                   "peak_tflops": None},
    "intensity": None, "roofline": None,
}

BAD_FLOPS_PROFILES = [
    (lambda d: d.update(analytic="x"), "analytic must be a JSON object"),
    (lambda d: d.update(deepspeed=[1]), "deepspeed must be a JSON object"),
    (lambda d: d["throughput"].update(samples_per_s="fast"), "throughput.samples_per_s must be a number"),
    (lambda d: d["analytic"]["per_layer"].update(q_proj=-1), "analytic.per_layer.q_proj"),
    (lambda d: d["deepspeed"].update(available=True), "deepspeed.forward_flops is missing"),
    (lambda d: d["throughput"].update(mfu=0.4), "throughput.peak_tflops"),
]


def test_flops_summary_reads_every_field_it_prints_checked():
    from tinytransformer.config import ConfigError
    from tinytransformer.profiling.flops_summary import check_flops_profile, flops_summary
    assert check_flops_profile(FLOPS_PROFILE, "f.json") is FLOPS_PROFILE
    assert "no timed steps" not in "\n".join(flops_summary(FLOPS_PROFILE))
    untimed = edited(FLOPS_PROFILE, lambda d: d["timing"].update(median_ms=None))
    assert "no timed steps" in "\n".join(flops_summary(check_flops_profile(untimed, "f.json")))
    for edit, says in BAD_FLOPS_PROFILES:
        with pytest.raises(ConfigError, match=says):
            check_flops_profile(edited(FLOPS_PROFILE, edit), "f.json")


def test_analyze_results_refuses_a_damaged_flops_profile(tmp_path):
    bad = write(tmp_path / "flops_profile.json", edited(FLOPS_PROFILE, BAD_FLOPS_PROFILES[2][0]))
    result = run("run_deepspeed_flops.py", "--analyze-results", bad, cwd=REPO / "version1_pytorch_baseline")
    assert_one_line_error(result, "run_deepspeed_flops.py")
    assert "throughput.samples_per_s" in result.stderr
