"""Which device we train on, who made it, how fast it can be, and how much memory a run used.

PyTorch's ROCm build keeps the `torch.cuda` API (a "cuda" device is an AMD GPU there), so the code is the same
for both vendors; `torch.version.hip` tells them apart.
"""
from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch

from .config import ConfigError

# Dense peak throughput in TFLOP/s (no sparsity), from the vendors' data sheets, for MFU. The key is matched
# against the device name; order matters (longer, more specific names first). Unknown devices get no MFU:
# we say so instead of inventing a number.
PEAK_TFLOPS = [
    # name fragment,  float32 (non-tensor), tf32 tensor, bf16/fp16 tensor
    ("H200", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),
    ("H100 PCIe", {"float32": 51.2, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0}),
    ("H100", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),
    ("A100", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
    ("L40S", {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.0, "float16": 362.0}),
    ("MI300X", {"float32": 163.4, "tf32": 653.7, "bfloat16": 1307.4, "float16": 1307.4}),
    ("MI300A", {"float32": 122.6, "tf32": 490.3, "bfloat16": 980.6, "float16": 980.6}),
    ("MI325X", {"float32": 163.4, "tf32": 653.7, "bfloat16": 1307.4, "float16": 1307.4}),
    ("MI250X", {"float32": 95.7, "tf32": 95.7, "bfloat16": 383.0, "float16": 383.0}),
    ("MI250", {"float32": 90.5, "tf32": 90.5, "bfloat16": 362.1, "float16": 362.1}),
    ("MI210", {"float32": 45.3, "tf32": 45.3, "bfloat16": 181.0, "float16": 181.0}),
]

# Peak memory bandwidth in TB/s (HBM, data sheets), for the roofline's sloped roof. Matched like PEAK_TFLOPS.
PEAK_BANDWIDTH_TBS = [
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),        # SXM
    ("A100", 2.0),         # 80 GB SXM (the 40 GB part has 1.6)
    ("L40S", 0.864),
    ("MI300X", 5.3),
    ("MI300A", 5.3),
    ("MI325X", 6.0),
    ("MI250X", 3.2),
    ("MI250", 3.2),
    ("MI210", 1.6),
]


@dataclass
class DeviceInfo:
    type: str                 # "cuda" (NVIDIA or AMD) or "cpu"
    vendor: str               # "nvidia", "amd" or "cpu"
    name: str
    backend: str              # "CUDA 13.0", "ROCm/HIP 6.4", "CPU"
    torch_version: str
    count: int

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_available() -> bool:
    return torch.cuda.is_available()


def is_rocm() -> bool:
    return torch.version.hip is not None


def resolve_device(requested: str) -> torch.device:
    """'auto' -> the GPU when there is one, else the CPU; asking for 'cuda' without a GPU is an error."""
    if requested == "cuda":
        if not gpu_available():
            raise ConfigError("--device cuda was requested but no GPU is visible to PyTorch "
                              "(check the driver / ROCm install, or use --device cpu)")
        return torch.device("cuda")
    if requested == "cpu":
        return torch.device("cpu")
    return torch.device("cuda" if gpu_available() else "cpu")


def describe(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        vendor = "amd" if is_rocm() else "nvidia"
        backend = f"ROCm/HIP {torch.version.hip}" if is_rocm() else f"CUDA {torch.version.cuda}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DeviceInfo("cuda", vendor, torch.cuda.get_device_name(index), backend,
                          torch.__version__, torch.cuda.device_count())
    name = platform.processor() or platform.machine() or "cpu"
    return DeviceInfo("cpu", "cpu", name, "CPU", torch.__version__, 1)


def release(version: str) -> tuple[int, int]:
    """The major and minor release of a package's version string: (2, 11) for "2.11.0+cu130", (3, 6) for
    "3.6.0rc1", so that a feature's first release can be compared with what is installed."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def software_and_gpu(on_gpu: bool = True) -> dict:
    """What a benchmark's JSON records about the machine it ran on: Python, torch, Triton (None when absent) and
    the platform; with on_gpu and a GPU present, the GPU's name and the backend (CUDA or ROCm and its version)."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if on_gpu and gpu_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["backend"] = f"ROCm {torch.version.hip}" if is_rocm() else f"CUDA {torch.version.cuda}"
    return info


def peak_tflops(device_name: str, dtype: str, tf32: bool = False) -> float | None:
    """The data-sheet peak for this device and precision, or None when we do not know the device."""
    key = "tf32" if (dtype == "float32" and tf32) else dtype
    for fragment, peaks in PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return peaks.get(key)
    return None


def peak_bandwidth_tbs(device_name: str) -> float | None:
    """The data-sheet memory bandwidth of this device in TB/s, or None when we do not know the device."""
    for fragment, bandwidth in PEAK_BANDWIDTH_TBS:
        if fragment.lower() in device_name.lower():
            return bandwidth
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak bytes held by PyTorch's allocator on the GPU since the last reset, in MiB (None on CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
