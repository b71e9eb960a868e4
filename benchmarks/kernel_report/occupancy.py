"""Occupancy: how many waves (AMD, per SIMD) or warps (NVIDIA, per SM) of a kernel can be resident at once.

A compute unit keeps a resident wave's registers and its workgroup's LDS for the wave's whole life, so each
of the three resources bounds how many can share it; the smallest bound wins, and whole workgroups (blocks)
only. The limits are the targets' published ones (targets.py).

AMD CDNA (gfx90a, gfx942): a CU has 4 SIMDs; a workgroup of W waves puts ceil(W / 4) on each. Per SIMD lane,
  512 VGPRs shared by all its waves, allocated in granules of 8 (AGPRs count, in the same file); 800 SGPRs,
  granules of 16; at most 8 waves. LDS: 64 KiB per CU shared by its workgroups.
NVIDIA (sm_80, sm_90): 65536 registers per SM, allocated per warp in granules of 256 (8 per thread); at most
  64 warps and 32 blocks; shared memory per SM 164 KiB (A100) / 228 KiB (H100), each block also holding
  1 KiB that the system reserves.
"""
from __future__ import annotations

import math

from .targets import Target


def _round_up(value: int, granule: int) -> int:
    return math.ceil(value / granule) * granule


def amd(target: Target, vgprs: int, sgprs: int, lds_bytes: int, num_warps: int) -> dict:
    """{"value": waves per SIMD, "max": 8, "limited_by": ...}; value 0 when one workgroup does not fit."""
    per_group = math.ceil(num_warps / 4)   # waves of one workgroup on each SIMD
    bounds = {"waves": target.max_resident,
              "VGPRs": target.registers // max(8, _round_up(vgprs, 8)),
              "SGPRs": target.scalar_registers // max(16, _round_up(sgprs, 16))}
    if lds_bytes:
        bounds["LDS"] = (target.shared_memory_per_unit // lds_bytes) * per_group
    return _whole_groups(bounds, per_group, target.max_resident)


def nvidia(target: Target, registers: int, shared_bytes: int, num_warps: int) -> dict:
    """{"value": warps per SM, "max": 64, "limited_by": ...}; value 0 when one block does not fit."""
    per_warp = _round_up(max(1, registers) * 32, 256)
    bounds = {"warps": target.max_resident,
              "blocks": target.max_blocks * num_warps,
              "registers": (target.registers // per_warp) // num_warps * num_warps,
              "shared memory": target.shared_memory_per_unit // (shared_bytes + 1024) * num_warps}
    return _whole_groups(bounds, num_warps, target.max_resident)


def _whole_groups(bounds: dict, per_group: int, most: int) -> dict:
    limited_by = min(bounds, key=lambda name: (bounds[name], name != "waves" and name != "warps"))
    value = bounds[limited_by] // per_group * per_group
    return {"value": value, "max": most, "limited_by": limited_by}
