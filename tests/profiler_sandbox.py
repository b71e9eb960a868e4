"""What the tests of the shell profiler wrappers share (profilers/*.sh and the thin wrappers in each version
directory): stand-in profilers and a stand-in training script in a sandbox directory.

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
