"""What the tests of version 4's fused kernels share (test_v4_add_rmsnorm.py, test_v4_linear_cross_entropy.py,
test_v4_embedding_backward.py, test_v4_swiglu_gemm.py (and the elementwise SwiGLU), test_v4_qkv_rope_gemm.py, test_v4_fused_layers.py): the
NaN-filled outputs, the float64 comparison and its per-dtype tolerances, seeded inputs.

A test file imports `poisoned_outputs` to make it its own autouse fixture: every buffer the kernel wrappers
allocate is filled with NaN first, so an element a kernel forgets to write fails the test.
"""
import math

import pytest
import torch

from version4_triton_ultra.kernels import add_rmsnorm as arn
from version4_triton_ultra.kernels import linear_cross_entropy as lce
from version4_triton_ultra.kernels import qkv_rope_gemm as qr
from version4_triton_ultra.kernels import swiglu_elementwise as se
from version4_triton_ultra.kernels import swiglu_gemm as sg

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
EPS = 1e-6


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the wrappers allocate starts as NaN. Returns the list of allocated shapes."""
    allocated = []

    def nan_filled(shape, dtype, device):
        allocated.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(arn, "_new_output", nan_filled)
    monkeypatch.setattr(lce, "_new_output", nan_filled)
    monkeypatch.setattr(sg, "_new_output", nan_filled)
    monkeypatch.setattr(se, "_new_output", nan_filled)
    monkeypatch.setattr(qr, "_new_output", nan_filled)
    return allocated


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64; infinite when out holds a NaN or inf, so NaN never passes."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(ref).all(), "the reference itself is not finite"
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


def assert_matches(out, ref, dtype, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3g} >= {TOLERANCE[dtype]:g} ({dtype})"


def random(shape, dtype, device, seed, scale=1.0):
    """Fresh random values drawn on the CPU (the same on every machine), moved to the device."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def as_float64_leaf(t):
    return t.detach().double().requires_grad_(True)



def rope_reference(t, cos, sin):
    """Version 1's RoPE (rotate-half) on [..., S, H, Dh] in float64; cos, sin: [S, Dh]."""
    half = t.shape[-1] // 2
    rotated_half = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, None, :] + rotated_half * sin[:, None, :]
