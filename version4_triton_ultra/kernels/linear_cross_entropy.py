"""Fused output head + cross-entropy, in chunks of rows, with the gradient computed during the forward pass.

The last layer of a language model is a matmul to V vocabulary scores per token followed by a softmax
cross-entropy. Done naively, with N tokens,

    logits = hidden @ weight.T                   # [N, V] in bf16: 0.5 GB for N=8192, V=32000
    loss = F.cross_entropy(logits.float(), t)    # a float32 copy (1 GB), softmax and its gradient (1 GB more)

the biggest tensors of the whole training step are these logits, although only one number per row (the loss)
and the two small gradients (of hidden [N, D] and weight [V, D]) are wanted in the end. This op never holds
more than one chunk of logits:

    for each chunk of rows:
        logits = hidden[chunk] @ weight.T            torch matmul (vendor BLAS), in hidden's dtype
        kernel: per-row loss in float32, and the logits overwritten in place by  softmax - onehot(target)
                (divided by n_valid, below)
        grad_hidden[chunk]  = dlogits @ weight       torch matmul
        grad_weight        += dlogits.T @ hidden[chunk]

Since the gradients are computed in forward, backward only scales them: one kernel. Without any input that
requires grad, only the loss is computed.

The weight's gradient is summed over the chunks in float32, unless the caller hands in `sixteen_bit_gradients`
({weight: gradient}, the dict the model's weight-gradient stream writes and TritonAdamW reads: backward_overlap.py)
for a bfloat16 training step (backward_once). Then each chunk's GEMM adds its product into one bfloat16 gradient
(beta = 1, summed in float32 inside the GEMM and rounded once a chunk), and the backward pass puts it into the dict
instead of handing autograd a float32 one. It is what autocast's own backward gives the head's float32 weight (the
16-bit product, widened later), summed from the chunks in bfloat16: at the medium preset ([32000, 1024], two
chunks) the first chunk writes 65 MB instead of 131, the second reads and writes 65 instead of 131 each, and the
optimizer reads 65 instead of 131: 262 MB a step fewer.

The mean's 1/n_valid: in bfloat16 and float32 the kernel writes (softmax - onehot) / n_valid, n_valid counted
from the targets before the first chunk, so both gradients leave the forward pass already divided. Backward then
multiplies them by grad_output. With backward_once (a training step, which differentiates each loss once: version
4's model) it does so in place and hands them over, and when grad_output is exactly 1 (loss.backward() on the
mean loss) its kernel reads that 1 and touches nothing: at the medium preset that saves reading and writing the
[32000, 1024] float32 weight gradient, ~70 us a step on an H200. (Otherwise it writes scaled copies, so that a
graph kept with retain_graph=True can be differentiated again, as the kernel benchmark does.) In float16 the
divided values (about 1 / (V * n_valid), e.g. 1e-9) would fall below float16's smallest normal number (6e-5) and
flush to zero, so float16 logits get softmax - onehot (probabilities, which float16 holds well) and backward
applies 1/n_valid in float32 with grad_output.

The kernel: one program per row streams over V in blocks of BLOCK_V (V may be 32000, not a power of two).
First pass: an "online" max and sum of exponentials, rescaling the running sum whenever the max grows, so the
row is read once for logsumexp. Second pass: the gradient, written back over the logits. When the whole row fits
one block (V <= MAX_BLOCK_V) the program reads it once and keeps it in registers for both.
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import interpreter_active, num_warps_for, small_interpreter_blocks
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel
from version4_triton_ultra.kernels.sixteen_bit_gradients import refuse_two_gradients

# Largest block of vocabulary entries one program handles at a time (the row loops over blocks this long).
MAX_BLOCK_V = 4096
# At most this many warps a row. A block of 4,096 entries with 16 warps (8 entries a thread) streamed slower than
# with 8 (16 a thread) on an H200, the kernel alone (tune_cross_entropy.py; benchmarks/results/kernel_time/
# h200_cross_entropy_launch.json): 4,160 rows of V = 32,000 (a chunk of the medium and large presets) 261 -> 226
# us, the small preset's 4,096 x 4,096 33.0 -> 29.3 us. (Blocks of 2,048 or 8,192 entries were slower or no faster
# at V = 32,000, and 4 warps slower; so was a block of the whole row, read once: 32,768 entries took 279 us with 32
# warps and 347 with 16, h200_cross_entropy_whole_row.json.)
MAX_WARPS = 8
# Default chunk: this many bytes of logits. Each chunk after the first also adds a [V, D] float32 matmul
# result into grad_weight (or, summed in bfloat16 for the optimizer's dict, a 16-bit one: the module docstring).
# Where the GEMM cannot add it itself (accumulate_matmul: float32 operands use addmm_,
# 16-bit ones on a GPU torch.addmm's float32 output; the rest, and the runs measured here, a separate add) that
# is one element-wise kernel reading 2 and writing 1 such array, whatever the chunk's length. At the medium preset
# with --use-amp (8192 tokens, V = 32000, D = 1024, bfloat16) that is 393 MB, ~120 us at the H100's 3.35 TB/s.
# With 32 MiB chunks (512 rows there, 16 chunks) that made 15 additions per step, ~1.8 ms of a ~27 ms step by
# this arithmetic (a profile of the step showed ~20 element-wise kernels of ~130 us each). 256 MiB (4160 rows
# there) leaves one addition at the medium and large presets, for 224 MiB more memory at the end of the
# forward pass. Measured on an H100 (tiny_llama_v4.py --use-amp, 32 MiB and 256 MiB runs interleaved): medium
# 27.07 -> 24.57 ms a step (591 -> 651 samples/s, peak 6,897 -> 7,238 MiB); large 117.6 -> 113.1 ms.
DEFAULT_CHUNK_BYTES = 256 * 2**20
# Chunk lengths are multiples of this (matmul tiles are usually 64 or 128 rows).
CHUNK_ROW_MULTIPLE = 64
# The logits' dtypes whose gradient the loss kernel divides by n_valid itself: those with float32's exponent range,
# where values of about 1 / (V * n_valid) do not underflow (the module docstring). float16's gradient is divided in
# the backward pass instead.
DIVIDED_IN_FORWARD = (torch.float32, torch.bfloat16)
# The compute dtypes whose weight gradient may be summed in that dtype (`sixteen_bit_gradients`). bfloat16 only:
# float32's sum is float32 already, and float16's is divided by n_valid in the backward pass, which would round it
# again at every step (a bfloat16 sum is scaled there only when grad_output is not exactly 1, e.g. a loss scale).
SUMMED_IN_COMPUTE_DTYPE = (torch.bfloat16,)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel: forward and backward of softmax cross-entropy, one row per program
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,                 # [rows, V] in, contiguous; with COMPUTE_GRAD, overwritten by the gradient
    targets_ptr,                # [rows] int64
    row_loss_ptr,               # [rows] float32 out: logsumexp - logit[target], 0 for ignored rows
    grad_scale_ptr,             # [1] float32, what the gradient is multiplied by (with SCALE_GRAD)
    vocab_size, ignore_index,
    COMPUTE_GRAD: tl.constexpr,
    SCALE_GRAD: tl.constexpr,   # multiply the gradient by grad_scale (1 / n_valid), else leave it unscaled
    BLOCK_V: tl.constexpr,
    ONE_BLOCK: tl.constexpr,    # V <= BLOCK_V: one read of the row instead of two passes
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    # int64: rows * V of a long chunk can exceed 2^31 elements.
    row_logits_ptr = logits_ptr + row.to(tl.int64) * vocab_size
    target = tl.load(targets_ptr + row)
    is_valid = target != ignore_index
    grad_scale = tl.load(grad_scale_ptr) if SCALE_GRAD else 1.0

    if ONE_BLOCK:
        # The whole row fits in one block (V <= BLOCK_V, e.g. the seed's 1000): read it once and keep it in
        # registers for both the loss and the gradient, instead of reading it again in a second pass.
        cols = tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        x = tl.load(row_logits_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        log_sum_exp = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
        target_logit = tl.sum(tl.where((cols == target) & mask, x, 0.0), axis=0)
        tl.store(row_loss_ptr + row, tl.where(is_valid, log_sum_exp - target_logit, 0.0))
        if COMPUTE_GRAD:
            grad = tl.exp(x - log_sum_exp) - tl.where(cols == target, 1.0, 0.0)
            grad = tl.where(is_valid, grad * grad_scale, 0.0)
            tl.store(row_logits_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: running max m and running sum s of exp(x - m), all in float32 whatever the logits' dtype.
        m = float("-inf")
        s = 0.0
        target_logit = 0.0
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < vocab_size
            x = tl.load(row_logits_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # Rescale what was summed relative to the old max; exp(-inf) = 0 on the first block.
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
            # Pick out the target's logit on the way, instead of a separate gather that could read out of range.
            target_logit += tl.sum(tl.where((cols == target) & mask, x, 0.0), axis=0)
        log_sum_exp = m + tl.log(s)
        tl.store(row_loss_ptr + row, tl.where(is_valid, log_sum_exp - target_logit, 0.0))

        # Pass 2: d(loss_row)/d(logits) = softmax - onehot(target); ignored rows get zeros.
        if COMPUTE_GRAD:
            for start in range(0, vocab_size, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < vocab_size
                x = tl.load(row_logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                grad = tl.exp(x - log_sum_exp) - tl.where(cols == target, 1.0, 0.0)
                grad = tl.where(is_valid, grad * grad_scale, 0.0)
                tl.store(row_logits_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mean_loss_kernel(
    row_loss_ptr, targets_ptr,   # [rows] float32, [rows] int64
    loss_ptr, inv_count_ptr,     # outputs: [1] float32 mean loss, [1] float32 1 / (number of counted rows)
    n_rows, ignore_index,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    """One program: the mean of the per-row losses over the rows whose target is not ignored.

    Six tiny PyTorch kernels otherwise (compare, count, cast, sum, divide, reciprocal); one program is enough
    for the few thousand rows of a batch, and it adds the rows in a fixed order (deterministic).
    """
    wait_for_previous_kernel(PDL)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        total += tl.load(row_loss_ptr + rows, mask=rows < n_rows, other=0.0)
    n_valid = _count_valid(targets_ptr, n_rows, ignore_index, BLOCK)
    # With every target ignored this is 0/0 = nan, as in F.cross_entropy.
    tl.store(loss_ptr, tl.sum(total, axis=0) / n_valid)
    tl.store(inv_count_ptr, _inverse(n_valid))


@triton.jit
def _inverse_count_kernel(targets_ptr, inv_count_ptr, n_rows, ignore_index, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """One program: 1 / (number of targets not ignored), before the chunks, for the loss kernel to divide by."""
    wait_for_previous_kernel(PDL)
    tl.store(inv_count_ptr, _inverse(_count_valid(targets_ptr, n_rows, ignore_index, BLOCK)))


@triton.jit
def _inverse(n_valid):
    """1 / n_valid, and 0 when every target is ignored: the gradient is then all zeros, as F.cross_entropy's,
    where 1 / 0 would make zero times infinity (nan) of it."""
    return tl.where(n_valid > 0, 1.0 / tl.maximum(n_valid, 1.0), 0.0)


@triton.jit
def _count_valid(targets_ptr, n_rows, ignore_index, BLOCK: tl.constexpr):
    """The number of targets not equal to ignore_index, as a float32 scalar."""
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_range = rows < n_rows
        target = tl.load(targets_ptr + rows, mask=in_range, other=ignore_index)
        count += tl.where(in_range & (target != ignore_index), 1.0, 0.0)
    return tl.sum(count, axis=0)


@triton.jit
def _scale_pair_kernel(a_ptr, a_out_ptr, a_elements, a_programs, b_ptr, b_out_ptr, b_elements,
                       grad_output_ptr, inv_count_ptr, HAS_INV_COUNT: tl.constexpr,
                       A_IN_PLACE: tl.constexpr, B_IN_PLACE: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """a_out = a * s and b_out = b * s, s = grad_output (* inv_count with HAS_INV_COUNT; float32 scalars in
    device memory), computed in float32 and rounded once to the outputs' dtypes. The first a_programs programs
    scale a, the others b: the backward pass of the loss is this one kernel. An output that is its input
    (A_IN_PLACE, B_IN_PLACE) is left untouched when s is exactly 1: nothing to read or write.

    PyTorch would take three kernels (the scalar product and two multiplications), and computes a 16-bit tensor
    times a float32 scalar tensor with its general (not vectorised) kernel: 16.9 us for the [16384, 256]
    bfloat16 grad_hidden of batch 32 x seq 512 on an H100, against the ~6 us that reading and writing 16 MB
    takes."""
    wait_for_previous_kernel(PDL)
    scale = tl.load(grad_output_ptr)
    if HAS_INV_COUNT:
        scale = scale * tl.load(inv_count_ptr)
    program = tl.program_id(0)
    if program < a_programs:
        _scale_block(a_ptr, a_out_ptr, a_elements, program, scale, A_IN_PLACE, BLOCK)
    else:
        _scale_block(b_ptr, b_out_ptr, b_elements, program - a_programs, scale, B_IN_PLACE, BLOCK)


@triton.jit
def _scale_block(x_ptr, out_ptr, n_elements, block, scale, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    if IN_PLACE:
        if scale != 1.0:
            _scale_values(x_ptr, out_ptr, n_elements, block, scale, BLOCK)
    else:
        _scale_values(x_ptr, out_ptr, n_elements, block, scale, BLOCK)


@triton.jit
def _scale_values(x_ptr, out_ptr, n_elements, block, scale, BLOCK: tl.constexpr):
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------------------
def _new_output(shape, dtype, device):
    """Every buffer a kernel or matmul fills is allocated here (uninitialised).

    A single allocation point lets the tests swap in NaN-filled buffers, so an element nobody writes shows
    up as NaN instead of as whatever memory happened to hold.
    """
    return torch.empty(shape, dtype=dtype, device=device)


def cross_entropy_rows_(logits, targets, row_loss, ignore_index=-100, compute_grad=True, launch=None,
                        grad_scale=None):
    """Per-row cross-entropy of `logits` [rows, V] (contiguous) into `row_loss` [rows] float32.

    With compute_grad, `logits` is overwritten in place by softmax - onehot(target) (zeros on ignored rows),
    multiplied by grad_scale (a one-element float32 tensor on the device) if given.
    launch: (BLOCK_V, warps), powers of two, for a tuner to time; None: the rule (cross_entropy_launch).
    """
    n_rows, vocab_size = logits.shape
    if n_rows == 0:
        return
    block_v, num_warps = cross_entropy_launch(vocab_size) if launch is None else launch
    _cross_entropy_rows_kernel[(n_rows,)](
        logits, targets, row_loss, row_loss if grad_scale is None else grad_scale, vocab_size, ignore_index,
        COMPUTE_GRAD=compute_grad, SCALE_GRAD=grad_scale is not None, BLOCK_V=block_v,
        ONE_BLOCK=vocab_size <= block_v, num_warps=num_warps, **launch_options(logits.device))


def cross_entropy_launch(vocab_size):
    """(BLOCK_V, warps) of the loss kernel for rows of vocab_size logits: the whole row in one block up to
    MAX_BLOCK_V entries, a few entries a thread, at most MAX_WARPS warps."""
    block_v = min(triton.next_power_of_2(vocab_size), MAX_BLOCK_V)
    return block_v, num_warps_for(block_v, max_warps=MAX_WARPS)


def mean_loss(row_loss, targets, ignore_index=-100):
    """(mean of row_loss over the rows whose target is not ignore_index, 1 / that count): two float32 scalars
    on the device, from one kernel (no host synchronisation)."""
    out = _new_output((2,), torch.float32, row_loss.device)
    block, num_warps = _one_program_launch(row_loss.shape[0])
    _mean_loss_kernel[(1,)](row_loss, targets, out, out[1:], row_loss.shape[0], ignore_index, BLOCK=block,
                            num_warps=num_warps, **launch_options(out.device))
    return out[0], out[1]


def inverse_count(targets, ignore_index=-100):
    """1 / (number of targets not equal to ignore_index): a one-element float32 tensor on targets' device."""
    out = _new_output((1,), torch.float32, targets.device)
    block, num_warps = _one_program_launch(targets.shape[0])
    _inverse_count_kernel[(1,)](targets, out, targets.shape[0], ignore_index, BLOCK=block, num_warps=num_warps,
                                **launch_options(out.device))
    return out


