"""The kernel report: every Triton kernel of versions 3 and 4 compiled for GPUs this machine need not have.

    python -m benchmarks.kernel_report            (all kernels, all presets, gfx942 gfx90a sm_90 sm_80)

Triton's pip wheel carries its compilers for AMD (AMDGCN, a code object) and NVIDIA (PTX, then a cubin made by
the ptxas it ships), and compiling needs no GPU. So on any machine, a CPU-only one included, this package:
  1. records the launches that a training step really makes (discovery.py): each version's model is built
     on meta tensors (shapes, no data) for a size preset and a target GPU, and its forward, backward and
     optimizer step run with Triton's launch replaced by a recorder; the launch configurations are therefore
     the ones the kernels' own rules choose for that GPU (triton_support.use_known_gpu);
  2. compiles each distinct launch for the target (compile.py), as Triton would at the first launch;
  3. reads the resources from the compiled code (amd.py: the AMDGCN kernel metadata; nvidia.py: the cubin's
     resource usage as cuobjdump reports it) and works out the occupancy they allow (occupancy.py);
  4. prints a table, writes JSON and a markdown summary (render.py).

What it proves and what it does not: that every kernel compiles for each target and fits its registers and
shared memory (LDS), and how many waves / warps can share a compute unit / SM. Not speed, and not correctness
on AMD hardware: that needs a run on such a GPU (version4_triton_ultra/README.md gives the commands).
"""
