"""Each single-tool wrapper (profilers/run_rocprofv3.sh, run_rocprof_sys.sh, run_rocprof_compute.sh, run_nsys.sh,
run_ncu.sh) with a stand-in tool: the exact command line it runs and the summary it prints."""
import pytest

from .profiler_sandbox import PROFILERS, TRAIN_FLAGS, Sandbox, training_cmd


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


@pytest.mark.parametrize("header", ["sdk", "alt"])
def test_rocprofv3_command_and_top_kernels(box, header):
    result = box.run(PROFILERS / "run_rocprofv3.sh", "--script", box.script, "--output-dir", box.out,
                     "--", *TRAIN_FLAGS, env=box.env(FAKE_STATS_HEADER=header))
    assert result.returncode == 0, result.stdout + result.stderr
    (call,) = box.tool_calls("rocprofv3")
    assert call["argv"] == ["--kernel-trace", "--stats", "--truncate-kernels", "-d", str(box.out),
                            "-o", "fake_train", "--output-format", "csv", "--", *training_cmd(box)]
    assert box.train_calls() == [{"script": str(box.script), "argv": TRAIN_FLAGS}]
    table = (box.out / "top_kernels.txt").read_text()
    assert table in result.stdout
    order = [table.index(k) for k in ("Cijk_gemm_MT128", "rmsnorm_fwd_kernel", "elementwise_kernel")]
    assert order == sorted(order), table
    assert "60.0%" in table and "3.000" in table  # share and total ms of the GEMM


