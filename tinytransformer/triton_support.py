"""Triton set-up shared by the Triton versions (v3, v4).

Triton compiles kernels for a GPU. On a machine without one, Triton's interpreter runs the same kernels on
the CPU (slowly, but with the same semantics), which is how laptops and CI test them. The interpreter is
chosen by the environment variable TRITON_INTERPRET=1, read when `triton` is first imported, so
`enable_interpreter_if_no_gpu()` must run before any `import triton`.
"""
import dataclasses
import functools
import os
import sys

import torch

from tinytransformer.device import is_rocm as torch_built_for_rocm, release


def enable_interpreter_if_no_gpu(verbose: bool = False) -> bool:
    """Turn on Triton's CPU interpreter when no GPU is present. Returns True when the interpreter is on."""
    if torch.cuda.is_available():
        if interpreter_active():   # set by the user on a GPU machine: a CPU run of version 3 or 4
            repair_interpreter_for_numpy()
        return interpreter_active()
    if "triton" in sys.modules and not interpreter_active():
        raise RuntimeError("triton was imported before the interpreter could be enabled; "
                           "call enable_interpreter_if_no_gpu() before importing triton")
    os.environ["TRITON_INTERPRET"] = "1"
    repair_interpreter_for_numpy()
    if verbose:
        print("No GPU found: running Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1); "
              "correct but slow.")
    return True


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------------------------------------
# Triton's interpreter before 3.7 with NumPy 2.4 or newer
# ----------------------------------------------------------------------------------------------------------
# In the interpreter a program id or a scalar argument is a one-element NumPy array, and a kernel that uses one
# as a `range` bound (`for start in range(program * BLOCK, n, ...)`: most kernels here) makes the interpreter
# call int() on that array. NumPy 2.4 refuses int() of an array that is not 0-dimensional, so with Triton 3.6 or
# older (torch 2.11 pins Triton 3.6) and NumPy 2.4 or newer, those kernels stop with "only 0-dimensional arrays
# can be converted to Python scalars" (triton-lang/triton issue 9171). Triton 3.7 converts the array's single
# element instead; where the two versions meet, the interpreter is given that conversion here.
FIRST_TRITON_WITH_THE_CONVERSION = (3, 7)
FIRST_NUMPY_THAT_REFUSES = (2, 4)


def interpreter_needs_the_numpy_repair(triton_version: str, numpy_version: str) -> bool:
    return (release(triton_version) < FIRST_TRITON_WITH_THE_CONVERSION
            and release(numpy_version) >= FIRST_NUMPY_THAT_REFUSES)


def _one_element_as_int(tensor) -> int:
    return int(tensor.handle.data.reshape(-1)[0])


def repair_interpreter_for_numpy() -> bool:
    """Where Triton's interpreter cannot turn a one-element array into an int (above), teach it to. Only with the
    interpreter on (importing triton picks its mode); returns whether the interpreter now carries the repair."""
    if not interpreter_active():
        return False
    try:
        import numpy
        import triton
    except ImportError:   # no Triton (it is Linux-only): nothing to repair
        return False
    if not interpreter_needs_the_numpy_repair(triton.__version__, numpy.__version__):
        return False
    from triton.runtime import interpreter
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:   # a Triton laid out otherwise: leave it as it is
        return False
    if getattr(patch_tensor, "converts_one_element", False):
        return True

    def patch_tensor_then_index(tensor, *args, **kwargs):
        patch_tensor(tensor, *args, **kwargs)
        # Some releases record each patched attribute in a scope that restores it after the launch, others set
        # it directly. Either way, replace the __index__ just set.
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", _one_element_as_int)
        else:
            tensor.__index__ = _one_element_as_int

    patch_tensor_then_index.converts_one_element = True
    interpreter._patch_lang_tensor = patch_tensor_then_index
    return True


# The most programs a launch grid may have along its second and third axes (CUDA's limit on gridDim.y and z;
# the first axis allows 2**31 - 1). Kernels that number something large along the second axis check it.
MAX_GRID_SECOND_AXIS = 65535


# ----------------------------------------------------------------------------------------------------------
# Block sizes in the interpreter
# ----------------------------------------------------------------------------------------------------------
# The interpreter runs a kernel's programs one after another, and every block operation of a program as a few
# NumPy calls whose cost hardly depends on the block's size: a CPU step costs per program and per operation.
# So there the kernels choose blocks that fit the problem (interpreter_block: up to a cap), and few programs
# run. A GPU's choices are untouched by this: they are made on the other branch of each launch configuration.
# Kernel tests set SMALL_INTERPRETER_BLOCKS (the `small_interpreter_blocks` fixture in tests/conftest.py):
# each kernel then takes the smallest blocks it allows, so that a small test problem still spans several
# blocks and exercises the loops and masks that a GPU's large blocks exercise on large problems.
SMALL_INTERPRETER_BLOCKS = False


def small_interpreter_blocks() -> bool:
    """True when the interpreter's kernels should take their smallest blocks (kernel tests), False: blocks that
    fit the problem (a CPU run)."""
    return SMALL_INTERPRETER_BLOCKS


