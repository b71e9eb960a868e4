"""Programmatic dependent launch: a kernel is launched while the kernel before it is still finishing.

Normally a kernel in a stream is launched only when the one before it has completed: its programs have exited and
their writes have been made visible to the whole GPU, and only then are the new kernel's programs placed on the
SMs. On NVIDIA GPUs from Hopper on (compute capability 9), a kernel launched with the programmatic-stream-
serialization attribute may be launched earlier: once every program of the kernel before it has exited, or has
said that it may (`griddepcontrol.launch_dependents`). Its programs then wait (`griddepcontrol.wait`) until that
kernel has completed and its writes are visible. A CUDA graph keeps the attribute as a programmatic edge, so the
graph-captured step has it on every replay.

So every Triton kernel of version 4 starts with `wait_for_previous_kernel(PDL)`: with PDL (a constexpr) it waits
for the kernel before it before it reads or writes anything. Nothing moves earlier than the wait, so the results
are those of the kernels launched one after another. Without PDL (AMD GPUs, NVIDIA GPUs before Hopper, Triton's
CPU interpreter, or `--no-programmatic-launch`) the branch is compiled away.

Our kernels never say early that the next one may launch. Saying it as a program starts was tried: the next
kernel's programs were then placed during this kernel's last wave and held their SM slots while they waited,
and the small preset's step took 2.4% longer; waiting only, it took the same time as without, and the seed
model's 1.7% less (version 4's MEASUREMENTS.md, "Triton kernels launched before the one before them has completed").

Only kernels launched with the attribute are launched early: the vendor GEMMs (cuBLAS), cuDNN's attention and
PyTorch's own kernels are launched as before, each once the kernel before it has completed.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tinytransformer.triton_support import interpreter_active, is_gpu, nvidia_generation

# The training script's --no-programmatic-launch turns it off (set_programmatic_launch): the form to compare.
_enabled = True


def set_programmatic_launch(enabled: bool) -> None:
    """Launch version 4's kernels with programmatic dependent launch where the GPU has it (True), or never."""
    global _enabled
    _enabled = enabled


def programmatic_launch_enabled() -> bool:
    return _enabled


def gpu_has_programmatic_launch(device: torch.device) -> bool:
    """True on an NVIDIA GPU of compute capability 9 or more (Hopper, Blackwell): the GPUs with griddepcontrol.
    With a known GPU chosen (the kernel report), that GPU's answer; in Triton's CPU interpreter, False."""
    if interpreter_active() or not is_gpu(device):
        return False
    generation = nvidia_generation(device)
    return generation is not None and generation >= 9


def launch_options(device: torch.device) -> dict:
    """The extra arguments of a kernel launch: PDL=True and Triton's launch_pdl option where programmatic
    dependent launch applies, else none (the kernel's PDL then keeps its default, False)."""
    if _enabled and gpu_has_programmatic_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """The first statement of every kernel. With PDL: wait until the kernel before this one in its stream has
    completed and its writes are visible (this kernel may have been launched before that)."""
    if PDL:
        gdc_wait()
