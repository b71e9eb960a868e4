"""Fused residual-add + RMSNorm: one kernel forward, one kernel backward.

A pre-norm transformer block does, twice per layer,

    h      = residual + delta                      # the residual stream
    normed = weight * h / sqrt(mean(h^2) + eps)    # the input of the next sub-layer

In plain PyTorch that is an add, a square, a mean, an rsqrt, two multiplies and a cast: several kernels, each
reading and writing a whole [N, D] tensor. Here each Triton program owns whole rows (a few per program): it
reads `residual` and `delta` once, writes `h` and `normed` once, and keeps everything in between in registers.
The statistics are computed in float32 whatever the input dtype, exactly like the reference

    h = residual + delta
    normed = (weight * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps))).to(h.dtype)

The first layer has no delta to add: pass `delta=None`, and the op is a plain RMSNorm that returns its input
unchanged as `new_residual` (no copy is made).

Backward. With x_hat = h * rstd and g = grad_normed * weight, the gradient of RMSNorm is

    grad_h = rstd * (g - x_hat * mean(g * x_hat))

and the residual path adds `grad_new_residual` on top. Since h = residual + delta, that same grad_h is the
gradient of both `residual` and `delta`. The weight gradient sum_rows(grad_normed * x_hat) is a reduction over
all rows: each backward program owns a block of rows, accumulates its own partial sum in float32 and writes
it to its own row of a [programs, D] buffer. The programs then add the partial sums up themselves, so that
no separate reduction kernel is launched. With few programs (short batches), the program that finishes LAST
adds them all. With many, in two levels: the programs form groups of GROUP_SIZE, the last program of each group
to finish adds its group's partial sums into one row of a [groups, D] buffer, and the last of those
group-summing programs adds the groups' sums into the weight gradient. Each program learns whether it is last
from an atomic ticket counter (one per group, one for the groups) that it increments once after storing its
sum. One level alone would leave one program adding hundreds of partial sums while the GPU idles (measured on
an H100: ~12 us for 528 partial sums of 256 features). Either way the additions happen in a fixed order
(blocks of partial sums in program order, then of the groups' sums in group order), whichever program finishes
when: the result is the same bit for bit on every run. These sums are the kernel's tail, when most of the GPU has
finished: a summing program reads many partial sums per load (SUM_ELEMENTS_PER_THREAD), each load one memory round
trip.

The model's first norm has no residual add but follows the token-embedding lookup: `embedding_rms_norm` does
both in one kernel each way. The forward kernel reads row ids[r] of the embedding table for row r (GATHER) and
writes it as the residual stream along with its norm; the backward kernel reads the table rows again and adds
each row's gradient into the table's gradient with atomic additions (SCATTER), as kernels/embedding_backward.py
does, instead of writing it for a separate kernel to read back. An id outside [0, V) reads and writes nothing:
its rows come out as NaN (PyTorch's lookup would stop with an error), so a bad batch shows up in the loss.
Under data parallel the backward kernel can instead write each row's gradient (TABLE_ROWS without SCATTER): the
ranks then exchange those rows and their token ids, and each adds every rank's rows into its table's gradient
(`row_exchange`, see EmbeddingRMSNormFunction), which is the table's gradient summed over the ranks. (The rows of
ids outside the table are then left unwritten: every rank's addition skips those ids.)
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import (interpreter_active, interpreter_block, is_gpu, is_rocm,
                                            multiprocessor_count, num_warps_for, small_interpreter_blocks,
                                            threads_per_warp)
from version4_triton_ultra.kernels.embedding_backward import (embedding_backward, embedding_backward_in_order,
                                                            embedding_lookup, token_order)
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel

# One program holds a whole row in registers; beyond this many features it would spill.
MAX_FEATURES = 8192
# Backward programs per group whose partial weight gradients the group's last program adds up (see the module
# docstring). ~sqrt(programs) at 4 programs per SM balances the two levels: on an H100 (528 programs), 17 groups;
# rows of 512 features and more get 2 programs per SM (see _backward_program_count), so about half as many.
GROUP_SIZE = 32
# Up to this many programs (short batches), one group: its last program adds all the partial sums itself.
ONE_GROUP_UP_TO = 64
# Partial sums a summing program loads at once, counted in float32 values per thread: [BLOCK_P, D] blocks of
# contiguous rows (16 partial sums at 1,024 features on 8 warps). Each load is a round trip to the L2 cache that the
# whole kernel waits for at its end, so few large loads. Before, the partial sums were stored as [D, programs]
# columns and read 4096 values at a time (4 partial sums at 1,024 features): on an H200 at 8,192 x 1,024 (bfloat16
# gradients, interleaved) the kernel took 48.9 us, and 41.5 us with these loads; a probe with the sums left out
# took 40.2 us (benchmarks/results/kernel_time/h200_norm_backward_row_major_sums.json, with the other widths and
# the steps).
SUM_ELEMENTS_PER_THREAD = 64
# Wide rows. Rows of at least WIDE_FROM_FEATURES features (counted as the power-of-two block that holds a row) get
# three launch settings in the backward kernel:
#   - tiles of at most WIDE_TILE_ROWS rows (a power of two, as tl.arange needs) and a warp per 512 elements of a
#     tile (see _backward_tile);
#   - 2 programs per SM instead of 4 (see _backward_program_count);
#   - on NVIDIA, the next tile's loads issued before the current tile is computed (see the kernel's loop), from
#     PREFETCH_FROM_FEATURES: the same width, kept apart so that tests can run either loop at any width.
# Timed for the kernel alone, bfloat16 gradients, the configurations interleaved:
#   - H100, 8,192 rows, the prefetch alone: 69.8 -> 66.9 us at 1,024 features, 146.3 -> 136.8 us at 2,048
#     (benchmarks/results/kernel_time/h100_norm_backward_prefetch.json);
#   - H100, the three settings against the rules before them (h100_norm_backward_wide_rows.json): 512 features
#     34.8 -> 30.6 us at 8,192 rows and 19.4 -> 14.7 us at 4,096 (the small preset's rows), 1,024 features
#     64.3 -> 60.8 us, 2,048 features 138.3 -> 123.1 us;
#   - H200, the sweeps they were chosen from, with the presets' steps (h200_norm_backward_wide_rows.json): the small
#     preset's step 2.132 -> 2.088 ms; at 512 features the prefetch alone (8-row tiles, 4 programs per SM) was
#     slower, 23.1 against 18.2 us at 4,096 rows.
# Not timed on AMD (the rules apply there too, the prefetch excepted: there the tile in flight costs occupancy,
# compiled for gfx942 at 2,048 features by the kernel report's compiler: 140 -> 192 VGPRs, 3 -> 2 waves per SIMD,
# and 8 SGPRs spilled with the embedding's scatter), nor at 257-511 or more than 4,096 features on any GPU (at 4,096,
# on an H200, the rules were the fastest of nine launches: see _backward_tile).
WIDE_FROM_FEATURES = 512
WIDE_TILE_ROWS = 4
PREFETCH_FROM_FEATURES = WIDE_FROM_FEATURES


def _prefetches(block_d: int) -> bool:
    """Whether the backward kernel loads its next tile early for rows of block_d features (see above)."""
    return not is_rocm() and block_d >= PREFETCH_FROM_FEATURES

# One vector width for every tensor of a backward tile. Triton lays each load and store out by its own element size
# (16 bytes a thread: 4 float32 or 8 bfloat16 values), and under bfloat16 autocast the tile mixes both: h, the
# residual's gradient and grad_h in float32, grad_normed and grad_h's copy in bfloat16. The compiler then kept the
# arithmetic in the bfloat16 loads' layout and moved every tile's float32 grad_h through shared memory into the
# float32 store's layout (a convert_layout in the loop, and a barrier, at every width: compiled for sm_90 and
# gfx942). Told that a row's columns come in runs of VECTOR, where VECTOR is what 16 bytes hold of the widest
# dtype, every load and store takes one layout (the 16-bit ones as 8-byte vectors) and the loop has no such move
# (`python -m benchmarks.kernel_report.norm_layouts` counts them). Alone on an H200, the kernel before against this
# one: 41.0 -> 39.3 us at 8,192 x 1,024, 9.6 -> 8.0 us at 4,096 x 512, 5.4 -> 4.3 us at 1,024 x 256, and 72.6 ->
# 73.2 us at 8,192 x 2,048 (one A/B); the tiny, small and medium steps 0.3-1.7% faster, the large one unchanged
# (benchmarks/results/kernel_time/h200_norm_backward_one_layout.json). Not timed on AMD, where the compile also
# frees registers (80 VGPRs instead of 86-91 from 512 features).
VECTOR_BYTES = 16


def _shared_vector(*dtypes: torch.dtype) -> int:
    """Columns a thread reads and writes together in every tensor of a backward tile of these dtypes."""
    return VECTOR_BYTES // max(dtype.itemsize for dtype in dtypes)

# Ticket counters allocated per device: one per group and one for the groups. Programs are a few per SM, so
# groups are far fewer than this on any GPU.
MAX_TICKETS = 1024


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_forward_kernel(
    residual_ptr, delta_ptr, weight_ptr,      # inputs: [N, D] (GATHER: [V, D]), [N, D] (unused without delta), [D]
    ids_ptr,                                  # input with GATHER: [N] integers, the table row of each row
    new_residual_ptr, normed_ptr, rstd_ptr,   # outputs: [N, D], [N, D], [N] float32 (kept for backward)
    n_rows, n_features, n_table_rows, eps,    # n_table_rows: V, with GATHER
    HAS_DELTA: tl.constexpr,                  # False: plain RMSNorm, nothing added
    GATHER: tl.constexpr,                     # residual row r is row ids[r] of a table (an embedding lookup)
    BLOCK_D: tl.constexpr,                    # power of two >= n_features: the whole row in one block
    BLOCK_ROWS: tl.constexpr,                 # rows per program: a [BLOCK_ROWS, BLOCK_D] tile
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    wait_for_previous_kernel(PDL)
    # int64 rows: row * D can exceed 2^31 elements for long sequences and wide models.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_features)[None, :]  # D need not be a power of two
    offsets = rows[:, None] * n_features + cols[None, :]

    if GATHER:
        ids = tl.load(ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        id_ok = (ids >= 0) & (ids < n_table_rows)
        h = tl.load(residual_ptr + ids[:, None] * n_features + cols[None, :], mask=mask & id_ok[:, None], other=0.0)
        h = tl.where(id_ok[:, None], h, float("nan"))         # a bad id: NaN rows, nothing read outside the table
        tl.store(new_residual_ptr + offsets, h, mask=mask)   # the looked-up rows: the residual stream
        h = h.to(tl.float32)
    else:
        h = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h += tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # Round h to the stream's dtype before normalising, so the norm sees exactly the new_residual that
        # the next layer will see (as in the reference, where h is a tensor of the input dtype).
        h = h.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + offsets, h, mask=mask)
        h = h.to(tl.float32)

    # Masked columns hold 0, so they add nothing to the sum of squares; divide by the true D.
    mean_square = tl.sum(h * h, axis=1) / n_features
    rstd = tl.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=cols < n_features, other=0.0).to(tl.float32)
    normed = h * rstd[:, None] * weight[None, :]
    tl.store(normed_ptr + offsets, normed.to(normed_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _add_rms_norm_backward_kernel(
    h_ptr, weight_ptr, rstd_ptr,              # saved by forward: [N, D], [D], [N]
    grad_normed_ptr, grad_new_residual_ptr,   # incoming gradients: [N, D], [N, D] (unused without it)
    grad_h_ptr,                               # output: [N, D], the gradient of residual and of delta
                                              #   (SCATTER: [V, D] float32, zero on entry; row r adds into ids[r])
    ids_ptr,                                  # with TABLE_ROWS: [N] integers, the table row of each row (h_ptr: table)
    grad_h_copy_ptr,                          # output: [N, D], the same gradient in delta's dtype (WRITE_COPY)
    partial_grad_weight_ptr,                  # scratch: [programs, D] float32, one partial sum per program
    group_sum_ptr,                            # scratch: [groups, D] float32, one sum per group (TWO_LEVELS)
    grad_weight_ptr,                          # output: [D] float32, written by the last group-summing program
    ticket_ptr,                               # int32 counters, one per group then one for the groups; 0 on entry
    n_rows, n_features, n_table_rows, rows_per_program, n_programs, n_groups,   # n_table_rows: V, with TABLE_ROWS
    HAS_RESIDUAL_GRAD: tl.constexpr,          # False when nothing downstream used new_residual
    WRITE_COPY: tl.constexpr,                 # True when delta's dtype differs from h's (e.g. bf16 vs float32)
    TABLE_ROWS: tl.constexpr,                 # h is rows ids[r] of a table (the model's embedding lookup)
    SCATTER: tl.constexpr,                    # with TABLE_ROWS: grad_h is added into the table's gradient
    PROGRAMS_PER_GROUP: tl.constexpr,         # programs per group (the last group may have fewer)
    TWO_LEVELS: tl.constexpr,                 # False with a single group: its sum is the weight gradient
    BLOCK_P: tl.constexpr,                    # partial sums read at a time by a summing program
    L2_LOAD: tl.constexpr,                    # ".cg" on NVIDIA (bypass L1); "" on AMD, whose acquire invalidates
    BLOCK_D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,                 # rows handled together: a [BLOCK_ROWS, BLOCK_D] tile per iteration
    PREFETCH: tl.constexpr,                   # load the next tile before computing this one (see the loop)
    VECTOR: tl.constexpr = 0,                 # columns a thread moves together in every tensor (0: each its own)
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    wait_for_previous_kernel(PDL)
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    if VECTOR > 0:   # one layout for the tile's float32 and 16-bit tensors (see _shared_vector)
        cols = tl.max_contiguous(cols, VECTOR)
    col_mask = cols < n_features
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # This program's share of sum_rows(grad_normed * x_hat), in float32 however many rows it covers.
    grad_weight_acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)

    # int64 rows (the loop variable takes the type of its bounds): row * D may exceed 2^31.
    first_row = program.to(tl.int64) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    # A tile of rows per iteration rather than one row: many independent loads in flight per program. One row
    # at a time left the GPU waiting on memory latency: ~90 us per call at 16384 x 256 on an H100.
    if PREFETCH:
        # The next tile's loads are issued before this tile's arithmetic and stores, so they are in flight
        # while it computes: without this, each iteration waits a whole memory latency before it can start
        # (the compiler pipelines the loads that feed tl.dot, not these). The last prefetch lies past
        # last_row: fully masked, it reads nothing.
        h, grad_normed, grad_res, rstd, mask, offsets, h_offsets = _load_backward_tile(
            h_ptr, grad_normed_ptr, grad_new_residual_ptr, rstd_ptr, ids_ptr, first_row, last_row, n_features,
            n_table_rows, cols, col_mask, HAS_RESIDUAL_GRAD, TABLE_ROWS, BLOCK_ROWS)
        for block_start in range(first_row, last_row, BLOCK_ROWS):
            next_tile = _load_backward_tile(
                h_ptr, grad_normed_ptr, grad_new_residual_ptr, rstd_ptr, ids_ptr, block_start + BLOCK_ROWS,
                last_row, n_features, n_table_rows, cols, col_mask, HAS_RESIDUAL_GRAD, TABLE_ROWS, BLOCK_ROWS)
            grad_weight_acc = _backward_of_tile(
                h, grad_normed, grad_res, rstd, weight, mask, offsets, h_offsets, grad_h_ptr, grad_h_copy_ptr,
                grad_weight_acc, n_features, HAS_RESIDUAL_GRAD, WRITE_COPY, SCATTER)
            h, grad_normed, grad_res, rstd, mask, offsets, h_offsets = next_tile
    else:
        for block_start in range(first_row, last_row, BLOCK_ROWS):
            h, grad_normed, grad_res, rstd, mask, offsets, h_offsets = _load_backward_tile(
                h_ptr, grad_normed_ptr, grad_new_residual_ptr, rstd_ptr, ids_ptr, block_start, last_row,
                n_features, n_table_rows, cols, col_mask, HAS_RESIDUAL_GRAD, TABLE_ROWS, BLOCK_ROWS)
            grad_weight_acc = _backward_of_tile(
                h, grad_normed, grad_res, rstd, weight, mask, offsets, h_offsets, grad_h_ptr, grad_h_copy_ptr,
                grad_weight_acc, n_features, HAS_RESIDUAL_GRAD, WRITE_COPY, SCATTER)

    tl.store(partial_grad_weight_ptr + program * n_features + cols, tl.sum(grad_weight_acc, axis=0), mask=col_mask)

    # Level 1: the last program of this group to finish adds the group's partial sums.
    group = program // PROGRAMS_PER_GROUP
    first_in_group = group * PROGRAMS_PER_GROUP
    group_programs = tl.minimum(n_programs - first_in_group, PROGRAMS_PER_GROUP)
    if is_last_to_arrive(ticket_ptr + group, group_programs):
        if TWO_LEVELS:
            _sum_rows(partial_grad_weight_ptr, first_in_group, group_programs, group_sum_ptr + group * n_features,
                      n_features, BLOCK_D, BLOCK_P, L2_LOAD)
            # Level 2: the last group-summing program to finish adds the groups' sums.
            if is_last_to_arrive(ticket_ptr + n_groups, n_groups):
                _sum_rows(group_sum_ptr, 0, n_groups, grad_weight_ptr, n_features, BLOCK_D, BLOCK_P, L2_LOAD)
        else:
            _sum_rows(partial_grad_weight_ptr, 0, n_programs, grad_weight_ptr, n_features, BLOCK_D, BLOCK_P, L2_LOAD)


@triton.jit
def _load_backward_tile(h_ptr, grad_normed_ptr, grad_new_residual_ptr, rstd_ptr, ids_ptr, block_start, last_row,
                        n_features, n_table_rows, cols, col_mask, HAS_RESIDUAL_GRAD: tl.constexpr,
                        TABLE_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """The backward kernel's inputs for rows [block_start, block_start + BLOCK_ROWS) that lie before last_row,
    as loaded (h, grad_normed, grad_new_residual (grad_normed again without one), rstd), with the tile's mask,
    its offsets and those of its h rows (the table rows ids[r] with TABLE_ROWS)."""
    rows = block_start + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < last_row
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * n_features + cols[None, :]
    if TABLE_ROWS:
        ids = tl.load(ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        mask = mask & ((ids >= 0) & (ids < n_table_rows))[:, None]   # a bad id: its rows add nothing
        h_offsets = ids[:, None] * n_features + cols[None, :]
    else:
        h_offsets = offsets
    h = tl.load(h_ptr + h_offsets, mask=mask, other=0.0)
    grad_normed = tl.load(grad_normed_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL_GRAD:
        grad_res = tl.load(grad_new_residual_ptr + offsets, mask=mask, other=0.0)
    else:
        grad_res = grad_normed   # never read
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    return h, grad_normed, grad_res, rstd, mask, offsets, h_offsets


@triton.jit
def _backward_of_tile(h, grad_normed, grad_res, rstd, weight, mask, offsets, h_offsets, grad_h_ptr,
                      grad_h_copy_ptr, grad_weight_acc, n_features, HAS_RESIDUAL_GRAD: tl.constexpr,
                      WRITE_COPY: tl.constexpr, SCATTER: tl.constexpr):
    """grad_h of one loaded tile, stored (or added into the table's gradient with SCATTER); returns the
    program's running sum of grad_normed * x_hat with this tile's rows added."""
    h = h.to(tl.float32)
    grad_normed = grad_normed.to(tl.float32)
    x_hat = h * rstd[:, None]
    g = grad_normed * weight[None, :]
    # mean(g * x_hat) couples every feature of a row: this is why a program owns whole rows.
    grad_h = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_features)[:, None])
    if HAS_RESIDUAL_GRAD:
        grad_h += grad_res.to(tl.float32)
    if SCATTER:
        # The embedding's backward, here instead of in a kernel of its own that would read grad_h back.
        # "relaxed": the additions need to be atomic, not ordered with respect to other memory accesses.
        tl.atomic_add(grad_h_ptr + h_offsets, grad_h, mask=mask, sem="relaxed")
    else:
        tl.store(grad_h_ptr + offsets, grad_h.to(grad_h_ptr.dtype.element_ty), mask=mask)
    if WRITE_COPY:  # saves a separate cast kernel (one per norm and step) for a 16-bit sub-layer output
        tl.store(grad_h_copy_ptr + offsets, grad_h.to(grad_h_copy_ptr.dtype.element_ty), mask=mask)
    return grad_weight_acc + grad_normed * x_hat   # masked rows loaded zeros: they add nothing


@triton.jit
def is_last_to_arrive(ticket_ptr, n_arrivals):
    """True for the program that takes the last of n_arrivals tickets; that program resets the counter to 0,
    ready for the next launch. The counters are shared by every launch on the device, so two backward launches
    must never run at the same time: all of them run on the main stream, one after another.

    The atomic add (acquire-release, device scope) publishes everything this program stored before its ticket
    is counted, and lets the program holding the last ticket see what every other program stored. One thread
    performs it: the barrier first makes every thread's stores part of what it publishes.
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1)
    is_last = ticket == n_arrivals - 1
    if is_last:
        tl.store(ticket_ptr, 0)
    return is_last


