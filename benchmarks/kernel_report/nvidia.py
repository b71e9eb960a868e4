"""Resource usage of an NVIDIA kernel, read from its cubin with cuobjdump (shipped in Triton's wheel).

`cuobjdump --dump-resource-usage` prints, per function, what ptxas allocated:
    REG     registers per thread
    LOCAL   local memory bytes per thread that ptxas does not count as stack (Triton's kernels keep no arrays there)
    SHARED  static shared memory bytes (Triton asks for its shared memory at launch: the kernel's metadata)
    STACK   stack frame bytes per thread: where ptxas puts the registers it spills (and call frames; Triton's
            kernels make no calls, so here it is spills)
The driver's local memory per thread (what Triton reports as n_spills, in 4-byte words) is LOCAL + STACK:
spilled registers show up as STACK with LOCAL still 0, so the two are read together (local_bytes).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path


def tool(name: str) -> str:
    """A CUDA tool from Triton's wheel (triton/backends/nvidia/bin), else the one on PATH."""
    import triton
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(shipped) if shipped.is_file() else name


def parse_resource_usage(text: str, kernel: str) -> dict:
    """{registers, local_bytes, static_shared_bytes, stack_bytes} of `kernel` in cuobjdump's report; local_bytes
    is all the local memory a thread uses (LOCAL + STACK, as the driver counts it), stack_bytes the STACK part."""
    match = re.search(rf"Function {re.escape(kernel)}:\s*\n\s*(.*)", text)
    if not match:
        raise ValueError(f"kernel {kernel} not in cuobjdump's resource usage")
    values = dict(re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", match.group(1)))
    local, stack = int(values.get("LOCAL", 0)), int(values.get("STACK", 0))
    return {"registers": int(values["REG"]), "local_bytes": local + stack,
            "static_shared_bytes": int(values.get("SHARED", 0)), "stack_bytes": stack}


def resources(cubin: bytes, kernel: str) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(cubin)
        done = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                              timeout=120)
    if done.returncode:
        raise ValueError(f"cuobjdump failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    return parse_resource_usage(done.stdout, kernel)
