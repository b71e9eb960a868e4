"""Version 4's causal flash attention in Triton: version 3's kernels, plus RoPE applied as q and k are loaded.

What changed from version 3 (`diff ../../version3_triton/kernels/flash_attention.py flash_attention.py`): the
ROPE switch of every kernel (rotate q and k on load in the forward; rotate dq and dk back in the backward, half by
half as they are stored: _store_rows_rotated_back), the rotated copies the forward writes for the backward,
`rope=` on the entry points, and packed_attention_forward / packed_attention_backward for the QKV GEMM that
rotates q and k in its epilogue (qkv_rope_gemm.py, version 4's default). rotate_half is public: that GEMM's
epilogue uses it. And the launch choices: version 3's everywhere, except for 16-bit inputs at head dims 64 and
128 on Hopper-class NVIDIA GPUs, which get the pipelined 64 x 64 tiles measured fastest at the size presets
(_launch_config). The kernels' arithmetic is version 3's.

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
    delta_i = sum_d dO_id * O_id                     (one product per row, no reduction over keys)
    p  = exp(q k^T * sm_scale - lse)                 dv = p^T dO
    dp = dO v^T          ds = p * (dp - delta)       dq = ds k * sm_scale      dk = ds^T q * sm_scale
One kernel owns a block of queries and loops over the key blocks (it accumulates dq, and writes delta for its
rows first); it runs before the other, which owns a block of keys and loops over the query blocks (it
accumulates dk and dv, reading delta; it works on transposed tiles, p^T and ds^T, which is what dv and dk need).
Each output element is written by exactly one program, so there are no atomics and the result is
deterministic; the price is computing q k^T and dO v^T twice.
(The kernels evaluate these exponentials as exp2, with log2(e) folded into the scale: see _LOG2E.)

RoPE on load (version 4 with --rope-in-attention): rotary embeddings rotate q and k by a position-dependent
angle just before attention. With `rope=(cos, sin)` the forward kernel receives UNrotated q and k and rotates each block
as it is loaded, in the rotate-half convention
    rot(x) = x * cos + rotate_half(x) * sin,     rotate_half(x) = cat(-x[..., Dh/2:], x[..., :Dh/2]),
with cos and sin of shape [S, Dh] and equal on both halves. No separate RoPE pass runs before attention. The
forward kernel rotates every key block again for each query block that visits it; so that the backward pass
does not rotate everything a second and third time, each forward program also writes the rotated q and k rows
of its own positions (and, in the packed layout, a copy of the v rows) into a buffer laid out like the input,
which is what the forward saves for the backward: the backward kernels then read q and k as they are. The
gradients come back with respect to the unrotated inputs: the rotation is orthogonal, so its transpose,
x * cos - rotate_half(x) * sin, is applied to dq and dk once before they are stored. (By default version 4
rotates q and k in its QKV GEMM's epilogue instead, and calls the kernels through packed_attention_forward /
packed_attention_backward: the forward without RoPE, the backward with its rotation of dq and dk.)

The entry points share the same kernels (they differ only in the strides they pass, see "Addressing"):
    flash_attention(q, k, v)             q, k, v, out: [B, H, S, Dh]                      (the textbook layout)
    flash_attention_packed(qkv, H)       qkv: [B, S, 3*D] straight from a fused QKV projection, columns
                                         [q heads | k heads | v heads]; out: [B, S, D], D = H * Dh, the
                                         layout the output projection reads (version 4 with
                                         --rope-in-attention)
    packed_attention_forward / _backward the packed layout's kernels without autograd, for a caller with its
                                         own autograd Function (version 4's default, whose QKV GEMM rotates
                                         q and k)
The packed one saves the transposes a model would otherwise copy around attention: [B, S, 3, H, Dh] ->
[3, B, H, S, Dh] before it, [B, H, S, Dh] -> [B, S, H * Dh] after it, and both again in the backward pass.
lse and delta: [B*H, S] float32 in both.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (MAX_GRID_SECOND_AXIS, interpreter_active, interpreter_block, is_rocm,
                                            shared_memory_per_program, small_interpreter_blocks)
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel
from version4_triton_ultra.kernels.whole_tiles import load_tile, store_tile, whole_tiles

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tests set this to True: every buffer the wrapper allocates for a kernel to fill (out, lse, the rotated q and
# k (and v) saved for the backward, delta, dq, dk, dv) then starts as NaN, so an element that a kernel forgets
# to write cannot pass as a plausible value.
FILL_NEW_BUFFERS_WITH_NAN = False


# ----------------------------------------------------------------------------------------------------------
# Addressing
# ----------------------------------------------------------------------------------------------------------
# Every kernel sees q, k, v, out and their gradients as B*H independent [S, Dh] matrices whose rows need not
# be adjacent in memory. Element (b, h, s, d) of such an operand lives at
#
#     base + b * batch_stride + h * head_stride + s * row_stride + d
#
# The second program id numbers the (batch, head) pairs as b * H + h. A kernel splits it with // H and % H,
# moves each base pointer once to row 0 of its head (in int64: B*H*S*Dh can pass 2**31), then steps
# row_stride elements per token (int32: the wrappers check that S * row_stride stays below 2**31). The Dh
# elements of one row are always adjacent, so each row is still read and written in a few wide transactions.
# The two entry points differ only in these numbers (D = H * Dh):
#
#                                batch_stride   head_stride   row_stride   used by
#     [B, H, S, Dh] contiguous   H * S * Dh     S * Dh        Dh           q, k, v, out, and all gradients
#     packed qkv [B, S, 3D]      S * 3D         Dh            3D           q, k, v, dq, dk, dv
#     packed out [B, S, D]       S * D          Dh            D            out, d(out)
#
# In the packed layout the wrapper passes qkv itself as q, k and v (and its gradient as dq, dk and dv), and the
# kernels add k_offset = D and v_offset = 2D elements for k and v: offsets rather than three views of qkv,
# because each view is a torch call, and at the seed size a training step waits for the host's calls.
# q, k, v, dq, dk, dv, and the rotated q, k (and v) that the forward saves with RoPE, share one set of strides
# (the "qkv" strides); out and d(out) share another.
# The RoPE tables are plain contiguous [S, Dh] matrices: row stride Dh.


# ----------------------------------------------------------------------------------------------------------
# Small helpers shared by the kernels (inlined by Triton)
# ----------------------------------------------------------------------------------------------------------
# The kernels compute exponentials in base 2. The GPU's exponential instruction is exp2, and exp(x) is
# compiled as exp2(x * log2(e)): one multiply per score. Folding log2(e) into the softmax scale once, and
# keeping the running maximum m and the log-sum-exp in base 2 inside the kernels, saves that multiply for
# every one of the S x S scores (the forward and dq kernels took 3% and 4% less time on an H100, see the v3 README).
# lse is still stored as a natural logarithm.
_LOG2E = tl.constexpr(1.4426950408889634)   # log2(e)
_LN2 = tl.constexpr(0.6931471805599453)     # ln(2) = 1 / log2(e)

@triton.jit
def _head_start(batch_head, num_heads, batch_stride, head_stride):
    """Offset (int64) of row 0 of head `batch_head % num_heads` of batch `batch_head // num_heads`."""
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    return batch * batch_stride + head * head_stride


@triton.jit
def _load_rows(base, rows, row_stride, seq_len, HEAD_DIM: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
    """Rows `rows` of a [seq_len, HEAD_DIM] matrix (rows row_stride apart) as a [len(rows), HEAD_DIM] block.

    Rows past the end (the last block of a sequence whose length is not a multiple of the block) read 0.
    WHOLE_BLOCKS: the sequence is a whole number of blocks (_whole_blocks), so no row is past the end and the
    load needs no mask (whole_tiles.py).
    """
    cols = tl.arange(0, HEAD_DIM)
    pointers = base + rows[:, None] * row_stride + cols[None, :]
    return load_tile(pointers, rows[:, None] < seq_len, WHOLE_BLOCKS)


@triton.jit
def _store_rows(base, rows, row_stride, seq_len, block, HEAD_DIM: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
    """Write `block` ([len(rows), HEAD_DIM]) into rows `rows`, skipping rows past the end (none: WHOLE_BLOCKS)."""
    cols = tl.arange(0, HEAD_DIM)
    pointers = base + rows[:, None] * row_stride + cols[None, :]
    store_tile(pointers, block.to(base.dtype.element_ty), rows[:, None] < seq_len, WHOLE_BLOCKS)


@triton.jit
def rotate_half(x, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """cat(-x2, x1) for a [BLOCK, HEAD_DIM] block held in registers, where x1, x2 are its column halves.

    tl.split / tl.join work on a last dimension of size 2, so the block is viewed as
    [row, column within half, which half] (reshape, then permute), split, swapped, joined and viewed back.
    """
    halves = tl.permute(tl.reshape(x, (BLOCK, 2, HEAD_DIM // 2)), (0, 2, 1))
    x1, x2 = tl.split(halves)
    return tl.reshape(tl.permute(tl.join(-x2, x1), (0, 2, 1)), (BLOCK, HEAD_DIM))


@triton.jit
def _store_rows_rotated_back(base, rows, row_stride, seq_len, x, Cos, Sin, BLOCK: tl.constexpr,
                             HEAD_DIM: tl.constexpr):
    """Store x rotated back by RoPE (x * cos - rotate_half(x) * sin, the transpose of the rotation: it takes a
    gradient with respect to a rotated row back to the unrotated row) into rows `rows`, skipping rows past the end.

    Half by half: with x = [x1 | x2] and cos, sin equal on both halves (c and s), the rows are
    [x1 c + x2 s | x2 c - x1 s], stored as two [BLOCK, HEAD_DIM / 2] blocks. Splitting x takes no layout
    conversion in the compiled code; rebuilding the rotated block with rotate_half before one store sent the
    float32 block through shared memory twice more, at the end of programs whose loops are short: the backward
    pass took 155.3 us instead of 142.5 at the medium preset's shape on an H200, and 438.9 instead of 391.3 at the
    large one's (the same bits either way; version 4's MEASUREMENTS.md, "The attention backward's RoPE").
    """
    half: tl.constexpr = HEAD_DIM // 2
    x1, x2 = tl.split(tl.permute(tl.reshape(x.to(tl.float32), (BLOCK, 2, half)), (0, 2, 1)))
    cols = tl.arange(0, half)
    in_sequence = rows[:, None] < seq_len
    c = tl.load(Cos + rows[:, None] * HEAD_DIM + cols[None, :], mask=in_sequence, other=0.0)
    s = tl.load(Sin + rows[:, None] * HEAD_DIM + cols[None, :], mask=in_sequence, other=0.0)
    first_half = base + rows[:, None] * row_stride + cols[None, :]
    tl.store(first_half, (x1 * c + x2 * s).to(base.dtype.element_ty), mask=in_sequence)
    tl.store(first_half + half, (x2 * c - x1 * s).to(base.dtype.element_ty), mask=in_sequence)


@triton.jit
def _load_q_or_k(base, row_stride, Cos, Sin, rows, seq_len, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROPE: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
    """Load a block of q or k, rotated by RoPE when ROPE is set, in the input dtype (what tl.dot consumes).

    rotate_half(x) is read from memory rather than built in registers: the same rows are loaded a second time
    with their column halves swapped (a cache hit), and the sign of the first half is folded into sin. The
    forward kernel's loop rotates every k block it visits, so this load must be cheap; a register shuffle
    (rotate_half) costs more there. Results rotated once per program (dq, dk) are stored half by half instead
    (_store_rows_rotated_back).
    """
    x = _load_rows(base, rows, row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    if ROPE:  # a constexpr: without RoPE this branch is not even compiled
        half: tl.constexpr = HEAD_DIM // 2
        cols = tl.arange(0, HEAD_DIM)
        swapped = tl.load(base + rows[:, None] * row_stride + ((cols + half) % HEAD_DIM)[None, :],
                          mask=rows[:, None] < seq_len, other=0.0)
        cos = _load_rows(Cos, rows, HEAD_DIM, seq_len, HEAD_DIM, WHOLE_BLOCKS)
        sin = _load_rows(Sin, rows, HEAD_DIM, seq_len, HEAD_DIM, WHOLE_BLOCKS)
        signed_sin = tl.where((cols < half)[None, :], -sin, sin)
        x = (x.to(tl.float32) * cos + swapped.to(tl.float32) * signed_sin).to(base.dtype.element_ty)
    return x


@triton.jit
def _visible(rows, cols, seq_len, CAUSAL: tl.constexpr):
    """[len(rows), len(cols)] mask of the keys each query may attend to: real keys, and with CAUSAL only the
    keys at or before the query's own position."""
    mask = cols[None, :] < seq_len
    if CAUSAL:
        mask = mask & (cols[None, :] <= rows[:, None])
    return mask


