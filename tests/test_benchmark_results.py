"""The README's result table is generated from the committed benchmark JSON, and matches it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_matches_committed_results():
    result = subprocess.run([sys.executable, "benchmarks/make_readme_table.py", "--check"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_results_record_machine_and_command():
    for path in (REPO_ROOT / "benchmarks" / "results").glob("*.json"):
        results = json.loads(path.read_text())
        assert measuring_commands(results), path.name
        assert all(command.startswith("python benchmarks/compare_versions.py")
                   for command in measuring_commands(results)), path.name
        assert results["environment"]["torch"], path.name
        assert results["environment"].get("gpu") or results["environment"].get("platform"), path.name
        assert all("samples_per_s" in row or "error" in row for row in results["rows"]), path.name


def measuring_commands(results):
    """The commands that measured a results file: its own, or each part's when merge_presets.py joined it."""
    if results["command"].startswith("python benchmarks/merge_presets.py"):
        return [part["command"] for part in results["parts"]]
    return [results["command"]]


def test_committed_scaling_results_record_machine_and_command():
    for path in (REPO_ROOT / "benchmarks" / "results" / "scaling").glob("*.json"):
        results = json.loads(path.read_text())
        assert results["command"].startswith("python benchmarks/scaling.py"), path.name
        assert results["environment"].get("gpu") and results["environment"].get("gpus_visible"), path.name
        assert all("samples_per_s" in row or "error" in row for row in results["rows"]), path.name


