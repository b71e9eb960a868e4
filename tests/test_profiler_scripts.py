"""The shell profiler wrappers (profilers/*.sh and the thin wrappers in each version directory).

No profiler is needed: stand-in executables named rocprofv3, rocprof-sys-run, rocprof-compute, nsys
and ncu are put first on PATH. Each records its command line, writes the kind of files the real tool
writes, and runs the wrapped command, so the training run really happens. The training script is a
tiny stand-in that records its arguments (the real version-1 script is used once, when it exists).
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROFILERS = REPO / "profilers"
VERSIONS = {
    "version1_pytorch_baseline": "tiny_llama_v1.py",
    "version2_pytorch_fused": "tiny_llama_v2.py",
    "version3_triton": "tiny_llama_v3.py",
    "version4_triton_ultra": "tiny_llama_v4.py",
}
WRAPPERS = [
    "run_all_profilers.sh",
    "run_rocprofv3.sh",
    "run_rocprof_sys.sh",
    "run_rocprof_compute.sh",
    "run_nsys.sh",
    "run_ncu.sh",
]
SINGLE_TOOL_SCRIPTS = {
    "run_rocprofv3.sh": "rocprofv3",
    "run_rocprof_sys.sh": "rocprof-sys-run",
    "run_rocprof_compute.sh": "rocprof-compute",
    "run_nsys.sh": "nsys",
    "run_ncu.sh": "ncu",
}
TOOLS = list(SINGLE_TOOL_SCRIPTS.values())
GPU_STEPS = ["rocprofv3", "rocprof-sys", "rocprof-compute", "nsys", "ncu"]
ALL_STEPS = ["timed-run", "pytorch-profiler", "deepspeed-flops", *GPU_STEPS]
TRAIN_FLAGS = ["--batch-size", "2", "--num-steps", "3"]
PY = sys.executable


def shell_scripts():
    return sorted(PROFILERS.glob("*.sh")) + sorted(REPO.glob("version*/*.sh"))


def runnable_scripts():
    return [p for p in shell_scripts() if p.name != "common.sh"]


def rel(path):
    return str(path.relative_to(REPO))


# ------------------------------------------------------------------------------------------------
# Stand-ins
# ------------------------------------------------------------------------------------------------

FAKE_TOOL = r'''#!/usr/bin/env python3
"""Stand-in profiler: records argv, writes plausible outputs, runs the wrapped command."""
import json, os, subprocess, sys
from pathlib import Path

TOOL = Path(sys.argv[0]).name
ARGS = sys.argv[1:]
NO_REPORT = os.environ.get("FAKE_NO_REPORT") == "1"


def record(**extra):
    with open(os.environ["FAKE_TOOL_LOG"], "a") as f:
        f.write(json.dumps({"tool": TOOL, "argv": ARGS, "cwd": os.getcwd(), **extra}) + "\n")


def value(name):
    return ARGS[ARGS.index(name) + 1] if name in ARGS else None


def after_dashdash(args):
    return args[args.index("--") + 1:]


def after_options(args, with_value):
    i = 0
    while i < len(args):
        if args[i] in with_value:
            i += 2
        elif args[i].startswith("-"):
            i += 1
        else:
            return args[i:]
    return []


STATS_HEADERS = {
    "sdk": '"Name","Calls","TotalDurationNs","AverageNs","Percentage","MinNs","MaxNs","StdDev"',
    "alt": '"Kernel_Name","Count","Total_Duration_ns"',
}
STATS_ROWS = {
    "sdk": ['"elementwise_kernel",10,500000,50000.0,10.0,1,2,0',
            '"Cijk_gemm_MT128",3,3000000,1000000.0,60.0,1,2,0',
            '"rmsnorm_fwd_kernel",5,1500000,300000.0,30.0,1,2,0'],
    "alt": ['"elementwise_kernel",10,500000',
            '"Cijk_gemm_MT128",3,3000000',
            '"rmsnorm_fwd_kernel",5,1500000'],
}

if TOOL == "rocprofv3":
    record()
    rc = subprocess.call(after_dashdash(ARGS))
    if not NO_REPORT:
        variant = os.environ.get("FAKE_STATS_HEADER", "sdk")
        out = Path(value("-d"))
        out.mkdir(parents=True, exist_ok=True)
        lines = [STATS_HEADERS[variant], *STATS_ROWS[variant]]
        (out / f"{value('-o')}_kernel_stats.csv").write_text("\n".join(lines) + "\n")
        (out / f"{value('-o')}_kernel_trace.csv").write_text('"Kind","Kernel_Name"\n')
    sys.exit(rc)

if TOOL == "rocprof-sys-run":
    record(env_output_path=os.environ.get("ROCPROFSYS_OUTPUT_PATH"))
    rc = subprocess.call(after_dashdash(ARGS))
    if not NO_REPORT:
        out = Path(value("-o") or os.environ["ROCPROFSYS_OUTPUT_PATH"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"perfetto-trace-{os.getpid()}.proto").write_bytes(b"\0")
        (out / "wall_clock.txt").write_text("fake\n")
    sys.exit(rc)

if TOOL == "rocprof-compute":
    record()
    if ARGS[0] == "profile":
        rc = subprocess.call(after_dashdash(ARGS))
        if not NO_REPORT:
            workload = Path("workloads") / value("-n") / "MI300A_A1"
            workload.mkdir(parents=True, exist_ok=True)
            (workload / "pmc_perf.csv").write_text("Dispatch_ID,Kernel_Name\n")
            if "--roof-only" in ARGS:
                for pdf in ("empirRoof_gpu-0_FP32.pdf", "empirRoof_gpu-0_FP16.pdf", "legend.pdf"):
                    (workload / pdf).write_bytes(b"%PDF")
        sys.exit(rc)
    if ARGS[0] == "analyze":
        if not Path(value("-p")).is_dir():
            print("no such workload", file=sys.stderr)
            sys.exit(1)
        if "--list-stats" in ARGS:
            print("Top Kernels: Cijk_gemm_MT128 dispatches 1538 1539")
        if "--dispatch" in ARGS:
            print(f"Dispatch {value('--dispatch')} details")
        sys.exit(0)
    sys.exit(2)

if TOOL == "nsys":
    record()
    if ARGS[0] == "profile":
        rc = subprocess.call(after_options(ARGS[1:], {"-o", "--output", "--force-overwrite", "-t"}))
        if not NO_REPORT:
            Path(value("-o") + ".nsys-rep").write_bytes(b"\0")
        sys.exit(rc)
    if ARGS[0] == "stats":
        if not Path(ARGS[-1]).is_file():
            sys.exit(1)
        print(" Time (%)  Total Time (ns)  Instances  Name\n 60.0  3000000  3  Cijk_gemm")
        sys.exit(0)
    sys.exit(2)

if TOOL == "ncu":
    record()
    if "--import" in ARGS:
        if not Path(value("--import")).is_file():
            sys.exit(1)
        print("  ampere_sgemm_128x64_tn (1, 1, 1)x(128, 1, 1), Invocations 3")
        sys.exit(0)
    with_value = {"--clock-control", "--target-processes", "--kernel-name", "--launch-skip",
                  "--launch-count", "-o", "--export", "-k", "-c", "-s"}
    rc = subprocess.call(after_options(ARGS, with_value))
    if not NO_REPORT:
        Path(value("-o") + ".ncu-rep").write_bytes(b"\0")
    sys.exit(rc)

sys.exit(f"unexpected stand-in name {TOOL}")
'''

FAKE_TRAIN = r'''"""Stand-in training script: records how it was called, writes --output-json."""
import json, os, sys
from pathlib import Path

with open(os.environ["FAKE_TRAIN_LOG"], "a") as f:
    f.write(json.dumps({"script": os.path.abspath(sys.argv[0]), "argv": sys.argv[1:]}) + "\n")
for option in ("--output-json", "--profile-dir", "--output-dir"):
    if option in sys.argv:
        target = Path(sys.argv[sys.argv.index(option) + 1])
        if option == "--output-json":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps({"tokens_per_second": 1.0}))
        else:
            target.mkdir(parents=True, exist_ok=True)
            (target / "result.txt").write_text("fake\n")
sys.exit(int(os.environ.get("FAKE_TRAIN_EXIT", "0")))
'''

FAKE_TRITON_KERNELS = '''\
import triton


@triton.autotune(configs=[], key=["n"])
@triton.jit
def fused_rmsnorm_kernel(x_ptr, n):
    pass


@triton.jit(do_not_specialize=["n"])
def swiglu_fwd_kernel(x_ptr, n):
    pass
'''


def write_executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def path_without_tools():
    """PATH minus the directories holding a real profiler; None when that would drop bash or python."""
    kept = [d for d in os.environ["PATH"].split(os.pathsep)
            if not any((Path(d) / tool).exists() for tool in TOOLS)]
    clean = os.pathsep.join(kept)
    needed = ["bash", "python3", "date", "find", "awk", "sort", "tee"]
    if any(shutil.which(tool, path=clean) is None for tool in needed):
        return None
    return clean


class Sandbox:
    """Temp dir with the stand-in tools, a stand-in version directory and helpers to run scripts."""

    def __init__(self, root):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in TOOLS:
            write_executable(self.bin / tool, FAKE_TOOL)
        self.version_dir = root / "version_fake"
        (self.version_dir / "kernels").mkdir(parents=True)
        self.script = self.version_dir / "fake_train.py"
        self.script.write_text(FAKE_TRAIN)
        (self.version_dir / "run_pytorch_profiler.py").write_text(FAKE_TRAIN)
        (self.version_dir / "run_deepspeed_flops.py").write_text(FAKE_TRAIN)
        (self.version_dir / "kernels" / "fused.py").write_text(FAKE_TRITON_KERNELS)
        # An importable (empty) deepspeed, so the orchestrator's "is DeepSpeed installed" check passes.
        self.packages = root / "packages"
        (self.packages / "deepspeed").mkdir(parents=True)
        (self.packages / "deepspeed" / "__init__.py").write_text("")
        self.tool_log = root / "tools.jsonl"
        self.train_log = root / "train.jsonl"
        self.out = root / "out"

    def env(self, with_tools=True, with_deepspeed=True, **extra):
        env = dict(os.environ)
        if with_tools:
            env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        else:
            clean = path_without_tools()
            if clean is None:
                pytest.skip("a profiler is installed next to bash/python3; cannot hide it")
            env["PATH"] = clean
        if with_deepspeed:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.packages), env.get("PYTHONPATH")]))
        env.update(PYTHON=PY, FAKE_TOOL_LOG=str(self.tool_log), FAKE_TRAIN_LOG=str(self.train_log))
        env.update(extra)
        return env

    def run(self, script, *args, cwd=None, env=None, timeout=60):
        env = env if env is not None else self.env()
        return subprocess.run(["bash", str(script), *map(str, args)], cwd=cwd or self.root, env=env,
                              capture_output=True, text=True, timeout=timeout)

    def tool_calls(self, tool=None):
        if not self.tool_log.exists():
            return []
        calls = [json.loads(line) for line in self.tool_log.read_text().splitlines()]
        return [c for c in calls if tool is None or c["tool"] == tool]

    def train_calls(self):
        if not self.train_log.exists():
            return []
        return [json.loads(line) for line in self.train_log.read_text().splitlines()]


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


def training_cmd(box):
    return [PY, str(box.script), *TRAIN_FLAGS]


def summary_rows(stdout):
    """{step: (status, seconds, output)} from the orchestrator's summary table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 4 and cells[0] in ALL_STEPS:
            rows[cells[0]] = tuple(cells[1:])
    return rows


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
# Single-tool scripts with stand-in tools: the exact command lines
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# The orchestrator
# ------------------------------------------------------------------------------------------------

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
