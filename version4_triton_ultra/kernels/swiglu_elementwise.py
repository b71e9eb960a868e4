"""SwiGLU as a kernel of its own each way: the form that the epilogue-fused GEMMs of swiglu_gemm.py replace.

    swiglu(gate_up)                h = silu(gate) * up                         reads [N, 2F], writes [N, F]
    swiglu_backward(dh, gate_up)   d(gate) = dh * up * s * (1 + gate * (1 - s)),  s = sigmoid(gate)
                                   d(up)   = dh * gate * s                     reads [N, F] and [N, 2F],
                                                                               writes [N, 2F]

gate_up is the fused gate/up projection's output, [gate | up] along its columns. Version 4 runs these under
--separate-swiglu: the feed-forward GEMMs then go to the vendor BLAS (cuBLAS, hipBLASLt) and SwiGLU costs one
more pass over memory each way. Whether the fused GEMMs win depends on the shape (a Triton GEMM may be slower than
the vendor's by more than that pass costs), so the switch is there to measure it at each size. The arithmetic is
the epilogues': float32 on the stored inputs, the result rounded once to the storage dtype.

A program handles BLOCK columns of one row; rows are the grid's first axis (up to 2**31 - 1 of them), column
blocks the second. Offsets are int64: N x 2F passes 2**31 at large batches.
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (interpreter_active, interpreter_block, num_warps_for,
                                            small_interpreter_blocks)
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _separate_swiglu_forward_kernel(gate_up_ptr, h_ptr, n_ffn, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_ffn
    gate = tl.load(gate_up_ptr + row * 2 * n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n_ffn + n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + row * n_ffn + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _separate_swiglu_backward_kernel(grad_h_ptr, gate_up_ptr, grad_gate_up_ptr, n_ffn, BLOCK: tl.constexpr,
                                     PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_ffn
    grad_h = tl.load(grad_h_ptr + row * n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_up_ptr + row * 2 * n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n_ffn + n_ffn + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    grad_gate = grad_h * up * s * (1.0 + gate * (1.0 - s))
    grad_up = grad_h * gate * s
    out_dtype = grad_gate_up_ptr.dtype.element_ty
    tl.store(grad_gate_up_ptr + row * 2 * n_ffn + cols, grad_gate.to(out_dtype), mask=mask)
    tl.store(grad_gate_up_ptr + row * 2 * n_ffn + n_ffn + cols, grad_up.to(out_dtype), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------------------
def _launch_config(n_ffn: int) -> dict:
    """BLOCK columns per program and its warps. On a GPU up to 1,024 columns, a few elements per thread
    (num_warps_for counts a warp as 32 threads on NVIDIA and a wavefront as 64 on AMD); in the interpreter the
    kernel tests' smallest block (so that rows span several blocks) or, for a CPU run, one covering the row."""
    if interpreter_active():
        block = 16 if small_interpreter_blocks() else interpreter_block(n_ffn, 16, 1024)
        return dict(BLOCK=block, num_warps=1)
    block = min(1024, triton.next_power_of_2(n_ffn))
    return dict(BLOCK=block, num_warps=num_warps_for(block, max_warps=8))


def _new_output(shape, dtype, device):
    """Every buffer a kernel fills is allocated here (uninitialised: the kernel writes every element), so that
    tests can hand out NaN-filled buffers instead and catch an element a kernel forgets to write."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_gate_up(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gate_up must be [N, 2F] in one of {SUPPORTED_DTYPES}; got {gate_up.dtype} "
                         f"{list(gate_up.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """h = silu(gate_up[:, :F]) * gate_up[:, F:], [N, F] in gate_up's dtype."""
    _check_gate_up(gate_up)
    gate_up = gate_up.contiguous()
    n_rows, n_ffn = gate_up.shape[0], gate_up.shape[1] // 2
    h = _new_output((n_rows, n_ffn), gate_up.dtype, gate_up.device)
    if n_rows > 0 and n_ffn > 0:
        config = _launch_config(n_ffn)
        grid = (n_rows, triton.cdiv(n_ffn, config["BLOCK"]))
        _separate_swiglu_forward_kernel[grid](gate_up, h, n_ffn, **config, **launch_options(gate_up.device))
    return h


def swiglu_backward(grad_h: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """d(gate_up) [N, 2F] from the gradient of h [N, F] and the saved gate_up [N, 2F] (one dtype)."""
    _check_gate_up(gate_up)
    n_rows, n_ffn = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(grad_h.shape) != (n_rows, n_ffn) or grad_h.dtype != gate_up.dtype:
        raise ValueError(f"grad_h must be {gate_up.dtype} {[n_rows, n_ffn]}; got {grad_h.dtype} "
                         f"{list(grad_h.shape)}")
    grad_h, gate_up = grad_h.contiguous(), gate_up.contiguous()
    grad_gate_up = _new_output(gate_up.shape, gate_up.dtype, gate_up.device)
    if n_rows > 0 and n_ffn > 0:
        config = _launch_config(n_ffn)
        grid = (n_rows, triton.cdiv(n_ffn, config["BLOCK"]))
        _separate_swiglu_backward_kernel[grid](grad_h, gate_up, grad_gate_up, n_ffn, **config,
                                               **launch_options(gate_up.device))
    return grad_gate_up
