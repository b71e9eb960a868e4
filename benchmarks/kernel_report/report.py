"""From compiled kernels to report rows: resources, occupancy and a status, one row per kernel configuration."""
from __future__ import annotations

from . import amd, nvidia, occupancy
from .compile import Compiled, compile_one, distinct_launches
from .discovery import discover, import_versions
from .targets import TARGETS, Target

OK, COMPILE_ERROR, DOES_NOT_FIT = "ok", "compile error", "does not fit"


def analyse(result: Compiled, target: Target) -> dict:
    row = {"kernel": result.kernel, "source": result.source, "target": target.name,
           "paths": sorted(result.paths), "presets": sorted(result.presets), "config": result.config,
           "status": OK, "error": result.error}
    if result.error:
        row["status"] = COMPILE_ERROR
        return row
    warps = result.num_warps
    if target.vendor == "amd":
        used = amd.resources(result.asm["amdgcn"], result.kernel)
        shared = result.shared + used["static_lds_bytes"]
        row.update(registers=used["vgprs"], agprs=used["agprs"], sgprs=used["sgprs"],
                   spills=used["vgpr_spills"] + used["sgpr_spills"], vgpr_spills=used["vgpr_spills"],
                   sgpr_spills=used["sgpr_spills"], scratch_bytes=used["scratch_bytes"],
                   shared_bytes=shared,
                   occupancy={**occupancy.amd(target, used["vgprs"], used["sgprs"], shared, warps),
                              "unit": "waves per SIMD"})
    else:
        used = nvidia.resources(result.asm["cubin"], result.kernel)
        shared = result.shared + used["static_shared_bytes"]
        row.update(registers=used["registers"], spills=used["local_bytes"], scratch_bytes=used["local_bytes"],
                   shared_bytes=shared,
                   occupancy={**occupancy.nvidia(target, used["registers"], shared, warps),
                              "unit": "warps per SM"})
    if shared > target.gpu.shared_memory_per_program:
        row["status"] = DOES_NOT_FIT
        row["error"] = (f"asks for {shared} bytes of shared memory; a program may use "
                        f"{target.gpu.shared_memory_per_program} on {target.name}")
    elif row["occupancy"]["value"] == 0:
        row["status"] = DOES_NOT_FIT
        row["error"] = f"one workgroup exceeds the {row['occupancy']['limited_by']} of a {target.name} unit"
    return row


def build(target_names: list[str], presets: list[str], progress=None, first_only: bool = False) -> list[dict]:
    """Rows for every distinct launch configuration of every kernel at `presets`, for each target.
    first_only: compile one configuration per kernel and target (the quick check of CI)."""
    modules = import_versions()
    rows = []
    for name in target_names:
        target = TARGETS[name]
        distinct = {}
        for preset in presets:
            distinct_launches(discover(target.gpu, preset, modules), target, preset, distinct)
        seen = set()
        for result, arguments in distinct.values():
            if first_only and (result.source, result.kernel) in seen:
                continue
            seen.add((result.source, result.kernel))
            row = analyse(compile_one(result, arguments, target), target)
            rows.append(row)
            if progress:
                progress(row)
    return rows
