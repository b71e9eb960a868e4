"""profilers/run_all_profilers.sh: every profiler in turn into one run directory, skipping what is missing, and a
summary table at the end."""
import json

import pytest

from .profiler_sandbox import ALL_STEPS, GPU_STEPS, PROFILERS, TOOLS, TRAIN_FLAGS, Sandbox, summary_rows


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


def test_orchestrator_runs_every_step_into_one_directory(box):
    run_dir = box.out / "run"
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script, "--output-dir", run_dir,
                     "--force-gpu-tools", "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = summary_rows(result.stdout)
    assert list(rows) == ALL_STEPS
    assert {status for status, _, _ in rows.values()} == {"ok"}, rows
    assert all(float(seconds) >= 0 for _, seconds, _ in rows.values())
    assert (run_dir / "summary.txt").read_text().strip() in result.stdout
    for step in ALL_STEPS:
        assert (run_dir / "logs" / f"{step}.log").is_file()
    assert json.loads((run_dir / "timed-run" / "metrics.json").read_text())

    # Each step ran the training once, with the user's flags and its own output option.
    calls = box.train_calls()
    assert len(calls) == len(ALL_STEPS)
    assert calls[0]["argv"] == [*TRAIN_FLAGS, "--output-json", str(run_dir / "timed-run" / "metrics.json")]
    assert calls[1] == {"script": str(box.version_dir / "run_pytorch_profiler.py"),
                        "argv": [*TRAIN_FLAGS, "--profile-dir", str(run_dir / "pytorch-profiler")]}
    assert calls[2] == {"script": str(box.version_dir / "run_deepspeed_flops.py"),
                        "argv": [*TRAIN_FLAGS, "--output-dir", str(run_dir / "deepspeed-flops")]}
    assert all(c == {"script": str(box.script), "argv": TRAIN_FLAGS} for c in calls[3:])

    # Every tool wrote inside its step directory of the run directory.
    by_tool = {c["tool"]: c for c in box.tool_calls()}
    assert by_tool["rocprofv3"]["argv"][3:5] == ["-d", str(run_dir / "rocprofv3")]
    assert by_tool["rocprof-sys-run"]["argv"][2:4] == ["-o", str(run_dir / "rocprof-sys")]
    assert box.tool_calls("rocprof-compute")[0]["cwd"] == str(run_dir / "rocprof-compute")
    assert box.tool_calls("nsys")[0]["argv"][4:6] == ["-o", str(run_dir / "nsys" / "fake_train")]
    ncu_argv = box.tool_calls("ncu")[0]["argv"]
    assert ncu_argv[ncu_argv.index("-o") + 1] == str(run_dir / "ncu" / "fake_train")
    assert (run_dir / "rocprofv3" / "top_kernels.txt").is_file()
    assert (run_dir / "rocprof-compute" / "workloads" / "fake_train" / "MI300A_A1").is_dir()


def test_orchestrator_skips_missing_tools_and_exits_0(box):
    run_dir = box.out / "run"
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script, "--output-dir", run_dir,
                     "--", *TRAIN_FLAGS, env=box.env(with_tools=False, with_deepspeed=False))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = summary_rows(result.stdout)
    assert list(rows) == ALL_STEPS
    assert rows["timed-run"][0] == "ok" and rows["pytorch-profiler"][0] == "ok"
    assert rows["deepspeed-flops"][0] in ("ok", "skipped")  # skipped unless DeepSpeed is installed
    for step, tool in zip(GPU_STEPS, TOOLS):
        status, seconds, reason = rows[step]
        assert (status, seconds) == ("skipped", "-")
        assert reason.startswith(f"{tool} not found on PATH")
    assert box.tool_calls() == []


def test_orchestrator_skip_option_and_missing_python_profilers(box):
    (box.version_dir / "run_pytorch_profiler.py").unlink()
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script, "--output-dir", box.out,
                     "--skip", "rocprof-compute,ncu,rocprof-sys", "--force-gpu-tools")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = summary_rows(result.stdout)
    assert rows["pytorch-profiler"] == ("skipped", "-", "no run_pytorch_profiler.py beside fake_train.py")
    assert rows["rocprof-compute"] == ("skipped", "-", "--skip rocprof-compute")
    assert rows["ncu"][0] == rows["rocprof-sys"][0] == "skipped"
    assert rows["nsys"][0] == rows["rocprofv3"][0] == "ok"
    assert {c["tool"] for c in box.tool_calls()} == {"rocprofv3", "nsys"}


def test_orchestrator_unknown_skip_name_exits_2(box):
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script, "--skip", "nsight")
    assert result.returncode == 2
    assert "unknown step 'nsight'" in result.stderr


def test_orchestrator_reports_failures_with_exit_1(box):
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script, "--output-dir", box.out,
                     "--skip", "rocprof-sys,rocprof-compute,nsys,ncu", "--force-gpu-tools",
                     env=box.env(FAKE_TRAIN_EXIT="1"))
    assert result.returncode == 1
    rows = summary_rows(result.stdout)
    assert rows["timed-run"][0] == rows["rocprofv3"][0] == "failed"
    assert "exit 1, see" in rows["timed-run"][2]
    assert "FAILED" in result.stderr


def test_orchestrator_default_run_dir(box):
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script,
                     "--skip", ",".join(ALL_STEPS[1:]), cwd=box.root)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = (box.root / "profile_runs").iterdir()
    assert (run_dir / "timed-run" / "metrics.json").is_file()
    assert (run_dir / "logs" / "timed-run.log").read_text().startswith("+ ")
    assert f"All outputs under {run_dir}" in result.stdout


def test_orchestrator_skips_gpu_tools_without_a_gpu(box):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU tools would run")
    result = box.run(PROFILERS / "run_all_profilers.sh", "--script", box.script, "--output-dir", box.out,
                     "--skip", "pytorch-profiler,deepspeed-flops")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = summary_rows(result.stdout)
    for step in GPU_STEPS:
        assert rows[step][0] == "skipped" and rows[step][2].startswith("no GPU visible to PyTorch"), rows
    assert box.tool_calls() == []
