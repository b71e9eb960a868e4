"""Version 3's RMSNorm kernels (kernels/rmsnorm.py).

Against a float64 PyTorch reference, forward and backward, over shapes and dtypes, with NaN-filled output
buffers (v3_kernel_checks.py). On a CPU-only machine the kernels run in Triton's interpreter (see conftest.py),
so CPU shapes are small; the full-size shapes and bfloat16 are in the gpu-marked tests.
"""
import pytest
import torch

from version3_triton.kernels.rmsnorm import rms_norm, rms_norm_backward, rms_norm_forward

from .v3_kernel_checks import (  # noqa: F401  (fresh_seed: this file's autouse fixture)
    DTYPES, assert_close, float64_leaf, fresh_seed, poisoned)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")
EPS = 1e-6


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
