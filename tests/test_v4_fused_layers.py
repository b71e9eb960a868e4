"""Version 4's fused-layer Functions (fused_layers.py) against float64 autograd: RotaryQKVAttention, the QKV GEMM
with RoPE in its epilogue followed by flash attention.

Against float64 PyTorch references, forward and every gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size and bfloat16 cases are gpu-marked.
"""
import math

import pytest
import torch

from version4_triton_ultra.kernels import swiglu_gemm as sg

# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    as_float64_leaf, assert_matches, leaf, poisoned_outputs, random, rope_reference)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def check_rotary_qkv_attention(batch, seq_len, heads, head_dim, dtype, device, seed):
    """Version 4's RotaryQKVAttention (QKV GEMM + RoPE epilogue -> flash attention) against float64 autograd of
    attention(RoPE(x @ W^T)): the output and the gradients of x and W."""
    from version3_triton.kernels.rope import rope_tables
    from version4_triton_ultra.fused_layers import RotaryQKVAttention
    dim = heads * head_dim
    x = leaf(random((batch, seq_len, dim), dtype, device, seed))
    weight = leaf(random((3 * dim, dim), torch.float32, device, seed + 1, scale=dim ** -0.5))
    grad_out = random((batch, seq_len, dim), dtype, device, seed + 2)
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    gemm_weight = weight if dtype == torch.float32 else weight.detach().to(dtype)
    precise = dtype == torch.float32
    out = RotaryQKVAttention.apply(x, weight, gemm_weight, cos, sin, heads, precise, None)
    out.backward(grad_out)

    x64, weight64 = as_float64_leaf(x), as_float64_leaf(weight)
    qkv = (x64 @ weight64.T).view(batch, seq_len, 3, heads, head_dim)
    q, k, v = qkv.unbind(2)
    q, k = rope_reference(q, cos.double(), sin.double()), rope_reference(k, cos.double(), sin.double())
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(head_dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)
    probabilities = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    want = torch.einsum("bhst,bthd->bshd", probabilities, v).reshape(batch, seq_len, dim)
    want.backward(grad_out.double())

    tolerance_dtype = torch.bfloat16 if sg.dot_precision(dtype) == "tf32" and x.is_cuda else dtype
    assert out.dtype == dtype
    assert_matches(out, want, tolerance_dtype, "out")
    assert_matches(x.grad, x64.grad, tolerance_dtype, "grad x")
    assert_matches(weight.grad, weight64.grad, tolerance_dtype, "grad weight")


def test_rotary_qkv_attention_matches_float64(device):
    check_rotary_qkv_attention(2, 19, 2, 16, torch.float32, device, seed=251)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_qkv_attention_full_size_gpu(dtype, device):
    check_rotary_qkv_attention(4, 512, 8, 32, dtype, device, seed=261)