@triton.jit
def _sum_rows(src_ptr, first, count, out_ptr, n_features, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
              L2_LOAD: tl.constexpr):
    """out[d] = sum of src[first : first + count, d] (src: [rows, D] float32), adding the rows in order: one pass
    over them, a [BLOCK_P, D] block of contiguous rows per load."""
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_features
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(first, first + count, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < first + count)[:, None] & col_mask[None, :]
        block = tl.load(src_ptr + rows[:, None] * n_features + cols[None, :], mask=mask, other=0.0,
                        cache_modifier=L2_LOAD)   # NVIDIA: from L2, where the other programs' stores are
        total += tl.sum(block, axis=0)
    tl.store(out_ptr + cols, total, mask=col_mask)


# ----------------------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------------------
def _new_output(shape, dtype, device):
    """Every buffer a kernel fills is allocated here (uninitialised: the kernel writes every element).

    A single allocation point lets the tests swap in NaN-filled buffers, so an element a kernel forgets to
    write shows up as NaN instead of as whatever memory happened to hold.
    """
    return torch.empty(shape, dtype=dtype, device=device)


def shape_problem(n_features: int) -> str | None:
    """Why the kernels cannot normalise rows of D = n_features (one line), or None when they can. The launchers
    raise it; version 4's check_arguments asks it about a model's width before anything is built."""
    if n_features > MAX_FEATURES:
        return f"add_rms_norm holds a whole row in one block; D={n_features} exceeds MAX_FEATURES={MAX_FEATURES}"
    return None


