"""Resource usage of an AMD kernel, read from the AMDGCN assembly that Triton's AMD backend writes.

The assembly ends with the code object's metadata (YAML between .amdgpu_metadata and .end_amdgpu_metadata),
in which the compiler states per kernel:
    .vgpr_count         vector registers per lane, VGPRs and AGPRs together (what limits waves per SIMD)
    .agpr_count         of which accumulation registers (the matrix cores' accumulators; CDNA only)
    .sgpr_count         scalar registers per wave
    .vgpr_spill_count / .sgpr_spill_count   registers spilled to scratch memory
    .private_segment_fixed_size             scratch bytes per lane (spills and stack)
    .group_segment_fixed_size               static LDS bytes (Triton's LDS is given at launch: its metadata)
These are what the loader itself reads, so no GPU is needed to know them.
"""
from __future__ import annotations

import re

FIELDS = {"vgpr_count": "vgprs", "agpr_count": "agprs", "sgpr_count": "sgprs", "vgpr_spill_count": "vgpr_spills",
          "sgpr_spill_count": "sgpr_spills", "private_segment_fixed_size": "scratch_bytes",
          "group_segment_fixed_size": "static_lds_bytes"}


def _metadata_of(assembly: str, kernel: str) -> str:
    start, end = assembly.find(".amdgpu_metadata"), assembly.find(".end_amdgpu_metadata")
    if start < 0 or end < 0:
        raise ValueError("no .amdgpu_metadata section in the assembly")
    metadata = assembly[start:end]
    # amdhsa.kernels is a list: one entry per kernel, each starting with "  - ." at two spaces of indentation
    # (its arguments are a deeper list); keep the entry named `kernel`.
    for entry in re.split(r"\n  - (?=\.)", metadata):
        if re.search(rf"\n\s*\.name:\s+{re.escape(kernel)}\s*\n", entry):
            return entry
    raise ValueError(f"kernel {kernel} not in the assembly's metadata")


def resources(assembly: str, kernel: str) -> dict:
    """{vgprs, agprs, sgprs, vgpr_spills, sgpr_spills, scratch_bytes, static_lds_bytes} of `kernel`."""
    entry = _metadata_of(assembly, kernel)
    out = {}
    for field, name in FIELDS.items():
        match = re.search(rf"(?:^|\n)\s*\.{field}:\s+(\d+)", entry)
        out[name] = int(match.group(1)) if match else 0
    if not re.search(r"(?:^|\n)\s*\.vgpr_count:\s+\d+", entry):
        raise ValueError(f"no .vgpr_count for {kernel} in the assembly's metadata")
    return out
