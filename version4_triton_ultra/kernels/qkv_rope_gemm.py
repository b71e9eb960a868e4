"""The fused QKV projection with RoPE in its epilogue: q and k leave the GEMM already rotated.

Attention needs q and k rotated by RoPE. Rotating them as the attention kernel loads them (version 4's first
way, `flash_attention_packed(..., rope=...)` in flash_attention.py) costs more than it looks: the forward
kernel loads every key block once per query block that visits it, so a k row is rotated up to S / BLOCK_M
times over, and the kernel has to write the rotated q and k (and a copy of v) for the backward pass. The
GEMM that produces q and k is a better place: there every element of q and k is rotated exactly once, while the
tile is still in registers (the epilogue), and the one [N, 3D] output is at once what attention reads and what
its backward reads.

    qkv_rope(x, W_qkv, cos, sin, S, Dh)      qkv = x @ W_qkv^T, [N, 3D], columns [q heads | k heads | v heads];
                                             then, in the same program, every q and k head rotated:
                                             rot(t) = t * cos + rotate_half(t) * sin (the rotate-half
                                             convention of ../../version3_triton/kernels/rope.py).

Row r of x is position r % seq_len of its sequence (x is [B * S, D] flattened). A program's BLOCK_N columns
are whole heads (BLOCK_N is a multiple of the head dim, both powers of two), so rotate_half, which pairs
column j of a head with column j + Dh/2, never needs a column of another program. The rotation runs in
float32 on the product rounded to the output dtype first, exactly what rotating a GEMM's stored output would
compute.

The backward pass needs no kernel here: the attention backward returns dq and dk rotated back (the transpose
of the rotation), which are the gradients of the GEMM's unrotated output, and the GEMM's backward is two
ordinary vendor GEMMs. Offsets into the activations are int64; into the weights int32 (weights of up to
2**31 elements; shape_problem says so before a model is built).
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (interpreter_active, interpreter_block, is_rocm, shared_memory_per_program,
                                            small_interpreter_blocks)
# The head dims are the attention kernels' (this GEMM's output is their input), and rotate_half is defined beside
# them: one definition of each in version 4.
from version4_triton_ultra.kernels.flash_attention import SUPPORTED_HEAD_DIMS, rotate_half
from version4_triton_ultra.kernels.swiglu_gemm import MAX_ROW_BLOCKS, SUPPORTED_DTYPES, dot_precision
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel
from version4_triton_ultra.kernels.whole_tiles import load_tile, store_tile, whole_tiles


@triton.jit
def _qkv_rope_kernel(
    x_ptr,        # [n_rows, n_in], contiguous
    w_ptr,        # [3 * D, n_in], contiguous: rows [q; k; v] (the fused QKV projection's weight)
    cos_ptr,      # [>= seq_len, HEAD_DIM] float32, contiguous: cos of position p, column j
    sin_ptr,      # same shape: sin
    qkv_ptr,      # out: [n_rows, 3 * D]
    n_rows, n_in, dim, seq_len,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WHOLE_TILES: tl.constexpr = False,   # every dimension a whole number of tiles: no masks (whole_tiles.py)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: rows [BLOCK_M] x columns [BLOCK_N] of qkv. Grid: (cdiv(3D, BLOCK_N), cdiv(N, BLOCK_M)); the
    column blocks of one row block run side by side and share its x tile in L2."""
    wait_for_previous_kernel(PDL)
    col_start = tl.program_id(0) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # int64: N * 3D may pass 2**31
    row_mask, col_mask = rows < n_rows, cols < 3 * dim

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, n_in, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < n_in
        x = load_tile(x_ptr + rows[:, None] * n_in + ks[None, :], row_mask[:, None] & k_mask[None, :], WHOLE_TILES)
        w = load_tile(w_ptr + cols[:, None] * n_in + ks[None, :], col_mask[:, None] & k_mask[None, :], WHOLE_TILES)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)

    # The epilogue. Round to the output dtype first, as a GEMM storing qkv would, then rotate q and k.
    qkv = acc.to(qkv_ptr.dtype.element_ty)
    if col_start < 2 * dim:   # the tile holds q or k columns (v is stored as it is)
        # The tile as [row, head, column within the head]: every head of a row shares its position's cos and
        # sin, so the tables are read as [BLOCK_M, HEAD_DIM] and broadcast over the heads. (Reading them as a
        # full [BLOCK_M, BLOCK_N] tile made this kernel 1.6x slower on an H100.)
        heads_per_tile: tl.constexpr = BLOCK_N // HEAD_DIM
        table_offsets = (rows % seq_len)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        cos = tl.load(cos_ptr + table_offsets)[:, None, :]   # rows past n_rows still index a real position
        sin = tl.load(sin_ptr + table_offsets)[:, None, :]
        heads = tl.reshape(qkv.to(tl.float32), (BLOCK_M, heads_per_tile, HEAD_DIM))
        # rotate_half pairs the two halves of each head: one head per row of a [BLOCK_M * heads, HEAD_DIM] view.
        swapped = tl.reshape(rotate_half(tl.reshape(heads, (BLOCK_M * heads_per_tile, HEAD_DIM)),
                                          BLOCK_M * heads_per_tile, HEAD_DIM), (BLOCK_M, heads_per_tile, HEAD_DIM))
        rotated = tl.reshape(heads * cos + swapped * sin, (BLOCK_M, BLOCK_N)).to(qkv_ptr.dtype.element_ty)
        qkv = tl.where((cols < 2 * dim)[None, :], rotated, qkv)   # a tile may end in v's first heads
    store_tile(qkv_ptr + rows[:, None] * (3 * dim) + cols[None, :], qkv, row_mask[:, None] & col_mask[None, :],
               WHOLE_TILES)


