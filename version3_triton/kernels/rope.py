"""Rotary position embedding (RoPE) in Triton, rotate-half convention, for q and k in one launch.

Split a head vector x of size Dh into halves x1 = x[:Dh/2], x2 = x[Dh/2:]. With tables cos, sin of shape
[S, Dh] (for each position, the angles of the Dh/2 frequencies, written twice: [a, a]):

    out = x * cos + rotate_half(x) * sin,       rotate_half(x) = cat(-x2, x1)
    i.e.  out1 = x1 * cos1 - x2 * sin1
          out2 = x2 * cos2 + x1 * sin2          (cos1 = cos[:, :Dh/2], cos2 = cos[:, Dh/2:], same for sin)

Each pair (x1[i], x2[i]) is turned by the angle pos * freq_i. PyTorch spells this as slicing, negation,
concatenation, two multiplies and an add: several kernels and temporary tensors. Here one program loads a block
of rows, rotates them in registers and stores them: one read and one write of q and k.

Backward: out is linear in x, so dx is the transpose (adjoint) applied to g = d loss / d out:

    dx = g * cos + rotate_half_transposed(g * sin),   rotate_half_transposed(y) = cat(y2, -y1)
    i.e.  dx1 = g1 * cos1 + g2 * sin2
          dx2 = g2 * cos2 - g1 * sin1

With the duplicated tables (cos1 = cos2, sin1 = sin2) this is the rotation by the opposite angle: the inverse
of the forward rotation, as expected for a rotation (an orthogonal map). The same kernel does both directions,
chosen by the compile-time flag INVERSE.

Two layouts, one kernel:
  apply_rope(q, k, ...)            q, k as [B, H, S, Dh] tensors (the textbook layout; v1's apply_rope)
  apply_rope_packed(qkv, H, ...)   the fused QKV projection's output [B, S, 3 * H * Dh] as it is: version 3's
                                   model uses this one. Taking q and k out of qkv as [B, H, S, Dh] would cost a
                                   copy of each (a permute is not contiguous), plus a copy of v for attention
                                   and copies back in the backward pass: seven extra kernels per layer and step.
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import interpreter_active, num_warps_for, small_interpreter_blocks

# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _rotate_rows(
    in_ptr, out_ptr,       # one row is one head vector (2 * half elements) at one position; see below
    cos_ptr, sin_ptr,      # [>= seq_len, 2 * half] float32 contiguous
    row_block, n_rows, seq_len, half,
    rows_per_position,     # 1 for [B, H, S, Dh]; H for the packed [B, S, 3 * H * Dh] layout (one row per head)
    position_stride,       # elements from one position's first row to the next position's
    INVERSE: tl.constexpr,
    COPY: tl.constexpr,    # True: copy the rows unchanged (v in the packed layout travels with q and k)
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= half
):
    """Rotate (or copy) the rows row_block * BLOCK_ROWS ... + BLOCK_ROWS - 1 of one tensor.

    Row r is head (r % rows_per_position) at the (r // rows_per_position)-th position of the tensor, whose
    positions are ordered [batch, seq]; so it starts at (r // rows_per_position) * position_stride + head * Dh
    and its position in the sequence is (r // rows_per_position) % seq_len.
      [B, H, S, Dh] contiguous:   rows_per_position = 1, position_stride = Dh   (row r starts at r * Dh)
      packed q (or k) of [B, S, 3D]: rows_per_position = H, position_stride = 3D (the H heads of a token are
                                     adjacent: a block of rows is a few runs of D elements, 3D apart)
    """
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    head_dim = 2 * half

    token = rows // rows_per_position
    head = rows % rows_per_position
    # int64: token * position_stride overflows int32 once a tensor holds more than 2^31 elements.
    first = (token.to(tl.int64) * position_stride + head * head_dim)[:, None] + cols[None, :]
    second = first + half
    x1 = tl.load(in_ptr + first, mask=mask, other=0.0)
    x2 = tl.load(in_ptr + second, mask=mask, other=0.0)
    if COPY:
        tl.store(out_ptr + first, x1, mask=mask)
        tl.store(out_ptr + second, x2, mask=mask)
    else:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        positions = token % seq_len
        table_first = positions[:, None] * head_dim + cols[None, :]
        table_second = table_first + half
        # The tables are small ([S, Dh]) and shared by every batch element and head: these loads hit the cache.
        cos1 = tl.load(cos_ptr + table_first, mask=mask, other=0.0)
        cos2 = tl.load(cos_ptr + table_second, mask=mask, other=0.0)
        sin1 = tl.load(sin_ptr + table_first, mask=mask, other=0.0)
        sin2 = tl.load(sin_ptr + table_second, mask=mask, other=0.0)

        if INVERSE:  # the adjoint, used by the backward pass (see the module docstring)
            out1 = x1 * cos1 + x2 * sin2
            out2 = x2 * cos2 - x1 * sin1
        else:
            out1 = x1 * cos1 - x2 * sin1
            out2 = x2 * cos2 + x1 * sin2

        tl.store(out_ptr + first, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + second, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, cos_ptr, sin_ptr,
    n_q_rows, n_k_rows, seq_len, half, rows_per_position, position_stride,
    tensor_offset,   # packed layout: q, k, v (and their outputs) start 0, D, 2D elements after their pointer
    INVERSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (row blocks, 2 or 3): the second grid axis picks the tensor, so q and k (and, in the packed layout,
    the copy of v) share one launch.

    Used for the forward pass (INVERSE=False: rotate q and k) and the backward pass (INVERSE=True: the
    pointers are then the gradients of q_rot and k_rot, and the outputs the gradients of q and k; in the packed
    layout v's gradient is copied through, as v itself was).
    k may have fewer heads than q (grouped-query attention): its surplus row blocks are simply masked off.
    """
    row_block = tl.program_id(0)
    tensor = tl.program_id(1)
    offset = tensor * tensor_offset
    if tensor == 0:
        _rotate_rows(q_ptr + offset, q_out_ptr + offset, cos_ptr, sin_ptr, row_block, n_q_rows, seq_len, half,
                     rows_per_position, position_stride, INVERSE, False, BLOCK_ROWS, BLOCK_HALF)
    elif tensor == 1:
        _rotate_rows(k_ptr + offset, k_out_ptr + offset, cos_ptr, sin_ptr, row_block, n_k_rows, seq_len, half,
                     rows_per_position, position_stride, INVERSE, False, BLOCK_ROWS, BLOCK_HALF)
    else:  # v: as many rows as k
        _rotate_rows(v_ptr + offset, v_out_ptr + offset, cos_ptr, sin_ptr, row_block, n_k_rows, seq_len, half,
                     rows_per_position, position_stride, INVERSE, True, BLOCK_ROWS, BLOCK_HALF)


# ------------------------------------------------------------------------------------------------ launchers

# Elements of one tensor (both halves) that one program rotates: large enough to amortise the index arithmetic
# and keep many loads in flight, small enough to stay in registers. In Triton's CPU interpreter, where a CPU
# run pays per program and per block operation, up to _INTERPRETER_ELEMENTS_PER_PROGRAM (kernel tests keep the
# GPU's number, so that their small problems span several programs).
_ELEMENTS_PER_PROGRAM = 2048
_INTERPRETER_ELEMENTS_PER_PROGRAM = 32768


def shape_problem(head_dim: int) -> str | None:
    """Why the kernel cannot rotate heads of head_dim features (one line), or None when it can: RoPE turns
    pairs (x1[i], x2[i]) of the two halves of a head, so a head has an even number of features."""
    if head_dim % 2:
        return f"RoPE rotates pairs of features: head dim {head_dim} must be even"
    return None


def _check_head_dim(head_dim: int) -> None:
    problem = shape_problem(head_dim)
    if problem:
        raise ValueError(problem)


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, device=None):
    """cos and sin tables, each [seq_len, head_dim] float32, in the rotate-half layout [angles, angles].

    angle[pos, i] = pos * theta^(-2i / head_dim) for i < head_dim / 2.
    The angles are computed in float64 and rounded once at the end: in float32, pos * freq would already
    carry an error of about pos * 6e-8 radians before the cos and sin.
    """
    _check_head_dim(head_dim)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # 2i / Dh
    freqs = theta ** (-exponents)                                             # [Dh/2]
    positions = torch.arange(seq_len, dtype=torch.float64)
    angles = torch.outer(positions, freqs)                                    # [S, Dh/2]
    angles = torch.cat([angles, angles], dim=-1)                              # [S, Dh]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _float32_tables(cos, sin, seq_len: int, head_dim: int):
    assert cos.shape == sin.shape and cos.shape[0] >= seq_len and cos.shape[1] == head_dim, \
        f"cos/sin must be [>= {seq_len}, {head_dim}], got {tuple(cos.shape)}"
    # The tables stay float32 whatever q's dtype: they are tiny, and angles near pi lose precision in bf16.
    return cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()


def _launch(tensors, outputs, cos, sin, n_q_rows, n_k_rows, seq_len, head_dim, rows_per_position,
            position_stride, inverse: bool, tensor_offset: int = 0):
    """One launch over (q, k) or (q, k, v): grid (row blocks, number of tensors). In the packed layout all of
    them are the one qkv tensor (and its output) and tensor_offset = D says where k and v start."""
    n_rows = max(n_q_rows, n_k_rows)
    if n_rows == 0:
        return
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    elements = (_INTERPRETER_ELEMENTS_PER_PROGRAM if interpreter_active() and not small_interpreter_blocks()
                else _ELEMENTS_PER_PROGRAM)
    block_rows = max(1, min(elements // (2 * block_half), triton.next_power_of_2(n_rows)))
    q, k = tensors[:2]
    v = tensors[2] if len(tensors) == 3 else q          # placeholder without v: never read (grid axis of 2)
    q_out, k_out = outputs[:2]
    v_out = outputs[2] if len(outputs) == 3 else q_out
    grid = (triton.cdiv(n_rows, block_rows), len(tensors))
    _rope_kernel[grid](
        q, k, v, q_out, k_out, v_out, cos, sin, n_q_rows, n_k_rows, seq_len, half, rows_per_position,
        position_stride, tensor_offset,
        INVERSE=inverse, BLOCK_ROWS=block_rows, BLOCK_HALF=block_half,
        num_warps=num_warps_for(2 * block_rows * block_half),
    )


def _launch_rope(q, k, cos, sin, q_out, k_out, inverse: bool):
    assert q.is_contiguous() and k.is_contiguous(), "the kernel addresses rows as row * head_dim"
    assert q.dim() == 4 and k.dim() == 4 and q.shape[-2:] == k.shape[-2:] and q.dtype == k.dtype, \
        "q and k must be [batch, heads, seq, head_dim] with the same seq, head_dim and dtype"
    seq_len, head_dim = q.shape[-2:]
    _check_head_dim(head_dim)
    cos, sin = _float32_tables(cos, sin, seq_len, head_dim)
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous() and k_out.is_contiguous()
    _launch((q, k), (q_out, k_out), cos, sin, q.numel() // head_dim, k.numel() // head_dim, seq_len, head_dim,
            rows_per_position=1, position_stride=head_dim, inverse=inverse)
    return q_out, k_out


def _launch_rope_packed(qkv, num_heads: int, cos, sin, out, inverse: bool):
    assert qkv.dim() == 3 and qkv.is_contiguous(), "qkv must be a contiguous [batch, seq, 3 * dim] tensor"
    batch, seq_len, width = qkv.shape
    assert width % (3 * num_heads) == 0, f"width {width} is not 3 * num_heads ({num_heads}) * head_dim"
    dim = width // 3
    head_dim = dim // num_heads
    _check_head_dim(head_dim)
    cos, sin = _float32_tables(cos, sin, seq_len, head_dim)
    out = torch.empty_like(qkv) if out is None else out
    assert out.shape == qkv.shape and out.is_contiguous() and out.dtype == qkv.dtype
    # q, k and v of a token are the column blocks [0, D), [D, 2D), [2D, 3D) of its row: the kernel finds them
    # D and 2D elements after qkv's first element (offsets rather than views: a view is a torch call, and at
    # the seed size the host's time per call is what a training step waits for).
    n_rows = batch * seq_len * num_heads
    _launch((qkv, qkv, qkv), (out, out, out), cos, sin, n_rows, n_rows, seq_len, head_dim,
            rows_per_position=num_heads, position_stride=width, inverse=inverse, tensor_offset=dim)
    return out


def rope_forward(q, k, cos, sin, q_out=None, k_out=None):
    """Rotate q [B, H, S, Dh] and k [B, Hk, S, Dh] (contiguous). Returns (q_rot, k_rot) in q's dtype.

    q_out and k_out may be passed in (tests pass buffers filled with NaN to prove every element is written).
    """
    return _launch_rope(q, k, cos, sin, q_out, k_out, inverse=False)


def rope_backward(grad_q_rot, grad_k_rot, cos, sin, grad_q=None, grad_k=None):
    """Gradients of q and k from those of q_rot and k_rot (contiguous, same shapes): the inverse rotation."""
    return _launch_rope(grad_q_rot, grad_k_rot, cos, sin, grad_q, grad_k, inverse=True)


def rope_packed_forward(qkv, num_heads: int, cos, sin, out=None):
    """qkv [B, S, 3D] (a fused QKV projection's output, contiguous) -> [B, S, 3D] with the q and k column blocks
    rotated and the v block copied: exactly the input flash_attention_packed reads. out may be passed in."""
    return _launch_rope_packed(qkv, num_heads, cos, sin, out, inverse=False)


def rope_packed_backward(grad_qkv_rot, num_heads: int, cos, sin, grad_qkv=None):
    """The gradient of qkv from that of rope_packed_forward's output: q and k blocks rotated back, v copied."""
    return _launch_rope_packed(grad_qkv_rot, num_heads, cos, sin, grad_qkv, inverse=True)


# ------------------------------------------------------------------------------------------------ autograd


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        # The textbook layout: contiguous [B, H, S, Dh] (row r at r * Dh). Views such as q and k permuted out of a
        # fused qkv projection are copied here first; version 3's model avoids those copies by calling
        # apply_rope_packed on the projection's output instead.
        q, k = q.contiguous(), k.contiguous()
        q_rot, k_rot = rope_forward(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return q_rot, k_rot

    @staticmethod
    def backward(ctx, grad_q_rot, grad_k_rot):
        cos, sin = ctx.saved_tensors
        # Autograd hands over zeros (not None) for an unused output, so both gradients are tensors here.
        grad_q, grad_k = rope_backward(grad_q_rot.contiguous(), grad_k_rot.contiguous(), cos, sin)
        return grad_q, grad_k, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Apply RoPE to q [B, H, S, Dh] and k [B, Hk, S, Dh] (any strides) with tables from rope_tables().

    cos, sin: [>= S, Dh] float32 (only the first S rows are used). Returns (q_rot, k_rot), contiguous.
    """
    return RoPEFunction.apply(q, k, cos, sin)


class RoPEPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, num_heads, cos, sin):
        qkv = qkv.contiguous()  # a projection's output already is: then this costs nothing
        ctx.save_for_backward(cos, sin)
        ctx.num_heads = num_heads
        return rope_packed_forward(qkv, num_heads, cos, sin)

    @staticmethod
    def backward(ctx, grad_qkv_rot):
        cos, sin = ctx.saved_tensors
        return rope_packed_backward(grad_qkv_rot.contiguous(), ctx.num_heads, cos, sin), None, None, None


def apply_rope_packed(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the output of a fused QKV projection, in one launch and without any layout copies.

    qkv: [B, S, 3D], per token the q heads, then the k heads, then the v heads (D = num_heads * Dh), as
    flash_attention_packed reads it. Returns a new [B, S, 3D] tensor: q and k rotated, v copied alongside (so
    the attention kernel finds all three in one tensor). The copy of v is the price of not rotating in place;
    it is one extra read and write of v, inside the same launch.
    """
    return RoPEPackedFunction.apply(qkv, num_heads, cos, sin)
