"""The feed-forward block's GEMMs with SwiGLU in their epilogues: no SwiGLU pass of its own, either way.

The feed-forward block computes  gate_up = x W_gu^T  ->  h = silu(gate) * up  ->  y = h W_down^T.
With a vendor GEMM the SwiGLU is a kernel of its own between the two GEMMs: the first GEMM writes gate_up
([N, 2F]) to memory, the SwiGLU kernel reads it back and writes h. The backward pass has the same shape:
the down projection's input-gradient GEMM writes dh, and a SwiGLU-backward kernel reads dh and gate_up to
write d(gate_up). Here each SwiGLU rides on the GEMM before it, in the GEMM's epilogue (the code that runs on
an output tile while it is still in registers, after the loop over the inner dimension):

    gate_up_swiglu(x, W_gu)                      one program: a tile of gate AND the same tile of up (two
                                                 accumulators), then h = silu(gate) * up from those registers.
                                                 Writes gate_up (the backward pass needs it) and h.
    down_swiglu_backward(dy, W_down, gate_up)    one program: a tile of dh = dy W_down, then, reading the
                                                 matching tiles of gate and up, d(gate) and d(up). dh itself
                                                 never reaches memory.

Forward, the SwiGLU kernel's read of gate_up disappears; backward, the write and the read of dh. The
formulas are the SwiGLU kernels' (../../version3_triton/kernels/swiglu.py), in float32, on gate, up and dh
rounded to the storage dtype first, as when a GEMM had written them to memory.

These are ordinary Triton GEMMs: a program owns a BLOCK_M x BLOCK_N output tile and loops over the inner
dimension BLOCK_K at a time with tl.dot (tensor cores; float32 inputs in TF32 when torch's TF32 switch
(`tinytransformer.precision`) is on, as for cuBLAS, else exact float32). The vendor BLAS stays in charge of
every other GEMM of the model. Offsets into the activations are int64; into the weights int32, which holds for
weights of up to 2**31 elements (shape_problem says so before a model is built).
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (MAX_GRID_SECOND_AXIS, interpreter_active, interpreter_block, is_rocm,
                                            small_interpreter_blocks)
from tinytransformer.precision import tf32_enabled
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel
from version4_triton_ultra.kernels.whole_tiles import load_tile, store_tile, whole_tiles

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr,          # [n_rows, n_in], contiguous
    w_ptr,          # [2 * n_ffn, n_in], contiguous: rows [gate; up] (the fused gate/up projection's weight)
    gate_up_ptr,    # out: [n_rows, 2 * n_ffn] = x @ w^T, kept for the backward pass
    h_ptr,          # out: [n_rows, n_ffn] = silu(gate) * up
    n_rows, n_ffn, n_in,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WHOLE_TILES: tl.constexpr = False,   # every dimension a whole number of tiles: no masks (whole_tiles.py)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: rows [BLOCK_M] x columns [BLOCK_N] of gate, of up and of h. Grid: (cdiv(F, BLOCK_N),
    cdiv(N, BLOCK_M)); the column blocks of one row block run next to each other and share its x tile in L2."""
    wait_for_previous_kernel(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # int64: N * 2F may pass 2**31
    row_mask, col_mask = rows < n_rows, cols < n_ffn

    gate_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, n_in, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < n_in
        x = load_tile(x_ptr + rows[:, None] * n_in + ks[None, :], row_mask[:, None] & k_mask[None, :], WHOLE_TILES)
        w_offsets = cols[:, None] * n_in + ks[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        w_gate = load_tile(w_ptr + w_offsets, w_mask, WHOLE_TILES)
        w_up = load_tile(w_ptr + n_ffn * n_in + w_offsets, w_mask, WHOLE_TILES)   # row F + c of w
        gate_acc = tl.dot(x, tl.trans(w_gate), gate_acc, input_precision=DOT_PRECISION)
        up_acc = tl.dot(x, tl.trans(w_up), up_acc, input_precision=DOT_PRECISION)

    # The epilogue. Round to the storage dtype first: the SwiGLU then sees exactly the gate_up it saves.
    gate = gate_acc.to(gate_up_ptr.dtype.element_ty)
    up = up_acc.to(gate_up_ptr.dtype.element_ty)
    out_mask = row_mask[:, None] & col_mask[None, :]
    gate_up_offsets = rows[:, None] * (2 * n_ffn) + cols[None, :]
    store_tile(gate_up_ptr + gate_up_offsets, gate, out_mask, WHOLE_TILES)
    store_tile(gate_up_ptr + gate_up_offsets + n_ffn, up, out_mask, WHOLE_TILES)
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    store_tile(h_ptr + rows[:, None] * n_ffn + cols[None, :], h.to(h_ptr.dtype.element_ty), out_mask, WHOLE_TILES)


@triton.jit
def _down_swiglu_backward_kernel(
    grad_y_ptr,          # [n_rows, n_out], contiguous: the gradient of the down projection's output
    w_down_ptr,          # [n_out, n_ffn], contiguous: the down projection's weight
    gate_up_ptr,         # [n_rows, 2 * n_ffn]: saved by the forward pass
    grad_gate_up_ptr,    # out: [n_rows, 2 * n_ffn]
    n_rows, n_ffn, n_out,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WHOLE_TILES: tl.constexpr = False,   # every dimension a whole number of tiles: no masks (whole_tiles.py)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: a [BLOCK_M, BLOCK_N] tile of dh = grad_y @ w_down, then the same tile of d(gate) and d(up).
    Grid as in the forward kernel."""
    wait_for_previous_kernel(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask, col_mask = rows < n_rows, cols < n_ffn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, n_out, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < n_out
        grad_y = load_tile(grad_y_ptr + rows[:, None] * n_out + ks[None, :], row_mask[:, None] & k_mask[None, :],
                           WHOLE_TILES)
        w = load_tile(w_down_ptr + ks[:, None] * n_ffn + cols[None, :], k_mask[:, None] & col_mask[None, :],
                      WHOLE_TILES)
        acc = tl.dot(grad_y, w, acc, input_precision=DOT_PRECISION)

    # The epilogue: SwiGLU's backward (see swiglu.py), on dh rounded as a GEMM writing it would round it.
    dh = acc.to(grad_gate_up_ptr.dtype.element_ty).to(tl.float32)
    out_mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * (2 * n_ffn) + cols[None, :]
    gate = load_tile(gate_up_ptr + offsets, out_mask, WHOLE_TILES).to(tl.float32)
    up = load_tile(gate_up_ptr + offsets + n_ffn, out_mask, WHOLE_TILES).to(tl.float32)
    sig = tl.sigmoid(gate)
    grad_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = dh * gate * sig
    store_tile(grad_gate_up_ptr + offsets, grad_gate.to(grad_gate_up_ptr.dtype.element_ty), out_mask, WHOLE_TILES)
    store_tile(grad_gate_up_ptr + offsets + n_ffn, grad_up.to(grad_gate_up_ptr.dtype.element_ty), out_mask,
               WHOLE_TILES)


# ----------------------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------------------
def _launch_config(dtype: torch.dtype, n_rows: int, kernel: str, n_ffn: int, n_in: int) -> dict:
    """Tile sizes, warps and pipeline stages of one kernel ("forward" or "backward") for n_rows rows, F = n_ffn
    and an inner dimension of n_in; on a GPU fixed per dtype and number of rows.

    From a sweep of 12 configs per kernel on an H100 (hidden 256, FFN 512; N = 1024 and 16384 rows), each
    kernel alone, replayed from a graph: the fastest config, or one within 5% of it for both sizes of the dtype.
    The backward kernel's epilogue holds two more tiles (gate and up) than the forward's, and in float32 it
    prefers half as many rows per program. On another GPU the best choice may differ.
    """
    if interpreter_active():
        if small_interpreter_blocks():
            # Kernel tests: the smallest tiles (16 is tl.dot's minimum), so small problems span several tiles.
            return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
        # A CPU run: NumPy executes each block operation of each program, at a cost per call, so tiles as large
        # as the problem (up to 128 rows x 256 columns, 256 deep) leave few programs and few loop iterations.
        return dict(BLOCK_M=interpreter_block(n_rows, 16, 128), BLOCK_N=interpreter_block(n_ffn, 16, 256),
                    BLOCK_K=interpreter_block(n_in, 16, 256), num_warps=1, num_stages=1)
    # AMD GPUs have 64 KiB of shared memory per compute unit (an H100 228 KiB): fewer pipeline stages there.
    stages = 2 if is_rocm() else 3
    if dtype == torch.float32:
        block_m = 64 if kernel == "forward" else 32
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=stages)
    if n_rows >= 8192:   # enough rows to fill the GPU with large tiles
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=stages)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=stages)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: float32 follows torch's TF32 switch for matmuls (the switch cuBLAS obeys);
    AMD accepts "tf32" only on some chips, so exact float32 there."""
    if dtype == torch.float32 and tf32_enabled() and not is_rocm():
        return "tf32"
    return "ieee"


def _new_output(shape, dtype, device):
    """Every buffer a kernel fills is allocated here (uninitialised: the kernel writes every element), so that
    tests can hand out NaN-filled buffers instead and catch an element a kernel forgets to write."""
    return torch.empty(shape, dtype=dtype, device=device)


# The row blocks are the grid's second axis, which allows at most this many programs. (Numbering them along the
# first axis, with the column blocks second, made the batch-32 backward kernel 8% slower on an H100: the column
# blocks of one row block then no longer run side by side sharing their input rows in L2.)
MAX_ROW_BLOCKS = MAX_GRID_SECOND_AXIS
# Offsets into the weights are int32 (see the module docstring): the gate/up weight, the larger of the two,
# holds 2F x K elements, and its last one must stay addressable.
MAX_WEIGHT_ELEMENTS = 2**31


def _weight_problem(n_in: int, n_ffn: int) -> str | None:
    if 2 * n_ffn * n_in > MAX_WEIGHT_ELEMENTS:
        return (f"the gate/up weight [2F, K] = [{2 * n_ffn}, {n_in}] has more than 2**31 elements, and the kernels' "
                f"offsets into the weights are 32-bit")
    return None


def _row_blocks_problem(n_rows: int, config: dict) -> str | None:
    row_blocks = triton.cdiv(n_rows, config["BLOCK_M"])
    if row_blocks > MAX_ROW_BLOCKS:
        return (f"{n_rows} rows need {row_blocks} row blocks of {config['BLOCK_M']}; the grid allows "
                f"{MAX_ROW_BLOCKS}: use a smaller batch x sequence")
    return None


def shape_problem(n_rows: int, n_in: int, n_ffn: int, dtype: torch.dtype) -> str | None:
    """Why the two kernels cannot take N = n_rows rows, an inner dimension K = n_in (the model width) and
    F = n_ffn in dtype (one line), or None when they can: the weights' 32-bit offsets, and the row blocks of
    each kernel's launch choice on this machine against the grid's limit. The kernels raise it; version 4's
    check_arguments asks it before anything is built."""
    problem = _weight_problem(n_in, n_ffn)
    for kernel in ("forward", "backward"):
        problem = problem or _row_blocks_problem(n_rows, _launch_config(dtype, n_rows, kernel, n_ffn, n_in))
    return problem


def _grid(n_rows: int, n_in: int, n_ffn: int, config: dict) -> tuple:
    problem = _weight_problem(n_in, n_ffn) or _row_blocks_problem(n_rows, config)
    if problem:
        raise ValueError(problem)
    return (triton.cdiv(n_ffn, config["BLOCK_N"]), triton.cdiv(n_rows, config["BLOCK_M"]))


def _check(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {list(shape)}; got {tensor.dtype} {list(tensor.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------
def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, h) for x [N, K] and the fused gate/up weight [2F, K]: gate_up = x @ weight^T [N, 2F] and
    h = silu(gate_up[:, :F]) * gate_up[:, F:] [N, F], from one kernel. x and weight share one dtype."""
    if x.dtype not in SUPPORTED_DTYPES or x.dim() != 2 or weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"need x [N, K] and weight [2F, K] in one of {SUPPORTED_DTYPES}; got {x.dtype} "
                         f"{list(x.shape)} and {weight.dtype} {list(weight.shape)}")
    n_rows, n_in = x.shape
    n_ffn = weight.shape[0] // 2
    _check("weight", weight, (2 * n_ffn, n_in), x.dtype)
    x, weight = x.contiguous(), weight.contiguous()
    gate_up = _new_output((n_rows, 2 * n_ffn), x.dtype, x.device)
    h = _new_output((n_rows, n_ffn), x.dtype, x.device)
    if n_rows > 0:
        config = _launch_config(x.dtype, n_rows, "forward", n_ffn, n_in)
        grid = _grid(n_rows, n_in, n_ffn, config)
        _gate_up_swiglu_kernel[grid](x, weight, gate_up, h, n_rows, n_ffn, n_in,
                                     DOT_PRECISION=dot_precision(x.dtype), **config,
                                     WHOLE_TILES=whole_tiles(config, M=n_rows, N=n_ffn, K=n_in),
                                     **launch_options(x.device))
    return gate_up, h


def down_swiglu_backward(grad_y: torch.Tensor, down_weight: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """d(gate_up) [N, 2F] for y = (silu(gate) * up) @ down_weight^T, from grad_y [N, D], down_weight [D, F] and
    the saved gate_up [N, 2F]: dh = grad_y @ down_weight and SwiGLU's backward, in one kernel."""
    if grad_y.dim() != 2 or down_weight.dim() != 2 or gate_up.dim() != 2:
        raise ValueError("need grad_y [N, D], down_weight [D, F] and gate_up [N, 2F]")
    n_rows, n_out = grad_y.shape
    n_ffn = down_weight.shape[1]
    _check("down_weight", down_weight, (n_out, n_ffn), grad_y.dtype)
    _check("gate_up", gate_up, (n_rows, 2 * n_ffn), grad_y.dtype)
    if grad_y.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {grad_y.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    grad_y, down_weight, gate_up = grad_y.contiguous(), down_weight.contiguous(), gate_up.contiguous()
    grad_gate_up = _new_output(gate_up.shape, gate_up.dtype, gate_up.device)
    if n_rows > 0:
        config = _launch_config(grad_y.dtype, n_rows, "backward", n_ffn, n_out)
        grid = _grid(n_rows, n_out, n_ffn, config)
        _down_swiglu_backward_kernel[grid](grad_y, down_weight, gate_up, grad_gate_up, n_rows, n_ffn, n_out,
                                           DOT_PRECISION=dot_precision(grad_y.dtype), **config,
                                           WHOLE_TILES=whole_tiles(config, M=n_rows, N=n_ffn, K=n_out),
                                           **launch_options(grad_y.device))
    return grad_gate_up