def _new_output(shape, dtype, device):
    """The output buffer (uninitialised: the kernel writes every element); tests hand out NaN-filled ones."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_config(dtype: torch.dtype, n_rows: int, head_dim: int, width: int = 0, n_in: int = 0) -> dict:
    """Tiles, warps and pipeline stages for n_rows rows of width = 3D output columns and an inner dimension of
    n_in; BLOCK_N holds whole heads. On a GPU, from a sweep of 12 configs on an H100 (hidden 256, head dim 32;
    N = 1024 and 16384 rows), the kernel alone replayed from a graph: the fastest, or within 5% of it. Beside
    cuBLAS's plain QKV GEMM: 23.4 vs 17.2 us at N = 16384 in bfloat16, 4.2 vs 3.2 us at N = 1024; in float32
    (TF32) 5.6 vs 7.0 us. On another GPU the best choice may differ."""
    if interpreter_active():
        if small_interpreter_blocks():
            # Kernel tests: the smallest tiles (16 is tl.dot's minimum), so small problems span several tiles.
            return dict(BLOCK_M=16, BLOCK_N=max(16, head_dim), BLOCK_K=16, num_warps=1, num_stages=1)
        # A CPU run: NumPy executes each block operation of each program, at a cost per call, so tiles as large
        # as the problem (up to 128 rows x 256 columns, 256 deep; powers of two, so whole heads) leave few
        # programs and few loop iterations.
        return dict(BLOCK_M=interpreter_block(n_rows, 16, 128),
                    BLOCK_N=interpreter_block(width, max(16, head_dim), 256),
                    BLOCK_K=interpreter_block(n_in, 16, 256), num_warps=1, num_stages=1)
    # AMD GPUs have 64 KiB of shared memory per compute unit (an H100 228 KiB): fewer stages there, and
    # _fit_shared_memory makes the tiles shallower where they would not fit.
    stages = 2 if is_rocm() else 3
    # Wider column tiles when there are enough rows to fill the GPU (and in float32, at any size).
    block_n = max(128, head_dim) if n_rows >= 8192 or dtype == torch.float32 else max(64, head_dim)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=stages)
    return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, num_warps=8, num_stages=stages)


def _fit_shared_memory(config: dict, itemsize: int, budget: int) -> dict:
    """The config with BLOCK_K halved until its pipelined x and weight tiles, num_stages x (BLOCK_M + BLOCK_N) x
    BLOCK_K elements, take at most 3/4 of `budget` bytes of shared memory (the rest is left for Triton's own
    buffers, such as the epilogue's reshapes). The tiles above were chosen on an H100, where they fit as they
    are; on a GPU with less shared memory a config that does not fit would fail to compile."""
    config = dict(config)
    while (config["num_stages"] * (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * itemsize
           > budget * 3 // 4 and config["BLOCK_K"] > 16):
        config["BLOCK_K"] //= 2
    return config


# Offsets into the weight are int32 (see the module docstring): its 3D x K elements must stay addressable.
MAX_WEIGHT_ELEMENTS = 2**31


def _config_problem(n_rows: int, head_dim: int, config: dict) -> str | None:
    if config["BLOCK_N"] % head_dim:
        return f"the column tile ({config['BLOCK_N']}) must hold whole heads of {head_dim}"
    row_blocks = triton.cdiv(n_rows, config["BLOCK_M"])
    if row_blocks > MAX_ROW_BLOCKS:
        return (f"{n_rows} rows need {row_blocks} row blocks of {config['BLOCK_M']}; the grid allows "
                f"{MAX_ROW_BLOCKS}: use a smaller batch x sequence")
    return None


def head_dim_problem(head_dim: int) -> str | None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} not supported; use one of {SUPPORTED_HEAD_DIMS}"
    return None


def _weight_problem(width: int, n_in: int) -> str | None:
    if width * n_in > MAX_WEIGHT_ELEMENTS:
        return (f"the QKV weight [3D, K] = [{width}, {n_in}] has more than 2**31 elements, and the kernel's offsets "
                f"into it are 32-bit")
    return None


def checked_rope_tables(cos: torch.Tensor, sin: torch.Tensor, n_rows: int, seq_len: int, head_dim: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables as the kernels read them: their first seq_len positions, float32, contiguous, on
    device. Raises ValueError unless n_rows are whole sequences of seq_len and both tables are [>= seq_len,
    head_dim]. Both RoPE kernels (this GEMM and qk_rotation.rotate_qk_) take their tables through here."""
    if seq_len < 1 or n_rows % seq_len:
        raise ValueError(f"{n_rows} rows are not whole sequences of {seq_len}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] < seq_len or table.shape[1] != head_dim:
            raise ValueError(f"rope {name} table must be [>= {seq_len}, {head_dim}]; got {list(table.shape)}")
    return tuple(table[:seq_len].to(device=device, dtype=torch.float32).contiguous() for table in (cos, sin))


def shape_problem(n_rows: int, n_in: int, dim: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot compute the rotated qkv [N, 3D] of N = n_rows rows from an inner dimension K = n_in
    with heads of head_dim in dtype (one line), or None when it can: the head dims it supports, the weight's
    32-bit offsets, and its launch choice on this machine (column tiles of whole heads, row blocks within the
    grid's limit). qkv_rope raises it; version 4's check_arguments asks it before anything is built."""
    config = _launch_config(dtype, n_rows, head_dim, 3 * dim, n_in)
    return (head_dim_problem(head_dim) or _weight_problem(3 * dim, n_in)
            or _config_problem(n_rows, head_dim, config))


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_len: int,
             head_dim: int) -> torch.Tensor:
    """qkv = x @ weight^T with its q and k heads rotated by RoPE.

    x: [N, K] with N = B * seq_len (row r is position r % seq_len); weight: [3D, K], rows [q; k; v], one dtype
    with x among float32 / float16 / bfloat16; cos, sin: [>= seq_len, head_dim] tables (any float dtype; read
    as float32). Returns qkv: [N, 3D] in x's dtype.
    """
    if x.dtype not in SUPPORTED_DTYPES or x.dim() != 2 or weight.dim() != 2 or weight.dtype != x.dtype:
        raise ValueError(f"need x [N, K] and weight [3D, K] of one dtype among {SUPPORTED_DTYPES}; got {x.dtype} "
                         f"{list(x.shape)} and {weight.dtype} {list(weight.shape)}")
    n_rows, n_in = x.shape
    width = weight.shape[0]
    problem = head_dim_problem(head_dim)
    if problem:
        raise ValueError(problem)
    if weight.shape[1] != n_in or width % 3 or (width // 3) % head_dim:
        raise ValueError(f"weight must be [3D, {n_in}] with D a multiple of head_dim {head_dim}; "
                         f"got {list(weight.shape)}")
    cos, sin = checked_rope_tables(cos, sin, n_rows, seq_len, head_dim, x.device)
    dim = width // 3
    config = _launch_config(x.dtype, n_rows, head_dim, width, n_in)
    if not interpreter_active():
        config = _fit_shared_memory(config, x.element_size(), shared_memory_per_program(x.device))
    problem = _weight_problem(width, n_in) or _config_problem(n_rows, head_dim, config)
    if problem:
        raise ValueError(problem)
    x, weight = x.contiguous(), weight.contiguous()
    qkv = _new_output((n_rows, width), x.dtype, x.device)
    if n_rows == 0:
        return qkv
    grid = (triton.cdiv(width, config["BLOCK_N"]), triton.cdiv(n_rows, config["BLOCK_M"]))
    _qkv_rope_kernel[grid](x, weight, cos, sin, qkv, n_rows, n_in, dim, seq_len,
                           HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(x.dtype), **config,
                           WHOLE_TILES=whole_tiles(config, M=n_rows, N=width, K=n_in), **launch_options(x.device))
    return qkv