def test_rocprofv3_triton_only_filters_on_triton_function_names(box):
    result = box.run(PROFILERS / "run_rocprofv3.sh", "--triton-only", "--script", box.script,
                     "--output-dir", box.out, "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    (call,) = box.tool_calls("rocprofv3")
    argv = call["argv"]
    assert argv[argv.index("--kernel-include-regex") + 1] == "fused_rmsnorm_kernel|swiglu_fwd_kernel"
    assert argv[argv.index("-o") + 1] == "fake_train_triton"
    assert argv[argv.index("--"):] == ["--", *training_cmd(box)]


def test_rocprofv3_without_stats_exits_4(box):
    result = box.run(PROFILERS / "run_rocprofv3.sh", "--script", box.script, "--output-dir", box.out,
                     env=box.env(FAKE_NO_REPORT="1"))
    assert result.returncode == 4
    assert "wrote no *kernel_stats.csv" in result.stderr


def test_rocprof_sys_command_and_trace_location(box):
    result = box.run(PROFILERS / "run_rocprof_sys.sh", "--script", box.script, "--output-dir", box.out,
                     "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    (call,) = box.tool_calls("rocprof-sys-run")
    assert call["argv"] == ["--profile", "--trace", "-o", str(box.out), "--", *training_cmd(box)]
    assert call["env_output_path"] == str(box.out)
    (trace,) = box.out.glob("perfetto-trace-*.proto")
    assert f"Perfetto trace: {trace}" in result.stdout and "ui.perfetto.dev" in result.stdout
    assert len(box.train_calls()) == 1


def test_rocprof_compute_profile_then_list_stats(box):
    result = box.run(PROFILERS / "run_rocprof_compute.sh", "--script", box.script, "--output-dir", box.out,
                     "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    profile, analyze = box.tool_calls("rocprof-compute")
    assert profile["argv"] == ["profile", "-n", "fake_train", "--no-roof", "--", *training_cmd(box)]
    assert profile["cwd"] == str(box.out)
    workload = box.out / "workloads" / "fake_train" / "MI300A_A1"
    assert analyze["argv"] == ["analyze", "-p", str(workload), "--list-stats"]
    assert "dispatches 1538" in (box.out / "stats.txt").read_text()
    assert len(box.train_calls()) == 1


def test_rocprof_compute_roofline(box):
    result = box.run(PROFILERS / "run_rocprof_compute.sh", "roofline", "--script", box.script,
                     "--output-dir", box.out, "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    (call,) = box.tool_calls("rocprof-compute")
    assert call["argv"] == ["profile", "-n", "fake_train_roof", "--roof-only", "--kernel-names",
                            "--device", "0", "--", *training_cmd(box)]
    assert result.stdout.count("roofline: ") == 3


def test_rocprof_compute_analyze_dispatch(box):
    workload = box.root / "workloads" / "ver2" / "MI300A_A1"
    workload.mkdir(parents=True)
    result = box.run(PROFILERS / "run_rocprof_compute.sh", "--mode", "analyze", "--workload", workload,
                     "--dispatch", "1538", "--output-dir", box.out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c["argv"] for c in box.tool_calls("rocprof-compute")] == [
        ["analyze", "-p", str(workload), "--list-stats"],
        ["analyze", "-p", str(workload), "--dispatch", "1538"],
    ]
    assert "Dispatch 1538 details" in (box.out / "dispatch_1538.txt").read_text()
    assert box.train_calls() == []


def test_nsys_command_and_kernel_summary(box):
    result = box.run(PROFILERS / "run_nsys.sh", "--script", box.script, "--output-dir", box.out,
                     "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    profile, stats = box.tool_calls("nsys")
    assert profile["argv"] == ["profile", "--trace=cuda,nvtx,osrt", "--force-overwrite", "true",
                               "-o", str(box.out / "fake_train"), *training_cmd(box)]
    assert stats["argv"] == ["stats", "--report", "cuda_gpu_kern_sum", "--force-export=true",
                             str(box.out / "fake_train.nsys-rep")]
    assert "Cijk_gemm" in (box.out / "cuda_gpu_kern_sum.txt").read_text()
    assert len(box.train_calls()) == 1


def test_nsys_without_report_exits_4_with_one_line(box):
    result = box.run(PROFILERS / "run_nsys.sh", "--script", box.script, "--output-dir", box.out,
                     env=box.env(FAKE_NO_REPORT="1"))
    assert result.returncode == 4
    assert result.stderr.strip().splitlines()[-1].startswith("nsys produced no report")
    assert [c["argv"][0] for c in box.tool_calls("nsys")] == ["profile"]


def test_ncu_command_and_summary(box):
    result = box.run(PROFILERS / "run_ncu.sh", "--script", box.script, "--output-dir", box.out,
                     "--", *TRAIN_FLAGS)
    assert result.returncode == 0, result.stdout + result.stderr
    profile, summary = box.tool_calls("ncu")
    regex = "gemm|Gemm|GEMM|nvjet|cutlass|xmma|triton|fused_rmsnorm_kernel|swiglu_fwd_kernel"
    assert profile["argv"] == ["--clock-control", "none", "--target-processes", "all",
                               "--kernel-name", f"regex:{regex}", "--launch-skip", "10",
                               "--launch-count", "3", "--force-overwrite",
                               "-o", str(box.out / "fake_train"), *training_cmd(box)]
    assert summary["argv"] == ["--import", str(box.out / "fake_train.ncu-rep"),
                               "--print-summary", "per-kernel"]
    assert "sgemm" in (box.out / "summary.txt").read_text()


def test_ncu_options_and_missing_report(box):
    result = box.run(PROFILERS / "run_ncu.sh", "--script", box.script, "--output-dir", box.out,
                     "--kernel-regex", "rmsnorm", "--launch-skip", "0", "--launch-count", "1",
                     env=box.env(FAKE_NO_REPORT="1"))
    assert result.returncode == 4
    assert "ncu wrote no report" in result.stderr
    (call,) = box.tool_calls("ncu")
    argv = call["argv"]
    assert argv[argv.index("--kernel-name") + 1] == "regex:rmsnorm"
    assert argv[argv.index("--launch-skip") + 1] == "0"
    assert argv[argv.index("--launch-count") + 1] == "1"


def test_default_output_dir_is_timestamped_under_profile_runs(box):
    result = box.run(PROFILERS / "run_nsys.sh", "--script", box.script, cwd=box.root)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = (box.root / "profile_runs").iterdir()
    assert run_dir.name[:8].isdigit() and run_dir.name[8] == "_"
    assert (run_dir / "nsys" / "fake_train.nsys-rep").is_file()