def _one_program_launch(n_rows):
    """(BLOCK, warps) of a kernel whose one program walks n_rows rows. Up to 16384 rows per iteration: few long
    iterations beat many short ones (measured on an H100 at 16384 rows: 21.7 us with 1024-row blocks; in version
    4's batch-32 step, 10.1 us with 4096-row blocks and 8 warps, 4.0 us with one 16384-row block and 16 warps)."""
    block = min(16384, triton.next_power_of_2(max(n_rows, 16)))
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


SCALE_BLOCK = 4096   # elements per program of the scaling kernel
INTERPRETER_SCALE_BLOCK = 65536   # in a CPU run of Triton's interpreter, which pays per program


def scaled_pair(a, a_dtype, b, b_dtype, grad_output, inv_count=None, in_place=False):
    """(a * s in a_dtype, b * s in b_dtype) with s = grad_output (* inv_count if given), from one kernel. a and b
    are contiguous tensors or None (then None comes back); grad_output and inv_count one-element float32 tensors
    on their device. With in_place, a tensor already in its dtype is scaled in place and returned (so the caller
    must own it), and left as it is when s is exactly 1; otherwise every result is a new tensor."""
    if a is None and b is None:
        return None, None
    a = a.contiguous() if a is not None else None   # the kernel indexes them as flat arrays
    b = b.contiguous() if b is not None else None
    a_out = _scaled_output(a, a_dtype, in_place)
    b_out = _scaled_output(b, b_dtype, in_place)
    # A missing tensor gets no programs, so its pointers are never used: the other tensor stands in.
    a_in, a_to = (a, a_out) if a is not None else (b, b)
    b_in, b_to = (b, b_out) if b is not None else (a, a)
    a_elements = a.numel() if a is not None else 0
    b_elements = b.numel() if b is not None else 0
    block = INTERPRETER_SCALE_BLOCK if interpreter_active() and not small_interpreter_blocks() else SCALE_BLOCK
    a_programs = triton.cdiv(a_elements, block)
    n_programs = a_programs + triton.cdiv(b_elements, block)
    if n_programs > 0:
        _scale_pair_kernel[(n_programs,)](a_in, a_to, a_elements, a_programs, b_in, b_to, b_elements,
                                          grad_output, grad_output if inv_count is None else inv_count,
                                          HAS_INV_COUNT=inv_count is not None, A_IN_PLACE=a_out is a,
                                          B_IN_PLACE=b_out is b, BLOCK=block, num_warps=8,
                                          **launch_options(grad_output.device))
    return a_out, b_out


