"""The correctness check (--check): every Triton output and input gradient against the same PyTorch code in float64.

    Before timing, every Triton output and input gradient is compared with the same PyTorch code evaluated
    in float64 on the same inputs (the exact answer, so the error shown is the Triton op's alone), and the
    PyTorch implementation at the benchmark's dtype is compared with it too, to show how much error plain
    rounding causes. Relative error ||out - ref|| / ||ref||; NaN or inf never passes.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..precision import exact_float32_matmuls
from ..triton_support import interpreter_active, is_rocm
from .ops import BenchShape, InputSet, OpBench, as_tuple

# Relative error allowed against the float64 reference, per dtype (the project's standard).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# float32 through TF32 tensor cores (Triton's flash attention on NVIDIA): every matmul input keeps 10
# mantissa bits, as in float16, and attention chains four matmuls (the flash attention tests use the same).
TF32_TOLERANCE = 5e-3


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; infinite when out holds NaN or inf, so those never pass."""
    out, ref = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def dots_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The error allowed for kernels whose matmuls are tl.dot at its default precision: float32 goes through TF32
    on an NVIDIA GPU; the interpreter computes exact float32, and on AMD the kernels ask for "ieee"."""
    gpu_tf32 = (dtype == torch.float32 and torch.device(device).type == "cuda"
                and not interpreter_active() and not is_rocm())
    return TF32_TOLERANCE if gpu_tf32 else TOLERANCE[dtype]


def tolerance_for(op: OpBench, dtype: torch.dtype, device: torch.device) -> float:
    return dots_tolerance(dtype, device) if op.tf32_dots else TOLERANCE[dtype]


def run_with_grads(fn, inputs: InputSet):
    """Outputs of fn and the gradients of its differentiable inputs for inputs.grad_outputs."""
    outputs = as_tuple(fn(*inputs.args()))
    if inputs.grad_outputs is None:
        inputs.grad_outputs = [torch.randn_like(o) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs.differentiable, inputs.grad_outputs)
    return [o.detach() for o in outputs], list(grads)


@contextlib.contextmanager
def float32_torch_matmuls():
    """torch's float32 matmuls in full float32 for a while, then the setting as it was.

    The check holds float32 results to float32 tolerances, and its PyTorch implementations (and Triton ops that
    call torch matmuls, such as the chunked output head) would otherwise follow a process-wide TF32 switch that
    someone else turned on (version 4's --tf32 does, for its own run).
    """
    with exact_float32_matmuls():
        yield


def check_op(op: OpBench, shape: BenchShape, device: torch.device) -> list[dict]:
    """Compare the Triton op (and the first PyTorch implementation) with the PyTorch code in float64."""
    skip = interpreter_skip_reason(op, shape)
    if skip:
        return [dict(op=op.name, tensor="(all)", skipped=skip)]
    torch.manual_seed(0)
    inputs = op.make_inputs(shape, device)
    triton_out, triton_grads = run_with_grads(op.triton, inputs)        # also draws inputs.grad_outputs
    reference_fn = next(iter(op.pytorch.values()))
    torch_out, torch_grads = run_with_grads(reference_fn, inputs)
    ref_out, ref_grads = run_with_grads(reference_fn, inputs.to_float64())

    tolerance = tolerance_for(op, shape.dtype, device)
    names = list(op.output_names) + [f"grad {name}" for name in op.input_names]
    rows = []
    for name, tri, ours, ref in zip(names, triton_out + triton_grads, torch_out + torch_grads,
                                    ref_out + ref_grads, strict=True):
        error = relative_error(tri, ref)
        rows.append(dict(op=op.name, tensor=name, triton_error=error, pytorch_error=relative_error(ours, ref),
                         tolerance=tolerance, ok=bool(error <= tolerance)))
    return rows


def interpreter_skip_reason(op: OpBench, shape: BenchShape) -> str | None:
    if op.uses_tl_dot and shape.dtype == torch.bfloat16 and interpreter_active():
        return ("SKIPPED: Triton's CPU interpreter computes tl.dot on bfloat16 wrongly; "
                "check bfloat16 on a GPU (or use float32/float16 here)")
    return None
