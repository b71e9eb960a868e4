"""A GEMM for Hopper written in Triton: tensor descriptors (TMA) and one program per SM that loops over tiles.

Version 4 leaves every plain GEMM of its step to the vendor BLAS (cuBLAS, hipBLASLt). Is that right, or would a
Triton GEMM written for the GPU do better? This kernel is a plain GEMM written in Triton for Hopper GPUs (measured
on an H200), so that the answer is measured, not assumed: compare_gemm_backends.py, beside it, times it against
cuBLAS at every GEMM of a preset's step, in the operand layouts the step uses. No version of the model calls it
(version 4's MEASUREMENTS.md, "Can a Triton GEMM beat cuBLAS here?", has the figures).

What it does that the GEMMs with epilogues (swiglu_gemm.py, qkv_rope_gemm.py) do not:
  - Tensor descriptors. A descriptor names a matrix in global memory (base, shape, strides) and a tile shape; one
    `desc.load([row, col])` has Hopper's tensor memory accelerator (TMA) copy the whole tile into shared memory,
    asynchronously, with no address arithmetic per thread, and with zeros where the tile hangs over the matrix's
    edge (no masks). The compiler keeps num_stages such copies in flight ahead of the tensor cores.
  - Persistent programs. The grid is one program per SM (at most one per tile); program p computes tiles p,
    p + programs, p + 2 * programs, ... A grid of one program per tile runs in waves, and the last wave leaves
    most SMs idle when the tiles do not divide evenly (wave quantisation); here each SM's programs stay resident,
    and `tl.range(..., flatten=True)` lets the compiler fetch the next tile's first inputs during the current
    tile's epilogue.
  - Grouped tile order. Consecutive tiles walk GROUP_M row blocks down one column block before moving right, so
    the programs running at once share their rows of b (and of a) in the L2 cache.

Operand layouts, as torch's a @ b takes them (a [M, K], b [K, N]): a either row-major or the transpose of a
row-major [K, M] (the weight gradient's grad_y.T), b either row-major [K, N] (an input gradient: grad_y @ W) or the
transpose of a row-major [N, K] (a forward pass: x @ W.T). Row-major here allows rows further apart than their
length (a column slice), as long as each row starts on a 16-byte boundary. The descriptor covers the matrix as it
is stored and the kernel transposes the tile it loaded (tl.dot reads either order from shared memory for 16-bit
types), so no operand is copied. Inputs are float16 or bfloat16, accumulated in float32; the output is the
inputs' dtype or float32 (as the step's weight gradients).

Where it runs: NVIDIA GPUs of compute capability 9 (Hopper) and newer, and Triton's CPU interpreter (the tests).
It has not been compiled for AMD GPUs; its launches are the H200's (below), and tma_gemm_problem says where it
cannot run.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tinytransformer.triton_support import (interpreter_active, interpreter_block, is_rocm, multiprocessor_count,
                                            small_interpreter_blocks)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
TMA_ALIGNMENT_BYTES = 16   # a descriptor's base address and every stride but the last are multiples of this


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _tile_origin(tile, row_blocks, col_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """(first row, first column) of output tile number `tile` in grouped order: GROUP_M row blocks at a time,
    down one column block, then the next column block (the last group may hold fewer row blocks)."""
    tiles_per_group = GROUP_M * col_blocks
    first_row_block = (tile // tiles_per_group) * GROUP_M
    rows_in_group = min(row_blocks - first_row_block, GROUP_M)
    row_block = first_row_block + (tile % tiles_per_group) % rows_in_group
    col_block = (tile % tiles_per_group) // rows_in_group
    return row_block * BLOCK_M, col_block * BLOCK_N


@triton.jit
def _tma_gemm_kernel(
    a_desc,      # a as stored: [M, K] in [BLOCK_M, BLOCK_K] tiles, or (A_TRANSPOSED) [K, M] in [BLOCK_K, BLOCK_M]
    b_desc,      # b as stored: [K, N] in [BLOCK_K, BLOCK_N] tiles, or (B_TRANSPOSED) [N, K] in [BLOCK_N, BLOCK_K]
    c_desc,      # out: [M, N], tiles [BLOCK_M, BLOCK_N], in the output dtype
    n_rows, n_cols, n_inner,
    A_TRANSPOSED: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,   # a constant of the compiled loop: each grid size under one per SM compiles anew
):
    """Program p: output tiles p, p + PROGRAMS, ... ; each the float32 sum over K of a-tile x b-tile products."""
    row_blocks = tl.cdiv(n_rows, BLOCK_M)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    k_steps = tl.cdiv(n_inner, BLOCK_K)
    for tile in tl.range(tl.program_id(0), row_blocks * col_blocks, PROGRAMS, flatten=True):
        row, col = _tile_origin(tile, row_blocks, col_blocks, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_step in range(k_steps):
            k = k_step * BLOCK_K
            if A_TRANSPOSED:
                a = a_desc.load([k, row]).T
            else:
                a = a_desc.load([row, k])
            if B_TRANSPOSED:
                b = b_desc.load([col, k]).T
            else:
                b = b_desc.load([k, col])
            acc = tl.dot(a, b, acc)
        c_desc.store([row, col], acc.to(c_desc.dtype))   # the TMA unit drops what lies past the matrix's edge


# ----------------------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------------------
# From compare_gemm_backends.py on one H200 (bfloat16, every GEMM of the four presets' steps, each alone
# in graph replays: benchmarks/results/kernel_time/h200_gemm_backends_*.json). With a 16-bit output, 128 x 256
# tiles on 8 warps and 3 stages were the fastest launch at the medium and large presets' shapes, and 128 x 128
# tiles on 4 warps and 4 stages wherever the large tiles leave SMs idle: an output of few tiles (the tiny and
# small presets), or a number of tiles that ends in a thin last wave (the medium preset's down-projection input
# gradient: 704 large tiles are 5.3 waves of 132 SMs, 1,408 small ones 10.7). Which one a shape gets is that
# count: waves of large tiles, each taking about BIG_TILE_COST times a small tile's time, against waves of
# small tiles (this rule picks the faster of the two at every one of those 44 GEMMs). With a float32 output
# (the weight gradients), whose tile waits in shared memory for its store, 128 x 128 tiles on 4 warps and 4
# stages (128 x 256 with 3 stages needs more shared memory than an SM has).
HOPPER_LAUNCH = {"16-bit": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
                 "16-bit, few tiles": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4,
                                           num_stages=4),
                 "float32": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)}
BIG_TILE_COST = 1.9   # a 128 x 256 tile's time in 128 x 128 tiles' (twice the work, a little more efficient)


def _waves(n_rows: int, n_cols: int, launch: dict, programs: int) -> int:
    tiles = triton.cdiv(n_rows, launch["BLOCK_M"]) * triton.cdiv(n_cols, launch["BLOCK_N"])
    return triton.cdiv(tiles, programs)


def launch_for(out_dtype: torch.dtype, n_rows: int, n_cols: int, n_inner: int, device: torch.device) -> dict:
    """Tiles, tile order, warps and stages for an [n_rows, n_cols] output with an inner dimension n_inner."""
    if interpreter_active():
        if small_interpreter_blocks():   # kernel tests: the smallest tiles, so small problems span several
            return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
        # A CPU run: NumPy runs each block operation, at a cost per call: few, large tiles.
        return dict(BLOCK_M=interpreter_block(n_rows, 16, 128), BLOCK_N=interpreter_block(n_cols, 16, 128),
                    BLOCK_K=interpreter_block(n_inner, 16, 128), GROUP_M=8, num_warps=1, num_stages=1)
    if out_dtype == torch.float32:
        return dict(HOPPER_LAUNCH["float32"])
    sms = multiprocessor_count(device)
    big, small = HOPPER_LAUNCH["16-bit"], HOPPER_LAUNCH["16-bit, few tiles"]
    big_time = BIG_TILE_COST * _waves(n_rows, n_cols, big, sms)
    return dict(big if big_time <= _waves(n_rows, n_cols, small, sms) else small)


def program_count(device: torch.device, tiles: int) -> int:
    """One program per SM, never more than there are tiles; in the interpreter 3, so that a program takes
    several tiles even in a small test."""
    if interpreter_active():
        return max(1, min(3, tiles))
    return max(1, min(multiprocessor_count(device), tiles))


# ----------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------
def tma_gemm_problem(device: torch.device) -> str | None:
    """Why tma_gemm cannot run on `device` (one line), or None: it needs Triton's interpreter or an NVIDIA GPU
    of compute capability 9 or newer (the tensor memory accelerator)."""
    if interpreter_active():
        return None
    if device.type != "cuda":
        return f"the TMA GEMM runs on an NVIDIA GPU or in Triton's interpreter, not on {device.type}"
    if is_rocm():
        return "the TMA GEMM was written and measured for NVIDIA's Hopper GPUs only; not compiled for AMD"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (f"the TMA GEMM needs compute capability 9.0 or newer (Hopper: H100, H200); this GPU has "
                f"{major}.{minor}")
    return None


def stored_matrix(operand: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    """(the row-major matrix an operand is, or is the transpose of; True if transposed). A descriptor reads a
    matrix whose elements are contiguous along one dimension; anything else is a ValueError naming the operand."""
    if operand.dim() != 2:
        raise ValueError(f"{name} must be a matrix; got {operand.dim()} dimensions")
    rows, cols = operand.shape
    if operand.stride(1) == 1 and operand.stride(0) >= max(cols, 1):
        return operand, False
    if operand.stride(0) == 1 and operand.stride(1) >= max(rows, 1):
        return operand.T, True
    raise ValueError(f"{name} must be row-major or the transpose of a row-major matrix; got strides "
                     f"{tuple(operand.stride())} for shape {tuple(operand.shape)}")


def _check_alignment(matrix: torch.Tensor, name: str) -> None:
    row_bytes = matrix.stride(0) * matrix.element_size()   # from one row's start to the next's
    if row_bytes % TMA_ALIGNMENT_BYTES or matrix.data_ptr() % TMA_ALIGNMENT_BYTES:
        raise ValueError(f"{name} as stored is [{matrix.shape[0]}, {matrix.shape[1]}] {matrix.dtype}: a TMA "
                         f"descriptor needs its rows and its start on {TMA_ALIGNMENT_BYTES}-byte boundaries "
                         f"(here rows start {row_bytes} bytes apart)")


def _check_operands(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> None:
    if a.dtype not in SUPPORTED_DTYPES or b.dtype != a.dtype:
        raise ValueError(f"a and b must share one dtype of {SUPPORTED_DTYPES}; got {a.dtype} and {b.dtype}")
    if out_dtype not in (a.dtype, torch.float32):
        raise ValueError(f"the output is {a.dtype} or torch.float32; got {out_dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need a [M, K] and b [K, N]; got {list(a.shape)} and {list(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} and b on {b.device}")
    problem = tma_gemm_problem(a.device)
    if problem:
        raise ValueError(problem)


def _new_output(shape, dtype, device):
    """Every buffer the kernel fills is allocated here (uninitialised: the kernel writes every element), so that
    tests can hand out NaN-filled buffers instead and catch an element it forgets to write."""
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------
def tma_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
             launch: dict | None = None) -> torch.Tensor:
    """a @ b for a [M, K] and b [K, N] (each row-major or the transpose of a row-major matrix; 16-bit), summed in
    float32 and returned in out_dtype (a's dtype unless float32 is asked for). `launch` replaces launch_for's
    choice (the keys of HOPPER_LAUNCH's entries), for tuning."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    _check_operands(a, b, out_dtype)
    n_rows, n_inner = a.shape
    n_cols = b.shape[1]
    out = _new_output((n_rows, n_cols), out_dtype, a.device)
    if out.numel() == 0 or n_inner == 0:   # nothing to compute: an empty output, or sums of no terms
        return out.zero_()
    a_stored, a_transposed = stored_matrix(a, "a")
    b_stored, b_transposed = stored_matrix(b, "b")
    for matrix, name in ((a_stored, "a"), (b_stored, "b"), (out, "the output")):
        _check_alignment(matrix, name)
    config = dict(launch or launch_for(out_dtype, n_rows, n_cols, n_inner, a.device))
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a_stored, [block_k, block_m] if a_transposed else [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(b_stored, [block_n, block_k] if b_transposed else [block_k, block_n])
    c_desc = TensorDescriptor.from_tensor(out, [block_m, block_n])
    programs = program_count(a.device, triton.cdiv(n_rows, block_m) * triton.cdiv(n_cols, block_n))
    _tma_gemm_kernel[(programs,)](a_desc, b_desc, c_desc, n_rows, n_cols, n_inner, A_TRANSPOSED=a_transposed,
                                  B_TRANSPOSED=b_transposed, PROGRAMS=programs, **config)
    return out
