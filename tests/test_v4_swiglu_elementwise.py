"""Version 4's SwiGLU as a kernel of its own each way (kernels/swiglu_elementwise.py, --separate-swiglu).

Against float64 PyTorch references, forward and gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size cases are gpu-marked.
"""
import pytest
import torch
import torch.nn.functional as F

from tinytransformer import triton_support
from version4_triton_ultra.kernels import swiglu_elementwise as se

# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    assert_matches, poisoned_outputs, random)

pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def reference_swiglu(gate_up, grad_h):
    """h and d(gate_up) in float64 with autograd, from the same (rounded) values the kernels read."""
    gate_up = gate_up.detach().double().requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    h.backward(grad_h.detach().double())
    return h.detach(), gate_up.grad


def check_swiglu(n_rows, n_ffn, dtype, device, seed):
    gate_up = random((n_rows, 2 * n_ffn), dtype, device, seed)
    grad_h = random((n_rows, n_ffn), dtype, device, seed + 1)
    h = se.swiglu(gate_up)
    grad_gate_up = se.swiglu_backward(grad_h, gate_up)
    ref_h, ref_grad_gate_up = reference_swiglu(gate_up, grad_h)
    assert h.dtype == grad_gate_up.dtype == dtype
    assert_matches(h, ref_h, dtype, "h")
    assert_matches(grad_gate_up, ref_grad_gate_up, dtype, "grad gate_up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("n_rows, n_ffn", [(7, 37), (3, 16), (1, 5)],
                         ids=["columns not a multiple of the block", "one block", "fewer columns than a block"])
def test_swiglu_matches_reference(n_rows, n_ffn, dtype, device):
    check_swiglu(n_rows, n_ffn, dtype, device, seed=311)


def test_swiglu_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """A CPU run's block covers a row of up to 1,024 columns; wider rows span several blocks."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_swiglu(3, 1100, torch.float32, device, seed=313)


def test_swiglu_of_no_rows_is_empty(device):
    gate_up = torch.ones(0, 8, device=device)
    assert se.swiglu(gate_up).shape == (0, 4)
    assert se.swiglu_backward(torch.ones(0, 4, device=device), gate_up).shape == (0, 8)


def test_swiglu_rejects_mismatched_operands(device):
    with pytest.raises(ValueError, match="gate_up must be"):
        se.swiglu(torch.ones(4, 7, device=device))
    with pytest.raises(ValueError, match="grad_h must be"):
        se.swiglu_backward(torch.ones(4, 3, device=device), torch.ones(4, 8, device=device))
    with pytest.raises(ValueError, match="grad_h must be"):
        se.swiglu_backward(torch.ones(4, 4, device=device, dtype=torch.bfloat16), torch.ones(4, 8, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_rows, n_ffn", [(1000, 512), (8192, 2816)], ids=["seed", "medium"])
def test_swiglu_full_size_gpu(n_rows, n_ffn, dtype, device):
    check_swiglu(n_rows, n_ffn, dtype, device, seed=317)
