"""Version 3's SwiGLU kernels (kernels/swiglu.py): gate and up as two tensors, and the fused gate/up output.

Against a float64 PyTorch reference, forward and backward, over shapes and dtypes, with NaN-filled output
buffers (v3_kernel_checks.py). On a CPU-only machine the kernels run in Triton's interpreter (see conftest.py),
so CPU shapes are small; the full-size shapes and bfloat16 are in the gpu-marked tests.
"""
import pytest
import torch
import torch.nn.functional as F

from version3_triton.kernels.swiglu import (swiglu, swiglu_backward, swiglu_forward, swiglu_fused,
                                            swiglu_fused_backward, swiglu_fused_forward)

from .v3_kernel_checks import (  # noqa: F401  (fresh_seed: this file's autouse fixture)
    DTYPES, assert_close, float64_leaf, fresh_seed, poisoned)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


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
