"""What the tests of version 3's memory-bound kernels share (test_v3_rmsnorm.py, test_v3_rope.py,
test_v3_swiglu.py): the per-dtype tolerances, the float64 comparison, NaN-filled output buffers, and a seed per
test.

Every result is compared with a float64 PyTorch reference computed from the same inputs, by relative error
||out - ref|| / ||ref|| under a per-dtype tolerance. Output buffers are filled with NaN before a kernel runs, so
an element the kernel forgets to write fails the test. A test file imports `fresh_seed` to make it its own
autouse fixture.
"""
import zlib

import pytest
import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# bfloat16 is tested on the GPU only: Triton's interpreter computes it wrongly.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


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
