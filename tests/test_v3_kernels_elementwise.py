"""Version 3's memory-bound Triton kernels (RMSNorm, RoPE, SwiGLU), forward and backward.

Every result is compared with a float64 PyTorch reference computed from the same inputs, by relative error
||out - ref|| / ||ref|| under a per-dtype tolerance. Output buffers are filled with NaN before a kernel runs,
so an element the kernel forgets to write fails the test. On a CPU-only machine the kernels run in Triton's
interpreter (see conftest.py), so CPU shapes are small; the full-size shapes are in the gpu-marked tests.
bfloat16 is tested on the GPU only.
"""
import zlib

import pytest
import torch
import torch.nn.functional as F

from version3_triton.kernels.rmsnorm import rms_norm, rms_norm_backward, rms_norm_forward
from version3_triton.kernels.rope import (apply_rope, apply_rope_packed, rope_backward, rope_forward,
                                          rope_packed_backward, rope_packed_forward, rope_tables)
from version3_triton.kernels.swiglu import (swiglu, swiglu_backward, swiglu_forward, swiglu_fused,
                                            swiglu_fused_backward, swiglu_fused_forward)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
EPS = 1e-6


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Different random inputs in every test, yet reproducible: the seed is derived from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the output (an element left unwritten?)"
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e} >= {TOLERANCE[dtype]:.0e} for {dtype}"


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def float64_leaf(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy of t that autograd tracks: the reference runs on exactly the values the kernel saw."""
    return t.detach().double().requires_grad_()


# ================================================================================================ RMSNorm


def rms_norm_reference(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rms_norm_inputs(shape, dtype, device):
    x = torch.randn(shape, device=device).to(dtype)
    # A weight far from all-ones, so that a kernel that ignored it would fail.
    weight = 1.0 + 0.5 * torch.randn(shape[-1], device=device)
    dy = torch.randn(shape, device=device).to(dtype)
    return x, weight, dy


def rms_norm_reference_grads(x, weight, dy):
    x64, w64 = float64_leaf(x), float64_leaf(weight)
    y64 = rms_norm_reference(x64, w64)
    y64.backward(dy.double())
    return y64.detach(), x64.grad, w64.grad


# D = 200 and 37: not powers of two (masked columns). 50 rows: more rows than the 8 backward programs on CPU.
RMS_NORM_SHAPES = [(4, 256), (3, 5, 200), (2, 37), (50, 64), (1, 8192)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_NORM_SHAPES)
def test_rms_norm_kernels_write_every_element(shape, dtype, device):
    x, weight, dy = rms_norm_inputs(shape, dtype, device)
    x_2d, dy_2d = x.reshape(-1, shape[-1]), dy.reshape(-1, shape[-1])
    n_rows = x_2d.shape[0]

    y, rstd = rms_norm_forward(x_2d, weight, EPS, y=poisoned(x_2d.shape, dtype, device),
                               rstd=poisoned((n_rows,), torch.float32, device))
    dx, dweight = rms_norm_backward(dy_2d, x_2d, weight, rstd, dx=poisoned(x_2d.shape, dtype, device))

    y_ref, dx_ref, dweight_ref = rms_norm_reference_grads(x_2d, weight, dy_2d)
    rstd_ref = torch.rsqrt(x_2d.double().pow(2).mean(-1) + EPS)
    assert y.dtype == dtype and dx.dtype == dtype and dweight.dtype == weight.dtype
    assert_close(y, y_ref, dtype, "y")
    assert_close(rstd, rstd_ref, torch.float32, "rstd")  # float32 whatever x's dtype
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dweight, dweight_ref, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 256), (5, 200)])
def test_rms_norm_autograd(shape, dtype, device):
    x, weight, dy = rms_norm_inputs(shape, dtype, device)
    x.requires_grad_()
    weight.requires_grad_()
    y = rms_norm(x, weight, EPS)
    y.backward(dy)

    y_ref, dx_ref, dweight_ref = rms_norm_reference_grads(x, weight, dy)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, y_ref, dtype, "y")
    assert_close(x.grad, dx_ref, dtype, "dx")
    assert_close(weight.grad, dweight_ref, dtype, "dweight")


def test_rms_norm_accepts_a_non_contiguous_input(device):
    base = torch.randn(6, 40, device=device, requires_grad=True)
    x = base.t()  # [40, 6], rows not adjacent in memory
    weight = 1.0 + 0.5 * torch.randn(6, device=device)
    dy = torch.randn(40, 6, device=device)
    rms_norm(x, weight, EPS).backward(dy)
    _, dx_ref, _ = rms_norm_reference_grads(x, weight, dy)
    assert_close(base.grad.t(), dx_ref, torch.float32, "dx")


@pytest.mark.parametrize("n_rows", [3, 123])  # fewer rows than backward programs; many rows per program
def test_rms_norm_weight_gradient(n_rows, device):
    """dweight = sum over rows of dy * x_hat, added up from per-program partial sums: right and deterministic."""
    x, weight, dy = rms_norm_inputs((n_rows, 96), torch.float32, device)
    weight.requires_grad_()
    rms_norm(x, weight, EPS).backward(dy)

    x64 = x.double()
    x_hat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    assert_close(weight.grad, (dy.double() * x_hat).sum(0), torch.float32, "dweight")

    first = weight.grad.clone()
    weight.grad = None
    rms_norm(x, weight, EPS).backward(dy)
    assert torch.equal(weight.grad, first), "dweight changed between two identical runs"


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_rms_norm_matches_the_float32_formula(dtype, device):
    """Same float32 arithmetic as the PyTorch formula of the model: results differ by at most one rounding."""
    x, weight, _ = rms_norm_inputs((7, 200), dtype, device)
    formula = (weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS))).to(x.dtype)
    torch.testing.assert_close(rms_norm(x, weight, EPS), formula, rtol=torch.finfo(dtype).eps, atol=1e-5)


def test_rms_norm_rejects_rows_longer_than_8192(device):
    with pytest.raises(ValueError):
        rms_norm(torch.randn(2, 8193, device=device), torch.ones(8193, device=device), EPS)


@pytest.mark.gpu
def test_rms_norm_under_autocast_keeps_the_activation_dtype(device):
    layer = torch.nn.Linear(256, 256, device=device)
    weight = torch.nn.Parameter(1.0 + 0.5 * torch.randn(256, device=device))
    inputs = torch.randn(8, 128, 256, device=device)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        x = layer(inputs)
        y = rms_norm(x, weight, EPS)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    y_ref, _, dweight_ref = rms_norm_reference_grads(x, weight, dy)
    assert_close(y, y_ref, torch.bfloat16, "y")
    assert_close(weight.grad, dweight_ref, torch.bfloat16, "dweight")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 128, 256), (4, 512, 1000), (2, 1024, 4096), (64, 8192)])
def test_rms_norm_full_size(shape, dtype, device):
    x, weight, dy = rms_norm_inputs(shape, dtype, device)
    x.requires_grad_()
    weight.requires_grad_()
    y = rms_norm(x, weight, EPS)
    y.backward(dy)
    y_ref, dx_ref, dweight_ref = rms_norm_reference_grads(x, weight, dy)
    assert_close(y, y_ref, dtype, "y")
    assert_close(x.grad, dx_ref, dtype, "dx")
    assert_close(weight.grad, dweight_ref, dtype, "dweight")


# ================================================================================================ RoPE


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_reference(x, cos, sin):
    seq_len = x.shape[-2]
    return x * cos[:seq_len].double() + rotate_half(x) * sin[:seq_len].double()


def rope_reference_grads(q, k, cos, sin, grad_q_rot, grad_k_rot):
    q64, k64 = float64_leaf(q), float64_leaf(k)
    q_rot, k_rot = rope_reference(q64, cos, sin), rope_reference(k64, cos, sin)
    torch.autograd.backward([q_rot, k_rot], [grad_q_rot.double(), grad_k_rot.double()])
    return q_rot.detach(), k_rot.detach(), q64.grad, k64.grad


def test_rope_tables(device):
    seq_len, head_dim, theta = 37, 32, 10000.0
    cos, sin = rope_tables(seq_len, head_dim, theta, device)
    assert cos.shape == sin.shape == (seq_len, head_dim) and cos.dtype == sin.dtype == torch.float32
    half = head_dim // 2
    # rotate-half layout: the angles are written twice along the last dimension
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    i = torch.arange(half, dtype=torch.float64)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * theta ** (-2 * i / head_dim)[None, :]
    torch.testing.assert_close(cos[:, :half].cpu().double(), angles.cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin[:, :half].cpu().double(), angles.sin(), rtol=0, atol=1e-7)


# (batch, q heads, k heads, seq, head_dim). S = 37 and 9: not powers of two; Hk < H: grouped-query attention;
# head_dim 48: half = 24 is not a power of two (masked columns).
ROPE_SHAPES = [(2, 3, 3, 37, 32), (1, 4, 2, 16, 64), (1, 2, 2, 5, 128), (2, 2, 1, 9, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rope_kernels_write_every_element(shape, dtype, device):
    batch, heads, kv_heads, seq_len, head_dim = shape
    cos, sin = rope_tables(seq_len + 5, head_dim, device=device)  # longer tables, as built for max_seq_len
    q = torch.randn(batch, heads, seq_len, head_dim, device=device).to(dtype)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, device=device).to(dtype)
    grad_q_rot, grad_k_rot = torch.randn_like(q), torch.randn_like(k)

    q_rot, k_rot = rope_forward(q, k, cos, sin, q_out=poisoned(q.shape, dtype, device),
                                k_out=poisoned(k.shape, dtype, device))
    grad_q, grad_k = rope_backward(grad_q_rot, grad_k_rot, cos, sin, grad_q=poisoned(q.shape, dtype, device),
                                   grad_k=poisoned(k.shape, dtype, device))

    q_rot_ref, k_rot_ref, grad_q_ref, grad_k_ref = rope_reference_grads(q, k, cos, sin, grad_q_rot, grad_k_rot)
    assert q_rot.dtype == k_rot.dtype == grad_q.dtype == dtype
    assert_close(q_rot, q_rot_ref, dtype, "q_rot")
    assert_close(k_rot, k_rot_ref, dtype, "k_rot")
    assert_close(grad_q, grad_q_ref, dtype, "grad_q")
    assert_close(grad_k, grad_k_ref, dtype, "grad_k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_autograd_on_views_of_a_fused_projection(dtype, device):
    """As in the model: q and k are permuted views of one qkv tensor, so they are not contiguous."""
    batch, seq_len, heads, head_dim = 2, 37, 4, 32
    qkv = torch.randn(batch, seq_len, 3, heads, head_dim, device=device).to(dtype).requires_grad_()
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)  # [B, H, S, Dh] views
    assert not q.is_contiguous()
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    grad_q_rot, grad_k_rot = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward([q_rot, k_rot], [grad_q_rot, grad_k_rot])

    q_rot_ref, k_rot_ref, grad_q_ref, grad_k_ref = rope_reference_grads(q, k, cos, sin, grad_q_rot, grad_k_rot)
    assert_close(q_rot, q_rot_ref, dtype, "q_rot")
    assert_close(k_rot, k_rot_ref, dtype, "k_rot")
    assert_close(qkv.grad[:, :, 0].transpose(1, 2), grad_q_ref, dtype, "grad_q")
    assert_close(qkv.grad[:, :, 1].transpose(1, 2), grad_k_ref, dtype, "grad_k")
    assert torch.count_nonzero(qkv.grad[:, :, 2]) == 0, "v was not an input: its gradient must stay zero"


def test_apply_rope_when_only_q_rot_is_used(device):
    q = torch.randn(1, 2, 7, 32, device=device, requires_grad=True)
    k = torch.randn(1, 2, 7, 32, device=device, requires_grad=True)
    cos, sin = rope_tables(7, 32, device=device)
    q_rot, _ = apply_rope(q, k, cos, sin)
    q_rot.sum().backward()
    assert torch.count_nonzero(k.grad) == 0
    _, _, grad_q_ref, _ = rope_reference_grads(q, k, cos, sin, torch.ones_like(q), torch.zeros_like(k))
    assert_close(q.grad, grad_q_ref, torch.float32, "grad_q")


@pytest.mark.parametrize("tables", ["rope", "random"])
def test_rope_backward_is_the_adjoint(tables, device):
    """<forward(x), g> == <x, backward(g)> for all x and g: the backward is exactly the transpose.

    With random (non-rotation) tables this checks the transpose itself, not only that it inverts a rotation.
    """
    batch, heads, seq_len, head_dim = 2, 3, 11, 32
    if tables == "rope":
        cos, sin = rope_tables(seq_len, head_dim, device=device)
    else:
        cos, sin = torch.randn(seq_len, head_dim, device=device), torch.randn(seq_len, head_dim, device=device)
    x_q, x_k = (torch.randn(batch, heads, seq_len, head_dim, device=device) for _ in range(2))
    g_q, g_k = (torch.randn(batch, heads, seq_len, head_dim, device=device) for _ in range(2))

    forward_q, forward_k = rope_forward(x_q, x_k, cos, sin)
    backward_q, backward_k = rope_backward(g_q, g_k, cos, sin)
    for x, g, fx, bg in [(x_q, g_q, forward_q, backward_q), (x_k, g_k, forward_k, backward_k)]:
        lhs = (fx.double() * g.double()).sum()
        rhs = (x.double() * bg.double()).sum()
        scale = fx.double().norm() * g.double().norm()
        assert abs(lhs - rhs) < 1e-6 * scale, f"<Rx, g> = {lhs:.6f} but <x, R^T g> = {rhs:.6f}"

    if tables == "rope":  # a rotation: its transpose is its inverse
        restored_q, restored_k = rope_backward(forward_q, forward_k, cos, sin)
        assert_close(restored_q, x_q.double(), torch.float32, "inverse(forward(q))")
        assert_close(restored_k, x_k.double(), torch.float32, "inverse(forward(k))")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 8, 128, 32), (4, 16, 1024, 64), (2, 32, 2048, 128), (3, 5, 1000, 64)])
def test_rope_full_size(shape, dtype, device):
    q = torch.randn(shape, device=device).to(dtype).requires_grad_()
    k = torch.randn(shape, device=device).to(dtype).requires_grad_()
    cos, sin = rope_tables(shape[2], shape[3], device=device)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    grad_q_rot, grad_k_rot = torch.randn_like(q_rot), torch.randn_like(k_rot)
    torch.autograd.backward([q_rot, k_rot], [grad_q_rot, grad_k_rot])
    q_rot_ref, k_rot_ref, grad_q_ref, grad_k_ref = rope_reference_grads(q, k, cos, sin, grad_q_rot, grad_k_rot)
    assert_close(q_rot, q_rot_ref, dtype, "q_rot")
    assert_close(k_rot, k_rot_ref, dtype, "k_rot")
    assert_close(q.grad, grad_q_ref, dtype, "grad_q")
    assert_close(k.grad, grad_k_ref, dtype, "grad_k")


# The packed layout: qkv [B, S, 3D] as the fused projection writes it (version 3's model uses this path).


def packed_reference_grads(qkv, num_heads, cos, sin, grad_out):
    """float64 reference: RoPE on the q and k column blocks of qkv, v passed through; and qkv's gradient."""
    qkv64 = float64_leaf(qkv)
    batch, seq_len, width = qkv.shape
    q, k, v = qkv64.view(batch, seq_len, 3, num_heads, -1).unbind(2)          # [B, S, H, Dh] views
    q_rot, k_rot = (rope_reference(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k))
    out = torch.stack([q_rot, k_rot, v], dim=2).reshape(batch, seq_len, width)
    out.backward(grad_out.double())
    return out.detach(), qkv64.grad


# (batch, seq, heads, head_dim): S = 37 is not a power of two; head_dim 48 has a half of 24 (masked columns).
PACKED_SHAPES = [(2, 37, 3, 32), (1, 16, 2, 64), (2, 9, 2, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PACKED_SHAPES)
def test_rope_packed_kernels_write_every_element(shape, dtype, device):
    batch, seq_len, heads, head_dim = shape
    width = 3 * heads * head_dim
    cos, sin = rope_tables(seq_len + 5, head_dim, device=device)
    qkv = torch.randn(batch, seq_len, width, device=device).to(dtype)
    grad_out = torch.randn_like(qkv)

    out = rope_packed_forward(qkv, heads, cos, sin, out=poisoned(qkv.shape, dtype, device))
    grad_qkv = rope_packed_backward(grad_out, heads, cos, sin, grad_qkv=poisoned(qkv.shape, dtype, device))

    out_ref, grad_ref = packed_reference_grads(qkv, heads, cos, sin, grad_out)
    assert out.dtype == grad_qkv.dtype == dtype
    assert_close(out, out_ref, dtype, "rotated qkv")
    assert_close(grad_qkv, grad_ref, dtype, "grad qkv")
    dim = heads * head_dim
    assert torch.equal(out[..., 2 * dim:], qkv[..., 2 * dim:]), "v must be copied unchanged"
    assert torch.equal(grad_qkv[..., 2 * dim:], grad_out[..., 2 * dim:]), "v's gradient must pass unchanged"


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_packed_agrees_with_the_unpacked_kernel(dtype, device):
    """Both layouts rotate with the same kernel: the packed result equals apply_rope on the permuted views."""
    batch, seq_len, heads, head_dim = 2, 21, 4, 32
    qkv = torch.randn(batch, seq_len, 3 * heads * head_dim, device=device).to(dtype).requires_grad_()
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    out = apply_rope_packed(qkv, heads, cos, sin)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    q, k, v = qkv.detach().view(batch, seq_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    rotated = out.detach().view(batch, seq_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    assert torch.equal(rotated[0], q_rot) and torch.equal(rotated[1], k_rot) and torch.equal(rotated[2], v)
    _, grad_ref = packed_reference_grads(qkv, heads, cos, sin, grad_out)
    assert_close(qkv.grad, grad_ref, dtype, "grad qkv")


def test_rope_packed_refuses_a_width_that_does_not_split_into_heads(device):
    cos, sin = rope_tables(4, 32, device=device)
    with pytest.raises(AssertionError, match="3 \\* num_heads"):
        rope_packed_forward(torch.randn(1, 4, 100, device=device), 2, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 128, 8, 32), (4, 1024, 16, 64), (2, 1000, 5, 128)])
def test_rope_packed_full_size(shape, dtype, device):
    batch, seq_len, heads, head_dim = shape
    qkv = torch.randn(batch, seq_len, 3 * heads * head_dim, device=device).to(dtype).requires_grad_()
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    out = apply_rope_packed(qkv, heads, cos, sin)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    out_ref, grad_ref = packed_reference_grads(qkv, heads, cos, sin, grad_out)
    assert_close(out, out_ref, dtype, "rotated qkv")
    assert_close(qkv.grad, grad_ref, dtype, "grad qkv")


# ================================================================================================ SwiGLU


def swiglu_reference_grads(gate, up, dout):
    gate64, up64 = float64_leaf(gate), float64_leaf(up)
    out64 = F.silu(gate64) * up64
    out64.backward(dout.double())
    return out64.detach(), gate64.grad, up64.grad


def swiglu_inputs(shape, dtype, device):
    gate = (3.0 * torch.randn(shape, device=device)).to(dtype)  # wide enough to reach both tails of sigmoid
    up = torch.randn(shape, device=device).to(dtype)
    dout = torch.randn(shape, device=device).to(dtype)
    return gate, up, dout


# F = 300 and 7: not powers of two; F = 3000: several column blocks per row.
SWIGLU_SHAPES = [(4, 300), (2, 3, 512), (2, 3000), (5, 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
def test_swiglu_kernels_write_every_element(shape, dtype, device):
    gate, up, dout = swiglu_inputs(shape, dtype, device)
    out = swiglu_forward(gate, up, out=poisoned(shape, dtype, device))
    dgate, dup = swiglu_backward(dout, gate, up, dgate=poisoned(shape, dtype, device),
                                 dup=poisoned(shape, dtype, device))
    out_ref, dgate_ref, dup_ref = swiglu_reference_grads(gate, up, dout)
    assert out.dtype == dgate.dtype == dup.dtype == dtype
    assert_close(out, out_ref, dtype, "out")
    assert_close(dgate, dgate_ref, dtype, "dgate")
    assert_close(dup, dup_ref, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
def test_swiglu_fused_kernels_write_every_element(shape, dtype, device):
    gate, up, dout = swiglu_inputs(shape, dtype, device)
    gate_up = torch.cat([gate, up], dim=-1)  # [..., 2F], the output of a fused gate/up projection
    out = swiglu_fused_forward(gate_up, out=poisoned(shape, dtype, device))
    dgate_up = swiglu_fused_backward(dout, gate_up, dgate_up=poisoned(gate_up.shape, dtype, device))

    n = shape[-1]
    out_ref, dgate_ref, dup_ref = swiglu_reference_grads(gate, up, dout)
    assert_close(out, out_ref, dtype, "out")
    assert_close(dgate_up[..., :n], dgate_ref, dtype, "dgate (first half of dgate_up)")
    assert_close(dgate_up[..., n:], dup_ref, dtype, "dup (second half of dgate_up)")
    # Same kernel as the separate layout, only the row stride differs: results must be identical.
    assert torch.equal(out, swiglu_forward(gate, up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_autograd(dtype, device):
    gate, up, dout = swiglu_inputs((3, 5, 300), dtype, device)
    gate.requires_grad_()
    up.requires_grad_()
    out = swiglu(gate, up)
    out.backward(dout)
    out_ref, dgate_ref, dup_ref = swiglu_reference_grads(gate, up, dout)
    assert_close(out, out_ref, dtype, "out")
    assert_close(gate.grad, dgate_ref, dtype, "dgate")
    assert_close(up.grad, dup_ref, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_fused_autograd_through_a_projection(dtype, device):
    """The fused layout as the model uses it: gate_up = x @ W^T, with W = [W_gate; W_up]."""
    hidden, ffn = 24, 300
    x = torch.randn(2, 7, hidden, device=device).to(dtype)
    w_gate = (torch.randn(ffn, hidden, device=device) / hidden ** 0.5).to(dtype).requires_grad_()
    w_up = (torch.randn(ffn, hidden, device=device) / hidden ** 0.5).to(dtype).requires_grad_()
    gate_up = x @ torch.cat([w_gate, w_up]).t()
    gate_up.retain_grad()
    out = swiglu_fused(gate_up)
    dout = torch.randn_like(out)
    out.backward(dout)

    assert gate_up.grad.shape == gate_up.shape and out.shape == (2, 7, ffn)
    out_ref, dgate_ref, dup_ref = swiglu_reference_grads(gate_up[..., :ffn], gate_up[..., ffn:], dout)
    assert_close(out, out_ref, dtype, "out")
    assert_close(gate_up.grad[..., :ffn], dgate_ref, dtype, "dgate")
    assert_close(gate_up.grad[..., ffn:], dup_ref, dtype, "dup")
    # ...and the gradient reaches the weights the same way it does for two separate projections.
    assert_close(w_gate.grad, dgate_ref.reshape(-1, ffn).t() @ x.double().reshape(-1, hidden), dtype, "dW_gate")


# The interpreter computes exp with numpy, which warns on the overflow to inf that this test provokes on purpose.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_swiglu_extreme_gates_stay_finite(device):
    """sigmoid(g) for |g| in the thousands: exp overflows to inf, which must still give silu -> 0 or g."""
    gate = torch.linspace(-1e4, 1e4, 2 * 501, device=device).reshape(2, 501)
    up, dout = torch.randn(2, 501, device=device), torch.randn(2, 501, device=device)
    out = swiglu_forward(gate, up)
    dgate, dup = swiglu_backward(dout, gate, up)
    assert torch.isfinite(out).all() and torch.isfinite(dgate).all() and torch.isfinite(dup).all()
    out_ref, dgate_ref, dup_ref = swiglu_reference_grads(gate, up, dout)
    assert_close(out, out_ref, torch.float32, "out")
    assert_close(dgate, dgate_ref, torch.float32, "dgate")
    assert_close(dup, dup_ref, torch.float32, "dup")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 128, 512), (4, 1024, 2752), (2, 2048, 11008)])
def test_swiglu_full_size(shape, dtype, device):
    gate, up, dout = swiglu_inputs(shape, dtype, device)
    gate_up = torch.cat([gate, up], dim=-1).requires_grad_()
    out = swiglu_fused(gate_up)
    out.backward(dout)
    out_ref, dgate_ref, dup_ref = swiglu_reference_grads(gate, up, dout)
    n = shape[-1]
    assert_close(out, out_ref, dtype, "out")
    assert_close(gate_up.grad[..., :n], dgate_ref, dtype, "dgate")
    assert_close(gate_up.grad[..., n:], dup_ref, dtype, "dup")