def test_scaling_table_says_how_each_row_averaged_its_gradients(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from scaling_table import scaling_table
    env = {"gpu": "NVIDIA H100 80GB HBM3", "gpus_visible": 2, "torch": "2.x"}
    figures = {"global_batch_size": 16, "samples_per_s": 100.0, "median_step_ms": 10.0, "speedup": 1.0,
               "efficiency": 1.0, "mfu": 0.4, "peak_memory_mib_per_gpu": 1000.0}
    files = {
        "a.json": {"engine": "ddp", "zero_stage": 0, "extra_flags": ["--enable-torch-compile"], "rows": [
            {"version": "v2", "preset": "large", "gpus": 2, "launcher": "torchrun", "gradients_averaged_by": "ddp",
             "repeats_samples_per_s": [99.0, 100.0, 101.0], **figures},
            {"version": "v4", "preset": "medium", "gpus": 1, "launcher": "none", **figures}]},
        "b.json": {"engine": "deepspeed", "zero_stage": 2, "extra_flags": [], "rows": [
            {"version": "v1", "preset": "medium", "gpus": 2, "launcher": "torchrun", "error": "exit 1"},
            {"version": "v4", "preset": "medium", "gpus": 2, "launcher": "torchrun", "gradients_averaged_by": "step",
             **figures}]},
    }
    for name, results in files.items():
        (tmp_path / name).write_text(json.dumps({"environment": env, **results}))
    lines = scaling_table(tmp_path).splitlines()[2:]
    assert [line.split(" | ")[0] for line in lines] == [   # medium before large
        "| v1, DeepSpeed ZeRO-2", "| v4 + torch.compile, one process, nothing to average", "| v4, DeepSpeed ZeRO-2",
        "| v2 + torch.compile, DDP"]
    assert lines[0].endswith("| failed: exit 1 |")
    assert "| 2 x H100 | median of 3 | `a.json` |" in lines[3]
    assert "| 1 (no torchrun) |" in lines[1]


def test_scaling_table_names_bfloat16_gradient_sums(tmp_path):
    """A run with --grad-reduce-dtype bfloat16 passed through is a row of its own kind, never mistaken for one
    with the exact float32 sums."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from scaling_table import flag_value, what_ran
    row = {"version": "v4", "launcher": "torchrun", "gradients_averaged_by": "step"}
    for flags, expected in [(["--grad-reduce-dtype", "bfloat16"], "v4, all-reduce in its graph, summed in bfloat16"),
                            (["--grad-reduce-dtype=bfloat16"], "v4, all-reduce in its graph, summed in bfloat16"),
                            (["--grad-reduce-dtype", "float32"], "v4, all-reduce in its graph"),
                            ([], "v4, all-reduce in its graph")]:
        assert what_ran({"engine": "ddp", "extra_flags": flags}, row) == expected, flags
    assert flag_value(["--grad-reduce-dtype"], "--grad-reduce-dtype") is None   # a flag without its value


def test_results_kept_beside_the_tables_record_machine_and_command():
    """Reruns and ablations in benchmarks/results/<folder>/ (not README tables) name their machine, command and
    the conditions they ran in."""
    folders = [REPO_ROOT / "benchmarks" / "results" / name for name in ("reruns", "ablation")]
    paths = [path for folder in folders for path in folder.glob("*.json")]
    assert paths
    for path in paths:
        results = json.loads(path.read_text())
        assert "python " in results["command"] and results["environment"]["gpu"], path.name
        assert results["note"] and all("samples_per_s" in row for row in results["rows"]), path.name


def test_a_b_runs_and_profiles_record_machine_commands_and_method():
    """The A/B pairs (benchmarks/results/ab/) keep every run with the command of each setting; the one-off
    profiles (benchmarks/results/host_time/) say how they measured what they hold."""
    results_dir = REPO_ROOT / "benchmarks" / "results"
    for path in (results_dir / "ab").glob("*.json"):
        results = json.loads(path.read_text())
        assert results["environment"]["gpu"] and results["note"], path.name
        assert all(command.startswith("python ") for command in results["commands"].values()), path.name
        for run in results["runs"]:
            assert run["p10_step_ms"] <= run["median_step_ms"] <= run["p90_step_ms"], (path.name, run)
    for path in (results_dir / "host_time").glob("*.json"):
        results = json.loads(path.read_text())
        assert results["environment"]["gpu"] and results["method"] and results["results"], path.name


def test_compare_versions_runs_on_cpu_and_checks_agreement(tmp_path):
    out = tmp_path / "r.json"
    command = [sys.executable, "benchmarks/compare_versions.py", "--variants", "v1,v2", "--num-steps", "3",
               "--warmup-steps", "1", "--device", "cpu", "--no-profile", "--output", str(out), "--",
               "--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
               "--vocab-size", "300"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["v1", "v2"]
    assert [r["timed_steps"] for r in rows] == [2, 2]   # 3 steps, 1 of warm-up, no profiled window
    assert rows[0]["first_loss"] == rows[1]["first_loss"] or abs(rows[0]["first_loss"] - rows[1]["first_loss"]) < 1e-4
    assert "loss agreement with v1: ok" in result.stdout


TINY_MODEL = ["--", "--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
              "--vocab-size", "300"]


def compare(*flags, timeout=300):
    command = [sys.executable, "benchmarks/compare_versions.py", "--num-steps", "3", "--warmup-steps", "1",
               "--device", "cpu", "--no-profile", *flags]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def test_resume_runs_only_what_is_missing(tmp_path):
    out = tmp_path / "r.json"
    first = compare("--variants", "v1", "--output", str(out), *TINY_MODEL)
    assert first.returncode == 0, first.stdout + first.stderr
    v1_row = json.loads(out.read_text())["rows"][0]

    resumed = compare("--variants", "v1,v2", "--output", str(out), "--resume", *TINY_MODEL)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "1 run(s) kept" in resumed.stdout
    results = json.loads(out.read_text())
    assert [r["variant"] for r in results["rows"]] == ["v1", "v2"]
    assert results["rows"][0]["wall_s"] == v1_row["wall_s"]            # kept, not run again
    assert "--resume" in results["resumed_by"][0] and "--resume" not in results["command"]
    # Every run got no cuBLAS workspace (the default), unless the environment chose one: the file says which.
    assert results["cublas_workspace"] == "none"
    assert results["cublas_workspace_config"] == os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":0:0")


def test_resume_refuses_a_file_measured_differently(tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"command": "python benchmarks/compare_versions.py", "dtype": "bfloat16",
                               "num_steps": 3, "warmup_steps": 1, "rows": []}))
    result = compare("--variants", "v1", "--output", str(out), "--resume", *TINY_MODEL)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "dtype (bfloat16 there, float32 here)" in result.stderr
    # A file from before --cublas-workspace was measured with cuBLAS's own workspace: not continued without one.
    out.write_text(json.dumps({"command": "python benchmarks/compare_versions.py", "dtype": "float32",
                               "num_steps": 3, "warmup_steps": 1, "rows": []}))
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:   # one exported here would be what "none" gives every run
        result = compare("--variants", "v1", "--output", str(out), "--resume", *TINY_MODEL)
        assert result.returncode == 2 and "cublas_workspace_config (None there, :0:0 here)" in result.stderr
    # Runs with the profiled window were timed over fewer steps: not continued without it, nor the other way.
    out.write_text(json.dumps({"command": "python benchmarks/compare_versions.py --no-profile", "dtype": "float32",
                               "num_steps": 3, "warmup_steps": 1, "rows": [], "profile": True}))
    result = compare("--variants", "v1", "--output", str(out), "--resume", *TINY_MODEL)
    assert result.returncode == 2 and "profile (True there, False here)" in result.stderr


def test_repeats_run_in_rounds_and_report_the_median_run(tmp_path):
    out = tmp_path / "r.json"
    result = compare("--variants", "v1,v2", "--repeats", "2", "--output", str(out), *TINY_MODEL)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    # Interleaved: round 1 runs v1 then v2, round 2 again.
    assert [(r["variant"], r["repeat"]) for r in results["runs"]] == [("v1", 0), ("v2", 0), ("v1", 1), ("v2", 1)]
    assert [r["variant"] for r in results["rows"]] == ["v1", "v2"]
    for row in results["rows"]:
        runs = [r for r in results["runs"] if r["variant"] == row["variant"]]
        assert row["repeats_samples_per_s"] == [r["samples_per_s"] for r in runs]
        assert row["samples_per_s"] == min(r["samples_per_s"] for r in runs)   # two runs: the slower middle
    assert "the median of 2 runs" in result.stdout


def test_median_run_of_three_and_a_failed_repeat():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from comparison_rows import median_runs
    def run(variant, repeat, speed=None, error=None):
        row = {"variant": variant, "batch_size": 8, "seq_len": 128, "repeat": repeat}
        row.update({"error": error} if error else {"samples_per_s": speed, "median_step_ms": 1000 / speed})
        return row
    runs = [run("v1", 0, 300.0), run("v3", 0, 500.0), run("v1", 1, 100.0), run("v3", 1, error="boom"),
            run("v1", 2, 200.0), run("v3", 2, 450.0)]
    rows = median_runs(runs)
    v1, v3 = rows
    assert v1["samples_per_s"] == 200.0 and v1["median_step_ms"] == 5.0   # the whole median run, consistent
    assert v1["repeats_samples_per_s"] == [300.0, 100.0, 200.0] and "repeat" not in v1
    assert v3["error"] == "boom" and "repeat" not in v3   # one failure in three: the variant is not measured
    assert all("repeat" in r for r in runs), "the list of runs must stay as it was"


def test_table_headers_count_the_steps_each_median_was_taken_over():
    """The steps after warm-up less the profiled window, which a run does not time: what the rows recorded, or,
    in files from before they recorded it, what their settings give."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from make_readme_table import timed_steps
    profiled = {"command": "python benchmarks/compare_versions.py --num-steps 200 --warmup-steps 30",
                "num_steps": 200, "warmup_steps": 30, "rows": [{"variant": "v1"}, {"variant": "v4"}]}
    assert timed_steps(profiled) == 166   # the profiler's wait, warm-up and 2 recorded steps
    unprofiled = {**profiled, "command": profiled["command"] + " --no-profile"}
    assert timed_steps(unprofiled) == 170
    recorded = {**profiled, "rows": [{"variant": "v1", "timed_steps": 150}, {"variant": "v4", "timed_steps": 150},
                                     {"variant": "v3", "error": "boom"}]}
    assert timed_steps(recorded) == 150
    # A joined file's own command is merge_presets.py's: its parts' commands say whether they were profiled.
    merged = {**unprofiled, "command": "python benchmarks/merge_presets.py a.json b.json",
              "parts": [{"command": profiled["command"]}, {"command": profiled["command"]}]}
    assert timed_steps(merged) == 166
    merged["parts"] = [{"command": unprofiled["command"]}] * 2
    assert timed_steps(merged) == 170
    assert timed_steps({**unprofiled, "profile": True}) == 166   # what the file says wins over its command


def test_repeats_must_be_positive():
    result = compare("--repeats", "0", *TINY_MODEL)
    assert result.returncode == 2 and "argument --repeats: the value must be a positive integer" in result.stderr


def test_appendix_efficiency_table_is_the_committed_step_time_as_flop_rate():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import make_readme_table
    from tinytransformer import flops
    from tinytransformer.config import ModelConfig

    block = make_readme_table.efficiency_block(make_readme_table.seed_results())
    float32 = json.loads((REPO_ROOT / "benchmarks" / "results" / "h100_seed_float32.json").read_text())
    v4 = next(r for r in float32["rows"] if r["variant"] == "v4")
    tflops = flops.training_flops(ModelConfig(), 8, 128) / (v4["median_step_ms"] * 1e-3) / 1e12
    row = next(line for line in block.splitlines() if line.startswith("| v4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{v4['median_step_ms']:.2f}" and cells[2] == f"{tflops:.2f}"
    assert cells[3] == f"{100 * v4['mfu']:.2f}%"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages on a machine without a GPU")
@pytest.mark.parametrize("flags, message", [([], "needs a GPU"), (["--in-step"], "needs a GPU"),
                                            (["--steps", "0"], "error:"), (["--bogus"], "error:")])
def test_launch_overhead_without_a_gpu_or_with_bad_flags_says_one_line(flags, message):
    result = subprocess.run([sys.executable, "benchmarks/launch_overhead.py", *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr


def test_a_run_without_version_1_says_n_a_for_the_speed_up():
    """compare_versions.py --variants without v1 has no reference to divide by: the column says n/a, not 'n/ax'."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from comparison_rows import table
    row = {"variant": "v2+compile", "preset": None, "batch_size": 8, "seq_len": 128, "samples_per_s": 3664.0,
           "tokens_per_s": 468971.0, "median_step_ms": 2.18, "mfu": 0.018, "peak_memory_mib": 158.0,
           "kernels_per_step": None, "speedup_vs_v1": None, "final_loss": 1.6375}
    cells = table([row]).splitlines()[-1].split(" | ")
    assert cells[-2] == "n/a" and "n/ax" not in table([row])
    assert table([{**row, "speedup_vs_v1": 9.31}]).splitlines()[-1].split(" | ")[-2] == "9.31x"


def test_version_2_peer_table_quotes_the_committed_medians():
    """Version 2's README table against the models people train is typed by hand: each of its step times must be
    the committed median of that row, in the file the table names."""
    import re
    text = (REPO_ROOT / "version2_pytorch_fused" / "README.md").read_text()
    table_rows = re.findall(r"^\| (seed|tiny|small|medium|large), (\w+) \(b\d+ s\d+\) \| (.+) \| `([\w.]+)` \|$",
                            text, flags=re.MULTILINE)
    assert len(table_rows) >= 5
    for size, dtype, cells, file_name in table_rows:
        results = json.loads((REPO_ROOT / "benchmarks" / "results" / file_name).read_text())
        preset = None if size == "seed" else size
        medians = {row["variant"]: row["median_step_ms"] for row in results["rows"]
                   if row.get("preset") == preset and "error" not in row}
        quoted = [cell.strip() for cell in cells.split(" | ")]
        for variant, value in zip(("v2", "hf", "v2+compile", "hf+compile", "v2+compile+graph"), quoted):
            if value == "not run":   # a row the file does not hold may say so, and only then
                assert variant not in medians, (size, dtype, variant)
                continue
            assert float(value.removesuffix(" ms")) == round(medians[variant], 2), (size, dtype, variant, value,
                                                                                    medians[variant])
