"""Tests of version 3's flash-attention op (forward and backward; version 4's copy with RoPE on load is tested
in test_v4_flash_attention.py).

Every case compares against attention computed in float64 by PyTorch with an explicit S x S softmax
(attention_checks.py), on fresh random inputs. On a machine without a GPU the kernels run in Triton's
interpreter, so CPU cases use short sequences; long sequences, head dim 128, bfloat16 and the memory check are
gpu-marked.
"""
import math
import warnings

import pytest
import torch

from tinytransformer import triton_support
from tinytransformer.triton_support import interpreter_active
from version3_triton.kernels import flash_attention as fa

from .attention_checks import (TF32_TOLERANCE, TOLERANCE, check_against_reference, check_backward_is_deterministic,
                               check_non_contiguous_inputs_and_broadcast_grad, check_packed_against_reference,
                               check_packed_equals_unpacked, fixed_tiles, pack_heads, recording_new_buffer,
                               reference_attention, relative_error, unpack_reference)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    """Every buffer the op allocates starts as NaN, so an element a kernel never writes fails the test."""
    monkeypatch.setattr(fa, "FILL_NEW_BUFFERS_WITH_NAN", True)


# ----------------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes
# ----------------------------------------------------------------------------------------------------------
# (batch, heads, seq_len, head_dim): sequence lengths of one row, below, at and past whole blocks (the
# interpreter's blocks are 32 queries x 16 keys; a GPU's are 64 or 128 x 32 or 64).
PLAIN_SHAPES = [(1, 2, 1, 32), (2, 1, 37, 32), (1, 2, 64, 32), (1, 2, 100, 32), (1, 1, 129, 32),
                (1, 2, 37, 64), (2, 1, 100, 64), (1, 1, 37, 16), (1, 1, 37, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", PLAIN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal_matches_reference(shape, dtype, device):
    check_against_reference(fa, *shape, dtype, device)


def test_non_causal_matches_reference(device):
    check_against_reference(fa, 2, 1, 37, 32, torch.float32, device, causal=False)


def test_custom_scale_and_head_dim_128(device):
    check_against_reference(fa, 1, 1, 37, 128, torch.float32, device, sm_scale=0.3)


def test_non_contiguous_inputs_and_broadcast_grad(device):
    check_non_contiguous_inputs_and_broadcast_grad(fa, device, use_rope=False)


def test_backward_is_deterministic(device):
    check_backward_is_deterministic(fa, device, use_rope=False)


def test_nan_fill_hook_is_active():
    """The autouse fixture really poisons the buffers the op allocates (else the tests above prove less)."""
    assert torch.isnan(fa._new_buffer((3, 4), torch.float32, torch.device("cpu"))).all()


def test_rejects_bad_inputs(device):
    q = torch.randn(1, 2, 8, 48, device=device)
    with pytest.raises(ValueError, match="head dim"):
        fa.flash_attention(q, q, q)
    q = torch.randn(1, 2, 8, 32, device=device)
    with pytest.raises(ValueError, match="dtype"):
        fa.flash_attention(q, q, q.half())


@pytest.mark.skipif(not interpreter_active(), reason="only Triton's interpreter gets bfloat16 matmuls wrong")
def test_bfloat16_refused_in_interpreter():
    q = torch.randn(1, 1, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="interpreter"):
        fa.flash_attention(q, q, q)


# ----------------------------------------------------------------------------------------------------------
# GPU only: long sequences, every head dim, bfloat16, tf32, memory
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq_len", [129, 1000, 4096])
def test_long_sequences_gpu(seq_len, head_dim, dtype, device):
    check_against_reference(fa, 1, 2, seq_len, head_dim, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [129, 1000])
def test_tf32_default_gpu(seq_len, device):
    """float32 without precise_fp32: tf32 tensor cores on NVIDIA (ieee on AMD), a looser tolerance."""
    check_against_reference(fa, 1, 2, seq_len, 64, torch.float32, device, precise_fp32=False,
                            tolerance=TF32_TOLERANCE)


@pytest.mark.gpu
def test_memory_stays_far_below_score_matrix_gpu(device):
    """Forward + backward at S = 4096 never holds anything like the B*H x S x S score matrix."""
    batch, heads, seq_len, head_dim = 1, 8, 4096, 64
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    fa.flash_attention(q, k, v).backward(grad_out)  # compile first: not part of the measurement
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fa.flash_attention(q, k, v).backward(grad_out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    score_matrix_bytes = batch * heads * seq_len * seq_len * 2
    # out, dq, dk, dv: 4 MiB each here (lse and delta: 128 KiB), against 256 MiB of float16 scores.
    assert extra < score_matrix_bytes / 8, \
        f"{extra / 2**20:.0f} MiB used; the score matrix alone is {score_matrix_bytes / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------------------------------------
# Packed entry point: q, k, v read from a fused QKV output [B, S, 3D], out written as [B, S, D]
# ----------------------------------------------------------------------------------------------------------
# (batch, heads, seq_len, head_dim): batch > 1 and heads > 1 in most, so that a mix-up of the batch and head
# strides shows; several heads per token row; sequence lengths of one row, below, at and past whole blocks.
PACKED_SHAPES = [(1, 2, 1, 32), (2, 3, 37, 16), (2, 2, 64, 32), (1, 1, 100, 64), (1, 1, 129, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_matches_reference(shape, dtype, device):
    check_packed_against_reference(fa, *shape, dtype, device)


def test_packed_non_causal_matches_reference(device):
    check_packed_against_reference(fa, 2, 2, 37, 32, torch.float32, device, causal=False)


def test_packed_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """The blocks a CPU run takes in the interpreter (query and key blocks of up to 128, fitted to the sequence):
    150 positions span two of each, the second one partial."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_packed_against_reference(fa, 2, 2, 150, 16, torch.float32, device)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_large_scores_warn_of_nothing(causal, device):
    """Scores far above a row's log-sum-exp (large q and k, as with performance-debugging stage 1's std-1 weights):
    the exponentials of the keys a row does not see overflow in lanes the kernels then drop; the results are
    finite, and Triton's interpreter, which computes those lanes with NumPy, no longer warns about them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 16, device=device) for _ in range(3))
    q, k = (30 * t for t in (q, k))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = fa.flash_attention(q, k, v, causal=causal, precise_fp32=True)
        out.backward(torch.randn_like(out))
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t).all(), name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_equals_unpacked(causal, device):
    check_packed_equals_unpacked(fa, 2, 3, 37, 16, torch.float32, device, causal, use_rope=False)


def test_packed_allocates_poisoned_outputs(monkeypatch, device):
    """out, lse, delta and the ONE gradient buffer of qkv all come from _new_buffer, i.e. start as NaN under the
    autouse fixture; finite results therefore mean every element was written."""
    allocated = recording_new_buffer(fa, monkeypatch)
    batch, heads, seq_len, head_dim = 2, 2, 37, 16
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device, requires_grad=True)
    out = fa.flash_attention_packed(qkv, heads)
    out.backward(torch.randn_like(out))
    assert sorted(allocated) == sorted([(batch, seq_len, dim), (batch * heads, seq_len),      # out, lse
                                        (batch * heads, seq_len), (batch, seq_len, 3 * dim)])  # delta, d(qkv)
    assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()


def test_packed_non_contiguous_qkv_and_broadcast_grad(device):
    """A qkv that is a column slice of a wider tensor (copied once) and the zero-stride gradient of out.sum()."""
    batch, heads, seq_len, head_dim = 2, 2, 37, 16
    dim = heads * head_dim
    wide = torch.randn(batch, seq_len, 3 * dim + 8, device=device, requires_grad=True)
    qkv = wide[..., 8:]
    assert not qkv.is_contiguous()
    fa.flash_attention_packed(qkv, heads, precise_fp32=True).sum().backward()   # float32 tolerance: no TF32

    qkv64 = qkv.detach().double().requires_grad_()
    want = reference_attention(*unpack_reference(qkv64, heads), True, 1.0 / math.sqrt(head_dim))
    pack_heads(want).sum().backward()
    assert relative_error(wide.grad[..., 8:], qkv64.grad) < TOLERANCE[torch.float32]
    assert torch.equal(wide.grad[..., :8], torch.zeros_like(wide.grad[..., :8]))


def test_packed_rejects_bad_inputs(device):
    qkv = torch.randn(1, 8, 3 * 2 * 32, device=device)
    with pytest.raises(ValueError, match="qkv must be"):
        fa.flash_attention_packed(qkv, 5)                      # 192 columns are not 3 * 5 heads * Dh
    with pytest.raises(ValueError, match="qkv must be"):
        fa.flash_attention_packed(qkv.view(8, 192), 2)
    with pytest.raises(ValueError, match="num_heads"):
        fa.flash_attention_packed(qkv, 0)
    with pytest.raises(ValueError, match="head dim"):
        fa.flash_attention_packed(qkv, 8)                      # Dh = 192 / (3 * 8) = 8
    with pytest.raises(ValueError, match="dtype"):
        fa.flash_attention_packed(qkv.double(), 2)


@pytest.mark.skipif(not interpreter_active(), reason="only Triton's interpreter gets bfloat16 matmuls wrong")
def test_packed_bfloat16_refused_in_interpreter():
    with pytest.raises(RuntimeError, match="interpreter"):
        fa.flash_attention_packed(torch.randn(1, 16, 96, dtype=torch.bfloat16), 1)


def test_gpu_launch_config_fits_the_head_dim(monkeypatch):
    """The GPU launch choice (computed here with the interpreter switched off): 64 x 64 tiles for rows of at
    most 128 bytes, smaller tiles for wider rows, one pipeline stage."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for kernel in ("forward", "dkdv", "dq"):
        narrow = fa._launch_config(32, torch.bfloat16, 512, kernel)
        assert (narrow["BLOCK_M"], narrow["BLOCK_N"], narrow["num_stages"]) == (64, 64, 1)
        wide = fa._launch_config(128, torch.float32, 512, kernel)
        assert wide["BLOCK_M"] * wide["BLOCK_N"] < 64 * 64


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 32), (16, 16)])
def test_loop_bounds_with_other_tile_shapes(block_m, block_n, causal, monkeypatch, device):
    """The split into unmasked and masked key blocks must hold for any tile shapes, including key blocks
    larger than query blocks (as a GPU config may choose), at a length that is a multiple of neither."""
    monkeypatch.setattr(fa, "_launch_config", fixed_tiles(block_m, block_n))
    check_packed_against_reference(fa, 2, 2, 45, 16, torch.float32, device, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq_len", [128, 200, 512, 1000])
def test_packed_full_size_gpu(seq_len, head_dim, dtype, device):
    """Both forward launch choices (S <= 256 and longer), every head dim, bfloat16."""
    check_packed_against_reference(fa, 4, 8 if head_dim == 32 else 4, seq_len, head_dim, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("seq_len", [128, 512])
def test_packed_equals_unpacked_gpu(seq_len, dtype, device):
    check_packed_equals_unpacked(fa, 4, 8, seq_len, 32, dtype, device, causal=True, use_rope=False)
