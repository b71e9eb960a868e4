"""tinytransformer/cublas_workspace.py: cuBLAS without a workspace (no memset before each GEMM), as version 4's
training script and compare_versions.py set it."""
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from tinytransformer import cublas_workspace as cw

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import comparison_rows  # noqa: E402


def test_no_workspace_is_asked_for_on_cuda_only_and_never_over_the_users_value(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)   # a CUDA build
    environ = {}
    assert cw.without_workspace(environ) and environ == {cw.VARIABLE: cw.NO_WORKSPACE}
    chosen = {cw.VARIABLE: ":4096:8"}
    assert not cw.without_workspace(chosen) and chosen == {cw.VARIABLE: ":4096:8"}
    monkeypatch.setattr(torch.version, "hip", "6.2")   # a ROCm build
    rocm = {}
    assert not cw.without_workspace(rocm) and rocm == {}


def test_the_header_says_which_workspace_the_gemms_have(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert cw.describe_cublas_workspace(True, {cw.VARIABLE: ":0:0"}).startswith("none")
    assert cw.describe_cublas_workspace(True, {}) == "cuBLAS's default"
    assert cw.describe_cublas_workspace(True, {cw.VARIABLE: ":4096:8"}) == f"{cw.VARIABLE}=:4096:8"
    assert cw.describe_cublas_workspace(False, {}) is None
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert cw.describe_cublas_workspace(True, {}) is None


@pytest.mark.parametrize("choice, device, expected", [("none", "cuda", cw.NO_WORKSPACE), ("default", "cuda", None),
                                                      ("none", "cpu", None)])
def test_the_flag_takes_effect_on_a_gpu_only(choice, device, expected, monkeypatch):
    monkeypatch.setenv(cw.VARIABLE, "unset below")   # so that monkeypatch restores the variable as it found it
    monkeypatch.delenv(cw.VARIABLE)
    monkeypatch.setattr(torch.version, "hip", None)
    cw.apply_cublas_workspace_argument(Namespace(cublas_workspace=choice), torch.device(device))
    assert os.environ.get(cw.VARIABLE) == expected


@pytest.mark.parametrize("choice", ["none", "default"])
def test_compare_versions_gives_every_row_one_setting(choice, tmp_path):
    """With default, version 4's rows are told to keep cuBLAS's workspace too (their own default is none); with
    none, compare_versions exports the variable to every run and no row needs a flag."""
    args = Namespace(num_steps=3, warmup_steps=1, seed=0, profile=False, device="cpu", dtype="float32", extra=[],
                     cublas_workspace=choice)
    commands = {label: comparison_rows.variant_command(label, args, (None, 2, 16), tmp_path / "x.json", tmp_path)
                for label in ("v2", "v4")}
    told = [label for label, command in commands.items() if "--cublas-workspace" in command]
    assert told == (["v4"] if choice == "default" else [])


def memsets_before_a_gemm(environ) -> int:
    """Memsets the profiler sees around one bfloat16 GEMM of the medium preset's gate/up shape, in a fresh process
    (cuBLAS reads its workspace size once per process)."""
    probe = ("import torch\nfrom torch.profiler import profile, ProfilerActivity\n"
             "x = torch.randn(8192, 1024, device='cuda', dtype=torch.bfloat16)\n"
             "w = torch.randn(5632, 1024, device='cuda', dtype=torch.bfloat16)\n"
             "x @ w.T; torch.cuda.synchronize()\n"
             "with profile(activities=[ProfilerActivity.CUDA]) as p:\n"
             "    x @ w.T; torch.cuda.synchronize()\n"
             "print(sum('emset' in e.name for e in p.events() if e.device_type.name == 'CUDA'))\n")
    result = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


@pytest.mark.gpu
def test_without_a_workspace_no_memset_precedes_a_hopper_gemm():
    """The premise, on the GPU it was measured on: with cuBLAS's workspace this GEMM comes with a memset (else
    there is nothing to compare on this GPU), and without one it does not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (CUDA or ROCm); none found")
    if torch.version.hip or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("measured on Hopper (sm_90) only")
    with_workspace = {key: value for key, value in os.environ.items() if key != cw.VARIABLE}
    if memsets_before_a_gemm(with_workspace) == 0:
        pytest.skip("this GPU's cuBLAS puts no memset before this GEMM even with its workspace: nothing to compare")
    assert memsets_before_a_gemm({**with_workspace, cw.VARIABLE: cw.NO_WORKSPACE}) == 0
