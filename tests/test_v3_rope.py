"""Version 3's RoPE kernels (kernels/rope.py): q and k as separate views, and the packed qkv [B, S, 3D].

Against a float64 PyTorch reference, forward and backward, over shapes and dtypes, with NaN-filled output
buffers (v3_kernel_checks.py). On a CPU-only machine the kernels run in Triton's interpreter (see conftest.py),
so CPU shapes are small; the full-size shapes and bfloat16 are in the gpu-marked tests.
"""
import pytest
import torch

from version3_triton.kernels.rope import (apply_rope, apply_rope_packed, rope_backward, rope_forward,
                                          rope_packed_backward, rope_packed_forward, rope_tables)

from .v3_kernel_checks import (  # noqa: F401  (fresh_seed: this file's autouse fixture)
    DTYPES, assert_close, float64_leaf, fresh_seed, poisoned)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


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