def _scaled_output(x, dtype, in_place):
    """Where the scaled x goes: x itself (in_place, and x has that dtype already), else a new tensor (None for
    None)."""
    if x is None or (in_place and x.dtype == dtype):
        return x
    return _new_output(x.shape, dtype, x.device)


def default_chunk_rows(vocab_size, dtype):
    """Rows per chunk so that one chunk of logits is about DEFAULT_CHUNK_BYTES."""
    row_bytes = vocab_size * torch.tensor([], dtype=dtype).element_size()
    rows = DEFAULT_CHUNK_BYTES // row_bytes
    return max(CHUNK_ROW_MULTIPLE, rows // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)


def _compute_dtype(hidden):
    """The dtype of the logits: autocast's dtype when autocast is on (as nn.Linear would use), else hidden's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


# ----------------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------------
class LinearCrossEntropyFunction(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], targets [N], chunk_size, ignore_index, grad_enabled, weight16, backward_once,
    sixteen_bit_gradients) -> mean loss.

    weight16: None, or a 16-bit copy of weight already made by the caller (used when it has the compute dtype).
    backward_once: backward scales the gradients in place and hands them over (see the module docstring).
    sixteen_bit_gradients: None, or the dict where the weight's 16-bit gradient goes (see the module docstring).

    grad_enabled: torch.is_grad_enabled() of the caller. Inside forward, grad mode is always off and
    ctx.needs_input_grad only reflects requires_grad, so under torch.no_grad() it would still ask for
    gradients nobody will use.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index, grad_enabled, weight16, backward_once,
                sixteen_bit_gradients):
        n_rows = hidden.shape[0]
        dtype = _compute_dtype(hidden)
        want_grad_hidden = grad_enabled and ctx.needs_input_grad[0]
        want_grad_weight = grad_enabled and ctx.needs_input_grad[1]
        compute_grad = want_grad_hidden or want_grad_weight
        chunk_size = chunk_size or default_chunk_rows(weight.shape[0], dtype)

        # Cast once, as autocast would for nn.Linear (unless the caller has the cast weight already); then turn
        # autocast off so every matmul below runs in exactly this dtype.
        hidden_c = hidden.to(dtype)
        weight_c = weight16 if weight16 is not None and weight16.dtype == dtype else weight.to(dtype)
        row_loss = _new_output((n_rows,), torch.float32, hidden.device)
        # The gradients, divided by n_valid already where the dtype allows (see the module docstring):
        # grad_hidden in the compute dtype, grad_weight summed over chunks in float32, or in bfloat16 for the dict
        # of 16-bit gradients where that is the weight's first gradient (weight_in_16_bits; _hand_over).
        divided = compute_grad and dtype in DIVIDED_IN_FORWARD
        grad_scale = inverse_count(targets, ignore_index) if divided else None
        grad_hidden = _new_output(hidden_c.shape, dtype, hidden.device) if want_grad_hidden else None
        grad_weight = None   # summed over the chunks, in float32 or (weight_in_16_bits) in the compute dtype
        # A leaf only: the dict is keyed by the parameter itself (a weight computed from one, say p * 1.0, would
        # take its gradient into the dict and away from p).
        weight_in_16_bits = (want_grad_weight and backward_once and sixteen_bit_gradients is not None
                             and weight.is_leaf and _first_gradient(weight, sixteen_bit_gradients)
                             and dtype in SUMMED_IN_COMPUTE_DTYPE)

        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, n_rows, chunk_size):
                rows = slice(start, min(start + chunk_size, n_rows))
                logits = hidden_c[rows] @ weight_c.T  # [rows, V]: the only logits that ever exist
                cross_entropy_rows_(logits, targets[rows], row_loss[rows], ignore_index, compute_grad,
                                    grad_scale=grad_scale)
                if not compute_grad:
                    continue
                dlogits = logits  # the kernel has overwritten the logits with (softmax - onehot) [/ n_valid]
                if want_grad_hidden:
                    torch.matmul(dlogits, weight_c, out=grad_hidden[rows])
                if weight_in_16_bits:
                    grad_weight = _accumulate_in_16_bits(grad_weight, dlogits.T, hidden_c[rows])
                elif want_grad_weight:
                    grad_weight = accumulate_matmul(grad_weight, dlogits.T, hidden_c[rows])

        # Mean over the rows that count; stays on the device (no .item(), so no host synchronisation).
        loss, inv_n_valid = mean_loss(row_loss, targets, ignore_index)
        if compute_grad:
            ctx.backward_once = backward_once
            if backward_once:
                # Kept on ctx, not saved, and let go by the backward, which scales them in place and hands them
                # over: once handed over they are the caller's (the weight's .grad), so a second backward through
                # a retained graph must not scale them again, and is refused.
                ctx.gradients = (grad_hidden, grad_weight)
            else:
                ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.inv_count = None if divided else inv_n_valid
            # The dtype the backward pass scales the weight's gradient in: the sum's own (no gradient without rows).
            ctx.dtypes = (hidden.dtype, grad_weight.dtype if grad_weight is not None else weight.dtype)
            # With the dict, the backward pass hands the weight's gradient over itself (_hand_over): a 16-bit sum
            # into the dict, a float32 one to autograd after widening into .grad any 16-bit one left in the dict.
            ctx.weight = weight
            ctx.sixteen_bit_gradients = sixteen_bit_gradients if want_grad_weight else None
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.backward_once:
            grad_hidden, grad_weight = ctx.saved_tensors
        elif ctx.gradients is None:   # they were scaled in place and handed over by the first backward
            raise RuntimeError("linear_cross_entropy(backward_once=True): backward through the same loss a second "
                               "time; pass backward_once=False to differentiate a retained graph again")
        else:
            (grad_hidden, grad_weight), ctx.gradients = ctx.gradients, None
        hidden_dtype, weight_dtype = ctx.dtypes
        # One kernel scales both by grad_output (e.g. a loss scale), and by 1/n_valid where the forward pass has
        # not divided them yet, in float32.
        grad_hidden, grad_weight = scaled_pair(grad_hidden, hidden_dtype, grad_weight, weight_dtype,
                                               grad_output.to(torch.float32), ctx.inv_count,
                                               in_place=ctx.backward_once)
        if ctx.sixteen_bit_gradients is not None and grad_weight is not None:
            grad_weight = _hand_over(ctx.weight, grad_weight, ctx.sixteen_bit_gradients)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _first_gradient(weight, sixteen_bit_gradients) -> bool:
    """Whether weight has no gradient yet, of either kind: only a first one is summed in 16 bits (a second
    backward pass before the optimizer step adds to the first in float32, as the weight-gradient stream does)."""
    return weight.grad is None and weight not in sixteen_bit_gradients


def _accumulate_in_16_bits(grad_weight, a, b):
    """grad_weight (16-bit, or None before the first chunk) + a @ b, in a and b's dtype: one GEMM whose epilogue
    adds the sum so far (beta = 1) before rounding to 16 bits."""
    if grad_weight is None:
        return a @ b
    return grad_weight.addmm_(a, b)


def _hand_over(weight, grad_weight, sixteen_bit_gradients):
    """What the backward pass returns for the weight, given the dict of 16-bit gradients. A 16-bit gradient that is
    the weight's first goes into the dict, and autograd gets none. Otherwise autograd gets it in float32 (widened),
    to add to .grad; a 16-bit gradient an earlier backward pass left in the dict is widened into .grad first, so
    that the two add up there (as the weight-gradient stream does with a second backward pass)."""
    if grad_weight.dtype != torch.float32 and _first_gradient(weight, sixteen_bit_gradients):
        sixteen_bit_gradients[weight] = grad_weight
        return None
    earlier = sixteen_bit_gradients.pop(weight, None)
    refuse_two_gradients(weight, earlier)
    if earlier is not None:
        weight.grad = earlier.to(torch.float32)
    return grad_weight.to(torch.float32)


_FLOAT32_OUTPUT_MATMUL = {"supported": True}


def matmul_to_float32(a, b, out=None):
    """a @ b returned in float32 (written into `out` if given), for float32 or 16-bit a and b (which are not
    copied to float32).

    On a GPU, one GEMM that accumulates in float32 and writes float32 (torch.mm's out_dtype, where this
    torch build has it); otherwise the 16-bit product is rounded to 16 bits first and then widened, which
    costs a second kernel and some precision."""
    if out is not None and (out.dtype != torch.float32 or out.shape != (a.shape[0], b.shape[1])):
        # Checked here, not left to torch: an error inside the try below would switch the one-GEMM path off.
        raise ValueError(f"out must be float32 [{a.shape[0]}, {b.shape[1]}]; got {out.dtype} {tuple(out.shape)}")
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda and _FLOAT32_OUTPUT_MATMUL["supported"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (RuntimeError, TypeError):  # an older torch, or a backend without the float32-output GEMM
            _FLOAT32_OUTPUT_MATMUL["supported"] = False
    product = (a @ b).to(torch.float32)
    return product if out is None else out.copy_(product)


_FLOAT32_OUTPUT_ADDMM = {"supported": True}


def accumulate_matmul(grad_weight, a, b):
    """grad_weight (float32, or None before the first chunk) + a @ b, without float32 copies of 16-bit a, b.

    In place, in the GEMM's epilogue (beta = 1), for float32 a and b and, on a GPU, for 16-bit ones through
    torch.addmm's float32 output (where this torch build has it). Otherwise the float32 product is added by an
    element-wise kernel of its own, which reads two [M, N] float32 arrays and writes one: at the medium preset's
    head (32000 x 1024) an 89 us kernel a step on an H200."""
    if grad_weight is None:
        return matmul_to_float32(a, b)
    if grad_weight.dtype != torch.float32 or grad_weight.shape != (a.shape[0], b.shape[1]):
        # Checked here, not left to torch: an error inside the try below would switch the one-GEMM path off.
        raise ValueError(f"grad_weight must be float32 [{a.shape[0]}, {b.shape[1]}]; got {grad_weight.dtype} "
                         f"{tuple(grad_weight.shape)}")
    if a.dtype == torch.float32:
        return grad_weight.addmm_(a, b)  # in place, no temporary
    if a.is_cuda and _FLOAT32_OUTPUT_ADDMM["supported"]:
        try:
            return torch.addmm(grad_weight, a, b, out_dtype=torch.float32, out=grad_weight)
        except torch.cuda.OutOfMemoryError:   # not a missing feature: the caller sees it
            raise
        except (RuntimeError, TypeError):  # an older torch, or a backend without the float32-output GEMM
            _FLOAT32_OUTPUT_ADDMM["supported"] = False
    return grad_weight.add_(matmul_to_float32(a, b))


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------
def linear_cross_entropy(hidden, weight, targets, chunk_size=None, ignore_index=-100, weight16=None,
                         backward_once=False, sixteen_bit_gradients=None):
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, never holding all the logits.

    hidden: [..., D] float32, or 16-bit (or float32 under autocast, then cast as nn.Linear would be).
    weight: [V, D] (the output head's weight). targets: [...] int64, matching hidden's leading dims; entries
    equal to ignore_index do not count. chunk_size: rows per chunk (default: ~DEFAULT_CHUNK_BYTES of logits).
    weight16: optional copy of weight in autocast's dtype that the caller already made (saves the cast).
    backward_once: the caller differentiates the loss once (a training step); backward then scales the gradients
    in place, touching nothing when grad_output is exactly 1, and refuses a second backward through a graph kept
    with retain_graph=True (see the module docstring).
    sixteen_bit_gradients: a dict {weight: 16-bit gradient}. With backward_once, a bfloat16 compute dtype (bfloat16
    autocast, or bfloat16 hidden) and a leaf weight that has no gradient yet, the weight's gradient is summed in
    bfloat16 and goes there instead of into weight.grad (see the module docstring); otherwise into weight.grad in
    float32, where a 16-bit gradient an earlier pass left in the dict is moved first, widened. None: float32 .grad.
    (A zero_grad(set_to_none=False) leaves zeroed entries in the dict, so every later pass then sums in float32.)
    Returns a float32 scalar equal to F.cross_entropy((hidden @ weight.T).float(), targets).
    """
    n_features = hidden.shape[-1]
    if weight.shape[-1] != n_features:
        raise ValueError(f"hidden has {n_features} features, weight {tuple(weight.shape)} expects "
                         f"{weight.shape[-1]}")
    hidden_rows = hidden.reshape(-1, n_features)
    targets_rows = targets.reshape(-1)
    if targets_rows.shape[0] != hidden_rows.shape[0]:
        raise ValueError(f"{targets_rows.shape[0]} targets for {hidden_rows.shape[0]} rows of hidden")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return LinearCrossEntropyFunction.apply(hidden_rows, weight, targets_rows.contiguous(), chunk_size,
                                            ignore_index, torch.is_grad_enabled(), weight16, backward_once,
                                            sixteen_bit_gradients)
