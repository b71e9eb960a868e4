"""Version 2's fusion ablation script, and the trace analysis on a real GPU trace recorded on an H100."""
import subprocess

import pytest
import sys
from pathlib import Path

from tinytransformer.profiling import analysis
from tinytransformer.profiling.trace import load_trace
from version2_pytorch_fused.fusion_ablation import combinations

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_TRACE = REPO_ROOT / "tests" / "fixtures" / "gpu_trace_v1_h100.json.gz"


def test_ablation_shows_each_switch_alone_and_left_out():
    from version2_pytorch_fused.tiny_llama_v2 import FUSION_NAMES
    runs = dict(combinations(with_compile=True))
    switches = [f"--enable-{flag}" for flag in FUSION_NAMES.values()] + ["--tf32"]   # every switch of v2
    enabled = lambda label: {flag for flag in runs[label] if flag in switches}  # noqa: E731
    assert len(runs) == 2 * len(switches) + 4    # none, alone each, all, all but each, two compiled runs
    assert "--no-tf32" in runs["none"]   # "none" is version 1's computation on a GPU too: exact float32
    assert enabled("none") == set() and enabled("all") == set(switches)
    alone = [label for label in runs if len(enabled(label)) == 1]
    left_out = [label for label in runs if label.startswith("all-")]
    assert {flag for label in alone for flag in enabled(label)} == set(switches)   # every switch of v2 alone
    assert {flag for label in left_out for flag in set(switches) - enabled(label)} == set(switches)
    assert "--compile-optimizer" in runs["all+compile+opt"] and "--enable-torch-compile" in runs["all+compile"]


@pytest.mark.slow   # 16 fresh processes; the version 2 README's command runs it in the doc-command test too
def test_ablation_runs_on_cpu():
    command = [sys.executable, "version2_pytorch_fused/fusion_ablation.py", "--num-steps", "3", "--warmup-steps", "1",
               "--", "--device", "cpu", "--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1",
               "--intermediate-size", "64", "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("fusions", 1)[1]
    for label in ("none", "qkv", "flash", "swiglu", "rmsnorm", "rope", "adamw", "tf32", "all", "all-rope", "all-tf32"):
        assert f"\n{label} " in table


def test_gpu_trace_fixture_is_analysed():
    """A small version-1 trace recorded on an H100 (batch 2, seq 32, 1 profiled step)."""
    trace = load_trace(GPU_TRACE)
    assert analysis.has_device_activity(trace)
    kernels = analysis.kernels_per_step(trace)
    assert kernels is not None and 300 < kernels < 1000
    top = analysis.top_kernels(trace, limit=5)
    assert top and all(row["total_us"] > 0 for row in top)
    phases = analysis.phase_split(trace)
    assert phases["basis"] == "device"
    assert phases["us"]["attention"] > 0 and phases["us"]["backward"] > 0 and phases["us"]["optimizer"] > 0
