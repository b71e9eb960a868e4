"""The shell profiler wrappers as commands: valid bash, the thin wrapper of every version directory, --help,
unknown options, a missing tool or training script; the version wrappers reach their own training script from any
directory, and the real version-1 script runs under a stand-in tool."""
import json
import os
import shutil
import subprocess

import pytest

from .profiler_sandbox import (PROFILERS, PY, REPO, SINGLE_TOOL_SCRIPTS, VERSIONS, WRAPPERS, Sandbox, rel,
                               runnable_scripts, shell_scripts, write_executable)


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


# ------------------------------------------------------------------------------------------------
# Static checks
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", shell_scripts(), ids=rel)
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    result = subprocess.run(["shellcheck", "-x", "--severity=warning", *map(str, shell_scripts())],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_version_has_thin_executable_wrappers():
    for version, training_script in VERSIONS.items():
        names = WRAPPERS + (["run_rocprof_triton.sh"] if version == "version3_triton" else [])
        for name in names:
            wrapper = REPO / version / name
            assert wrapper.is_file(), wrapper
            assert os.access(wrapper, os.X_OK), f"{wrapper} is not executable"
            lines = wrapper.read_text().splitlines()
            assert 3 <= len(lines) <= 6, f"{wrapper}: {len(lines)} lines"
            assert lines[0] == "#!/usr/bin/env bash"
            assert lines[1].startswith("# "), f"{wrapper}: second line should say what it runs"
            target = "run_rocprofv3.sh" if name == "run_rocprof_triton.sh" else name
            assert lines[-1].startswith(f'exec bash "$here/../profilers/{target}" '
                                        f'--script "$here/{training_script}"'), lines[-1]
            assert lines[-1].endswith('"$@"')
    assert "--triton-only" in (REPO / "version3_triton" / "run_rocprof_triton.sh").read_text()


# ------------------------------------------------------------------------------------------------
# Usage: --help, unknown options, missing tools
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", runnable_scripts(), ids=rel)
def test_help_exits_0(script, box):
    result = box.run(script, "--help", cwd=script.parent)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and "Examples:" in result.stdout
    assert box.tool_calls() == [] and box.train_calls() == []


@pytest.mark.parametrize("script", runnable_scripts(), ids=rel)
def test_unknown_option_exits_2_with_one_line(script, box):
    result = box.run(script, "--no-such-option", "--", "--num-steps", "1")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "unknown option '--no-such-option'" in result.stderr
    assert box.tool_calls() == [] and box.train_calls() == []


@pytest.mark.parametrize("name,tool", SINGLE_TOOL_SCRIPTS.items())
def test_missing_tool_exits_3_with_one_line(name, tool, box):
    result = box.run(PROFILERS / name, "--script", box.script, "--output-dir", box.out,
                     env=box.env(with_tools=False))
    assert result.returncode == 3, result.stdout + result.stderr
    message = result.stderr.strip()
    assert message.count("\n") == 0
    assert message.startswith(f"{tool} not found on PATH: install") and message.endswith("; skipping")
    assert box.train_calls() == []


def test_missing_training_script_is_a_usage_error(box):
    result = box.run(PROFILERS / "run_nsys.sh", "--script", box.root / "nope.py")
    assert result.returncode == 2
    assert "training script not found" in result.stderr


# ------------------------------------------------------------------------------------------------
# The version wrappers and the real training script
# ------------------------------------------------------------------------------------------------

FAKE_PYTHON = r'''#!/usr/bin/env bash
# Stand-in interpreter: records the script it was asked to run.
printf '%s\n' "$1" >>"$FAKE_PYTHON_LOG"
'''


@pytest.mark.parametrize("version", VERSIONS)
def test_version_wrapper_points_at_its_script_from_any_directory(version, box):
    script = REPO / version / VERSIONS[version]
    if not script.exists():
        pytest.skip(f"{rel(script)} not written yet")
    fake_python = box.root / "fake_python"
    write_executable(fake_python, FAKE_PYTHON)
    python_log = box.root / "python.log"
    env = box.env(PYTHON=str(fake_python), FAKE_PYTHON_LOG=str(python_log))
    for cwd, wrapper in [(REPO / version, "run_nsys.sh"), (REPO, f"{version}/run_nsys.sh")]:
        result = subprocess.run(["bash", wrapper, "--output-dir", str(box.out), "--", "--num-steps", "1"],
                                cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    assert python_log.read_text().splitlines() == [str(script)] * 2


def test_real_version1_script_under_a_stand_in_tool(box):
    script = REPO / "version1_pytorch_baseline" / "tiny_llama_v1.py"
    if not script.exists():
        pytest.skip("version1_pytorch_baseline/tiny_llama_v1.py not written yet")
    metrics = box.out / "metrics.json"
    tiny = ["--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--num-steps", "3",
            "--warmup-steps", "1", "--hidden-dim", "32", "--num-layers", "1", "--num-heads", "2",
            "--intermediate-size", "64", "--vocab-size", "64", "--output-json", str(metrics)]
    result = subprocess.run(
        ["bash", "version1_pytorch_baseline/run_rocprofv3.sh", "--output-dir", str(box.out), "--", *tiny],
        cwd=REPO, env=box.env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (call,) = box.tool_calls("rocprofv3")
    assert call["argv"][call["argv"].index("--"):] == ["--", PY, str(script), *tiny]
    assert json.loads(metrics.read_text())  # the real training run happened under the stand-in
    assert (box.out / "top_kernels.txt").is_file()
