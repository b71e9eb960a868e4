"""Gradient of a token-embedding lookup: a scatter-add of the output gradient's rows, in one Triton kernel.

The forward pass of an embedding copies row input_ids[t] of the weight [V, D] to output row t. Its backward
pass adds output-gradient row t into row input_ids[t] of the weight gradient; a token that occurs n times
receives n rows. Two ways to compute that sum:

  * sort the token ids, then add each run of equal ids in a fixed order (PyTorch's embedding backward):
    deterministic, but the sort is the expensive part;
  * add every row straight into its place with atomic additions (this kernel): no sort, every row read once.
    The order in which the additions of one vocabulary row land depends on the GPU's scheduling, so the
    result may differ from run to run in the last bits of float32 (never more than rounding).

PyTorch's `index_add_` adds with atomics too, but goes element by element; this kernel gives each program a
tile of BLOCK_T token rows x the whole row width: wide, coalesced loads of the gradient rows and one atomic add
per element, all independent. In version 4's graphed step at batch 32 x seq 512 (16384 tokens, D = 256) on an
H100, `index_add_` took 28.8 us per step; `python run_kernel_benchmarks.py --kernel embedding` times this kernel
against PyTorch's sort-based backward.

The ranks of a data-parallel run that each add the same gathered rows (the embedding's row exchange) must get
the same bits, which atomics do not promise: `embedding_backward_in_order` sorts the ids (stably) and lets the
first position of each run of equal ids add the run's rows in that order, one program per position, no atomics.

`embedding_lookup(input_ids, weight)` is a differentiable lookup whose forward pass is PyTorch's row gather and
whose backward pass is this kernel. Version 4's model uses the same atomic additions inside the backward kernel of
its first norm (`embedding_rms_norm` in add_rmsnorm.py), which reads the lookup's gradient from registers instead
of from memory; `embedding_lookup` remains its path for a 16-bit table, and the benchmark's subject.
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import interpreter_active, is_gpu
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel

# A program's tile holds about this many elements (BLOCK_T rows x the row width), enough loads in flight per
# program without spilling registers.
TILE_ELEMENTS = 4096


@triton.jit
def _embedding_backward_kernel(
    ids_ptr,            # [T] int64: the token id of each gradient row
    grad_output_ptr,    # [T, D] float32, contiguous
    grad_weight_ptr,    # [V, D] float32, zero on entry; row ids[t] receives row t of grad_output
    n_tokens, n_features, vocab_size,
    BLOCK_T: tl.constexpr,   # token rows per program
    BLOCK_D: tl.constexpr,   # power of two >= n_features
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_tokens
    mask = row_mask[:, None] & (cols < n_features)[None, :]
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=0)
    mask = mask & ((ids >= 0) & (ids < vocab_size))[:, None]   # an id outside the table adds nothing
    # int64 offsets: T * D (and V * D) may exceed 2^31 elements.
    grad = tl.load(grad_output_ptr + rows.to(tl.int64)[:, None] * n_features + cols[None, :], mask=mask,
                   other=0.0)
    # "relaxed": the additions need to be atomic, not ordered with respect to any other memory access.
    tl.atomic_add(grad_weight_ptr + ids.to(tl.int64)[:, None] * n_features + cols[None, :], grad, mask=mask,
                  sem="relaxed")


@triton.jit
def _embedding_backward_in_order_kernel(
    sorted_ids_ptr,     # [T] int64: the token ids, sorted (stably: equal ids keep their order)
    order_ptr,          # [T] int64: the gradient row of each sorted position
    grad_output_ptr,    # [T, D] float32, contiguous
    grad_weight_ptr,    # [V, D] float32, zero on entry; each row looked up is written once
    n_tokens, n_features, vocab_size,
    BLOCK_D: tl.constexpr,   # power of two >= n_features
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    wait_for_previous_kernel(PDL)
    # One program per sorted position. The first position of each run of equal ids adds the run's rows one
    # after another, in sorted order, and stores the sum: no atomics, so the same bits on every run.
    position = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_features
    token = tl.load(sorted_ids_ptr + position)
    previous = tl.load(sorted_ids_ptr + position - 1, mask=position > 0, other=-1)
    starts_a_run = (position == 0) | (previous != token)
    if starts_a_run & (token >= 0) & (token < vocab_size):   # an id outside the table adds nothing
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        next_token = token
        while next_token == token:
            row = tl.load(order_ptr + position).to(tl.int64)
            total += tl.load(grad_output_ptr + row * n_features + cols, mask=col_mask, other=0.0)
            position += 1
            next_token = tl.load(sorted_ids_ptr + position, mask=position < n_tokens, other=-1)
        tl.store(grad_weight_ptr + token.to(tl.int64) * n_features + cols, total, mask=col_mask)


def _rows_and_output(input_ids, grad_output, vocab_size, out):
    """The ids [T] and gradient rows [T, D] of an embedding backward, and the zeroed [V, D] gradient to add into
    (`out` if given: zeroed earlier by the caller, where it had something to overlap the fill with)."""
    n_features = grad_output.shape[-1]
    ids = input_ids.reshape(-1)
    grad_rows = grad_output.reshape(-1, n_features)
    if ids.shape[0] != grad_rows.shape[0]:
        raise ValueError(f"{ids.shape[0]} token ids for {grad_rows.shape[0]} gradient rows")
    if out is None:
        out = torch.zeros(vocab_size, n_features, dtype=grad_output.dtype, device=grad_output.device)
    elif out.shape != (vocab_size, n_features) or out.dtype != grad_output.dtype:
        raise ValueError(f"out must be [{vocab_size}, {n_features}] {grad_output.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return ids, grad_rows, out


def _runs_in_triton(grad_output: torch.Tensor) -> bool:
    return grad_output.dtype == torch.float32 and (is_gpu(grad_output.device) or interpreter_active())


def embedding_backward(input_ids: torch.Tensor, grad_output: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The gradient [vocab_size, D] of an embedding weight, from input_ids [...] and grad_output [..., D].

    float32 gradients go through the Triton kernel above (the model's embedding weight is float32); other
    dtypes through `index_add_`, since atomic additions of 16-bit values are not available on every GPU.
    """
    ids, grad_rows, grad_weight = _rows_and_output(input_ids, grad_output, vocab_size, None)
    if not _runs_in_triton(grad_output):
        return grad_weight.index_add_(0, ids, grad_rows)
    if ids.shape[0] == 0:
        return grad_weight
    n_features = grad_rows.shape[1]
    block_d = triton.next_power_of_2(n_features)
    block_t = max(1, min(16, TILE_ELEMENTS // block_d))
    _embedding_backward_kernel[(triton.cdiv(ids.shape[0], block_t),)](
        ids.contiguous(), grad_rows.contiguous(), grad_weight, ids.shape[0], n_features, vocab_size,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4, **launch_options(grad_weight.device))
    return grad_weight


def token_order(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ids sorted, the position each sorted id came from): a stable sort, so equal ids keep their order. The
    first half of embedding_backward_in_order, on its own so that a caller can sort while the rows are still
    arriving (the data-parallel row exchange)."""
    return torch.sort(input_ids.reshape(-1), stable=True)


def embedding_backward_in_order(ordered_ids: tuple[torch.Tensor, torch.Tensor], grad_output: torch.Tensor,
                                vocab_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """embedding_backward, with the same bits on every run: each row of the gradient is the sum of its tokens'
    rows added one after another in the order they come. `ordered_ids`: token_order(input_ids).

    Data parallel needs this where every rank adds the same rows itself (the embedding's row exchange,
    EmbeddingRMSNormFunction in add_rmsnorm.py): atomic additions land in an order that varies from run to run,
    so the ranks' gradients, and then their weights, would drift apart in the last bits. One program per sorted
    position; the first of each run of equal ids reads the run's rows once. On the CPU without Triton's
    interpreter this is `index_add_` in sorted order; so are other dtypes (in order on the CPU only: the
    data-parallel exchange sends float32 rows).
    """
    sorted_ids, order = ordered_ids
    _, grad_rows, grad_weight = _rows_and_output(sorted_ids, grad_output, vocab_size, out)
    if not _runs_in_triton(grad_output):
        return grad_weight.index_add_(0, sorted_ids, grad_rows[order])
    if sorted_ids.shape[0] == 0:
        return grad_weight
    _embedding_backward_in_order_kernel[(sorted_ids.shape[0],)](
        sorted_ids, order, grad_rows.contiguous(), grad_weight, sorted_ids.shape[0], grad_rows.shape[1],
        vocab_size, BLOCK_D=triton.next_power_of_2(grad_rows.shape[1]), num_warps=4,
        **launch_options(grad_weight.device))
    return grad_weight


class EmbeddingLookup(torch.autograd.Function):
    """weight[input_ids], whose backward is embedding_backward (one zero fill and one Triton kernel)."""

    @staticmethod
    def forward(ctx, input_ids, weight):
        ctx.save_for_backward(input_ids)
        ctx.vocab_size = weight.shape[0]
        return weight[input_ids]

    @staticmethod
    def backward(ctx, grad_output):
        (input_ids,) = ctx.saved_tensors
        return None, embedding_backward(input_ids, grad_output, ctx.vocab_size)


def embedding_lookup(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(input_ids, weight) (no padding index, no max_norm) with the scatter-add backward above."""
    return EmbeddingLookup.apply(input_ids, weight)
