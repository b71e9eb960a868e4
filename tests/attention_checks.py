"""The float64 reference and the checks that version 3's and version 4's flash-attention tests share.

Each check takes the kernel module (`fa`: version3_triton.kernels.flash_attention or version 4's copy) and runs
forward and backward through it and through attention computed in float64 by PyTorch with an explicit S x S
softmax, on fresh random inputs. `use_rope` asks the kernels to rotate q and k as they load them, which only
version 4's copy does.
"""
import math

import torch

# Relative error ||out - ref|| / ||ref|| allowed per input dtype (float32: exact float32 matmuls).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# float32 through tf32 tensor cores (the GPU default): the inputs of every matmul keep 10 mantissa bits, as
# in float16, and attention chains four matmuls; a float64 simulation of that truncation gives ~2e-3.
TF32_TOLERANCE = 5e-3


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


def rope_kwargs(rope):
    """rope= only when given: version 3's entry points have no such argument."""
    return {} if rope is None else {"rope": rope}


def check_against_reference(fa, batch, heads, seq_len, head_dim, dtype, device, causal=True, use_rope=False,
                            sm_scale=None, precise_fp32=True, tolerance=None):
    """Run forward and backward through fa.flash_attention and through the float64 reference; compare all."""
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, device=device).to(dtype)
    # Tables longer than the sequence, as a model precomputes them for its maximum length.
    rope = rope_tables(seq_len + 5, head_dim, device=device) if use_rope else None
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)

    out = fa.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, precise_fp32=precise_fp32,
                             **rope_kwargs(rope))
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


def check_non_contiguous_inputs_and_broadcast_grad(fa, device, use_rope):
    """A transposed [B, S, H, Dh] view (what a model produces) and the zero-stride gradient of out.sum()."""
    batch, seq_len, heads, head_dim = 1, 37, 2, 32
    base = [torch.randn(batch, seq_len, heads, head_dim, device=device, requires_grad=True) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    rope = rope_tables(seq_len, head_dim, device=device) if use_rope else None
    fa.flash_attention(q, k, v, precise_fp32=True, **rope_kwargs(rope)).sum().backward()   # no TF32

    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in base)
    reference_attention(q64, k64, v64, True, 1.0 / math.sqrt(head_dim), rope).sum().backward()
    for got, want in ((base[0].grad, q64.grad), (base[1].grad, k64.grad), (base[2].grad, v64.grad)):
        assert relative_error(got.transpose(1, 2), want) < TOLERANCE[torch.float32]


def check_backward_is_deterministic(fa, device, use_rope):
    """Each gradient element is written by one program (no atomics): two runs agree bit for bit."""
    q, k, v = (torch.randn(1, 2, 37, 32, device=device, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 2, 37, 32, device=device)
    rope = rope_tables(37, 32, device=device) if use_rope else None
    grads = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        fa.flash_attention(q, k, v, **rope_kwargs(rope)).backward(grad_out)
        grads.append([q.grad.clone(), k.grad.clone(), v.grad.clone()])
    for first, second in zip(*grads):
        assert torch.equal(first, second)


# ----------------------------------------------------------------------------------------------------------
# The packed entry point: q, k, v read from a fused QKV output [B, S, 3D], out written as [B, S, D]
# ----------------------------------------------------------------------------------------------------------
def unpack_reference(qkv, heads):
    """The copies the packed entry point avoids: [B, S, 3D] -> q, k, v views of [B, H, S, Dh]."""
    batch, seq_len, width = qkv.shape
    return qkv.view(batch, seq_len, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def pack_heads(x):
    """[B, H, S, Dh] -> [B, S, H * Dh], head h in columns h*Dh : (h+1)*Dh (what an output projection reads)."""
    batch, heads, seq_len, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq_len, heads * head_dim)


def check_packed_against_reference(fa, batch, heads, seq_len, head_dim, dtype, device, causal=True,
                                   use_rope=False, precise_fp32=True, tolerance=None):
    """Forward and the gradient of qkv through fa.flash_attention_packed against the float64 reference."""
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(batch, seq_len, dim, device=device).to(dtype)
    rope = rope_tables(seq_len + 5, head_dim, device=device) if use_rope else None

    out = fa.flash_attention_packed(qkv, heads, causal=causal, precise_fp32=precise_fp32, **rope_kwargs(rope))
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


def check_packed_equals_unpacked(fa, batch, heads, seq_len, head_dim, dtype, device, causal, use_rope):
    """Same data through both entry points: the same kernels do the same arithmetic, so the results agree
    bit for bit; only the addresses differ."""
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(batch, seq_len, dim, device=device).to(dtype)
    rope = rope_tables(seq_len, head_dim, device=device) if use_rope else None

    packed_out = fa.flash_attention_packed(qkv, heads, causal=causal, **rope_kwargs(rope))
    packed_out.backward(grad_out)

    q, k, v = (t.detach().contiguous().requires_grad_() for t in unpack_reference(qkv, heads))
    out = fa.flash_attention(q, k, v, causal=causal, **rope_kwargs(rope))
    out.backward(grad_out.view(batch, seq_len, heads, head_dim).transpose(1, 2))

    assert torch.equal(packed_out, pack_heads(out))
    assert torch.equal(qkv.grad, torch.cat([pack_heads(q.grad), pack_heads(k.grad), pack_heads(v.grad)], dim=-1))


def recording_new_buffer(fa, monkeypatch) -> list:
    """Replace fa._new_buffer by one that checks each buffer starts as NaN and records its shape; returns the
    list of shapes it fills as the op allocates."""
    allocated = []
    original = fa._new_buffer

    def new_buffer(shape, dtype, buffer_device):
        buffer = original(shape, dtype, buffer_device)
        assert torch.isnan(buffer).all()
        allocated.append(tuple(buffer.shape))
        return buffer

    monkeypatch.setattr(fa, "_new_buffer", new_buffer)
    return allocated


def fixed_tiles(block_m, block_n):
    """A stand-in for fa._launch_config: every kernel launched with these tiles."""
    return lambda *args: dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=1)
