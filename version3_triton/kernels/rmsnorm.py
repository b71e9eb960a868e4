"""RMSNorm in Triton: one fused kernel forward, one fused kernel backward.

    y = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)   (statistics over the last dimension)

PyTorch runs this as about six kernels (square, mean, add, rsqrt, two multiplies), each reading and writing a
full tensor. A row of the model is only a few hundred numbers, so one program can hold a whole row in registers,
read x once, and write y once: the op becomes as cheap as a copy, which is the best a memory-bound op can do.

Precision: x may be float32, float16 or bfloat16; the statistics are always computed in float32 and y is stored
in x's dtype. This equals PyTorch's
    (weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)

Layout: x [..., D] is read as a contiguous 2-D tensor [rows, D], so row r starts at r * D. The launchers take it
as it is, without building a 2-D view: at the workshop's seed size a training step is bound by the host, where
each extra torch call (a view, an allocation) costs about as much time as launching a kernel.
"""

import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (interpreter_block, is_gpu, multiprocessor_count, num_warps_for,
                                            small_interpreter_blocks)

# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr,        # [rows, n_cols], contiguous, any float dtype
    weight_ptr,   # [n_cols]
    y_ptr,        # [rows, n_cols], contiguous, x's dtype
    rstd_ptr,     # [rows] float32: saved for the backward pass so it need not recompute the statistics
    n_cols,
    eps,
    BLOCK_SIZE: tl.constexpr,  # next power of two >= n_cols: one program holds one whole row
):
    # One program per row. int64 so that row * n_cols cannot overflow on large tensors.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    # BLOCK_SIZE is a power of two (Triton requires it for tl.arange); the mask hides the padding columns.
    mask = cols < n_cols
    row_start = row * n_cols

    # Masked columns load 0, so they add nothing to the sum of squares.
    x = tl.load(x_ptr + row_start + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.rsqrt(mean_square + eps)

    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Same order of operations as the PyTorch reference: normalise first, then scale by the weight.
    y = (x * rstd) * weight
    tl.store(y_ptr + row_start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr,               # [rows, n_cols], contiguous: gradient of the loss with respect to y
    x_ptr,                # [rows, n_cols], contiguous: the forward input
    weight_ptr,           # [n_cols]
    rstd_ptr,             # [rows] float32, from the forward pass
    dx_ptr,               # [rows, n_cols], contiguous, x's dtype
    dweight_partial_ptr,  # [n_cols, n_programs] float32: one partial sum of dweight per program
    n_rows,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,   # rows per tile: each iteration works on a [BLOCK_ROWS, BLOCK_SIZE] tile
):
    """With x_hat = x * rstd and g = dy * weight:

        dx      = rstd * (g - x_hat * mean(g * x_hat))     (mean over the row)
        dweight = sum over rows of dy * x_hat

    dweight sums over every row. Rather than make all programs add into one vector with atomics (slow under
    contention, and the order of float additions, hence the result, changes from run to run), each program
    walks over a strided set of row tiles, keeps its own running sum in registers, and writes it once. PyTorch
    then adds the few hundred partial sums: deterministic, and no extra kernel to write.

    Why tiles of rows rather than one row per iteration: a single row is a few hundred numbers, too little
    independent work to hide memory latency; a loop over single rows ran ~4x below memory speed on an H100.
    """
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols

    # The weight is the same for every row: load it once, outside the loop.
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dweight_sum = tl.zeros([BLOCK_ROWS, BLOCK_SIZE], dtype=tl.float32)

    # Program p handles row tiles p, p + n_programs, p + 2 * n_programs, ...
    for tile_start in range(program * BLOCK_ROWS, n_rows, n_programs * BLOCK_ROWS):
        # int64 rows: row * n_cols may exceed 2^31 on large tensors.
        rows = (tile_start + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        g = dy * weight[None, :]
        # Padding columns have x_hat = 0 and g = 0, so they do not disturb the mean; divide by the true n_cols.
        mean_g_x_hat = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * mean_g_x_hat[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)

        dweight_sum += dy * x_hat   # padding rows loaded zeros: they add nothing

    # Stored transposed, [n_cols, n_programs]: the final sum then reads contiguous memory, a fast row reduction
    # (summing a [programs, n_cols] buffer over its first dimension was measured at ~11 us per call on an H100).
    tl.store(dweight_partial_ptr + cols * n_programs + program, tl.sum(dweight_sum, axis=0), mask=col_mask)


# ------------------------------------------------------------------------------------------------ launchers


# The widest row: one program holds a whole row in registers; beyond this it would need a loop over column chunks.
MAX_ROW_ELEMENTS = 8192


def shape_problem(n_cols: int) -> str | None:
    """Why the kernels cannot normalise rows of n_cols elements (one line), or None when they can. The launchers
    raise it; the training scripts check a model's width with it before building anything."""
    if n_cols > MAX_ROW_ELEMENTS:
        return f"rms_norm supports rows of at most {MAX_ROW_ELEMENTS} elements, got {n_cols}"
    return None


def _block_size(n_cols: int) -> int:
    problem = shape_problem(n_cols)
    if problem:
        raise ValueError(problem)
    return triton.next_power_of_2(n_cols)


def _backward_rows_per_tile(block_size: int, n_rows: int, device: torch.device) -> int:
    """About 4096 elements per tile (it stays in registers). In the interpreter, 4 rows for kernel tests (enough
    to test masking), else all the rows in as few tiles of up to 16384 elements as possible (few programs)."""
    if is_gpu(device):
        return max(1, min(16, 4096 // block_size))
    if small_interpreter_blocks():
        return 4
    return interpreter_block(n_rows, 1, max(1, 16384 // block_size))


def _backward_program_count(n_tiles: int, device: torch.device) -> int:
    """A few programs per SM (compute unit), never more than there are row tiles."""
    if is_gpu(device):
        target = 4 * multiprocessor_count(device)
    else:
        target = 8  # Triton's CPU interpreter runs programs one after another: parallelism does not matter.
    return max(1, min(n_tiles, target))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     y: torch.Tensor | None = None, rstd: torch.Tensor | None = None):
    """Launch the forward kernel.

    x: [..., D] contiguous (read as [rows, D]); weight: [D]. Returns (y like x, rstd [rows] float32).
    y and rstd may be passed in (tests pass buffers filled with NaN to prove every element is written).
    """
    assert x.is_contiguous(), "x must be contiguous: the kernel reads row r at r * D"
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    assert weight.shape == (n_cols,) and weight.is_contiguous()
    y = torch.empty_like(x) if y is None else y
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if rstd is None else rstd
    assert y.shape == x.shape and y.is_contiguous() and rstd.shape == (n_rows,) and rstd.dtype == torch.float32
    if n_rows == 0:
        return y, rstd
    block_size = _block_size(n_cols)
    _rms_norm_forward_kernel[(n_rows,)](
        x, weight, y, rstd, n_cols, eps,
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dx: torch.Tensor | None = None):
    """Launch the backward kernel, then add up the per-program partial sums of dweight.

    dy, x: [..., D] contiguous; weight: [D]; rstd: [rows] float32 from the forward pass.
    Returns (dx like x, dweight [D] in weight.dtype). dx may be passed in.
    """
    assert dy.shape == x.shape and dy.is_contiguous() and x.is_contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    dx = torch.empty_like(x) if dx is None else dx
    assert dx.shape == x.shape and dx.is_contiguous()
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    block_size = _block_size(n_cols)
    block_rows = _backward_rows_per_tile(block_size, n_rows, x.device)
    n_programs = _backward_program_count(triton.cdiv(n_rows, block_rows), x.device)
    dweight_partial = torch.empty(n_cols, n_programs, dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(n_programs,)](
        dy, x, weight, rstd, dx, dweight_partial, n_rows, n_cols,
        BLOCK_SIZE=block_size, BLOCK_ROWS=block_rows, num_warps=num_warps_for(block_rows * block_size, max_warps=8),
    )
    dweight = dweight_partial.sum(dim=1)
    return dx, (dweight if dweight.dtype == weight.dtype else dweight.to(weight.dtype))


# ------------------------------------------------------------------------------------------------ autograd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        # Any leading dimensions ([batch, seq, D], [tokens, D], ...): the kernels read rows of D elements.
        x = x.contiguous()   # a no-op for the contiguous activations of the model
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension. x: [..., D] (float32/float16/bfloat16); weight: [D]. Returns y like x."""
    return RMSNormFunction.apply(x, weight, eps)
