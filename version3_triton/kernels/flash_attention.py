"""Causal flash attention in Triton: forward and backward, with an optional RoPE applied as q and k are loaded.

Attention is out = softmax(q k^T * sm_scale + causal mask) v. Written naively it builds the S x S score
matrix for every head: at S = 4096 that is 16 M scores per head, written to memory and read back by the
softmax and by the second matmul. Flash attention never builds it. Each program owns a block of BLOCK_M
query rows and walks over the keys BLOCK_N at a time, keeping in registers

    m   the running row maximum of the scores seen so far        (float32, [BLOCK_M])
    l   the running sum of exp(score - m)                        (float32, [BLOCK_M])
    acc the running sum of exp(score - m) * v                    (float32, [BLOCK_M, Dh])

When a new key block raises the maximum from m to m_new, everything accumulated so far was scaled by
exp(-m) and must be rescaled by alpha = exp(m - m_new); at the end out = acc / l. This "online softmax" reads
q, k and v once per query block and writes only out plus one number per row, lse = m + log(l) (the row's
log-sum-exp), which the backward pass uses to rebuild the probabilities p = exp(score - lse) exactly.

The backward pass (FlashAttention-2) recomputes the scores block by block instead of storing them:
    delta_i = sum_d dO_id * O_id                     (a small preprocess kernel)
    p  = exp(q k^T * sm_scale - lse)                 dv = p^T dO
    dp = dO v^T          ds = p * (dp - delta)       dq = ds k * sm_scale      dk = ds^T q * sm_scale
One kernel owns a block of keys and loops over the query blocks (it accumulates dk and dv); another owns a
block of queries and loops over the key blocks (it accumulates dq). Each output element is written by
exactly one program, so there are no atomics and the result is deterministic; the price is computing
q k^T and dO v^T twice.

RoPE on load (used by version 4): rotary embeddings rotate q and k by a position-dependent angle just
before attention. With `rope=(cos, sin)` the kernels receive UNrotated q and k and rotate each block as it is
loaded, in the rotate-half convention
    rot(x) = x * cos + rotate_half(x) * sin,     rotate_half(x) = cat(-x[..., Dh/2:], x[..., :Dh/2]),
with cos and sin of shape [S, Dh] and equal on both halves. That saves a separate pass that would read and
write q and k once more. The gradients come back with respect to the unrotated inputs: the rotation is
orthogonal, so its transpose, x * cos - rotate_half(x) * sin, is applied to dq and dk before they are stored.

Shapes: q, k, v, out: [B, H, S, Dh]; the kernels see them as B*H independent [S, Dh] matrices.
lse and delta: [B*H, S] float32.
"""
import math