def interpreter_block(n: int, smallest: int, largest: int) -> int:
    """The interpreter's block for n elements: the power of two that covers them, within [smallest, largest]
    (both powers of two), so that one block, or a few, cover the problem."""
    covering = 1 << max(0, n - 1).bit_length()
    return max(smallest, min(largest, covering))


# ----------------------------------------------------------------------------------------------------------
# The GPU whose launch configurations the kernels choose
# ----------------------------------------------------------------------------------------------------------
# Launch configurations depend on the GPU: its vendor (warp of 32 or wavefront of 64), its multiprocessor count
# and its shared memory. Normally these are asked of the GPU this process runs on. The kernel report
# (python -m benchmarks.kernel_report) compiles the kernels for GPUs this machine does not have: it sets a
# KnownGpu with `use_known_gpu`, and then the same functions answer from that GPU's published limits, and meta
# tensors stand in for the GPU's tensors (launches are recorded, never run).
@dataclasses.dataclass(frozen=True)
class KnownGpu:
    target: str                     # the compiler's name: "gfx942", "sm_90"
    vendor: str                     # "amd" or "nvidia"
    multiprocessors: int            # SMs (NVIDIA) or compute units (AMD) of the GPU (one GCD of an MI250X)
    shared_memory_per_program: int  # bytes one program may use (NVIDIA: the opt-in maximum per block)


KNOWN_GPUS = {
    "gfx942": KnownGpu("gfx942", "amd", 304, 64 * 1024),      # MI300X (the MI300A has 228 CUs)
    "gfx90a": KnownGpu("gfx90a", "amd", 110, 64 * 1024),      # MI250X, one of its two GCDs
    "sm_90": KnownGpu("sm_90", "nvidia", 132, 227 * 1024),    # H100 SXM
    "sm_80": KnownGpu("sm_80", "nvidia", 108, 163 * 1024),    # A100
}
_known_gpu: KnownGpu | None = None


def use_known_gpu(gpu: KnownGpu | None) -> None:
    """Choose launch configurations for `gpu` (None: for the GPU of this process again)."""
    global _known_gpu
    _known_gpu = gpu


def is_gpu(device: torch.device) -> bool:
    """True for a GPU tensor's device; with a known GPU chosen, also for meta tensors, which stand in for it."""
    return device.type == "cuda" or (_known_gpu is not None and device.type == "meta")


def is_rocm() -> bool:
    """True on AMD GPUs: PyTorch's ROCm build reports a HIP version and still uses the torch.cuda API."""
    if _known_gpu is not None:   # the kernel report's stand-in GPU answers for the GPU it stands in for
        return _known_gpu.vendor == "amd"
    return torch_built_for_rocm()


def threads_per_warp() -> int:
    """Threads that execute in lock-step: a warp (32) on NVIDIA, a wavefront (64) on AMD CDNA GPUs.

    Triton's `num_warps` counts these units, so the same num_warps means twice the threads on AMD.
    """
    return 64 if is_rocm() else 32


def num_warps_for(block_elements: int, max_warps: int = 16) -> int:
    """A num_warps that gives each thread a few elements of a block of `block_elements` elements."""
    elements_per_thread = 8
    warps = max(1, block_elements // (elements_per_thread * threads_per_warp()))
    # Powers of two only: Triton requires it.
    warps = 1 << (warps.bit_length() - 1)
    return min(warps, max_warps)


@functools.lru_cache(maxsize=None)
def _multiprocessor_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) of a GPU: both are reported under this name.

    Cached: asking the driver for the device properties costs microseconds of host time, and kernels that size
    their grid by it are launched many times per training step."""
    if _known_gpu is not None:
        return _known_gpu.multiprocessors
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessor_count_of(index)


def nvidia_generation(device: torch.device) -> int | None:
    """The major number of an NVIDIA GPU's compute capability (8: Ampere, 9: Hopper, 10: Blackwell), None on AMD.
    Cached, as multiprocessor_count is. With a known GPU chosen (use_known_gpu), read from its target ("sm_90")."""
    if is_rocm():
        return None
    if _known_gpu is not None:
        return int(_known_gpu.target.removeprefix("sm_")) // 10
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compute_capability_major_of(index)


@functools.lru_cache(maxsize=None)
def _compute_capability_major_of(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def shared_memory_per_program(device: torch.device) -> int:
    """Bytes of shared memory (NVIDIA) or LDS (AMD) one Triton program may use on this GPU, as Triton's own
    driver reports it: about 227 KiB on an H100, 99 KiB on many Ampere and Ada cards, 64 KiB on an MI300.
    A kernel whose pipelined tiles need more fails to compile. With a known GPU chosen (use_known_gpu), its
    published limit: the same rule then sizes tiles for a GPU this machine does not have."""
    if _known_gpu is not None:
        return _known_gpu.shared_memory_per_program
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _driver_shared_memory(index)


@functools.lru_cache(maxsize=None)
def _driver_shared_memory(device_index: int) -> int:
    import triton   # here, not at the top: enable_interpreter_if_no_gpu must run before the first import
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


# A kernel module imports triton, then this module: if this is the first import of it, with the interpreter on,
# the repair is made now. Importing triton here instead would fix its mode too early for a process that turns the
# interpreter off before its kernels are defined (benchmarks/kernel_report/discovery.py: import_versions).
if "triton" in sys.modules:
    repair_interpreter_for_numpy()
