"""cuBLAS without a workspace: no memset before each GEMM of a graph-captured step.

On Hopper, given a workspace, cuBLAS runs many of the model's bfloat16 and TF32 GEMMs with kernels that need part
of it cleared before they start (most likely a counter from which their blocks take output tiles), so it puts a
memset before each of those GEMMs. In a CUDA graph that memset is a node of its own, and where every kernel waits
for the one before it (the forward pass: norm, GEMM, attention, ...) the GPU idles for a few microseconds on each
side of it: in a profile of version 4's medium step on an H200, about 25 memsets a step, with ~215 us in which no
kernel ran around them. Given no workspace, cuBLAS picks kernels with the same tiles whose names say statically
scheduled (`*_ssched_*`), within 1-3% of the others' time alone, and no memset before them (measured for single
GEMMs of the step's shapes: benchmarks/results/kernel_time/h200_v4_cublas_workspace.json).

The workspace is sized by an environment variable, CUBLAS_WORKSPACE_CONFIG (":KIB:COUNT" pairs; ":0:0" for none),
which PyTorch and cuBLAS read once, at the process's first cuBLAS call. So the setting is made before any GEMM,
and it holds for everything in the process. A value the user exported is left as it is. ROCm builds (hipBLASLt)
are not touched: their workspace has settings of its own, and nothing was measured there.
"""
from __future__ import annotations

import os

from .device import is_rocm

VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"
CHOICES = ("none", "default")


def add_cublas_workspace_argument(group) -> None:
    group.add_argument("--cublas-workspace", choices=CHOICES, default="none",
                       help="none (the default on NVIDIA GPUs): cuBLAS without a workspace, so no memset before "
                            "each GEMM (tinytransformer/cublas_workspace.py); default: cuBLAS's own workspace (to "
                            f"compare; a {VARIABLE} you exported wins over both)")


def without_workspace(environ=None) -> bool:
    """Ask cuBLAS for no workspace in this process (call it before the first GEMM). Not on ROCm, and not over a
    value the user exported. True when the process runs cuBLAS without one. (environ stands in for os.environ in
    tests.)"""
    environ = os.environ if environ is None else environ
    if is_rocm():
        return False
    environ.setdefault(VARIABLE, NO_WORKSPACE)
    return environ[VARIABLE] == NO_WORKSPACE


def apply_cublas_workspace_argument(args, device) -> None:
    """On a GPU, --cublas-workspace none takes effect (before the run's first GEMM)."""
    if device.type == "cuda" and args.cublas_workspace == "none":
        without_workspace()


def describe_cublas_workspace(on_gpu: bool, environ=None) -> str | None:
    """The cuBLAS workspace this run's GEMMs have, for the run's header (None off NVIDIA GPUs)."""
    environ = os.environ if environ is None else environ
    if not on_gpu or is_rocm():
        return None
    value = environ.get(VARIABLE)
    if value == NO_WORKSPACE:
        return f"none ({VARIABLE}={NO_WORKSPACE}): no memset before each GEMM"
    return f"{VARIABLE}={value}" if value else "cuBLAS's default"