import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import interpreter_active, is_rocm

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tests set this to True: every buffer the wrapper allocates for a kernel to fill (out, lse, delta, dq, dk,
# dv) then starts as NaN, so an element that a kernel forgets to write cannot pass as a plausible value.
FILL_NEW_BUFFERS_WITH_NAN = False


# ----------------------------------------------------------------------------------------------------------
# Small helpers shared by the kernels (inlined by Triton)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _load_rows(base, rows, seq_len, HEAD_DIM: tl.constexpr):
    """Rows `rows` of a contiguous [seq_len, HEAD_DIM] matrix as a [len(rows), HEAD_DIM] block.

    Rows past the end (the last block of a sequence whose length is not a multiple of the block) read 0.
    """
    cols = tl.arange(0, HEAD_DIM)
    return tl.load(base + rows[:, None] * HEAD_DIM + cols[None, :], mask=rows[:, None] < seq_len, other=0.0)


@triton.jit
def _store_rows(base, rows, seq_len, block, HEAD_DIM: tl.constexpr):
    """Write `block` ([len(rows), HEAD_DIM]) into rows `rows`, skipping rows past the end."""
    cols = tl.arange(0, HEAD_DIM)
    tl.store(base + rows[:, None] * HEAD_DIM + cols[None, :], block.to(base.dtype.element_ty),
             mask=rows[:, None] < seq_len)


@triton.jit
def _rotate_half(x, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """cat(-x2, x1) for a [BLOCK, HEAD_DIM] block held in registers, where x1, x2 are its column halves.

    tl.split / tl.join work on a last dimension of size 2, so the block is viewed as
    [row, column within half, which half] (reshape, then permute), split, swapped, joined and viewed back.
    """
    halves = tl.permute(tl.reshape(x, (BLOCK, 2, HEAD_DIM // 2)), (0, 2, 1))
    x1, x2 = tl.split(halves)
    return tl.reshape(tl.permute(tl.join(-x2, x1), (0, 2, 1)), (BLOCK, HEAD_DIM))


@triton.jit
def _rope(x, Cos, Sin, rows, seq_len, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INVERSE: tl.constexpr):
    """Rotate the block x (rows `rows` of a sequence) by RoPE, in float32.

    INVERSE applies the transpose of the rotation, x * cos - rotate_half(x) * sin: it takes a gradient with
    respect to a rotated row back to the unrotated row (valid because cos and sin repeat across the halves).
    """
    cos = _load_rows(Cos, rows, seq_len, HEAD_DIM)
    sin = _load_rows(Sin, rows, seq_len, HEAD_DIM)
    if INVERSE:
        sin = -sin
    x = x.to(tl.float32)
    return x * cos + _rotate_half(x, BLOCK, HEAD_DIM) * sin


@triton.jit
def _load_q_or_k(base, Cos, Sin, rows, seq_len, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROPE: tl.constexpr):
    """Load a block of q or k, rotated by RoPE when ROPE is set, in the input dtype (what tl.dot consumes)."""
    x = _load_rows(base, rows, seq_len, HEAD_DIM)
    if ROPE:  # a constexpr: without RoPE this branch is not even compiled
        x = _rope(x, Cos, Sin, rows, seq_len, BLOCK, HEAD_DIM, False).to(base.dtype.element_ty)
    return x


@triton.jit
def _visible(rows, cols, seq_len, CAUSAL: tl.constexpr):
    """[len(rows), len(cols)] mask of the keys each query may attend to: real keys, and with CAUSAL only the
    keys at or before the query's own position."""
    mask = cols[None, :] < seq_len
    if CAUSAL:
        mask = mask & (cols[None, :] <= rows[:, None])
    return mask


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _flash_attention_forward_kernel(
    Q, K, V, Out, Lse, Cos, Sin,
    seq_len, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). Grid: (cdiv(S, BLOCK_M), B * H)."""
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    # int64: B*H*S*Dh can pass 2**31 for long sequences.
    head_start = head.to(tl.int64) * seq_len * HEAD_DIM
    Q += head_start
    K += head_start
    V += head_start
    Out += head_start
    Lse += head.to(tl.int64) * seq_len

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_q_or_k(Q, Cos, Sin, rows, seq_len, BLOCK_M, HEAD_DIM, ROPE)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Causal: no row of this block sees a key after its last row, so those key blocks are skipped entirely:
    # about half of the work for long sequences. (Only the diagonal blocks need the mask; a faster version
    # runs them in a second loop so the others skip the tl.where. One loop keeps this one short.)
    if CAUSAL:
        key_end = tl.minimum((block_m + 1) * BLOCK_M, seq_len)
    else:
        key_end = seq_len
    # Every row sees key 0, and key block 0 comes first, so m is finite from the first iteration on and
    # exp(m - m_new) is never exp(-inf + inf) = NaN.
    for key_start in range(0, key_end, BLOCK_N):
        cols = key_start + tl.arange(0, BLOCK_N)
        k = _load_q_or_k(K, Cos, Sin, cols, seq_len, BLOCK_N, HEAD_DIM, ROPE)
        v = _load_rows(V, cols, seq_len, HEAD_DIM)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        scores = tl.where(_visible(rows, cols, seq_len, CAUSAL), scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)              # rescales what was accumulated under the old maximum
        p = tl.exp(scores - m_new[:, None])    # masked scores give exp(-inf) = 0
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new

    _store_rows(Out, rows, seq_len, acc / l[:, None], HEAD_DIM)
    tl.store(Lse + rows, m + tl.log(l), mask=rows < seq_len)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _flash_attention_backward_delta_kernel(Out, dOut, Delta, total_rows, HEAD_DIM: tl.constexpr,
                                           BLOCK_ROWS: tl.constexpr):
    """delta = rowsum(dO * O) for all B*H*S rows at once. Grid: (cdiv(B*H*S, BLOCK_ROWS),).

    delta_i = sum_j p_ij dp_ij is the term that the softmax backward subtracts; computing it from O and dO
    is one cheap pass instead of a reduction over all keys inside the big kernels.
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    o = _load_rows(Out, rows, total_rows, HEAD_DIM).to(tl.float32)
    do = _load_rows(dOut, rows, total_rows, HEAD_DIM).to(tl.float32)
    tl.store(Delta + rows, tl.sum(o * do, axis=1), mask=rows < total_rows)


@triton.jit
def _probabilities(q, k, lse, rows, cols, seq_len, sm_scale, CAUSAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Rebuild the attention probabilities p = exp(q k^T * sm_scale - lse) of a [rows, cols] tile.

    Masked keys and query rows past the end get exactly 0, so they add nothing to any gradient.
    """
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
    keep = _visible(rows, cols, seq_len, CAUSAL) & (rows[:, None] < seq_len)
    return tl.where(keep, tl.exp(scores - lse[:, None]), 0.0)


@triton.jit
def _flash_attention_backward_dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV, Cos, Sin,
    seq_len, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: dk and dv for BLOCK_N keys of one (batch, head), looping over query blocks.

    Grid: (cdiv(S, BLOCK_N), B * H).
    """
    block_n = tl.program_id(0)
    head = tl.program_id(1)
    head_start = head.to(tl.int64) * seq_len * HEAD_DIM
    Q += head_start
    K += head_start
    V += head_start
    dOut += head_start
    dK += head_start
    dV += head_start
    Lse += head.to(tl.int64) * seq_len
    Delta += head.to(tl.int64) * seq_len

    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_q_or_k(K, Cos, Sin, cols, seq_len, BLOCK_N, HEAD_DIM, ROPE)
    v = _load_rows(V, cols, seq_len, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Causal: queries before this key block's first key cannot see any of its keys: start at the query
    # block that contains that first key.
    if CAUSAL:
        query_start = (block_n * BLOCK_N // BLOCK_M) * BLOCK_M
    else:
        query_start = 0
    for row_start in range(query_start, seq_len, BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        q = _load_q_or_k(Q, Cos, Sin, rows, seq_len, BLOCK_M, HEAD_DIM, ROPE)
        do = _load_rows(dOut, rows, seq_len, HEAD_DIM)
        lse = tl.load(Lse + rows, mask=rows < seq_len, other=0.0)
        delta = tl.load(Delta + rows, mask=rows < seq_len, other=0.0)

        p = _probabilities(q, k, lse, rows, cols, seq_len, sm_scale, CAUSAL, DOT_PRECISION)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)

    dk = dk * sm_scale
    if ROPE:  # dk is the gradient for the rotated keys: rotate it back
        dk = _rope(dk, Cos, Sin, cols, seq_len, BLOCK_N, HEAD_DIM, True)
    _store_rows(dK, cols, seq_len, dk, HEAD_DIM)
    _store_rows(dV, cols, seq_len, dv, HEAD_DIM)


@triton.jit
def _flash_attention_backward_dq_kernel(
    Q, K, V, dOut, Lse, Delta, dQ, Cos, Sin,
    seq_len, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: dq for BLOCK_M queries of one (batch, head), looping over key blocks.

    Grid: (cdiv(S, BLOCK_M), B * H).
    """
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    head_start = head.to(tl.int64) * seq_len * HEAD_DIM
    Q += head_start
    K += head_start
    V += head_start
    dOut += head_start
    dQ += head_start
    Lse += head.to(tl.int64) * seq_len
    Delta += head.to(tl.int64) * seq_len

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_q_or_k(Q, Cos, Sin, rows, seq_len, BLOCK_M, HEAD_DIM, ROPE)
    do = _load_rows(dOut, rows, seq_len, HEAD_DIM)
    lse = tl.load(Lse + rows, mask=rows < seq_len, other=0.0)
    delta = tl.load(Delta + rows, mask=rows < seq_len, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Causal: the same key blocks the forward pass visited.
    if CAUSAL:
        key_end = tl.minimum((block_m + 1) * BLOCK_M, seq_len)
    else:
        key_end = seq_len
    for key_start in range(0, key_end, BLOCK_N):
        cols = key_start + tl.arange(0, BLOCK_N)
        k = _load_q_or_k(K, Cos, Sin, cols, seq_len, BLOCK_N, HEAD_DIM, ROPE)
        v = _load_rows(V, cols, seq_len, HEAD_DIM)

        p = _probabilities(q, k, lse, rows, cols, seq_len, sm_scale, CAUSAL, DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)

    dq = dq * sm_scale
    if ROPE:  # dq is the gradient for the rotated queries: rotate it back
        dq = _rope(dq, Cos, Sin, rows, seq_len, BLOCK_M, HEAD_DIM, True)
    _store_rows(dQ, rows, seq_len, dq, HEAD_DIM)


# ----------------------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------------------
def _launch_config(head_dim: int, dtype: torch.dtype, backward: bool) -> dict:
    """Block sizes, warps and pipeline stages for one kernel. Fixed per (head dim, dtype, vendor).

    This is where @triton.autotune would go: it would time a list of such configs per shape and keep the
    fastest. Fixed choices keep the first call fast and the behaviour the same on every run.
    """
    if interpreter_active():
        # The CPU interpreter executes every block operation in NumPy: small blocks keep tests fast (16 is
        # the smallest size tl.dot accepts). Query and key blocks differ in size, as on a GPU, so that CPU
        # tests also cover the loop bounds where they do not line up.
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1)
    # A row of Dh elements of >= 256 bytes (float32 with Dh >= 64, 16-bit with Dh = 128): halve the tiles so
    # the accumulators fit in registers and the k/v tiles in shared memory (64 KiB of LDS on MI300).
    wide_rows = head_dim * dtype.itemsize >= 256
    if backward:
        # Two float32 accumulators (dk and dv) per program: smaller square tiles.
        block_m = block_n = 32 if wide_rows else 64
    else:
        block_m, block_n = (64, 32) if wide_rows else (128, 64)
    # num_warps counts warps of 32 threads on NVIDIA and wavefronts of 64 on AMD, so 4 means 128 or 256
    # threads. On NVIDIA, tiles of 64 x 64 and more want 8 warps to spread their float32 accumulators.
    num_warps = 8 if (not is_rocm() and min(block_m, block_n) * head_dim >= 64 * 64) else 4
    # AMD's Triton pipelines loads with num_stages=1 already ("stream pipeliner"); NVIDIA double-buffers.
    num_stages = 1 if is_rocm() else 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def _dot_precision(dtype: torch.dtype, precise_fp32: bool) -> str:
    """tl.dot's input_precision. Only float32 inputs care: NVIDIA then uses tf32 tensor cores by default
    (10-bit mantissa, fast); "ieee" is exact float32. AMD accepts "tf32" only on some chips, so use "ieee"."""
    if dtype != torch.float32 or precise_fp32 or is_rocm():
        return "ieee"
    return "tf32"


def _new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer a kernel will fill completely (NaN-filled when tests ask, see FILL_NEW_BUFFERS_WITH_NAN)."""
    if FILL_NEW_BUFFERS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must all be [B, H, S, Dh]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k, v must share one dtype among {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")
    batch, heads, seq_len, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if seq_len < 1 or batch * heads < 1:
        raise ValueError(f"empty input {tuple(q.shape)}")
    if rope is not None:
        cos, sin = rope
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dim() != 2 or table.shape[0] < seq_len or table.shape[1] != head_dim:
                raise ValueError(f"rope {name} table must be [>= S, Dh] = [>= {seq_len}, {head_dim}]; "
                                 f"got {tuple(table.shape)}")
    if q.dtype == torch.bfloat16 and interpreter_active():
        raise RuntimeError("flash_attention: Triton's CPU interpreter computes tl.dot on bfloat16 wrongly, so "
                           "bfloat16 is refused without a GPU; use float32 or float16 here, bfloat16 on a GPU.")


# ----------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------
class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue: forward launches one kernel, backward three (delta, dk/dv, dq)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, sm_scale: float, cos, sin, precise_fp32: bool):
        batch, heads, seq_len, head_dim = q.shape
        # The kernels address element (head, row, col) as head*S*Dh + row*Dh + col: one base pointer and no
        # strides keep the index arithmetic readable, and each row is Dh adjacent elements, which the GPU
        # loads in few wide (coalesced) transactions. Views such as a transpose of [B, S, H, Dh] are copied
        # once here; contiguous() costs nothing for a tensor that already is.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        rope = cos is not None
        if rope:
            cos = cos[:seq_len].to(device=q.device, dtype=torch.float32).contiguous()
            sin = sin[:seq_len].to(device=q.device, dtype=torch.float32).contiguous()

        out = _new_buffer(q.shape, q.dtype, q.device)
        lse = _new_buffer((batch * heads, seq_len), torch.float32, q.device)
        config = _launch_config(head_dim, q.dtype, backward=False)
        grid = (triton.cdiv(seq_len, config["BLOCK_M"]), batch * heads)
        precision = _dot_precision(q.dtype, precise_fp32)
        _flash_attention_forward_kernel[grid](
            q, k, v, out, lse,
            cos if rope else q, sin if rope else q,  # placeholders: never read without RoPE
            seq_len, sm_scale,
            HEAD_DIM=head_dim, CAUSAL=causal, ROPE=rope, DOT_PRECISION=precision, **config,
        )
        ctx.save_for_backward(q, k, v, out, lse, cos, sin)
        ctx.causal, ctx.sm_scale, ctx.precision = causal, sm_scale, precision
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cos, sin = ctx.saved_tensors
        batch, heads, seq_len, head_dim = q.shape
        rope = cos is not None
        # The incoming gradient can be a broadcast view (e.g. from out.sum()) with zero strides.
        grad_out = grad_out.contiguous()

        delta = _new_buffer((batch * heads, seq_len), torch.float32, q.device)
        total_rows = batch * heads * seq_len
        block_rows = 16 if interpreter_active() else 64
        _flash_attention_backward_delta_kernel[(triton.cdiv(total_rows, block_rows),)](
            out, grad_out, delta, total_rows, HEAD_DIM=head_dim, BLOCK_ROWS=block_rows,
        )

        dq = _new_buffer(q.shape, q.dtype, q.device)
        dk = _new_buffer(k.shape, k.dtype, k.device)
        dv = _new_buffer(v.shape, v.dtype, v.device)
        config = _launch_config(head_dim, q.dtype, backward=True)
        common = dict(HEAD_DIM=head_dim, CAUSAL=ctx.causal, ROPE=rope, DOT_PRECISION=ctx.precision, **config)
        cos_arg, sin_arg = (cos, sin) if rope else (q, q)
        _flash_attention_backward_dkdv_kernel[(triton.cdiv(seq_len, config["BLOCK_N"]), batch * heads)](
            q, k, v, grad_out, lse, delta, dk, dv, cos_arg, sin_arg, seq_len, ctx.sm_scale, **common,
        )
        _flash_attention_backward_dq_kernel[(triton.cdiv(seq_len, config["BLOCK_M"]), batch * heads)](
            q, k, v, grad_out, lse, delta, dq, cos_arg, sin_arg, seq_len, ctx.sm_scale, **common,
        )
        # One gradient per forward input: q, k, v, then none for causal, sm_scale, cos, sin, precise_fp32.
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    sm_scale: float | None = None, rope=None, precise_fp32: bool = False) -> torch.Tensor:
    """softmax(q k^T * sm_scale + causal mask) v without building the S x S matrix; differentiable.

    q, k, v: [B, H, S, Dh], one dtype among float32 / float16 / bfloat16, Dh in {16, 32, 64, 128}, any S >= 1.
    sm_scale: defaults to 1 / sqrt(Dh).
    rope: None, or (cos, sin) float32 tables [>= S, Dh] (rotate-half convention, halves equal): q and k are
        then given unrotated, rotated inside the kernels, and their gradients are for the unrotated inputs.
    precise_fp32: for float32 inputs on NVIDIA, use exact float32 matmuls instead of tf32 tensor cores.
    Returns out: [B, H, S, Dh] in the input dtype.
    """
    _check_inputs(q, k, v, rope)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    cos, sin = rope if rope is not None else (None, None)
    return FlashAttentionFunction.apply(q, k, v, causal, float(sm_scale), cos, sin, precise_fp32)
