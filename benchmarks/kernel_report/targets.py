"""The GPUs the report compiles for: the compiler's target and the per-SM / per-CU limits behind occupancy.

The launch-configuration side (vendor, multiprocessor count, shared memory one program may use) lives in
tinytransformer/triton_support.py as KNOWN_GPUS, because the kernels' own rules read it there; this file adds
what only the report needs: the register files and the per-SM / per-CU shared memory (published limits).
"""
from __future__ import annotations

import dataclasses

from tinytransformer.triton_support import KNOWN_GPUS, KnownGpu


@dataclasses.dataclass(frozen=True)
class Target:
    gpu: KnownGpu
    label: str                  # the GPUs it stands for
    backend: str                # Triton's backend: "hip" or "cuda"
    arch: str | int             # "gfx942" or a compute capability (90)
    warp_size: int              # 64 (a CDNA wavefront) or 32 (an NVIDIA warp)
    # AMD, per SIMD (a CU has 4): the VGPR file (VGPRs and AGPRs share it), SGPRs, the most resident waves
    # NVIDIA, per SM: 32-bit registers, resident warps and blocks
    registers: int
    max_resident: int
    scalar_registers: int = 0
    max_blocks: int = 0
    shared_memory_per_unit: int = 0   # bytes of shared memory per SM / LDS per CU

    @property
    def name(self) -> str:
        return self.gpu.target

    @property
    def vendor(self) -> str:
        return self.gpu.vendor

    def triton_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS = {
    # CDNA3 and CDNA2: 512 VGPRs per lane per SIMD (unified with the AGPRs), 800 SGPRs, 8 waves per SIMD,
    # 64 KiB of LDS per CU.
    "gfx942": Target(KNOWN_GPUS["gfx942"], "MI300X / MI300A", "hip", "gfx942", 64,
                     registers=512, max_resident=8, scalar_registers=800, shared_memory_per_unit=64 * 1024),
    "gfx90a": Target(KNOWN_GPUS["gfx90a"], "MI250X / MI210", "hip", "gfx90a", 64,
                     registers=512, max_resident=8, scalar_registers=800, shared_memory_per_unit=64 * 1024),
    # Hopper and Ampere: 65536 registers, 64 warps and 32 blocks per SM; 228 / 164 KiB of shared memory per SM.
    "sm_90": Target(KNOWN_GPUS["sm_90"], "H100 / H200", "cuda", 90, 32,
                    registers=65536, max_resident=64, max_blocks=32, shared_memory_per_unit=228 * 1024),
    "sm_80": Target(KNOWN_GPUS["sm_80"], "A100", "cuda", 80, 32,
                    registers=65536, max_resident=64, max_blocks=32, shared_memory_per_unit=164 * 1024),
}


def targets_from_flag(parser, text: str) -> list[str]:
    """The target names of a comma-separated --targets flag; an empty or unknown one is the parser's error."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in TARGETS for name in names):
        parser.error(f"--targets: choose from {','.join(TARGETS)} (got {text!r})")
    return names