def _block_size(n_features):
    problem = shape_problem(n_features)
    if problem:
        raise ValueError(problem)
    return triton.next_power_of_2(n_features)


# In the interpreter (a CPU run), a tile of up to this many elements: few programs (see
# tinytransformer/triton_support.py, "Block sizes in the interpreter").
INTERPRETER_TILE_ELEMENTS = 16384


# Elements of a forward program's [rows, D] tile (at least one whole row).
FORWARD_TILE_ELEMENTS = 1024


def _forward_tile(block_d, n_rows):
    """(rows per program, warps) of the forward kernel: whole rows, about FORWARD_TILE_ELEMENTS per program.

    At D = 256, 4 rows and 4 warps per program instead of one row and one warp: each call alone took the same
    time on an H100 (16.7 vs 16.6 us at 16384 rows), but version 4's graph-captured step was faster, twice in
    alternation: batch 32 x seq 512 bfloat16 2052.0 / 2055.2 -> 2039.6 / 2039.0 us, seed size bfloat16
    477.4 -> 467.9 us, float32 634.0 -> 632.2 us.
    """
    if interpreter_active():
        if small_interpreter_blocks():
            return 4, 1   # kernel tests: several rows per program, and a partial last tile, exercised on the CPU
        return interpreter_block(n_rows, 1, max(1, INTERPRETER_TILE_ELEMENTS // block_d)), 1
    rows = max(1, FORWARD_TILE_ELEMENTS // block_d)
    return rows, num_warps_for(rows * block_d)


def _backward_tile(block_d, n_rows, device):
    """(rows per [rows, D] tile, warps) of the backward kernel.

    About 4096 elements per tile (16 rows at D = 256), so a tile stays in registers, and at most 4 warps for it
    (num_warps_for alone would give 16 for 16 x 256; the cap used to be 8). Measured on an H100 in version 4's
    graph-captured step (D = 256): 26.5 us per call against 32.7 us with 8 warps at N = 16384 rows (batch 32 x
    seq 512, bfloat16), 6.4 against 7.4 us at N = 1024 (the seed size, bfloat16). With fewer threads per
    program each thread keeps more loads of its rows in flight, and the column sums for grad_weight need fewer
    cross-warp steps.

    With more rows than the programs (see _backward_program_count) cover with one such tile each, tiles of half
    the rows with half the warps: on the H100 the batch-32 step took ~31 us less (9 calls at N = 16384, D = 256,
    i.e. 31 rows per program), while at the seed size (N = 1024, one tile per program) the same tiles made the
    step ~60 us slower. Only measured at D <= 256 (and on NVIDIA).

    Wide rows (from WIDE_FROM_FEATURES) take tiles of WIDE_TILE_ROWS rows up to 4,096 elements, and a warp per
    512 elements (16 per thread on NVIDIA), at most 8 warps. Timed for the kernel alone at 8,192 rows, bfloat16
    gradients, 2 programs per SM with the prefetch, on an H200 (benchmarks/results/kernel_time/
    h200_norm_backward_wide_rows.json): at 512 features 4 rows and 4 warps 25.2 us against 31.7 with 8 rows; at
    2,048 features 2 rows and 8 warps 96.8 us against 112.4 with 4 warps (the large preset's step 95.9 -> 95.2 ms);
    at 1,024 features 4 rows and 8 warps 49.0 us against 49.4 with 4. At 4,096 features this rule (one row, 8 warps)
    was the fastest of nine launches on an H200 at 8,192 rows: 142.4 us against 161.7 with 2 rows and 8 warps and
    176.1 with one row and 4 (h200_streaming_bandwidth.json). On AMD GPUs nothing was timed. A row wider than 4,096
    features is a tile of its own with 8 warps: 4 would give each thread too many elements (at D = 8192, N = 2048
    the kernel took 923 us with 4 warps against 162 us with 8, on an H100).
    """
    if interpreter_active():
        if small_interpreter_blocks():
            return 4, 1   # kernel tests: small tiles that still exercise the masking of a partial last tile
        return interpreter_block(n_rows, 1, max(1, INTERPRETER_TILE_ELEMENTS // block_d)), 1
    if block_d >= WIDE_FROM_FEATURES:
        rows = max(1, min(WIDE_TILE_ROWS, 4096 // block_d))
        # 512 elements a warp: 4 warps for 2,048, 8 for 4,096 elements and more (see the docstring).
        return rows, min(8, max(1, rows * block_d // 512))
    rows = max(1, min(16, 4096 // block_d))
    programs, _ = _backward_program_count(n_rows, rows, block_d, device)
    if n_rows > programs * rows:
        rows //= 2
        return rows, num_warps_for(rows * block_d, max_warps=2)
    return rows, num_warps_for(rows * block_d, max_warps=4)


def _backward_program_count(n_rows, block_rows, block_d, device):
    """A few programs per SM (compute unit), each owning a contiguous range of rows.

    Fewer programs than rows keeps the partial-sum buffer (and its summing) small; a few per SM keep
    enough loads in flight to stream at memory speed. How few: 4 per SM for rows of up to 256 features, 2 for
    wide rows (a block of 512 features or more: WIDE_FROM_FEATURES; 257 features already take one), where a
    longer range of rows per program streams better. Measured for the kernel alone at 8,192 rows
    (the medium and large presets' batch x sequence), bfloat16 gradients: on an H100 (132 SMs), every tile and
    warp count swept, at 2,048 features 131.5 us a call with 2 programs per SM against 152.6 us or more with 4
    (same tile and warps), at 1,024 features 69.4 against 71.6 us; on an H200 at 512 features 27.5 us against
    30.3 with 4 (8-row tiles, 4 warps, no prefetch; with 4-row tiles and the prefetch, 2 per SM took 25.2 us).
    The outputs matched. Rows of 256 features (the seed and tiny presets) were tuned with 4 in the graph-captured
    step and keep it. None of this was measured on an AMD GPU (the same rule applies there, per compute unit).
    """
    if is_gpu(device) and not interpreter_active():
        target = _programs_per_sm(block_d) * multiprocessor_count(device)
    elif small_interpreter_blocks():
        target = 4  # the interpreter runs programs one after another: a few are enough to test the loop
    else:
        target = 1  # a CPU run: one program walks all the tiles (the interpreter costs per program)
    target = min(target, triton.cdiv(n_rows, block_rows))
    rows_per_program = triton.cdiv(n_rows, target)
    return triton.cdiv(n_rows, rows_per_program), rows_per_program


def _partial_sums_per_load(largest_sum: int, block_d: int, num_warps: int) -> int:
    """Rows of partial sums ([BLOCK_P, D] float32) a summing program loads at once: SUM_ELEMENTS_PER_THREAD values
    a thread, and no more rows than the longest sum needs (a power of two, as tl.arange needs)."""
    fits = max(1, SUM_ELEMENTS_PER_THREAD * num_warps * threads_per_warp() // block_d)
    return min(triton.next_power_of_2(largest_sum), 1 << (fits.bit_length() - 1))


def _programs_per_sm(block_d: int) -> int:
    """Backward programs per SM (compute unit) on a GPU for rows of block_d features (see above)."""
    return 2 if block_d >= WIDE_FROM_FEATURES else 4


_TICKET_COUNTERS = {}


def _ticket_counters(device):
    """MAX_TICKETS int32 zeros per device, shared by all backward launches: each launch leaves them at zero.

    They are created on first use and then kept, so a CUDA/HIP graph captured later reuses the same memory.
    """
    if device not in _TICKET_COUNTERS:
        _TICKET_COUNTERS[device] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
    return _TICKET_COUNTERS[device]


def _as_rows(x, n_features):
    """[..., D] -> contiguous [N, D]: the kernels index rows as row * D."""
    return x.reshape(-1, n_features).contiguous()


def _rms_norm_forward(x, delta, weight, eps, stream_dtype, normed_dtype, ids=None):
    """Launch the forward kernel on rows x [N, D] (and delta [N, D] or None); with ids [N], on the rows
    x[ids] of a table x [V, D] instead (an embedding lookup, no delta).

    Returns (new_residual [N, D], or None for plain rows without delta, normed [N, D], rstd [N] float32).
    """
    gather = ids is not None
    n_rows, n_features = (ids.shape[0], x.shape[1]) if gather else x.shape
    has_delta = delta is not None
    writes_residual = has_delta or gather
    new_residual = _new_output((n_rows, n_features), stream_dtype, x.device) if writes_residual else None
    normed = _new_output((n_rows, n_features), normed_dtype, x.device)
    rstd = _new_output((n_rows,), torch.float32, x.device)
    if n_rows > 0:
        block_d = _block_size(n_features)
        block_rows, num_warps = _forward_tile(block_d, n_rows)
        # x stands in for the pointers a launch does not use: the kernel never touches them.
        _add_rms_norm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, delta if has_delta else x, weight, ids if gather else x, new_residual if writes_residual else x,
            normed, rstd, n_rows, n_features, x.shape[0], eps, HAS_DELTA=has_delta, GATHER=gather, BLOCK_D=block_d,
            BLOCK_ROWS=block_rows, num_warps=num_warps, **launch_options(x.device))
    return new_residual, normed, rstd


def _rms_norm_backward(h, weight, rstd, grad_normed, grad_new_residual, copy_dtype=None, ids=None, scatter=True):
    """Launch the backward kernel. Returns (grad_h [N, D] in h's dtype, the same in copy_dtype or None,
    grad_weight [D] float32).

    With ids [N] (h is then the table [V, D] whose rows ids were normalised), grad_h is instead added into the
    rows ids of a float32 [V, D] gradient of the table, which is returned in its place; with scatter=False as well,
    grad_h is the rows' gradient [N, D] in float32, for the caller to add into the table's gradient."""
    table_rows = ids is not None
    scatter = table_rows and scatter
    n_rows, n_features = (ids.shape[0], h.shape[1]) if table_rows else h.shape
    grad_normed = _as_rows(grad_normed, n_features)
    has_residual_grad = grad_new_residual is not None
    # Without a residual gradient, grad_normed stands in for the unused pointer.
    grad_res = _as_rows(grad_new_residual, n_features) if has_residual_grad else grad_normed
    if scatter:
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)   # the atomic additions' start
    else:
        grad_h = _new_output((n_rows, n_features), torch.float32 if table_rows else h.dtype, h.device)
    grad_h_copy = _new_output((n_rows, n_features), copy_dtype, h.device) if copy_dtype is not None else None
    if n_rows == 0:
        return grad_h, grad_h_copy, torch.zeros(n_features, dtype=torch.float32, device=h.device)

    block_d = _block_size(n_features)
    block_rows, num_warps = _backward_tile(block_d, n_rows, h.device)
    n_programs, rows_per_program = _backward_program_count(n_rows, block_rows, block_d, h.device)
    # One group up to ONE_GROUP_UP_TO programs (that constant as the group size, so that the kernel is compiled
    # once for all such counts), else groups of GROUP_SIZE.
    programs_per_group = ONE_GROUP_UP_TO if n_programs <= ONE_GROUP_UP_TO else GROUP_SIZE
    n_groups = triton.cdiv(n_programs, programs_per_group)
    if n_groups + 1 > MAX_TICKETS:
        raise ValueError(f"add_rms_norm backward: {n_programs} programs need {n_groups + 1} ticket counters, "
                         f"more than MAX_TICKETS={MAX_TICKETS}")
    partial_grad_weight = _new_output((n_programs, n_features), torch.float32, h.device)
    group_sums = _new_output((n_groups, n_features), torch.float32, h.device)
    grad_weight = _new_output((n_features,), torch.float32, h.device)
    largest_sum = max(min(programs_per_group, n_programs), n_groups)   # partial sums one program adds at most
    _add_rms_norm_backward_kernel[(n_programs,)](
        h, weight, rstd, grad_normed, grad_res, grad_h, ids if table_rows else rstd,
        grad_h if grad_h_copy is None else grad_h_copy, partial_grad_weight, group_sums, grad_weight,
        _ticket_counters(h.device), n_rows, n_features, h.shape[0], rows_per_program, n_programs, n_groups,
        HAS_RESIDUAL_GRAD=has_residual_grad, WRITE_COPY=grad_h_copy is not None, TABLE_ROWS=table_rows,
        SCATTER=scatter,
        PROGRAMS_PER_GROUP=programs_per_group, TWO_LEVELS=n_groups > 1,
        BLOCK_P=_partial_sums_per_load(largest_sum, block_d, num_warps),
        L2_LOAD="" if is_rocm() else ".cg",
        BLOCK_D=block_d, BLOCK_ROWS=block_rows, PREFETCH=_prefetches(block_d),
        VECTOR=_shared_vector(*(t.dtype for t in (h, grad_normed, grad_res, grad_h, grad_h_copy) if t is not None)),
        num_warps=num_warps, **launch_options(h.device))
    return grad_h, grad_h_copy, grad_weight


# ----------------------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------------------
class AddRMSNormFunction(torch.autograd.Function):
    """(residual, delta or None, weight [D], eps) -> (new_residual, normed), both shaped like residual."""

    @staticmethod
    def forward(ctx, residual, delta, weight, eps, normed_dtype):
        shape, n_features = residual.shape, residual.shape[-1]
        if weight.shape != (n_features,):
            raise ValueError(f"weight {tuple(weight.shape)} must be [{n_features}]")
        has_delta = delta is not None
        if has_delta and delta.shape != residual.shape:
            raise ValueError(f"delta {tuple(delta.shape)} must match residual {tuple(residual.shape)}")
        # new_residual follows PyTorch's type promotion, e.g. float32 stream + bfloat16 sub-layer output.
        stream_dtype = torch.result_type(residual, delta) if has_delta else residual.dtype
        x = _as_rows(residual, n_features)
        d = _as_rows(delta, n_features) if has_delta else None
        weight = weight.contiguous()
        new_residual, normed, rstd = _rms_norm_forward(x, d, weight, eps, stream_dtype, normed_dtype or stream_dtype)

        h = new_residual if has_delta else x
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_delta, ctx.shape = has_delta, shape
        ctx.dtypes = (residual.dtype, delta.dtype if has_delta else None)
        # A None gradient for new_residual (not used downstream) lets the kernel skip that load.
        ctx.set_materialize_grads(False)
        if has_delta:
            return new_residual.view(shape), normed.view(shape)
        # Returned unchanged: the caller's residual stream is the input itself (autograd makes it a view).
        return residual, normed.view(shape)

    @staticmethod
    def backward(ctx, grad_new_residual, grad_normed):
        h, weight, rstd = ctx.saved_tensors
        residual_dtype, delta_dtype = ctx.dtypes

        # delta in another dtype than the stream (a bf16 sub-layer output added to a float32 stream): the kernel
        # writes its gradient in that dtype too.
        copy_dtype = delta_dtype if ctx.has_delta and delta_dtype != h.dtype else None
        grad_h_copy = None
        if grad_normed is None:  # only the residual path was used: the norm contributes nothing
            grad_h, grad_weight = grad_new_residual, None
        else:
            grad_h, grad_h_copy, grad_weight = _rms_norm_backward(h, weight, rstd, grad_normed, grad_new_residual,
                                                                  copy_dtype)

        grad_residual = grad_delta = None
        if grad_h is not None:
            grad_h = grad_h.view(ctx.shape)
            grad_residual = grad_h.to(residual_dtype)
            if ctx.has_delta:
                # The very same tensor when the dtypes agree.
                grad_delta = grad_h.to(delta_dtype) if grad_h_copy is None else grad_h_copy.view(ctx.shape)
        if grad_weight is not None and ctx.needs_input_grad[2]:
            grad_weight = grad_weight.to(weight.dtype)
        else:
            grad_weight = None
        return grad_residual, grad_delta, grad_weight, None, None


class EmbeddingRMSNormFunction(torch.autograd.Function):
    """(input_ids [...], table [V, D] float32, weight [D], eps, normed_dtype) -> (table[input_ids], its RMSNorm).

    The embedding lookup and the first norm of the model in one kernel each way. Forward: the kernel reads the
    rows of the table (which at a small vocabulary stays in the GPU's cache) and writes the residual stream and
    the normalised rows; a separate lookup would write the rows and the norm read them back. Backward: the
    kernel reads the table rows again instead of a saved copy, and adds the gradient of each row straight into
    the table's gradient (atomic additions, as in kernels/embedding_backward.py) instead of writing it for an
    embedding backward kernel to read back.

    Under data parallel, `row_exchange` (a gradient_sync.EmbeddingRowExchange, or None) sums the table's
    gradient over the ranks by exchanging what it is made of: the forward pass starts gathering every rank's
    token ids; the backward kernel writes each row's gradient instead of adding it, the ranks gather those rows,
    and each rank adds all of them into its table's gradient (embedding_backward_in_order: in a fixed order, so
    that every rank gets the same bits and the ranks' weights stay equal). That is
    the sum of the ranks' table gradients, built from ranks x tokens rows instead of an all-reduce of the [V, D]
    table: at the medium preset on two GPUs 2 x 8,192 rows of 1,024 floats (67 MB gathered) instead of 32,000
    (131 MB all-reduced). The norm weight's gradient stays this rank's, for the usual all-reduce.
    """

    @staticmethod
    def forward(ctx, input_ids, table, weight, eps, normed_dtype, row_exchange=None):
        if table.dim() != 2:
            raise ValueError(f"table must be [V, D], got {tuple(table.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integers, got {input_ids.dtype}")
        if input_ids.device != table.device:
            raise ValueError(f"input_ids on {input_ids.device}, table on {table.device}: they must share a device")
        n_features = table.shape[1]
        if weight.shape != (n_features,):
            raise ValueError(f"weight {tuple(weight.shape)} must be [{n_features}]")
        ids = input_ids.reshape(-1).contiguous()
        table, weight = table.contiguous(), weight.contiguous()
        h, normed, rstd = _rms_norm_forward(table, None, weight, eps, table.dtype, normed_dtype or table.dtype,
                                            ids=ids)
        ctx.save_for_backward(ids, table, weight, rstd)
        ctx.set_materialize_grads(False)
        # Every rank's ids, gathered while the rest of the forward and the backward pass run.
        ctx.row_exchange = row_exchange
        ctx.ids_gathering = row_exchange.start(ids) if row_exchange is not None else None
        shape = (*input_ids.shape, n_features)
        return h.view(shape), normed.view(shape)

    @staticmethod
    def backward(ctx, grad_h, grad_normed):
        ids, table, weight, rstd = ctx.saved_tensors
        exchange, grad_weight = ctx.row_exchange, None
        if grad_h is None and grad_normed is None:
            if exchange is not None:
                ctx.ids_gathering.wait()   # a captured graph must not leave a collective it started unwaited
            return None, None, None, None, None, None
        if grad_normed is not None and exchange is None:   # the usual case: each row's gradient added in place
            grad_table, _, grad_weight = _rms_norm_backward(table, weight, rstd, grad_normed, grad_h, ids=ids)
        else:
            if grad_normed is None:   # only the looked-up rows were used: grad_h is their gradient
                rows = grad_h.reshape(-1, table.shape[1])
            else:
                rows, _, grad_weight = _rms_norm_backward(table, weight, rstd, grad_normed, grad_h, ids=ids,
                                                          scatter=False)
            if exchange is None:
                grad_table = embedding_backward(ids, rows, table.shape[0])
            else:   # every rank's ids and rows, added in an order that does not vary (the same bits on every rank)
                rows_gathering = exchange.start(rows)
                # While the rows travel: the table's gradient zeroed, and every rank's ids sorted.
                grad_table = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
                ordered_ids = token_order(ctx.ids_gathering.wait())
                grad_table = embedding_backward_in_order(ordered_ids, rows_gathering.wait(), table.shape[0],
                                                         out=grad_table)
        grad_table = grad_table if ctx.needs_input_grad[1] else None
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None and ctx.needs_input_grad[2] else None
        return None, grad_table, grad_weight, None, None, None


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------
def add_rms_norm(residual, delta, weight, eps=1e-6, normed_dtype=None):
    """Fused `h = residual + delta; normed = RMSNorm(h) * weight`. Returns (new_residual, normed).

    residual: [..., D] (D <= 8192); delta: same shape as residual, or None for a plain RMSNorm, in which case
    `new_residual` is `residual` itself. weight: [D]. Statistics in float32; new_residual takes the promoted
    dtype of residual and delta, normed that dtype too unless `normed_dtype` is given (under autocast, the
    GEMM that reads `normed` wants the 16-bit dtype: writing it directly saves a cast kernel each way).
    """
    return AddRMSNormFunction.apply(residual, delta, weight, eps, normed_dtype)


def rms_norm(x, weight, eps=1e-6):
    """Plain RMSNorm through the same kernels: `add_rms_norm(x, None, weight, eps)[1]`."""
    return add_rms_norm(x, None, weight, eps)[1]


def embedding_rms_norm(input_ids, table, weight, eps=1e-6, normed_dtype=None, row_exchange=None):
    """Fused `h = table[input_ids]; normed = RMSNorm(h) * weight`. Returns (h, normed), both [..., D].

    table: [V, D] (an embedding weight; D <= 8192), weight: [D]. The same function as `embedding_lookup` followed
    by `add_rms_norm(h, None, weight, eps, normed_dtype)`, in one kernel each way. The table's gradient comes from
    atomic additions, so it needs a float32 table: other dtypes take the two separate ops (and no row_exchange,
    with which the table's gradient comes out summed over the ranks: see EmbeddingRMSNormFunction).
    """
    if table.dtype != torch.float32:
        if row_exchange is not None:
            raise ValueError(f"a row exchange needs a float32 table, got {table.dtype}")
        h = embedding_lookup(input_ids, table)
        return h, add_rms_norm(h, None, weight, eps, normed_dtype)[1]
    return EmbeddingRMSNormFunction.apply(input_ids, table, weight, eps, normed_dtype, row_exchange)
