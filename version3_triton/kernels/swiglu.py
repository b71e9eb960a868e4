"""SwiGLU activation in Triton: out = silu(gate) * up, with silu(g) = g * sigmoid(g).

PyTorch computes silu(gate) into a temporary tensor, then multiplies: three full-size reads and two writes, and
in the backward pass several more temporaries. One Triton kernel reads gate and up once and writes out once.

Two layouts share the same kernels:
- separate: gate [..., F] and up [..., F];
- fused:    gate_up [..., 2F], gate = the first F columns, up = the last F. This is what the fused gate/up
  projection produces (one matmul with a [2F, hidden] weight). The kernel reads both halves in place: a row of
  gate starts at row * 2F, the matching row of up at row * 2F + F, so no slice is ever copied.
The kernels only need to know the distance between rows of the inputs (F or 2F): that is `in_row_stride`.

Backward, with s = sigmoid(g):
    d silu(g) / dg = s + g * s * (1 - s) = s * (1 + g * (1 - s))
    dgate = dout * up * s * (1 + g * (1 - s))
    dup   = dout * silu(g)
The backward kernel recomputes s from gate instead of saving it: one extra exp per element is far cheaper
than writing and re-reading another full-size tensor.
Arithmetic is float32 inside the kernels whatever the storage dtype; results are stored in the input dtype.
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import num_warps_for

# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _swiglu_forward_kernel(
    gate_ptr, up_ptr,   # [rows, F] each, rows in_row_stride apart, columns adjacent
    out_ptr,            # [rows, F] contiguous
    n_cols,             # F
    in_row_stride,      # F (separate inputs) or 2F (fused gate_up)
    BLOCK_SIZE: tl.constexpr,
):
    # Grid (rows, column blocks). int64 so that row * stride cannot overflow on large activations.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols

    gate = tl.load(gate_ptr + row * in_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * in_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dout_ptr,               # [rows, F] contiguous
    gate_ptr, up_ptr,       # [rows, F] each, rows in_row_stride apart (the forward inputs)
    dgate_ptr, dup_ptr,     # [rows, F] each, same layout as gate and up
    n_cols,
    in_row_stride,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    in_offsets = row * in_row_stride + cols

    dout = tl.load(dout_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + in_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + in_offsets, mask=mask, other=0.0).to(tl.float32)

    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dout * silu
    # For the fused layout dgate_ptr and dup_ptr point into the same [rows, 2F] tensor: the two halves of the
    # gradient of gate_up are written side by side, exactly as the forward read them.
    tl.store(dgate_ptr + in_offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + in_offsets, dup.to(dup_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ launchers

# Columns one program handles. FFN widths are a few hundred to a few thousand: one or a few blocks per row.
_MAX_BLOCK_SIZE = 1024


def _launch_config(n_rows: int, n_cols: int):
    block_size = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_SIZE)
    grid = (n_rows, triton.cdiv(n_cols, block_size))
    return grid, block_size


def _check_halves(gate, up):
    """gate and up: [rows, F] views with the same row stride and adjacent columns (separate or fused)."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype
    assert gate.stride() == up.stride() and gate.stride(1) == 1, "rows of gate and up must be laid out alike"


def _swiglu_forward_2d(gate, up, out):
    _check_halves(gate, up)
    n_rows, n_cols = gate.shape
    out = torch.empty(n_rows, n_cols, dtype=gate.dtype, device=gate.device) if out is None else out
    assert out.shape == (n_rows, n_cols) and out.is_contiguous()
    if out.numel() == 0:
        return out
    grid, block_size = _launch_config(n_rows, n_cols)
    _swiglu_forward_kernel[grid](
        gate, up, out, n_cols, gate.stride(0),
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )
    return out


def _swiglu_backward_2d(dout, gate, up, dgate, dup):
    _check_halves(gate, up)
    _check_halves(dgate, dup)
    assert dgate.stride() == gate.stride() and dout.shape == gate.shape and dout.is_contiguous()
    if dout.numel() == 0:
        return
    n_rows, n_cols = gate.shape
    grid, block_size = _launch_config(n_rows, n_cols)
    _swiglu_backward_kernel[grid](
        dout, gate, up, dgate, dup, n_cols, gate.stride(0),
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )


def swiglu_forward(gate, up, out=None):
    """silu(gate) * up for gate, up [..., F] (contiguous). Returns out [..., F]; out may be passed in."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    n_cols = gate.shape[-1]
    out_2d = None if out is None else out.view(-1, n_cols)
    out_2d = _swiglu_forward_2d(gate.view(-1, n_cols), up.view(-1, n_cols), out_2d)
    return out_2d.view(gate.shape)


def swiglu_backward(dout, gate, up, dgate=None, dup=None):
    """Gradients (dgate, dup), each [..., F], from dout [..., F]. dgate and dup may be passed in."""
    assert dout.is_contiguous() and gate.is_contiguous() and up.is_contiguous()
    dgate = torch.empty_like(gate) if dgate is None else dgate
    dup = torch.empty_like(up) if dup is None else dup
    n_cols = gate.shape[-1]
    _swiglu_backward_2d(dout.view(-1, n_cols), gate.view(-1, n_cols), up.view(-1, n_cols),
                        dgate.view(-1, n_cols), dup.view(-1, n_cols))
    return dgate, dup


def _split_halves(gate_up_2d):
    """Views (not copies) of the gate and up halves of a [rows, 2F] tensor."""
    n_cols = gate_up_2d.shape[1] // 2
    return gate_up_2d[:, :n_cols], gate_up_2d[:, n_cols:]


def swiglu_fused_forward(gate_up, out=None):
    """silu(gate) * up for gate_up [..., 2F] (contiguous). Returns out [..., F]; out may be passed in."""
    assert gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0, "gate_up must be contiguous [..., 2F]"
    n_cols = gate_up.shape[-1] // 2
    out_shape = gate_up.shape[:-1] + (n_cols,)
    gate, up = _split_halves(gate_up.view(-1, 2 * n_cols))
    out_2d = None if out is None else out.view(-1, n_cols)
    return _swiglu_forward_2d(gate, up, out_2d).view(out_shape)


def swiglu_fused_backward(dout, gate_up, dgate_up=None):
    """Gradient of gate_up [..., 2F] (one tensor, gate half then up half) from dout [..., F]."""
    assert dout.is_contiguous() and gate_up.is_contiguous()
    dgate_up = torch.empty_like(gate_up) if dgate_up is None else dgate_up
    assert dgate_up.shape == gate_up.shape and dgate_up.is_contiguous()
    n_cols = gate_up.shape[-1] // 2
    gate, up = _split_halves(gate_up.view(-1, 2 * n_cols))
    dgate, dup = _split_halves(dgate_up.view(-1, 2 * n_cols))
    _swiglu_backward_2d(dout.view(-1, n_cols), gate, up, dgate, dup)
    return dgate_up


# ------------------------------------------------------------------------------------------------ autograd


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)  # not the output: the backward recomputes silu(gate) from gate
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dout.contiguous(), gate, up)


class SwiGLUFusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()  # a no-op for the output of a linear layer
        ctx.save_for_backward(gate_up)
        return swiglu_fused_forward(gate_up)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        return swiglu_fused_backward(dout.contiguous(), gate_up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. gate, up: [..., F] (float32/float16/bfloat16). Returns [..., F] in their dtype."""
    return SwiGLUFunction.apply(gate, up)


def swiglu_fused(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gate_up [..., 2F] = [gate | up] along the last dimension. Returns [..., F]."""
    return SwiGLUFusedFunction.apply(gate_up)
