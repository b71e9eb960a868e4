"""Tests of version 3's flash-attention op (forward and backward, with and without RoPE on load).

Every case compares against attention computed in float64 by PyTorch with an explicit S x S softmax, on
fresh random inputs. On a machine without a GPU the kernels run in Triton's interpreter, so CPU cases use
short sequences; long sequences, head dim 128, bfloat16 and the memory check are gpu-marked.
"""
import math

import pytest
import torch

from tinytransformer import triton_support
from tinytransformer.triton_support import interpreter_active
from version3_triton.kernels import flash_attention as fa

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")
HAS_GPU = torch.cuda.is_available()
# Relative error ||out - ref|| / ||ref|| allowed per input dtype (float32: exact float32 matmuls).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# float32 through tf32 tensor cores (the GPU default): the inputs of every matmul keep 10 mantissa bits, as
# in float16, and attention chains four matmuls; a float64 simulation of that truncation gives ~2e-3.
TF32_TOLERANCE = 5e-3


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    """Every buffer the op allocates starts as NaN, so an element a kernel never writes fails the test."""
    monkeypatch.setattr(fa, "FILL_NEW_BUFFERS_WITH_NAN", True)


# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------
def rope_tables(seq_len, head_dim, theta=10000.0, device=None):
    """cos, sin: float32 [seq_len, head_dim] for RoPE in the rotate-half convention (halves repeat)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def reference_attention(q, k, v, causal, sm_scale, rope=None):
    """Plain attention on float64 copies; q and k are rotated first when rope=(cos, sin) is given."""
    seq_len = q.shape[-2]
    if rope is not None:
        cos, sin = (table[:seq_len].double() for table in rope)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    scores = q @ k.transpose(-1, -2) * sm_scale
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def relative_error(got, want):
    """||got - want|| / ||want|| in float64; NaN or inf anywhere gives inf.

    With S = 1 the only key gets weight 1 whatever q and k are, so dq = dk = 0 exactly: the error is then
    measured in absolute terms (the kernel's rounding leaves ~1e-7).
    """
    got = got.double()
    if not torch.isfinite(got).all():
        return math.inf
    scale = want.norm().item()
    return (got - want).norm().item() / (scale if scale > 0 else 1.0)


def check_against_reference(batch, heads, seq_len, head_dim, dtype, device, causal=True, use_rope=False,
                            sm_scale=None, precise_fp32=True, tolerance=None):
    """Run forward and backward through flash_attention and through the float64 reference; compare all."""
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, device=device).to(dtype)
    # Tables longer than the sequence, as a model precomputes them for its maximum length.
    rope = rope_tables(seq_len + 5, head_dim, device=device) if use_rope else None
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)

    out = fa.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, rope=rope, precise_fp32=precise_fp32)
    out.backward(grad_out)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference_attention(q64, k64, v64, causal, scale, rope)
    want.backward(grad_out.double())

    tolerance = tolerance or TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == shape
    for name, got, ref in (("out", out, want), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                           ("dv", v.grad, v64.grad)):
        error = relative_error(got, ref)
        assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance:.0e} for {shape} {dtype}"


# ----------------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: small shapes
# ----------------------------------------------------------------------------------------------------------
# (batch, heads, seq_len, head_dim): sequence lengths of one row, below, at and past whole blocks (the
# interpreter's blocks are 32 queries x 16 keys; a GPU's are 64 or 128 x 32 or 64).
PLAIN_SHAPES = [(1, 2, 1, 32), (2, 1, 37, 32), (1, 2, 64, 32), (1, 2, 100, 32), (1, 1, 129, 32),
                (1, 2, 37, 64), (2, 1, 100, 64), (1, 1, 37, 16), (1, 1, 37, 128)]
ROPE_SHAPES = [(1, 2, 1, 32), (2, 1, 37, 32), (1, 2, 100, 32), (1, 1, 64, 64), (1, 1, 37, 16),
               (1, 1, 37, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", PLAIN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal_matches_reference(shape, dtype, device):
    check_against_reference(*shape, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_on_load_matches_reference(shape, dtype, device):
    check_against_reference(*shape, dtype, device, use_rope=True)


@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
def test_non_causal_matches_reference(use_rope, device):
    check_against_reference(2, 1, 37, 32, torch.float32, device, causal=False, use_rope=use_rope)


def test_custom_scale_and_head_dim_128(device):
    check_against_reference(1, 1, 37, 128, torch.float32, device, sm_scale=0.3)


@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
def test_non_contiguous_inputs_and_broadcast_grad(use_rope, device):
    """A transposed [B, S, H, Dh] view (what a model produces) and the zero-stride gradient of out.sum()."""
    batch, seq_len, heads, head_dim = 1, 37, 2, 32
    base = [torch.randn(batch, seq_len, heads, head_dim, device=device, requires_grad=True) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    rope = rope_tables(seq_len, head_dim, device=device) if use_rope else None
    fa.flash_attention(q, k, v, rope=rope, precise_fp32=True).sum().backward()   # float32 tolerance: no TF32

    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in base)
    reference_attention(q64, k64, v64, True, 1.0 / math.sqrt(head_dim), rope).sum().backward()
    for got, want in ((base[0].grad, q64.grad), (base[1].grad, k64.grad), (base[2].grad, v64.grad)):
        assert relative_error(got.transpose(1, 2), want) < TOLERANCE[torch.float32]


def test_backward_is_deterministic(device):
    """Each gradient element is written by one program (no atomics): two runs agree bit for bit."""
    q, k, v = (torch.randn(1, 2, 37, 32, device=device, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 2, 37, 32, device=device)
    cos, sin = rope_tables(37, 32, device=device)
    grads = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        fa.flash_attention(q, k, v, rope=(cos, sin)).backward(grad_out)
        grads.append([q.grad.clone(), k.grad.clone(), v.grad.clone()])
    for first, second in zip(*grads):
        assert torch.equal(first, second)


def test_nan_fill_hook_is_active():
    """The autouse fixture really poisons the buffers the op allocates (else the tests above prove less)."""
    assert torch.isnan(fa._new_buffer((3, 4), torch.float32, torch.device("cpu"))).all()


def test_rejects_bad_inputs(device):
    q = torch.randn(1, 2, 8, 48, device=device)
    with pytest.raises(ValueError, match="head dim"):
        fa.flash_attention(q, q, q)
    q = torch.randn(1, 2, 8, 32, device=device)
    with pytest.raises(ValueError, match="rope"):
        fa.flash_attention(q, q, q, rope=rope_tables(4, 32, device=device))
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
@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq_len", [129, 1000, 4096])
def test_long_sequences_gpu(seq_len, head_dim, dtype, use_rope, device):
    check_against_reference(1, 2, seq_len, head_dim, dtype, device, use_rope=use_rope)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_more_heads_and_non_causal_gpu(head_dim, causal, device):
    check_against_reference(3, 5, 300, head_dim, torch.float16, device, causal=causal, use_rope=True)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [129, 1000])
def test_tf32_default_gpu(seq_len, device):
    """float32 without precise_fp32: tf32 tensor cores on NVIDIA (ieee on AMD), a looser tolerance."""
    check_against_reference(1, 2, seq_len, 64, torch.float32, device, precise_fp32=False,
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
def unpack_reference(qkv, heads):
    """The copies the packed entry point avoids: [B, S, 3D] -> q, k, v views of [B, H, S, Dh]."""
    batch, seq_len, width = qkv.shape
    return qkv.view(batch, seq_len, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def pack_heads(x):
    """[B, H, S, Dh] -> [B, S, H * Dh], head h in columns h*Dh : (h+1)*Dh (what an output projection reads)."""
    batch, heads, seq_len, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq_len, heads * head_dim)


def check_packed_against_reference(batch, heads, seq_len, head_dim, dtype, device, causal=True, use_rope=False,
                                   precise_fp32=True, tolerance=None):
    """Forward and the gradient of qkv through flash_attention_packed against the float64 reference."""
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(batch, seq_len, dim, device=device).to(dtype)
    rope = rope_tables(seq_len + 5, head_dim, device=device) if use_rope else None

    out = fa.flash_attention_packed(qkv, heads, causal=causal, rope=rope, precise_fp32=precise_fp32)
    out.backward(grad_out)

    qkv64 = qkv.detach().double().requires_grad_()
    want = pack_heads(reference_attention(*unpack_reference(qkv64, heads), causal, 1.0 / math.sqrt(head_dim),
                                          rope))
    want.backward(grad_out.double())

    assert out.dtype == dtype and out.shape == (batch, seq_len, dim) and out.is_contiguous()
    assert qkv.grad.dtype == dtype and qkv.grad.shape == qkv.shape
    tolerance = tolerance or TOLERANCE[dtype]
    # q, k, v and their gradients compared block by block: dq is much smaller than dv, so a wrong dq could
    # hide inside the error of the whole gradient.
    checks = [("out", out, want)] + [
        (name, got, ref) for name, got, ref in zip(("dq", "dk", "dv"), qkv.grad.split(dim, dim=-1),
                                                   qkv64.grad.split(dim, dim=-1))]
    for name, got, ref in checks:
        error = relative_error(got, ref)
        shape = (batch, heads, seq_len, head_dim)
        assert error < tolerance, f"packed {name}: relative error {error:.2e} >= {tolerance:.0e} for {shape} {dtype}"


# (batch, heads, seq_len, head_dim): batch > 1 and heads > 1 in most, so that a mix-up of the batch and head
# strides shows; several heads per token row; sequence lengths of one row, below, at and past whole blocks.
PACKED_SHAPES = [(1, 2, 1, 32), (2, 3, 37, 16), (2, 2, 64, 32), (1, 1, 100, 64), (1, 1, 129, 16)]


@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_matches_reference(shape, dtype, use_rope, device):
    check_packed_against_reference(*shape, dtype, device, use_rope=use_rope)


@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
def test_packed_non_causal_matches_reference(use_rope, device):
    check_packed_against_reference(2, 2, 37, 32, torch.float32, device, causal=False, use_rope=use_rope)


@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
def test_packed_with_the_blocks_of_a_cpu_run(use_rope, monkeypatch, device):
    """The blocks a CPU run takes in the interpreter (query and key blocks of up to 128, fitted to the sequence):
    150 positions span two of each, the second one partial."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_packed_against_reference(2, 2, 150, 16, torch.float32, device, use_rope=use_rope)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_large_scores_warn_of_nothing(causal, device):
    """Scores far above a row's log-sum-exp (large q and k, as with performance-debugging stage 1's std-1 weights):
    the exponentials of the keys a row does not see overflow in lanes the kernels then drop; the results are
    finite, and Triton's interpreter, which computes those lanes with NumPy, no longer warns about them."""
    import warnings
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


def check_packed_equals_unpacked(batch, heads, seq_len, head_dim, dtype, device, causal, use_rope):
    """Same data through both entry points: the same kernels do the same arithmetic, so the results agree
    bit for bit; only the addresses differ."""
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(batch, seq_len, dim, device=device).to(dtype)
    rope = rope_tables(seq_len, head_dim, device=device) if use_rope else None

    packed_out = fa.flash_attention_packed(qkv, heads, causal=causal, rope=rope)
    packed_out.backward(grad_out)

    q, k, v = (t.detach().contiguous().requires_grad_() for t in unpack_reference(qkv, heads))
    out = fa.flash_attention(q, k, v, causal=causal, rope=rope)
    out.backward(grad_out.view(batch, seq_len, heads, head_dim).transpose(1, 2))

    assert torch.equal(packed_out, pack_heads(out))
    assert torch.equal(qkv.grad, torch.cat([pack_heads(q.grad), pack_heads(k.grad), pack_heads(v.grad)], dim=-1))


@pytest.mark.parametrize("causal,use_rope", [(True, True), (False, False)], ids=["causal-rope", "full-plain"])
def test_packed_equals_unpacked(causal, use_rope, device):
    check_packed_equals_unpacked(2, 3, 37, 16, torch.float32, device, causal, use_rope)


def test_forward_with_rope_refuses_to_run_without_a_buffer_for_the_rotated_rows(device):
    """The kernel writes the rotated q and k for the backward: a caller that gives nowhere to put them gets a
    clear error, not a kernel writing through placeholder pointers."""
    batch, heads, seq_len, head_dim = 1, 1, 8, 16
    q = torch.randn(batch, heads, seq_len, head_dim, device=device)
    strides = (heads * seq_len * head_dim, seq_len * head_dim, head_dim)   # contiguous [B, H, S, Dh]
    problem = fa._Problem(batch, heads, seq_len, head_dim, qkv_strides=strides, out_strides=strides,
                          causal=True, sm_scale=0.25, precision="ieee")
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    with pytest.raises(ValueError, match="rotated"):
        fa._run_forward(problem, q, q, q, torch.empty_like(q), cos, sin)


def test_packed_allocates_poisoned_outputs(monkeypatch, device):
    """out, lse, the rotated [q | k | v] the forward saves for the backward, delta and the ONE gradient buffer of
    qkv all come from _new_buffer, i.e. start as NaN under the autouse fixture; finite results therefore mean
    every element was written (the backward reads every element of the rotated buffer)."""
    allocated = []
    original = fa._new_buffer

    def recording_new_buffer(shape, dtype, buffer_device):
        buffer = original(shape, dtype, buffer_device)
        assert torch.isnan(buffer).all()
        allocated.append(tuple(buffer.shape))
        return buffer

    monkeypatch.setattr(fa, "_new_buffer", recording_new_buffer)
    batch, heads, seq_len, head_dim = 2, 2, 37, 16
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device, requires_grad=True)
    out = fa.flash_attention_packed(qkv, heads, rope=rope_tables(seq_len, head_dim, device=device))
    out.backward(torch.randn_like(out))
    assert sorted(allocated) == sorted([(batch, seq_len, dim), (batch * heads, seq_len),      # out, lse
                                        (batch, seq_len, 3 * dim),                              # rotated qkv
                                        (batch * heads, seq_len), (batch, seq_len, 3 * dim)])  # delta, d(qkv)
    assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_kernels_on_prerotated_qkv(causal, device):
    """packed_attention_forward / _backward, the kernels without autograd (version 4 wraps them in a Function
    whose QKV GEMM rotates q and k in its epilogue): on a qkv whose q and k were rotated beforehand, the output
    is attention of the rotated q and k, and with rope= the gradient comes back for the UNrotated q and k."""
    batch, heads, seq_len, head_dim = 2, 3, 37, 16
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device)
    grad_out = torch.randn(batch, seq_len, dim, device=device)
    cos, sin = rope_tables(seq_len + 4, head_dim, device=device)

    qkv64 = qkv.double().requires_grad_()
    q, k, v = unpack_reference(qkv64, heads)
    want = pack_heads(reference_attention(q, k, v, causal, 1.0 / math.sqrt(head_dim), (cos, sin)))
    want.backward(grad_out.double())

    def rotate(t):   # [B, H, S, Dh] in float64, as the GEMM's epilogue would rotate it
        c, s = cos[:seq_len].double(), sin[:seq_len].double()
        return t * c + rotate_half(t) * s
    q, k, v = unpack_reference(qkv.double(), heads)
    rotated = torch.cat([pack_heads(rotate(q)), pack_heads(rotate(k)), pack_heads(v)], dim=-1).float()

    out, lse = fa.packed_attention_forward(rotated, heads, causal=causal, precise_fp32=True)
    assert lse.shape == (batch * heads, seq_len) and lse.dtype == torch.float32
    grad_qkv = fa.packed_attention_backward(rotated, out, lse, grad_out, heads, causal=causal, precise_fp32=True,
                                            rope=(cos, sin))
    checks = [("out", out, want)] + list(zip(("dq", "dk", "dv"), grad_qkv.split(dim, dim=-1),
                                             qkv64.grad.split(dim, dim=-1)))
    for name, got, ref in checks:
        error = relative_error(got, ref)
        assert error < TOLERANCE[torch.float32], f"{name}: relative error {error:.2e}"