@triton.jit
def _key_blocks_of_query_block(block_m, seq_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               CAUSAL: tl.constexpr):
    """(full_end, end): query block `block_m` visits the keys [0, end); the key blocks in [0, full_end) are
    visible to every one of its rows and real keys, so they need no mask."""
    if CAUSAL:
        end = tl.minimum((block_m + 1) * BLOCK_M, seq_len)
        full_end = (block_m * BLOCK_M // BLOCK_N) * BLOCK_N    # blocks that end before the first row
    else:
        end = seq_len
        full_end = (seq_len // BLOCK_N) * BLOCK_N              # all but a partial last block
    return full_end, end


@triton.jit
def _attend_to_key_block(q, m, l, acc, K, V, Cos, Sin, rows, key_start, seq_len, sm_scale, row_stride,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                         CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         WHOLE_BLOCKS: tl.constexpr):
    """One step of the online softmax: fold the keys [key_start, key_start + BLOCK_N) into (m, l, acc)."""
    cols = key_start + tl.arange(0, BLOCK_N)
    k = _load_q_or_k(K, row_stride, Cos, Sin, cols, seq_len, BLOCK_N, HEAD_DIM, ROPE, WHOLE_BLOCKS)
    v = _load_rows(V, cols, row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)

    # In base 2 (see _LOG2E): scores2 = score * log2(e), and exp2(scores2 - m) = exp(score - m * ln 2).
    scores2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (sm_scale * _LOG2E)
    if MASKED:
        scores2 = tl.where(_visible(rows, cols, seq_len, CAUSAL), scores2, float("-inf"))

    m_new = tl.maximum(m, tl.max(scores2, axis=1))
    alpha = tl.math.exp2(m - m_new)              # rescales what was accumulated under the old maximum
    p = tl.math.exp2(scores2 - m_new[:, None])   # masked scores give exp2(-inf) = 0
    l = l * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l, acc


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _flash_attention_forward_kernel(
    Q, K, V, Out, Lse, Cos, Sin, QRot, KRot, VCopy,
    seq_len, num_heads, sm_scale,
    qkv_batch_stride, qkv_head_stride, qkv_row_stride, out_batch_stride, out_head_stride, out_row_stride,
    k_offset, v_offset,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ROPE: tl.constexpr, COPY_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr = False,   # S a whole number of query and of key blocks: no row masks (_whole_blocks)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: BLOCK_M query rows of one (batch, head). Grid: (cdiv(S, BLOCK_M), B * H).

    With ROPE it also writes, for the backward pass, the rotated q and k rows of its positions into QRot and
    KRot and, with COPY_V, the v rows into VCopy (all three laid out like q, k, v)."""
    wait_for_previous_kernel(PDL)
    block_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    qkv_start = _head_start(batch_head, num_heads, qkv_batch_stride, qkv_head_stride)
    Q += qkv_start
    K += qkv_start + k_offset
    V += qkv_start + v_offset
    Out += _head_start(batch_head, num_heads, out_batch_stride, out_head_stride)
    Lse += batch_head.to(tl.int64) * seq_len

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_q_or_k(Q, qkv_row_stride, Cos, Sin, rows, seq_len, BLOCK_M, HEAD_DIM, ROPE, WHOLE_BLOCKS)
    if ROPE:  # keep what this program rotates once for the backward, which then needs no RoPE in its loops
        _store_rows(QRot + qkv_start, rows, qkv_row_stride, seq_len, q, HEAD_DIM, WHOLE_BLOCKS)
        k_rows = _load_q_or_k(K, qkv_row_stride, Cos, Sin, rows, seq_len, BLOCK_M, HEAD_DIM, ROPE, WHOLE_BLOCKS)
        _store_rows(KRot + qkv_start + k_offset, rows, qkv_row_stride, seq_len, k_rows, HEAD_DIM, WHOLE_BLOCKS)
        if COPY_V:
            v_rows = _load_rows(V, rows, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
            _store_rows(VCopy + qkv_start + v_offset, rows, qkv_row_stride, seq_len, v_rows, HEAD_DIM,
                        WHOLE_BLOCKS)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Causal: no row of this block sees a key after its last row, so those key blocks are skipped entirely
    # (about half of the work for long sequences). Only the blocks on the diagonal and a block past the end
    # of the sequence need a mask: the first loop runs the others without one, the second loop the rest.
    # Key block 0 comes first, and every row sees key 0, so m is finite after the first block and
    # exp(m - m_new) is never exp(-inf + inf) = NaN.
    full_end, key_end = _key_blocks_of_query_block(block_m, seq_len, BLOCK_M, BLOCK_N, CAUSAL)
    for key_start in range(0, full_end, BLOCK_N):
        m, l, acc = _attend_to_key_block(q, m, l, acc, K, V, Cos, Sin, rows, key_start, seq_len, sm_scale,
                                         qkv_row_stride, HEAD_DIM, BLOCK_N, False, CAUSAL, ROPE, DOT_PRECISION,
                                         WHOLE_BLOCKS)
    for key_start in range(full_end, key_end, BLOCK_N):
        m, l, acc = _attend_to_key_block(q, m, l, acc, K, V, Cos, Sin, rows, key_start, seq_len, sm_scale,
                                         qkv_row_stride, HEAD_DIM, BLOCK_N, True, CAUSAL, ROPE, DOT_PRECISION,
                                         WHOLE_BLOCKS)

    _store_rows(Out, rows, out_row_stride, seq_len, acc / l[:, None], HEAD_DIM, WHOLE_BLOCKS)
    # m and log2(l) are in base 2; lse is stored as a natural logarithm, like everyone else's.
    tl.store(Lse + rows, (m + tl.math.log2(l)) * _LN2, mask=rows < seq_len)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _probabilities(q, k, lse2, rows, cols, seq_len, sm_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Rebuild the attention probabilities p = exp(q k^T * sm_scale - lse) of a [rows, cols] tile, in base 2:
    p = exp2(q k^T * sm_scale * log2(e) - lse2), with lse2 = lse * log2(e) from _load_lse2.

    Query rows past the end get exactly 0 without a mask: their lse is loaded as +inf (_load_lse2). MASKED
    tiles also zero the keys a row must not see (past the end, or after the row when CAUSAL). They are masked
    after the exponential: a key a row does not see is not in the row's lse, so its exp2 may overflow to inf,
    which the select then drops (masking the scores first instead made this kernel about 2% slower on an H100;
    see _run_backward for what the interpreter makes of the overflow).
    """
    scores2 = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (sm_scale * _LOG2E)
    p = tl.math.exp2(scores2 - lse2[:, None])
    if MASKED:
        p = tl.where(_visible(rows, cols, seq_len, CAUSAL), p, 0.0)
    return p


@triton.jit
def _load_lse2(Lse, rows, seq_len, WHOLE_BLOCKS: tl.constexpr):
    """lse * log2(e) of the rows (the base-2 log-sum-exp); +inf past the end, so that p is 0 there."""
    return load_tile(Lse + rows, rows < seq_len, WHOLE_BLOCKS, other=float("inf")) * _LOG2E


@triton.jit
def _dkdv_from_query_block(k, v, dk, dv, Q, dOut, Lse, Delta, cols, row_start, seq_len, sm_scale,
                           qkv_row_stride, out_row_stride, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
    """Add the contribution of the queries [row_start, row_start + BLOCK_M) to dk and dv.

    Works on TRANSPOSED tiles, [keys, queries]: p^T = exp2(k q^T * sm_scale * log2(e) - lse * log2(e))
    directly, rather than p and then tl.trans(p). dv += p^T dO and dk += ds^T q then take p^T and ds^T as they
    are, in registers; transposing a tile that lives in registers would send it through shared memory, twice
    per query block (measured on an H100 at batch 32 x 8 heads x seq 512 x head dim 32, bfloat16: 60 us per
    call with the transposes, 53 without).
    MASKED (causal tiles on the diagonal) zeroes the pairs where the key comes after the query. Keys past the
    end need no mask here: their dk and dv rows are never stored.
    """
    rows = row_start + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, rows, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    do = _load_rows(dOut, rows, out_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    lse2 = _load_lse2(Lse, rows, seq_len, WHOLE_BLOCKS)
    delta = tl.load(Delta + rows, mask=rows < seq_len, other=0.0)

    scores2_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * (sm_scale * _LOG2E)
    p_t = tl.math.exp2(scores2_t - lse2[None, :])   # masked after the exponential, as in _probabilities
    if MASKED:
        p_t = tl.where(cols[:, None] <= rows[None, :], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _flash_attention_backward_dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV, Cos, Sin,
    seq_len, num_heads, sm_scale,
    qkv_batch_stride, qkv_head_stride, qkv_row_stride, out_batch_stride, out_head_stride, out_row_stride,
    k_offset, v_offset,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr = False,   # S a whole number of query and of key blocks: no row masks (_whole_blocks)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: dk and dv for BLOCK_N keys of one (batch, head), looping over query blocks.

    Q and K are read as the forward pass scored them (with RoPE: the rotated copies it saved); ROPE only
    rotates dk back to the unrotated keys before it is stored. Grid: (cdiv(S, BLOCK_N), B * H).
    """
    wait_for_previous_kernel(PDL)
    block_n = tl.program_id(0)
    batch_head = tl.program_id(1)
    qkv_start = _head_start(batch_head, num_heads, qkv_batch_stride, qkv_head_stride)
    Q += qkv_start
    K += qkv_start + k_offset
    V += qkv_start + v_offset
    dK += qkv_start + k_offset
    dV += qkv_start + v_offset
    dOut += _head_start(batch_head, num_heads, out_batch_stride, out_head_stride)
    Lse += batch_head.to(tl.int64) * seq_len
    Delta += batch_head.to(tl.int64) * seq_len

    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(K, cols, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    v = _load_rows(V, cols, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Causal: queries before this key block's first key cannot see any of its keys, so start at the query
    # block that holds that key; the query blocks that overlap the key block need the causal mask, the later
    # ones see all of its keys. Keys past the end need no mask here: their dk and dv are never stored, and
    # k, v rows past the end are loaded as 0, so they add nothing to the real keys' gradients.
    if CAUSAL:
        query_start = (block_n * BLOCK_N // BLOCK_M) * BLOCK_M
        masked_end = tl.minimum(tl.cdiv((block_n + 1) * BLOCK_N, BLOCK_M) * BLOCK_M, seq_len)
    else:
        query_start = 0
        masked_end = 0
    for row_start in range(query_start, masked_end, BLOCK_M):
        dk, dv = _dkdv_from_query_block(k, v, dk, dv, Q, dOut, Lse, Delta, cols, row_start, seq_len, sm_scale,
                                        qkv_row_stride, out_row_stride, HEAD_DIM, BLOCK_M, True, DOT_PRECISION,
                                        WHOLE_BLOCKS)
    for row_start in range(masked_end, seq_len, BLOCK_M):
        dk, dv = _dkdv_from_query_block(k, v, dk, dv, Q, dOut, Lse, Delta, cols, row_start, seq_len, sm_scale,
                                        qkv_row_stride, out_row_stride, HEAD_DIM, BLOCK_M, False, DOT_PRECISION,
                                        WHOLE_BLOCKS)

    dk = dk * sm_scale
    if ROPE:  # dk is the gradient for the rotated keys: rotate it back
        _store_rows_rotated_back(dK, cols, qkv_row_stride, seq_len, dk, Cos, Sin, BLOCK_N, HEAD_DIM)
    else:
        _store_rows(dK, cols, qkv_row_stride, seq_len, dk, HEAD_DIM, WHOLE_BLOCKS)
    _store_rows(dV, cols, qkv_row_stride, seq_len, dv, HEAD_DIM, WHOLE_BLOCKS)


@triton.jit
def _dq_from_key_block(q, do, lse2, delta, dq, K, V, rows, key_start, seq_len, sm_scale, qkv_row_stride,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
    """Add the contribution of the keys [key_start, key_start + BLOCK_N) to dq."""
    cols = key_start + tl.arange(0, BLOCK_N)
    k = _load_rows(K, cols, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    v = _load_rows(V, cols, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)

    p = _probabilities(q, k, lse2, rows, cols, seq_len, sm_scale, MASKED, CAUSAL, DOT_PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _flash_attention_backward_dq_kernel(
    Q, K, V, Out, dOut, Lse, Delta, dQ, Cos, Sin,
    seq_len, num_heads, sm_scale,
    qkv_batch_stride, qkv_head_stride, qkv_row_stride, out_batch_stride, out_head_stride, out_row_stride,
    k_offset, v_offset,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr = False,   # S a whole number of query and of key blocks: no row masks (_whole_blocks)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: dq for BLOCK_M queries of one (batch, head), looping over key blocks. Runs BEFORE the
    dk/dv kernel, and also writes delta = rowsum(dO * O) of its rows for it.

    delta_i = sum_j p_ij dp_ij is the term the softmax backward subtracts. Computed from O and dO it is one
    product per row instead of a reduction over all keys; this program has dO of its rows in registers
    anyway, so it costs one extra read of O's rows, and no launch of its own.
    Q and K as in the dk/dv kernel: already rotated with RoPE; ROPE rotates dq back before it is stored.
    Grid: (cdiv(S, BLOCK_M), B * H).
    """
    wait_for_previous_kernel(PDL)
    block_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    qkv_start = _head_start(batch_head, num_heads, qkv_batch_stride, qkv_head_stride)
    Q += qkv_start
    K += qkv_start + k_offset
    V += qkv_start + v_offset
    dQ += qkv_start
    out_start = _head_start(batch_head, num_heads, out_batch_stride, out_head_stride)
    Lse += batch_head.to(tl.int64) * seq_len
    Delta += batch_head.to(tl.int64) * seq_len

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, rows, qkv_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    do = _load_rows(dOut + out_start, rows, out_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    lse2 = _load_lse2(Lse, rows, seq_len, WHOLE_BLOCKS)
    o = _load_rows(Out + out_start, rows, out_row_stride, seq_len, HEAD_DIM, WHOLE_BLOCKS)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)   # rows past the end: 0 (loaded as zeros)
    tl.store(Delta + rows, delta, mask=rows < seq_len)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The same key blocks as the forward pass, split the same way into unmasked and masked ones.
    full_end, key_end = _key_blocks_of_query_block(block_m, seq_len, BLOCK_M, BLOCK_N, CAUSAL)
    for key_start in range(0, full_end, BLOCK_N):
        dq = _dq_from_key_block(q, do, lse2, delta, dq, K, V, rows, key_start, seq_len, sm_scale, qkv_row_stride,
                                HEAD_DIM, BLOCK_N, False, CAUSAL, DOT_PRECISION, WHOLE_BLOCKS)
    for key_start in range(full_end, key_end, BLOCK_N):
        dq = _dq_from_key_block(q, do, lse2, delta, dq, K, V, rows, key_start, seq_len, sm_scale, qkv_row_stride,
                                HEAD_DIM, BLOCK_N, True, CAUSAL, DOT_PRECISION, WHOLE_BLOCKS)

    dq = dq * sm_scale
    if ROPE:  # dq is the gradient for the rotated queries: rotate it back
        _store_rows_rotated_back(dQ, rows, qkv_row_stride, seq_len, dq, Cos, Sin, BLOCK_M, HEAD_DIM)
    else:
        _store_rows(dQ, rows, qkv_row_stride, seq_len, dq, HEAD_DIM, WHOLE_BLOCKS)


# ----------------------------------------------------------------------------------------------------------
# Launch choices
# ----------------------------------------------------------------------------------------------------------
def _launch_config(head_dim: int, dtype: torch.dtype, seq_len: int, kernel: str,
                   device: torch.device | None = None, rope_on_load: bool = False) -> dict:
    """Block sizes, warps and pipeline stages for one kernel ("forward", "dkdv" or "dq"), per head dim, dtype,
    vendor and, on NVIDIA, the GPU's shared memory (`device`; None: the current GPU). `rope_on_load`: the forward
    rotates q and k as it loads them (--rope-in-attention), which needs more shared memory per stage.

    This is where @triton.autotune would go: it would time a list of such configs per shape and keep the
    fastest. Fixed choices keep the first call fast and the behaviour the same on every run. Version 3's rule
    (_portable_launch_config) is the default; on Hopper-class NVIDIA GPUs, 16-bit inputs with head dims of 64
    and 128 (the size presets' shapes) get the pipelined tiles that tune_attention_tiles.py found fastest there
    (_hopper_launch_config).
    """
    rule = _launch_rule(head_dim, dtype, device)
    if rule == "interpreter":
        if small_interpreter_blocks():
            # Kernel tests: the smallest blocks (16 is the smallest size tl.dot accepts), query and key blocks of
            # different sizes as on a GPU, so that small test problems cover the loops and the loop bounds
            # where they do not line up.
            return dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1)
        # A CPU run: each program's block operations run as NumPy calls, whose cost is per call, so one block
        # of queries and one of keys cover a sequence of up to 128 (fewer programs, one pass of each loop).
        block = interpreter_block(seq_len, 16, 128)
        return dict(BLOCK_M=block, BLOCK_N=block, num_warps=1, num_stages=1)
    if rule == "hopper":
        return _hopper_launch_config(head_dim, kernel, rope_on_load)
    return _portable_launch_config(head_dim, dtype, kernel)


def _launch_rule(head_dim: int, dtype: torch.dtype, device: torch.device | None) -> str:
    """Which of _launch_config's rules applies: "interpreter" (Triton's CPU interpreter), "hopper" (the pipelined
    tiles, _hopper_tiles_apply) or "portable" (version 3's, every other GPU)."""
    if interpreter_active():
        return "interpreter"
    return "hopper" if _hopper_tiles_apply(head_dim, dtype, device) else "portable"


def _whole_blocks(seq_len: int, config: dict) -> bool:
    """Is the sequence a whole number of the launch's query blocks and of its key blocks? Then no block has a row
    past the end, and the kernels load the rows of q, k, v, dO, O and lse and store out, dv and (without RoPE) dq and
    dk without a mask (their WHOLE_BLOCKS); every preset's sequence allows it. Measured on an H200 in version 4's
    MEASUREMENTS.md ("Attention without row masks"): at the medium preset's shape 3 us less a forward, 1.6 us a
    backward."""
    # Both axes of whole_tiles are the sequence here: BLOCK_M rows of queries, BLOCK_N rows of keys.
    return whole_tiles(config, M=seq_len, N=seq_len)


def _portable_launch_config(head_dim: int, dtype: torch.dtype, kernel: str) -> dict:
    """Version 3's choices, for every GPU. They come from timing 60 configs per kernel (tiles 16..128, 2/4/8
    warps, 1/2 stages) on an H100 at head dim 32, S = 128..1024, float32 and bfloat16, with version 3's
    tune_flash_attention.py (which then timed these kernels, RoPE on load included): 64 x 64 tiles, 4 warps,
    1 stage was the fastest or within 7% of it in bfloat16 for every kernel and shape, and up to 1.4x faster
    than the 2-stage, 128-row forward used before. In float32 some kernels prefer other tiles (the forward
    128 x 64 with 8 warps, up to 10% faster from S = 256; dq 64 x 32, up to 18% faster from S = 512): one choice
    for all keeps this readable. After the dq kernel took over computing delta (it now also reads O), a --quick
    re-run of the dq sweep kept 64 x 64, 4 warps, 1 stage the fastest of its 12 configs at S = 128 and 512 in
    both dtypes.
    """
    # A row of Dh elements of >= 256 bytes (float32 with Dh >= 64, 16-bit with Dh = 128): smaller tiles, so the
    # float32 accumulators fit in registers and the k/v tiles in shared memory (64 KiB of LDS on MI300).
    wide_rows = head_dim * dtype.itemsize >= 256
    if kernel == "forward":
        block_m, block_n = (64, 32) if wide_rows else (64, 64)
    else:
        # dkdv keeps two float32 accumulators (dk and dv) per program: square tiles, halved for wide rows.
        block_m = block_n = 32 if wide_rows else 64
    # num_warps counts warps of 32 threads on NVIDIA and wavefronts of 64 on AMD: 4 means 128 or 256 threads.
    # One stage: the loops are short (S / 64 iterations at most) and every extra stage costs shared memory
    # and a longer prologue; AMD's Triton pipelines loads with num_stages=1 anyway ("stream pipeliner").
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1)


# The H100 offers 227 KiB of shared memory to one program, the A100 163 KiB and many Ampere and Ada cards
# 99 KiB. Each pipeline stage holds one more tile of k and v (or q and dO) in shared memory, so GPUs with less
# keep the portable rule. The pipelined tiles were measured on the H100 only: an NVIDIA GPU with as much shared
# memory but another architecture (a B200, say) gets them too, untimed; run tune_attention_tiles.py there.
HOPPER_CLASS_SHARED_MEMORY = 200 * 1024


def _hopper_tiles_apply(head_dim: int, dtype: torch.dtype, device: torch.device | None) -> bool:
    """True for float16/bfloat16 at head dim 64 or 128 on an NVIDIA GPU with Hopper's shared memory."""
    if is_rocm() or dtype == torch.float32 or head_dim < 64:
        return False
    return shared_memory_per_program(device or torch.device("cuda")) >= HOPPER_CLASS_SHARED_MEMORY


def _hopper_launch_config(head_dim: int, kernel: str, rope_on_load: bool) -> dict:
    """64 x 64 tiles and 4 warps for all three kernels, with the pipeline stages (num_stages: how many tiles of
    k and v, or of q and dO, are being loaded while the current one is used) that were fastest per kernel.

    Measured on an H100 with tune_attention_tiles.py, bfloat16 and float16, causal, each kernel alone against
    the portable tiles (benchmarks/results/kernel_time/h100_attention_tiles_by_shape.json; us per pass):
      head dim 128 (large, 8 x 16 x 1024): forward 167 -> 120 (3 stages), backward 992 -> 743 with dq at
        2 stages and 993 -> 713 with dk/dv at 2 stages (from version 3's 32 x 32 tiles, sized for AMD's LDS);
        with both backward kernels on these tiles the pass takes 458 us;
      head dim 64 (medium, 16 x 16 x 512): forward 64 -> 53 (3 stages), dq 170 -> 167 (2 stages); dk/dv keeps
        one stage (2 stages: 275 us against 171).
    The forward with RoPE on load buffers the rotated half and the cos and sin tiles of every key block too:
    3 stages would need 272 KiB at head dim 128, so it keeps one stage.
    """
    if kernel == "forward":
        stages = 1 if rope_on_load else 3
    elif kernel == "dq":
        stages = 2
    else:
        stages = 2 if head_dim == 128 else 1
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=stages)


LAUNCH_NAMES = {"forward": "forward", "dq": "dq", "dkdv": "dk/dv"}   # in the order a step launches them
RULE_NAMES = {"interpreter": "Triton's CPU interpreter", "hopper": "Hopper-class tiles from tune_attention_tiles.py",
              "portable": "the portable rule"}


def launch_summary(head_dim: int, dtype: torch.dtype, seq_len: int, device: torch.device | None = None,
                   rope_on_load: bool = False) -> str:
    """The launches _launch_config chooses at this shape, in words: version 4's run header prints them, so a
    run says which tiles its attention takes (the rule depends on the GPU, the dtype and the head dim) without
    a profiler. Arguments as _launch_config's; `rope_on_load` concerns the forward only, as in _run_forward."""
    rule = RULE_NAMES[_launch_rule(head_dim, dtype, device)]
    launches, every_block_whole = [], True
    for kernel, name in LAUNCH_NAMES.items():
        config = _launch_config(head_dim, dtype, seq_len, kernel, device, rope_on_load and kernel == "forward")
        stages = config["num_stages"]
        launches.append(f"{name} {config['BLOCK_M']}x{config['BLOCK_N']}, {config['num_warps']} warps, "
                        f"{stages} stage{'s' if stages > 1 else ''}")
        every_block_whole = every_block_whole and _whole_blocks(seq_len, config)
    masks = "no row masks" if every_block_whole else "row masks on the last block"
    return "; ".join(launches) + f" ({rule}; {masks})"


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


def shape_problem(batch_heads: int, seq_len: int, head_dim: int, row_stride: int) -> str | None:
    """Why the kernels cannot take B*H = batch_heads sequences of seq_len rows of head_dim elements, consecutive
    rows row_stride elements apart (Dh for [B, H, S, Dh], 3 * D for the packed qkv), in one line; None when
    they can. The entry points raise it, and the scripts that build a model from a user's sizes check it first
    (version 4's check_arguments), so this is the one place these rules live:
      - Dh is a power of two that tl.dot and tl.arange accept, and one the launch choices were made for;
      - offsets within one head are 32-bit (see Addressing): S * row_stride < 2**31;
      - the (batch, head) pairs number the grid's second axis, which allows MAX_GRID_SECOND_AXIS programs."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} not supported; use one of {SUPPORTED_HEAD_DIMS}"
    if seq_len * row_stride >= 2**31:
        return (f"offsets within one head are 32-bit, so S * row stride = {seq_len} * {row_stride} must stay "
                f"below 2**31")
    if batch_heads > MAX_GRID_SECOND_AXIS:
        return (f"batch x heads = {batch_heads} (batch, head) pairs, more than the {MAX_GRID_SECOND_AXIS} programs "
                f"the grid's second axis allows")
    return None


def _check_problem(dtype: torch.dtype, batch_heads: int, seq_len: int, head_dim: int, row_stride: int, rope,
                   shape) -> None:
    """Checks shared by both entry points, once the layout has given B*H, S, Dh and the largest row stride."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} not supported; use one of {SUPPORTED_DTYPES}")
    if seq_len < 1 or batch_heads < 1:
        raise ValueError(f"empty input {tuple(shape)}")
    problem = shape_problem(batch_heads, seq_len, head_dim, row_stride)
    if problem:
        raise ValueError(f"input {tuple(shape)}: {problem}")
    if rope is not None:
        cos, sin = rope
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dim() != 2 or table.shape[0] < seq_len or table.shape[1] != head_dim:
                raise ValueError(f"rope {name} table must be [>= S, Dh] = [>= {seq_len}, {head_dim}]; "
                                 f"got {tuple(table.shape)}")
    if dtype == torch.bfloat16 and interpreter_active():
        raise RuntimeError("flash_attention: Triton's CPU interpreter computes tl.dot on bfloat16 wrongly, so "
                           "bfloat16 is refused without a GPU; use float32 or float16 here, bfloat16 on a GPU.")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must all be [B, H, S, Dh]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype among {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")
    batch, heads, seq_len, head_dim = q.shape
    _check_problem(q.dtype, batch * heads, seq_len, head_dim, head_dim, rope, q.shape)


def _check_packed_input(qkv: torch.Tensor, num_heads: int, rope) -> None:
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int; got {num_heads!r}")
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * num_heads) != 0:
        raise ValueError(f"qkv must be [B, S, 3 * num_heads * Dh] with num_heads = {num_heads}; "
                         f"got {tuple(qkv.shape)}")
    batch, seq_len, width = qkv.shape
    _check_problem(qkv.dtype, batch * num_heads, seq_len, width // (3 * num_heads), width, rope, qkv.shape)


# ----------------------------------------------------------------------------------------------------------
# Launches (shared by both layouts)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Problem:
    """What every launch needs besides the tensors: sizes, options and the strides of the layout.

    qkv_strides and out_strides are (batch, head, row) strides in elements, as in the Addressing table.
    """
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    qkv_strides: tuple   # of q, k, v, dq, dk, dv
    out_strides: tuple   # of out and d(out)
    causal: bool
    sm_scale: float
    precision: str       # tl.dot's input_precision
    k_offset: int = 0    # packed layout: k (dk, the rotated k) starts D elements after q's pointer ...
    v_offset: int = 0    # ... and v 2D after it; 0 for separate q, k, v tensors

    def scalar_args(self) -> tuple:
        """The scalar arguments of the forward, dk/dv and dq kernels, in their order."""
        return (self.seq_len, self.heads, self.sm_scale, *self.qkv_strides, *self.out_strides, self.k_offset,
                self.v_offset)


def _rope_tables(cos, sin, seq_len: int, device: torch.device):
    """The first S rows of the RoPE tables as contiguous float32 on the inputs' device; (None, None) without."""
    if cos is None:
        return None, None
    return tuple(table[:seq_len].to(device=device, dtype=torch.float32).contiguous() for table in (cos, sin))


def _run_forward(problem: _Problem, q, k, v, out, cos, sin, rotated=None) -> torch.Tensor:
    """Fill out from q, k, v, laid out as `problem` says: element (0, 0, 0, 0) of q is q's first element, those of
    k and v lie problem.k_offset and problem.v_offset elements after the first element of k and v (the packed
    layout passes qkv itself three times; separate tensors use offsets 0). Returns lse: [B*H, S] float32.

    With RoPE (cos given), `rotated` = (q_rot, k_rot, v_copy) laid out like q, k, v: the kernel fills q_rot and
    k_rot with the rotated q and k, and v_copy (unless it is None) with v, for the backward pass.
    """
    rope = cos is not None
    if rope and rotated is None:
        raise ValueError("_run_forward with RoPE needs rotated=(q_rot, k_rot, v_copy or None) to write into")
    lse = _new_buffer((problem.batch * problem.heads, problem.seq_len), torch.float32, q.device)
    q_rot, k_rot, v_copy = rotated if rope else (q, q, None)   # placeholders: never touched without RoPE
    config = _launch_config(problem.head_dim, q.dtype, problem.seq_len, "forward", q.device, rope)
    grid = (triton.cdiv(problem.seq_len, config["BLOCK_M"]), problem.batch * problem.heads)
    _flash_attention_forward_kernel[grid](
        q, k, v, out, lse,
        cos if rope else q, sin if rope else q,  # placeholders: never read without RoPE
        q_rot, k_rot, q if v_copy is None else v_copy,
        *problem.scalar_args(),
        HEAD_DIM=problem.head_dim, CAUSAL=problem.causal, ROPE=rope, COPY_V=v_copy is not None,
        DOT_PRECISION=problem.precision, WHOLE_BLOCKS=_whole_blocks(problem.seq_len, config), **config,
        **launch_options(q.device),
    )
    return lse


def _run_backward(problem: _Problem, q, k, v, out, lse, cos, sin, grad_out, dq, dk, dv) -> None:
    """Fill dq, dk, dv (laid out like q, k, v) from the saved forward tensors and grad_out (laid out like out).

    q and k as the forward pass scored them: with RoPE (cos given) the rotated copies it wrote; dq and dk come
    out with respect to the unrotated inputs."""
    batch_heads, seq_len = problem.batch * problem.heads, problem.seq_len
    rope = cos is not None
    with _masked_lanes_may_overflow():
        _launch_backward(problem, q, k, v, out, lse, cos, sin, grad_out, dq, dk, dv, batch_heads, seq_len, rope)


def _masked_lanes_may_overflow():
    """Around the backward launches: in Triton's CPU interpreter, NumPy's overflow warnings are off. The backward
    kernels compute exp2(score - lse) for every pair of a tile, also for the keys a row does not see (which are
    not in its lse, so their exp2 may overflow to inf) and only then zero those lanes, which costs less on a GPU
    than masking first (_probabilities). A GPU computes the inf and drops it silently; NumPy, computing the same
    lanes, warned "overflow encountered in exp2" whenever scores were large (performance-debugging stage 1's
    std-1 weights), about values that never reach a result. On a GPU this is a no-op."""
    if not interpreter_active():
        return contextlib.nullcontext()
    import numpy as np
    return np.errstate(over="ignore")


def _launch_backward(problem: _Problem, q, k, v, out, lse, cos, sin, grad_out, dq, dk, dv, batch_heads: int,
                     seq_len: int, rope: bool) -> None:
    # The dq kernel runs first: it also writes delta = rowsum(dO * O), which the dk/dv kernel reads.
    delta = _new_buffer((batch_heads, seq_len), torch.float32, q.device)
    common = dict(HEAD_DIM=problem.head_dim, CAUSAL=problem.causal, ROPE=rope, DOT_PRECISION=problem.precision)
    cos_arg, sin_arg = (cos, sin) if rope else (q, q)
    config = _launch_config(problem.head_dim, q.dtype, seq_len, "dq", q.device)
    _flash_attention_backward_dq_kernel[(triton.cdiv(seq_len, config["BLOCK_M"]), batch_heads)](
        q, k, v, out, grad_out, lse, delta, dq, cos_arg, sin_arg, *problem.scalar_args(), **common, **config,
        WHOLE_BLOCKS=_whole_blocks(seq_len, config), **launch_options(q.device),
    )
    config = _launch_config(problem.head_dim, q.dtype, seq_len, "dkdv", q.device)
    _flash_attention_backward_dkdv_kernel[(triton.cdiv(seq_len, config["BLOCK_N"]), batch_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, cos_arg, sin_arg, *problem.scalar_args(), **common, **config,
        WHOLE_BLOCKS=_whole_blocks(seq_len, config), **launch_options(q.device),
    )


def _packed_problem(qkv: torch.Tensor, num_heads: int, causal: bool, sm_scale: float,
                    precise_fp32: bool) -> _Problem:
    """The _Problem of a contiguous packed qkv [B, S, 3D]: q, k and v are all qkv, k starting D columns and v 2D
    columns after q; out is [B, S, D]."""
    batch, seq_len, width = qkv.shape
    dim = width // 3
    head_dim = dim // num_heads
    return _Problem(batch, num_heads, seq_len, head_dim,
                    qkv_strides=(seq_len * width, head_dim, width), out_strides=(seq_len * dim, head_dim, dim),
                    causal=causal, sm_scale=sm_scale, precision=_dot_precision(qkv.dtype, precise_fp32),
                    k_offset=dim, v_offset=2 * dim)


def _packed_backward(problem: _Problem, qkv, out, lse, cos, sin, grad_out) -> torch.Tensor:
    """grad_qkv [B, S, 3D] from the packed forward's saved tensors (qkv with q and k as they were scored)."""
    grad_out = grad_out.contiguous()  # as in FlashAttentionFunction: read with out's strides
    grad_qkv = _new_buffer(qkv.shape, qkv.dtype, qkv.device)
    # The kernels write dq, dk, dv straight into the three column blocks of grad_qkv (offsets as forward).
    _run_backward(problem, qkv, qkv, qkv, out, lse, cos, sin, grad_out, grad_qkv, grad_qkv, grad_qkv)
    return grad_qkv


# ----------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------
class FlashAttentionFunction(torch.autograd.Function):
    """Autograd glue for q, k, v of [B, H, S, Dh]: forward launches one kernel, backward two (dq, which also
    writes delta, then dk/dv)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, sm_scale: float, cos, sin, precise_fp32: bool):
        batch, heads, seq_len, head_dim = q.shape
        # Contiguous [B, H, S, Dh]: one set of strides for every operand. Other views, such as a transpose of
        # [B, S, H, Dh], are copied once here; contiguous() costs nothing for a tensor that already is.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        strides = (heads * seq_len * head_dim, seq_len * head_dim, head_dim)
        problem = _Problem(batch, heads, seq_len, head_dim, qkv_strides=strides, out_strides=strides,
                           causal=causal, sm_scale=sm_scale, precision=_dot_precision(q.dtype, precise_fp32))
        cos, sin = _rope_tables(cos, sin, seq_len, q.device)

        out = _new_buffer(q.shape, q.dtype, q.device)
        if cos is None:
            lse = _run_forward(problem, q, k, v, out, cos, sin)
        else:  # the backward reads the rotated q and k the forward writes (v is saved as it is)
            q_rot, k_rot = _new_buffer(q.shape, q.dtype, q.device), _new_buffer(k.shape, k.dtype, k.device)
            lse = _run_forward(problem, q, k, v, out, cos, sin, rotated=(q_rot, k_rot, None))
            q, k = q_rot, k_rot
        ctx.save_for_backward(q, k, v, out, lse, cos, sin)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cos, sin = ctx.saved_tensors
        # The incoming gradient can be a broadcast view (e.g. from out.sum()) with zero strides; the kernels
        # read it with out's strides.
        grad_out = grad_out.contiguous()
        dq, dk, dv = (_new_buffer(t.shape, t.dtype, t.device) for t in (q, k, v))
        _run_backward(ctx.problem, q, k, v, out, lse, cos, sin, grad_out, dq, dk, dv)
        # One gradient per forward input: q, k, v, then none for causal, sm_scale, cos, sin, precise_fp32.
        return dq, dk, dv, None, None, None, None, None


class FlashAttentionPackedFunction(torch.autograd.Function):
    """Autograd glue for the packed layout: q, k, v are read from qkv [B, S, 3D], out is written as [B, S, D],
    and the backward writes dq, dk, dv side by side into one [B, S, 3D] gradient of qkv. No copies either way."""

    @staticmethod
    def forward(ctx, qkv, num_heads: int, causal: bool, sm_scale: float, cos, sin, precise_fp32: bool):
        qkv = qkv.contiguous()  # a projection's output already is: then this costs nothing
        batch, seq_len, width = qkv.shape
        problem = _packed_problem(qkv, num_heads, causal, sm_scale, precise_fp32)
        cos, sin = _rope_tables(cos, sin, seq_len, qkv.device)

        out = _new_buffer((batch, seq_len, width // 3), qkv.dtype, qkv.device)
        # q, k and v are all qkv: the problem's k_offset and v_offset say where k and v start.
        if cos is None:
            lse = _run_forward(problem, qkv, qkv, qkv, out, cos, sin)
        else:  # the kernel also writes [rotated q | rotated k | v] into a buffer like qkv: the backward's input
            qkv_rotated = _new_buffer(qkv.shape, qkv.dtype, qkv.device)
            lse = _run_forward(problem, qkv, qkv, qkv, out, cos, sin,
                               rotated=(qkv_rotated, qkv_rotated, qkv_rotated))
            qkv = qkv_rotated
        ctx.save_for_backward(qkv, out, lse, cos, sin)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, out, lse, cos, sin = ctx.saved_tensors
        grad_qkv = _packed_backward(ctx.problem, qkv, out, lse, cos, sin, grad_out)
        # One gradient per forward input: qkv, then none for num_heads, causal, sm_scale, cos, sin, precise_fp32.
        return grad_qkv, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------
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


def flash_attention_packed(qkv: torch.Tensor, num_heads: int, causal: bool = True, sm_scale: float | None = None,
                           rope=None, precise_fp32: bool = False) -> torch.Tensor:
    """flash_attention on the output of a fused QKV projection, returning the input of the output projection.

    qkv: [B, S, 3 * D] with D = num_heads * Dh: per token the q heads, then the k heads, then the v heads
        (head h of q in columns h*Dh : (h+1)*Dh, of k from D + h*Dh, of v from 2D + h*Dh), i.e. x @ W^T for
        W = the q, k and v projection matrices stacked. Non-contiguous input is copied once.
    Returns out: [B, S, D] contiguous, head h in columns h*Dh : (h+1)*Dh. The gradient of qkv comes back as one
    [B, S, 3 * D] tensor. causal, sm_scale, rope, precise_fp32, dtypes and head dims: as for flash_attention.
    The same as, without the two copies (and their two backward copies),
        q, k, v = qkv.view(B, S, 3, H, Dh).permute(2, 0, 3, 1, 4)
        flash_attention(q, k, v, ...).transpose(1, 2).reshape(B, S, D)
    """
    _check_packed_input(qkv, num_heads, rope)
    head_dim = qkv.shape[-1] // (3 * num_heads)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    cos, sin = rope if rope is not None else (None, None)
    return FlashAttentionPackedFunction.apply(qkv, num_heads, causal, float(sm_scale), cos, sin, precise_fp32)


def _checked_packed_problem(qkv, num_heads, causal, sm_scale, precise_fp32, rope):
    """(contiguous qkv, its _Problem) for the two functions below, after the checks flash_attention_packed makes;
    sm_scale None means 1 / sqrt(Dh)."""
    _check_packed_input(qkv, num_heads, rope)
    qkv = qkv.contiguous()
    head_dim = qkv.shape[-1] // (3 * num_heads)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    return qkv, _packed_problem(qkv, num_heads, causal, sm_scale, precise_fp32)


def packed_attention_forward(qkv: torch.Tensor, num_heads: int, causal: bool = True,
                             sm_scale: float | None = None, precise_fp32: bool = False):
    """The packed layout's forward kernel without autograd: (out [B, S, D], lse [B*H, S] float32).

    For a caller that wraps its own autograd Function around attention and something before it: version 4's
    QKV GEMM rotates q and k in its epilogue, so qkv arrives with q and k already rotated, and its Function
    calls this, then packed_attention_backward with the RoPE tables. Arguments as for flash_attention_packed
    (no rope: the forward kernel runs without RoPE).
    """
    qkv, problem = _checked_packed_problem(qkv, num_heads, causal, sm_scale, precise_fp32, rope=None)
    batch, seq_len, width = qkv.shape
    out = _new_buffer((batch, seq_len, width // 3), qkv.dtype, qkv.device)
    lse = _run_forward(problem, qkv, qkv, qkv, out, None, None)
    return out, lse


def packed_attention_backward(qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                              num_heads: int, causal: bool = True, sm_scale: float | None = None,
                              precise_fp32: bool = False, rope=None) -> torch.Tensor:
    """grad_qkv [B, S, 3D] for packed_attention_forward's (out, lse) on the same qkv and options.

    rope=(cos, sin): q and k in qkv are RoPE-rotated by these tables, and dq, dk are rotated back before they
    are stored, so grad_qkv is the gradient with respect to the unrotated q and k (what the GEMM that produced
    them needs). Without rope it is the gradient with respect to qkv itself.
    """
    qkv, problem = _checked_packed_problem(qkv, num_heads, causal, sm_scale, precise_fp32, rope)
    cos, sin = rope if rope is not None else (None, None)
    cos, sin = _rope_tables(cos, sin, qkv.shape[1], qkv.device)
    return _packed_backward(problem, qkv, out, lse, cos, sin, grad_out)
