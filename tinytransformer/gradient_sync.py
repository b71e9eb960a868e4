"""Gradient averaging for a training step that does its own data-parallel communication (no DDP wrapper).

Why a step would. DistributedDataParallel starts its all-reduces from gradient hooks that autograd calls as each
gradient is accumulated. Version 4's graph-captured step computes the projections' weight gradients on a second
stream and writes `weight.grad` itself (WeightGradientStream in version4_triton_ultra/backward_overlap.py), so
autograd never sees those gradients and DDP's hooks would never fire for them; and DDP's Python-side bookkeeping
(buckets, the "ready" counts of each backward pass) is host logic that a replayed CUDA/HIP graph would skip. So
that step averages the gradients itself, with plain all-reduces that the graph captures like any other kernel:
a synchronous `dist.all_reduce` on the current stream. PyTorch's NCCL process group (RCCL on ROCm) runs it on a
stream of its own (a high-priority one: distributed.nccl_options), ordered after the current stream and back with
events, and stream capture records those events, so the collective becomes a node of the graph and runs again at
every replay.

Why the loss is scaled instead of the gradients divided. The average gradient over N ranks is
sum_r grad_r / N. The step multiplies its loss by `loss_scale` = 1/N before backward, so each rank's gradients
come out already divided by N, and a SUM all-reduce yields the average: no extra pass over every gradient after
the all-reduce. At world size 1 the scale is exactly 1 and an in-place SUM over one rank leaves every value as
it was, so `torchrun --nproc-per-node 1` trains bit-for-bit like a single process (with float32 sums) while
paying for the communication path (what a scaling measurement needs as its first point).

Every rank must issue the same all-reduces in the same order (a collective matches calls by order), so
`sum_` walks the parameters in the order given (the model's, identical on every rank) and skips exactly those
without a gradient (the same ones on every rank: the same model, the same step). The weights need no broadcast
at the start: every rank builds them from the same seed or loads the same checkpoint (DDP would broadcast rank
0's; here they are equal already).

Summing in bfloat16 (--grad-reduce-dtype bfloat16). Each gradient (or run of adjacent ones) is cast into a
bfloat16 buffer, the buffer is all-reduced, and the sum is written back into the float32 gradients: half the bytes
on the wire and in NCCL's kernels, which share the GPU with the backward pass they overlap, for one rounding of
each sum to bfloat16 and two element-wise passes. Under graph capture the buffers come from the graph's memory pool and are reused at every
replay.

Works with gloo on the CPU too (the tests use it); there nothing is captured.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


class GradientAllReduce:
    """Averages gradients over the ranks of a data-parallel run: scale the loss by `loss_scale` before backward,
    then `sum_` the parameters' gradients.

    Small gradients travel together. A collective costs a fixed few microseconds however few bytes it moves
    (a launch, a handshake between the ranks), and the collectives of a rank run one after another on the process
    group's stream. A model's norm weights are one row each (1,024 values at the medium preset, 25 of them), so
    summing each on its own queues 25 collectives that move almost nothing. Gradients of fewer than
    `SMALL_GRADIENT_ELEMENTS` values are therefore copied into one buffer, summed with one all-reduce and copied
    back; a larger gradient is summed on its own (in place, or in its bfloat16 copy with --grad-reduce-dtype
    bfloat16): a copy of it into a shared buffer would cost more than its collective's fixed cost. Unless it
    already shares one: consecutive large gradients that lie one after another in one block of memory (`adjacent`:
    version 4's step writes each layer's projection gradients into one buffer of that layer) are summed by one
    collective over a view covering them, as DDP's buckets are: one collective per layer instead of four.
    """

    SMALL_GRADIENT_ELEMENTS = 1 << 16

    def __init__(self, context):
        if not context.enabled:
            raise ValueError("GradientAllReduce needs a data-parallel run (a process group)")
        self.context = context
        self.loss_scale = 1.0 / context.world_size
        self.reduce_dtype = getattr(torch, context.grad_reduce_dtype)

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def sum_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over the ranks, in place, on the current stream."""
        for grads in self._wire_groups(params):
            buffer = self._wire_buffer(grads)
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            self._write_back(buffer, grads)

    def _wire_groups(self, params: Iterable[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
        """The gradients of `params` grouped by collective: the small ones together (first), then the large ones
        in the order given (the same on every rank, as collectives must be), each alone or, where consecutive
        ones lie next to each other in one buffer (adjacent), with its neighbours."""
        grads = [param.grad for param in params if param.grad is not None]
        small = [grad for grad in grads if grad.numel() < self.SMALL_GRADIENT_ELEMENTS]
        runs = []
        for grad in (grad for grad in grads if grad.numel() >= self.SMALL_GRADIENT_ELEMENTS):
            if runs and adjacent(runs[-1][-1], grad):
                runs[-1].append(grad)
            else:
                runs.append([grad])
        return ([small] if small else []) + runs

    def _wire_buffer(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """What is all-reduced for `grads`: a lone gradient itself, or one view over adjacent ones, or their copy
        in the reduce dtype; or several scattered ones copied into one flat buffer."""
        if len(grads) == 1 or adjacent(*grads):
            covering = grads[0] if len(grads) == 1 else one_view(grads)
            return covering.to(self.reduce_dtype)   # the gradients themselves when they have that dtype already
        return torch.cat([grad.reshape(-1).to(self.reduce_dtype) for grad in grads])

    @staticmethod
    def _write_back(buffer: torch.Tensor, grads: list[torch.Tensor]) -> None:
        if buffer.data_ptr() == grads[0].data_ptr() and buffer.dtype == grads[0].dtype:
            return   # summed in place: the buffer is the gradients' own memory
        if len(grads) == 1:
            grads[0].copy_(buffer)
        elif adjacent(*grads):
            one_view(grads).copy_(buffer)
        else:
            sums = buffer.split([grad.numel() for grad in grads])
            torch._foreach_copy_(grads, [piece.view_as(grad) for piece, grad in zip(sums, grads)])
        if buffer.is_cuda:
            # start_sum may have made the buffer on another stream (the weight-gradient stream): the caching
            # allocator must know this stream reads it too, or it could reuse the memory before the copy ran.
            buffer.record_stream(torch.cuda.current_stream(buffer.device))

    def start_sum(self, params: Iterable[torch.nn.Parameter]) -> list:
        """Start the same all-reduces without waiting for them, and return their handles for `finish`.

        On a GPU the collectives run on the process group's own stream, ordered after what the current stream
        has queued so far; the current stream goes on at once. So a step can start a layer's all-reduces as
        soon as the backward pass has produced that layer's gradients, and let them run while it computes the
        gradients of the layers below (version 4's graph-captured step does). With gloo (CPU) they run on
        a thread of their own."""
        started = []
        for grads in self._wire_groups(params):
            buffer = self._wire_buffer(grads)
            started.append((dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True), buffer, grads))
        return started

    @classmethod
    def finish(cls, handles: list) -> None:
        """Wait for all-reduces `start_sum` started (writing a copied sum back into its gradients), and empty the
        list: on a GPU, the current stream waits for them (the host does not); with gloo, the host waits."""
        for work, buffer, grads in handles:
            work.wait()
            cls._write_back(buffer, grads)
        handles.clear()

    def row_exchange(self) -> "EmbeddingRowExchange":
        """An EmbeddingRowExchange over the same ranks, sending in the same dtype: for a step that sums its
        embedding's gradient by exchanging rows (see rows_cheaper_than_table)."""
        return EmbeddingRowExchange(self.context, self.reduce_dtype)

    def describe(self, where: str) -> str:
        """For the run's header, e.g. 'gradients averaged in v4's own step (all-reduce, no DDP wrapper) over 2
        rank(s) (nccl)'."""
        summed_in = "" if self.reduce_dtype == torch.float32 else f", summed in {self.context.grad_reduce_dtype}"
        return (f"gradients averaged in {where} (all-reduce, no DDP wrapper) over {self.context.world_size} "
                f"rank(s) ({self.context.backend_label}){summed_in}")


def adjacent(*tensors: torch.Tensor) -> bool:
    """Whether these contiguous tensors of one dtype lie one after another in one block of memory (gradients
    written into one flat buffer: GraphedStep's layer buffers), so that one view covers them all."""
    return all(a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and a.device == b.device
               and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
               and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
               for a, b in zip(tensors, tensors[1:]))


def one_view(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat view over adjacent tensors (see adjacent)."""
    first = tensors[0]
    return first.as_strided((sum(t.numel() for t in tensors),), (1,), first.storage_offset())


# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; older torch has only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rows_cheaper_than_table(world_size: int, tokens_per_rank: int, vocab_size: int) -> bool:
    """Whether an embedding table's gradient is better summed over the ranks by gathering the rows it is made of
    (EmbeddingRowExchange) than by all-reducing the table.

    The table's gradient is the sum of one row of gradient per token, added into the row of its id. An all-reduce
    of the [V, D] table moves about 2 (W-1)/W x V x D values per rank (ring); gathering every rank's rows moves
    (W-1) x T x D, after which each rank adds all W x T rows itself. So the rows cost less on the wire while
    W x T < 2 V; this rule asks W x T <= V, which also keeps the added work (W x T rows read and added) within
    one pass over the table. One rank has nothing to exchange."""
    return world_size > 1 and world_size * tokens_per_rank <= vocab_size


class EmbeddingRowExchange:
    """Sums an embedding table's gradient over the ranks without all-reducing the table: every rank gathers
    every rank's token ids and their rows of gradient, and adds them all into its own table's gradient (the
    model's embedding backward does, see EmbeddingRMSNormFunction in version 4's kernels/add_rmsnorm.py), in an
    order that does not vary, so that every rank gets the same bits (embedding_backward_in_order).

    `start(ids)` in the forward pass starts gathering the ids (they travel while the forward and backward passes
    run); `start(rows)` in the backward pass the rows of gradient [T, D], in the reduce dtype on the wire. Each
    returns a Gathering, whose wait() gives every rank's tensor in rank order ([W T] ids, [W T, D] rows in the
    dtype given): the current stream waits, not the host, so it can zero the table's gradient and sort the ids
    while the rows travel. As with the all-reduces, the loss was scaled by 1/W, so the sum of every rank's rows
    is the average gradient. Works with gloo on the CPU too.
    """

    def __init__(self, context, reduce_dtype: torch.dtype = torch.float32):
        self.world_size = context.world_size
        self.reduce_dtype = reduce_dtype

    def start(self, tensor: torch.Tensor) -> "Gathering":
        sent = (tensor.to(self.reduce_dtype) if tensor.is_floating_point() else tensor).contiguous()
        everyone = sent.new_empty((self.world_size * sent.shape[0], *sent.shape[1:]))
        work = _all_gather_single(everyone, sent, async_op=True)
        return Gathering(work, sent, everyone, tensor.dtype)


class Gathering:
    """An all-gather in flight (EmbeddingRowExchange.start). It holds what is sent until the gather is done."""

    def __init__(self, work, sent: torch.Tensor, everyone: torch.Tensor, dtype: torch.dtype):
        self.work, self.sent, self.everyone, self.dtype = work, sent, everyone, dtype

    def wait(self) -> torch.Tensor:
        """Every rank's tensor, once the current stream has waited for the gather (with gloo, the host waits)."""
        self.work.wait()
        return self.everyone.to(self.dtype)