def test_packed_kernels_without_rope_equal_the_autograd_function(device):
    """Without RoPE the two ways into the same kernels agree bit for bit."""
    batch, heads, seq_len, head_dim = 2, 2, 29, 32
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device, requires_grad=True)
    grad_out = torch.randn(batch, seq_len, dim, device=device)
    out = fa.flash_attention_packed(qkv, heads)
    out.backward(grad_out)
    plain_out, lse = fa.packed_attention_forward(qkv.detach(), heads)
    grad_qkv = fa.packed_attention_backward(qkv.detach(), plain_out, lse, grad_out, heads)
    assert torch.equal(plain_out, out) and torch.equal(grad_qkv, qkv.grad)


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
    with pytest.raises(ValueError, match="rope"):
        fa.flash_attention_packed(qkv, 2, rope=rope_tables(4, 32, device=device))
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
    monkeypatch.setattr(fa, "_launch_config",
                        lambda *args: dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=1))
    check_packed_against_reference(2, 2, 45, 16, torch.float32, device, causal=causal, use_rope=True)


@pytest.mark.gpu
@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq_len", [128, 200, 512, 1000])
def test_packed_full_size_gpu(seq_len, head_dim, dtype, use_rope, device):
    """Both forward launch choices (S <= 256 and longer), every head dim, bfloat16."""
    check_packed_against_reference(4, 8 if head_dim == 32 else 4, seq_len, head_dim, dtype, device,
                                   use_rope=use_rope)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("seq_len", [128, 512])
def test_packed_equals_unpacked_gpu(seq_len, dtype, device):
    check_packed_equals_unpacked(4, 8, seq_len, 32, dtype, device, causal=True, use_rope=True)
