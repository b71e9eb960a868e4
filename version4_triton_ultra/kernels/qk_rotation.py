"""RoPE as a kernel of its own: the form that the QKV GEMM's epilogue (qkv_rope_gemm.py) replaces.

    rotate_qk_(qkv, cos, sin, S, Dh)     in place, on a packed qkv [N, 3D] (columns [q heads | k heads | v heads],
                                         the vendor QKV GEMM's output): every q and k head rotated,
                                         rot(t) = t * cos + rotate_half(t) * sin; v is not touched.
    rotate_qk_(..., inverse=True)        the inverse rotation (by -angle, sin negated): RoPE's backward, turning
                                         the gradients of rotated q and k into those of the unrotated product.

Version 4 runs it from about a billion multiply-adds in the QKV GEMM (fused_layers.separate_rope_pays) and under
--separate-rope: the QKV product then comes from the vendor BLAS (cuBLAS, hipBLASLt), and RoPE costs one more
pass over q and k. Whether the epilogue wins depends on the shape (at large sizes the vendor GEMM is faster than
the Triton one by more than that pass costs); --rope-in-gemm and --separate-rope are there to measure it. With
version 4's attention kernels the backward pass needs nothing from this file in either form: their backward returns
dq and dk rotated back, the gradients of the unrotated product. With the vendor's attention (fused_layers:
vendor_attention_pays) the gradients come back rotated, and the inverse rotation here turns them back: RoPE is a
rotation by an angle per position and column pair, so its transpose, and inverse, rotates by minus that angle.
The arithmetic is the epilogue's: float32 on the stored (rounded) product, the result rounded once to qkv's dtype.

A program rotates BLOCK_M rows x HEADS heads. It loads each head as its two halves (columns j and j + Dh/2 are
the pairs rotate_half mixes), so no element is shuffled in registers, and reads the cos and sin tables once per
row as [BLOCK_M, Dh/2] halves broadcast over its heads. Row offsets are int64 (N x 3D passes 2**31 at large
batches), and the row blocks run on the grid's first axis, so on NVIDIA GPUs the number of rows has no limit of
its own (on AMD the row blocks x threads of a launch must fit 32 bits: about 16.8M rows).
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (MAX_GRID_SECOND_AXIS, interpreter_active, interpreter_block, is_rocm,
                                            small_interpreter_blocks, threads_per_warp)
# The head dims are the attention kernels' (qkv is their input), and the cos / sin tables are read as the QKV
# GEMM's epilogue reads them: one definition of each in version 4.
from version4_triton_ultra.kernels.flash_attention import SUPPORTED_HEAD_DIMS
from version4_triton_ultra.kernels.qkv_rope_gemm import checked_rope_tables, head_dim_problem
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_qk_kernel(
    qkv_ptr,      # [n_rows, 3 * dim], contiguous; rotated in place
    cos_ptr,      # [>= seq_len, HEAD_DIM] float32, contiguous: cos of position p, column j
    sin_ptr,      # same shape: sin
    n_rows, dim, seq_len,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
    INVERSE: tl.constexpr,   # rotate by minus the angle: sin(-a) = -sin(a), cos(-a) = cos(a)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """Grid: (cdiv(n_rows, BLOCK_M), cdiv(2 * dim / HEAD_DIM, HEADS)). Heads are numbered over q then k. The row
    blocks are on the grid's first axis, which allows 2**31 - 1 programs (the second allows 65,535)."""
    wait_for_previous_kernel(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    halves = tl.arange(0, HALF)
    mask = (rows < n_rows)[:, None, None] & (heads < 2 * dim // HEAD_DIM)[None, :, None]
    # [row, head, column within the first half]; the second half is HALF columns further on.
    first = rows[:, None, None] * (3 * dim) + heads[None, :, None] * HEAD_DIM + halves[None, None, :]
    x1 = tl.load(qkv_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + first + HALF, mask=mask, other=0.0).to(tl.float32)

    table = (rows % seq_len)[:, None] * HEAD_DIM + halves[None, :]   # every row indexes a real position
    cos1 = tl.load(cos_ptr + table)[:, None, :]
    sin1 = tl.load(sin_ptr + table)[:, None, :]
    cos2 = tl.load(cos_ptr + table + HALF)[:, None, :]
    sin2 = tl.load(sin_ptr + table + HALF)[:, None, :]
    if INVERSE:
        sin1, sin2 = -sin1, -sin2
    # rotate_half(t) = [-t2, t1], so t * cos + rotate_half(t) * sin is, half by half:
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    tl.store(qkv_ptr + first, out1.to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(qkv_ptr + first + HALF, out2.to(qkv_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_rows: int, rotated_heads: int, head_dim: int) -> dict:
    """Rows and heads per program. On a GPU: every q and k head of a row up to 1,024 columns, rows to make 2,048
    elements a program, 8 warps. From tune_qk_rotation.py on an H200 (the small, medium and large presets'
    shapes, bfloat16, and medium in float32; benchmarks/results/kernel_time/h200_rotation_launch.json): the
    fastest launch or within 2% of it at each, where 8,192-element programs of 4 warps had taken 25-33% longer in
    bfloat16 (6% in float32).
    Nothing here depends on the warp's width (32 on NVIDIA, 64 on AMD: there 4 elements a thread)."""
    heads = triton.next_power_of_2(rotated_heads)
    if interpreter_active():
        if small_interpreter_blocks():   # kernel tests: small blocks, so small problems span several
            return dict(BLOCK_M=4, HEADS=1, num_warps=1)
        return dict(BLOCK_M=interpreter_block(n_rows, 16, 256), HEADS=heads, num_warps=1)
    heads = min(heads, max(1, 1024 // head_dim))
    return dict(BLOCK_M=max(1, 2048 // (heads * head_dim)), HEADS=heads, num_warps=8)


def _grid(n_rows: int, rotated_heads: int, config: dict) -> tuple:
    return triton.cdiv(n_rows, config["BLOCK_M"]), triton.cdiv(rotated_heads, config["HEADS"])


# On AMD GPUs a launch's programs x threads along one axis must fit 32 bits (the HIP dispatch counts work items).
MAX_WORK_ITEMS_PER_AXIS = 2**32 - 1


def _grid_problem(n_rows: int, rotated_heads: int, config: dict) -> str | None:
    row_blocks, head_blocks = _grid(n_rows, rotated_heads, config)
    if head_blocks > MAX_GRID_SECOND_AXIS:
        return (f"{rotated_heads} q and k heads need {head_blocks} blocks of {config['HEADS']}; the grid allows "
                f"{MAX_GRID_SECOND_AXIS}: use fewer heads")
    threads = config["num_warps"] * threads_per_warp()
    if is_rocm() and row_blocks * threads > MAX_WORK_ITEMS_PER_AXIS:
        return (f"{n_rows} rows need {row_blocks} row blocks of {threads} threads, more than a HIP launch counts "
                f"(2**32 work items): use a smaller batch x sequence")
    return None


def shape_problem(n_rows: int, dim: int, head_dim: int) -> str | None:
    """Why the kernel cannot rotate a qkv of n_rows rows of 3 x dim columns with heads of head_dim (one line), or
    None when it can: the head dims it supports and its grid's head blocks under this machine's launch choice.
    rotate_qk_ raises it; version 4's check_arguments asks it before anything is built."""
    problem = head_dim_problem(head_dim)
    if problem:
        return problem
    rotated_heads = 2 * dim // head_dim
    return _grid_problem(n_rows, rotated_heads, _launch_config(n_rows, rotated_heads, head_dim))


def rotate_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_len: int, head_dim: int,
               launch: dict | None = None, inverse: bool = False) -> torch.Tensor:
    """Rotates the q and k heads of qkv [N, 3D] (N = B * seq_len; row r is position r % seq_len) by RoPE, in
    place, and returns qkv. cos, sin: [>= seq_len, head_dim] tables (any float dtype; read as float32).
    inverse: rotate by minus RoPE's angles instead (undoes a rotation; RoPE's backward).
    launch: BLOCK_M, HEADS and num_warps instead of _launch_config's (tune_qk_rotation.py's candidates)."""
    if qkv.dtype not in SUPPORTED_DTYPES or qkv.dim() != 2 or not qkv.is_contiguous():
        raise ValueError(f"need a contiguous qkv [N, 3D] in one of {SUPPORTED_DTYPES}; got {qkv.dtype} "
                         f"{list(qkv.shape)}")
    n_rows, width = qkv.shape
    problem = shape_problem(n_rows, width // 3, head_dim)
    if problem:
        raise ValueError(problem)
    if width % 3 or (width // 3) % head_dim:
        raise ValueError(f"qkv must be [N, 3D] with D a multiple of head_dim {head_dim}; got {list(qkv.shape)}")
    cos, sin = checked_rope_tables(cos, sin, n_rows, seq_len, head_dim, qkv.device)
    if n_rows == 0:
        return qkv
    dim = width // 3
    rotated_heads = 2 * dim // head_dim
    config = launch or _launch_config(n_rows, rotated_heads, head_dim)
    if launch:   # the rule's own launch passed shape_problem above
        problem = _grid_problem(n_rows, rotated_heads, launch)
        if problem:
            raise ValueError(problem)
    _rotate_qk_kernel[_grid(n_rows, rotated_heads, config)](qkv, cos, sin, n_rows, dim, seq_len, HEAD_DIM=head_dim,
                                                             INVERSE=inverse, **config,
                                                             **launch_options(qkv.device))
    return qkv
