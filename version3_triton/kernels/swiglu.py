"""SwiGLU activation in Triton: out = silu(gate) * up, with silu(g) = g * sigmoid(g).

PyTorch computes silu(gate) into a temporary tensor, then multiplies: three full-size reads and two writes, and
in the backward pass several more temporaries. One Triton kernel reads gate and up once and writes out once.

Two layouts share the same kernels:
- separate: gate [..., F] and up [..., F];
- fused:    gate_up [..., 2F], gate = the first F columns, up = the last F. This is what the fused gate/up
  projection produces (one matmul with a [2F, hidden] weight). The kernel reads both halves in place: a row of
  gate starts at row * 2F, the matching row of up at row * 2F + F, so no slice is ever copied.
The kernels only need to know the distance between rows of the inputs (F or 2F): that is `in_row_stride`,
and where up starts relative to gate's pointer: `up_offset` (F in the fused layout, where both pointers are
gate_up; 0 for separate tensors).

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
    up_offset,          # 0 (separate inputs) or F (fused: gate_ptr and up_ptr are both gate_up)
    BLOCK_SIZE: tl.constexpr,
):
    # Grid (rows, column blocks). int64 so that row * stride cannot overflow on large activations.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    in_offsets = row * in_row_stride + cols

    gate = tl.load(gate_ptr + in_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + up_offset + in_offsets, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dout_ptr,               # [rows, F] contiguous
    gate_ptr, up_ptr,       # [rows, F] each, rows in_row_stride apart (the forward inputs)
    dgate_ptr, dup_ptr,     # [rows, F] each, same layout as gate and up
    n_cols,
    in_row_stride,
    up_offset,              # as in the forward kernel: for up and for dup
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    in_offsets = row * in_row_stride + cols

    dout = tl.load(dout_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + in_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + up_offset + in_offsets, mask=mask, other=0.0).to(tl.float32)

    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dout * silu
    # For the fused layout dgate_ptr and dup_ptr point into the same [rows, 2F] tensor: the two halves of the
    # gradient of gate_up are written side by side, exactly as the forward read them.
    tl.store(dgate_ptr + in_offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + up_offset + in_offsets, dup.to(dup_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ launchers
#
# These run on every training step, and at the workshop's seed size a step is bound by the host, not the GPU:
# each torch call made here (a view, a slice, an allocation) costs about as much host time as launching a
# kernel. So the launchers pass base tensors and integer offsets to the kernels instead of building views of
# the gate and up halves, and allocate only the outputs.

# Columns one program handles. FFN widths are a few hundred to a few thousand: one or a few blocks per row.
_MAX_BLOCK_SIZE = 1024


def _launch_config(n_rows: int, n_cols: int):
    """(grid, BLOCK_SIZE): one program per row and block of columns."""
    block_size = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_SIZE)
    return (n_rows, triton.cdiv(n_cols, block_size)), block_size


def _launch_forward(gate, up, out, n_cols: int, in_row_stride: int, up_offset: int):
    """out [rows, F] (any leading dimensions, contiguous) = silu(gate) * up."""
    if out.numel() == 0:
        return
    grid, block_size = _launch_config(out.numel() // n_cols, n_cols)
    _swiglu_forward_kernel[grid](
        gate, up, out, n_cols, in_row_stride, up_offset,
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )


def _launch_backward(dout, gate, up, dgate, dup, n_cols: int, in_row_stride: int, up_offset: int):
    """dgate, dup from dout [rows, F] (any leading dimensions, contiguous)."""
    if dout.numel() == 0:
        return
    grid, block_size = _launch_config(dout.numel() // n_cols, n_cols)
    _swiglu_backward_kernel[grid](
        dout, gate, up, dgate, dup, n_cols, in_row_stride, up_offset,
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )


def _check_output(out, shape, dtype) -> None:
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous(), \
        f"output buffer must be contiguous {tuple(shape)} {dtype}, got {tuple(out.shape)} {out.dtype}"


def swiglu_forward(gate, up, out=None):
    """silu(gate) * up for gate, up [..., F] (contiguous). Returns out [..., F]; out may be passed in."""
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape and gate.dtype == up.dtype
    out = torch.empty_like(gate) if out is None else out
    _check_output(out, gate.shape, gate.dtype)
    n_cols = gate.shape[-1]
    _launch_forward(gate, up, out, n_cols, in_row_stride=n_cols, up_offset=0)
    return out


def swiglu_backward(dout, gate, up, dgate=None, dup=None):
    """Gradients (dgate, dup), each [..., F], from dout [..., F]. dgate and dup may be passed in."""
    assert dout.is_contiguous() and gate.is_contiguous() and up.is_contiguous()
    assert dout.shape == gate.shape == up.shape and gate.dtype == up.dtype
    dgate = torch.empty_like(gate) if dgate is None else dgate
    dup = torch.empty_like(up) if dup is None else dup
    _check_output(dgate, gate.shape, gate.dtype)
    _check_output(dup, up.shape, up.dtype)
    n_cols = gate.shape[-1]
    _launch_backward(dout, gate, up, dgate, dup, n_cols, in_row_stride=n_cols, up_offset=0)
    return dgate, dup


def swiglu_fused_forward(gate_up, out=None):
    """silu(gate) * up for gate_up [..., 2F] (contiguous). Returns out [..., F]; out may be passed in."""
    assert gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0, "gate_up must be contiguous [..., 2F]"
    n_cols = gate_up.shape[-1] // 2
    out_shape = gate_up.shape[:-1] + (n_cols,)
    out = gate_up.new_empty(out_shape) if out is None else out
    _check_output(out, out_shape, gate_up.dtype)
    # gate and up are both read from gate_up: row r of gate starts at r * 2F, row r of up F elements later.
    _launch_forward(gate_up, gate_up, out, n_cols, in_row_stride=2 * n_cols, up_offset=n_cols)
    return out


def swiglu_fused_backward(dout, gate_up, dgate_up=None):
    """Gradient of gate_up [..., 2F] (one tensor, gate half then up half) from dout [..., F]."""
    assert dout.is_contiguous() and gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0
    n_cols = gate_up.shape[-1] // 2
    assert dout.shape == gate_up.shape[:-1] + (n_cols,), "dout must be [..., F] for gate_up [..., 2F]"
    dgate_up = torch.empty_like(gate_up) if dgate_up is None else dgate_up
    _check_output(dgate_up, gate_up.shape, gate_up.dtype)
    # The two halves of the gradient are written side by side into dgate_up, as the forward read gate_up.
    _launch_backward(dout, gate_up, gate_up, dgate_up, dgate_up, n_cols, in_row_stride=2 * n_cols,
                     up_offset=n_cols)
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
