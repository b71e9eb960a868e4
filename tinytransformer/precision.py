"""One switch for TF32: may float32 matrix multiplies use the tensor cores' TF32 mode?

PyTorch has had two APIs for this switch:
- up to 2.8: `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32` (booleans);
- from 2.9: `fp32_precision` = "ieee" | "tf32" | "none" on `torch.backends.cuda.matmul` and on
  `torch.backends.cudnn.conv` ("none": follow the global `torch.backends.fp32_precision`). The old names are
  deprecated there, and a process that mixes the two APIs gets an error when it reads the old one.

Everything in the workshop reads and sets TF32 through this module, which uses the new API wherever the
installed torch has it and the old one otherwise. One catch under the new API: torch itself still reads the
process-wide `torch.get_float32_matmul_precision()` in places (TorchInductor's `max-autotune` mode keys its GEMM
choices by it), and that read fails once the matmul's `fp32_precision` was set on its own. So the matmul switch
goes through `torch.set_float32_matmul_precision` ("high" = TF32, "highest" = IEEE), which sets the matmul's
`fp32_precision` and the process-wide value together, and every reader, old or new, sees one answer.
Each function takes an optional `backends` object (default: `torch.backends`) so that tests can hand in a
stand-in of either API; a stand-in of the new one brings its own `set_float32_matmul_precision`.
"""
from __future__ import annotations

import contextlib

import torch


def _backends(backends=None):
    return torch.backends if backends is None else backends


def has_fp32_precision_api(backends=None) -> bool:
    """True when this torch has the `fp32_precision` switches (torch 2.9 and later)."""
    try:
        getattr(_backends(backends).cuda.matmul, "fp32_precision")
    except (AttributeError, RuntimeError):
        return False
    return True


def _resolve(setting: str, parent: str | None) -> str:
    """'none' means: inherit the parent's setting (itself 'none' = IEEE float32)."""
    return parent if setting == "none" and parent is not None else setting


def tf32_enabled(backends=None) -> bool:
    """Do float32 matmuls (cuBLAS / hipBLASLt, and the Triton GEMMs that follow the same switch) use TF32?"""
    b = _backends(backends)
    if has_fp32_precision_api(b):
        return _resolve(b.cuda.matmul.fp32_precision, getattr(b, "fp32_precision", None)) == "tf32"
    return bool(b.cuda.matmul.allow_tf32)


def _set_matmul_precision(b, setting: str) -> None:
    """The matmul's fp32_precision ("tf32" | "ieee" | "none") with the process-wide value kept equal to it."""
    set_process_wide = getattr(b, "set_float32_matmul_precision", torch.set_float32_matmul_precision)
    tf32 = _resolve(setting, getattr(b, "fp32_precision", None)) == "tf32"
    # torch's words for TF32 and IEEE float32. The call sets oneDNN's (CPU) matmul precision too; the training
    # scripts switch TF32 on for GPU runs only (apply_tf32_argument), so their CPU matmuls stay exact.
    set_process_wide("high" if tf32 else "highest")
    if setting == "none":   # "follow the global setting", as in a fresh process (for every matmul backend)
        for backend in (b.cuda, getattr(b, "mkldnn", None)):
            if backend is not None:
                backend.matmul.fp32_precision = "none"


def set_tf32(enabled: bool, backends=None) -> None:
    """Switch TF32 on or off for float32 matmuls and cuDNN convolutions, in this whole process."""
    b = _backends(backends)
    if has_fp32_precision_api(b):
        value = "tf32" if enabled else "ieee"
        _set_matmul_precision(b, value)
        conv = getattr(b.cudnn, "conv", None)
        if conv is not None:
            conv.fp32_precision = value
    else:
        b.cuda.matmul.allow_tf32 = bool(enabled)
        b.cudnn.allow_tf32 = bool(enabled)


def saved_state(backends=None) -> tuple:
    """The exact current settings (whichever API), to put back with restore_state()."""
    b = _backends(backends)
    if has_fp32_precision_api(b):
        conv = getattr(b.cudnn, "conv", None)
        return ("fp32_precision", b.cuda.matmul.fp32_precision, conv.fp32_precision if conv is not None else None)
    return ("allow_tf32", bool(b.cuda.matmul.allow_tf32), bool(b.cudnn.allow_tf32))


def restore_state(state: tuple, backends=None) -> None:
    b = _backends(backends)
    api, matmul, cudnn = state
    if api == "fp32_precision":
        _set_matmul_precision(b, matmul)
        if cudnn is not None:
            b.cudnn.conv.fp32_precision = cudnn
    else:
        b.cuda.matmul.allow_tf32 = matmul
        b.cudnn.allow_tf32 = cudnn


@contextlib.contextmanager
def tf32_setting(enabled: bool, backends=None):
    """TF32 on or off inside the block, then exactly the settings as they were."""
    state = saved_state(backends)
    set_tf32(enabled, backends)
    try:
        yield
    finally:
        restore_state(state, backends)


def exact_float32_matmuls(backends=None):
    """IEEE float32 matmuls inside the block (a float32 correctness check must not follow a TF32 switch that
    another part of the process turned on), then the settings as they were."""
    return tf32_setting(False, backends)


# ----------------------------------------------------------------------------------------------------------
# The --tf32 / --no-tf32 switch of the training scripts (versions 2 and 4; version 1 always computes exact
# float32, the reference the others are checked against)
# ----------------------------------------------------------------------------------------------------------
def add_tf32_arguments(group) -> None:
    group.add_argument("--tf32", dest="tf32", action="store_true", default=True,
                       help="float32 matmuls on TF32 tensor cores (default; NVIDIA Ampere+ / AMD MI300)")
    group.add_argument("--no-tf32", dest="tf32", action="store_false", help="exact float32 matmuls")


def apply_tf32_argument(args, device) -> None:
    """On a GPU, the process's float32 matmuls follow --tf32 / --no-tf32 (on the CPU they are always exact)."""
    if device.type == "cuda":
        set_tf32(args.tf32)


def describe_float32_matmuls(args, on_gpu: bool, on_cpu: str = "exact float32 (TF32, --tf32, is for GPUs)") -> str:
    """What float32 matmuls of this run compute in, for the run's header and JSON."""
    if not on_gpu:
        return on_cpu
    return "TF32 tensor cores for float32" if args.tf32 else "exact float32"
