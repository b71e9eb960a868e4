"""run_pytorch_profiler.py (tinytransformer/profiling/pytorch_profiler_cli.py), on the CPU: a profiled training run
of versions 1 and 2, --analyze-existing on a run's trace, the committed CPU trace and a synthetic GPU trace, and
bad input (one line, exit 2). Also the thin scripts every version directory has for both profiler commands."""
import csv
import json
import os
import runpy
import subprocess
import sys
import time

import pytest

from tinytransformer.profiling.attribution import PHASES as ALL_PHASES
from tinytransformer.profiling.pytorch_profiler_cli import pytorch_profiler_main
from version1_pytorch_baseline.tiny_llama_v1 import SPEC as V1
from version2_pytorch_fused.tiny_llama_v2 import SPEC as V2

from .profiler_commands import REPO, TRAIN_FLAGS, assert_one_line_error, mkdir, run_main, write
from .trace_samples import CPU_TRACE as FIXTURE_TRACE
from .trace_samples import build_gpu_trace

PHASES = ("attention", "ffn", "rmsnorm", "rope", "output_head", "loss", "backward", "optimizer", "other")


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
        assert [row["phase"] for row in csv.DictReader(handle)] == list(ALL_PHASES)


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


@pytest.mark.parametrize("case", sorted(PROFILER_BAD_INPUTS))
def test_profiler_bad_input_is_one_line_and_exit_2(case, tmp_path):
    code, _, err = run_main(pytorch_profiler_main, V1, PROFILER_BAD_INPUTS[case](tmp_path))
    assert_one_line_error(code, err)


def test_reports_never_replace_what_the_command_reads(tmp_path):
    # A trace whose name is one of the reports written beside it, and a training input inside --profile-dir under a
    # report's name (the trace, the summary, the --generate-report file): refused before anything is written.
    trace = write(mkdir(tmp_path / "a") / "summary.md", FIXTURE_TRACE.read_bytes())
    text = write(mkdir(tmp_path / "b") / "profile_report_v1.md", bytes(range(256)) * 8)
    config = write(tmp_path / "b" / "trace_v1.json", b"num_steps: 2\n")
    before = {path: path.read_bytes() for path in (trace, text, config)}
    cases = [["--analyze-existing", trace],
             TRAIN_FLAGS + ["--vocab-size", "256", "--data", f"text:{text}", "--profile-dir", text.parent,
                            "--generate-report"],
             TRAIN_FLAGS + ["--config", config, "--profile-dir", config.parent]]
    for argv in cases:
        code, _, err = run_main(pytorch_profiler_main, V1, argv)
        assert_one_line_error(code, err)
        assert "reads; write the output elsewhere" in err, err
    assert {path: path.read_bytes() for path in before} == before


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
