"""Version 4's backward pass beside itself: the weight-gradient GEMMs on a second stream, and the optimizer's
early update launched from inside the backward pass (item 9 of tiny_llama_v4.py's docstring).

    WeightGradientStream    the second stream: queues each projection's weight-gradient GEMM there and joins it
    weight_gradient         a projection's weight gradient: returned to autograd (float32), or queued on the stream
    ProjectionMatmul        y = x @ W^T for the model's Projection (16-bit weight copy under autocast), whose
                            backward computes the weight gradient with weight_gradient
    CallDuringBackward      identity in the forward pass; calls back once the backward pass reaches it

The graph-captured step (graphed_step.py) switches the stream on and makes the early update; the model
(tiny_llama_v4.py) and its fused layers (fused_layers.py) hand their weight gradients to weight_gradient.
"""
import torch

from version4_triton_ultra.kernels.adamw import SIXTEEN_BIT_GRADIENT_DTYPES
from version4_triton_ultra.kernels.linear_cross_entropy import accumulate_matmul, matmul_to_float32
from version4_triton_ultra.kernels.sixteen_bit_gradients import refuse_two_gradients


class WeightGradientStream:
    """Runs the weight-gradient GEMMs of the backward pass on a second stream, beside the critical path.

    In the backward pass of y = x @ W^T, grad_x = grad_y @ W feeds the next backward operation, but
    grad_W = grad_y^T @ x is only read by the optimizer, after the whole backward pass. At this model size one
    GEMM occupies a fraction of the GPU's SMs, so the weight GEMMs can run at the same time as the chain of
    input-gradient GEMMs, norms and attention backwards instead of after each of them. Each projection's
    backward queues its weight GEMM here (writing the gradient itself and handing autograd no weight gradient);
    `join()`, which the training step calls after loss.backward() (under data parallel, after the main stream's
    own updates), makes the main stream wait for all of them before it reads their gradients or ends the step:
    until then the queued GEMMs' operands are held. (So it serves a plain loss.backward() of the whole model:
    `backward(inputs=...)` and `torch.autograd.grad` would not see these gradients.)

    16-bit gradients: given a dict `sixteen_bit_gradients` (the model's), a GEMM of 16-bit operands (under
    autocast) writes the weight's first gradient of a step in their dtype, into the dict, instead of float32 into
    weight.grad. That is the gradient that autocast's own backward gives a float32 weight (the 16-bit product, widened
    later), and the optimizer reads it as it is (TritonAdamW, kernels/adamw.py): 2 bytes a weight fewer written
    here and read there. A second backward pass before the optimizer step continues in float32: the 16-bit
    gradient is widened into weight.grad and the GEMM adds to it.

    Memory: a queued GEMM's operands (grad_y and x) must live until it has run. They are kept here, and once
    more than `max_pending` GEMMs are queued the main stream waits for the oldest one and lets its operands go,
    so at most about one layer's operands are held (the oldest GEMM has usually finished by then anyway).

    Used by the graph-captured step (a CUDA/HIP graph records both streams and the events between them). Not
    with the DDP wrapper: DDP starts its all-reduces from autograd's gradient hooks, which this bypasses; under
    torchrun the graph-captured step averages the gradients itself (tinytransformer/gradient_sync.py).
    """

    def __init__(self, device: torch.device, max_pending: int = 4, sixteen_bit_gradients=None):
        self.stream = torch.cuda.Stream(device)
        self.max_pending = max_pending
        self.pending = []   # (event after the GEMM, the tensors it reads), oldest first
        # {weight: its 16-bit gradient} to write into under autocast, or None: float32, into weight.grad.
        self.sixteen_bit_gradients = sixteen_bit_gradients
        # id(weight) -> the tensor its gradient is written into when it has none yet (a dict, or anything with
        # its pop: graphed_step.LayerGradientBuffers under data parallel); a weight not in it gets its own.
        self.gradient_slots = {}

    def queue(self, weight: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
        """weight's gradient (+)= grad_y^T @ x on the side stream; grad_y: [rows, out], x: [rows, in]. Written into
        weight.grad in float32, or into sixteen_bit_gradients[weight] (see the class docstring)."""
        if weight.dtype != torch.float32 or (weight.grad is not None and weight.grad.dtype != torch.float32):
            raise ValueError("the weight-gradient stream writes the gradients of float32 weights, into float32 .grad")
        main = torch.cuda.current_stream(weight.device)
        sixteen_bit = self.sixteen_bit_gradients
        earlier_16_bit = sixteen_bit.pop(weight, None) if sixteen_bit is not None else None
        refuse_two_gradients(weight, earlier_16_bit)
        first = weight.grad is None and earlier_16_bit is None   # else a second backward: accumulate
        in_16_bits = (first and sixteen_bit is not None and grad_y.dtype in SIXTEEN_BIT_GRADIENT_DTYPES
                      and x.dtype == grad_y.dtype)
        # Gradients are allocated on the main stream, which reads them (the optimizer) and frees them (zero_grad).
        if in_16_bits:
            sixteen_bit[weight] = torch.empty_like(weight, dtype=grad_y.dtype)
        elif weight.grad is None:
            slot = self.gradient_slots.pop(id(weight), None)
            weight.grad = slot if slot is not None else torch.empty_like(weight)
        self.stream.wait_stream(main)   # grad_y and x are produced on the main stream
        with torch.cuda.stream(self.stream):
            if in_16_bits:
                torch.mm(grad_y.T, x, out=sixteen_bit[weight])
            elif first:
                matmul_to_float32(grad_y.T, x, out=weight.grad)
            else:
                if earlier_16_bit is not None:   # widened first: the sum of two backward passes in float32
                    weight.grad.copy_(earlier_16_bit)
                accumulate_matmul(weight.grad, grad_y.T, x)
            done = torch.cuda.Event()
            done.record()
        self.pending.append((done, (grad_y, x, earlier_16_bit)))
        while len(self.pending) > self.max_pending:
            oldest_done, oldest_operands = self.pending.pop(0)
            main.wait_event(oldest_done)
            del oldest_operands   # only now: later main-stream work may reuse their memory

    def run_after_queued(self, work) -> None:
        """Call work() on the side stream, ordered after every GEMM queued so far and after everything the main
        stream has done so far (the optimizer's updates during the backward pass: GraphedStep._update_layer)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            work()

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.pending.clear()   # safe now: later work on the main stream is ordered after the side stream's


class CallDuringBackward(torch.autograd.Function):
    """Identity on (h, normed) in the forward pass; in the backward pass, calls `callback()` once the gradients
    of both have arrived, i.e. once the backward of everything after this point in the forward pass has been
    launched (queued on the GPU, not necessarily finished: the callback must order its own work after it, as
    WeightGradientStream.run_after_queued does)."""

    @staticmethod
    def forward(ctx, callback, h, normed):
        ctx.callback = callback
        return h.view_as(h), normed.view_as(normed)

    @staticmethod
    def backward(ctx, grad_h, grad_normed):
        ctx.callback()
        return None, grad_h, grad_normed


class ProjectionMatmul(torch.autograd.Function):
    """y = x @ gemm_weight^T, where gemm_weight is either the float32 `weight` itself or a 16-bit copy of it
    made before the forward pass (under autocast).

    Backward: grad_x = grad_y @ gemm_weight (16-bit under autocast, as autocast would do), and the weight
    gradient from the same operands straight into float32, as the gradient of the float32 `weight` (the
    optimizer's master copy): returned to autograd, or, with a WeightGradientStream, queued on its stream (which
    may write it in the 16-bit dtype instead: WeightGradientStream's docstring).
    """

    @staticmethod
    def forward(ctx, x, weight, gemm_weight, weight_grad_stream):
        x = x.to(gemm_weight.dtype)
        ctx.save_for_backward(x, gemm_weight)
        ctx.weight, ctx.weight_grad_stream = weight, weight_grad_stream
        return x @ gemm_weight.T

    @staticmethod
    def backward(ctx, grad_y):
        x, gemm_weight = ctx.saved_tensors
        grad_x = grad_y @ gemm_weight if ctx.needs_input_grad[0] else None   # first: the critical path
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient(ctx.weight, grad_y.reshape(-1, grad_y.shape[-1]),
                                          x.reshape(-1, x.shape[-1]), ctx.weight_grad_stream)
        return grad_x, grad_weight, None, None


def weight_gradient(weight, grad_y_rows, x_rows, weight_grad_stream):
    """The float32 gradient grad_y^T @ x of a projection's weight, returned to autograd; or, with a
    WeightGradientStream, queued on its stream (it writes the gradient itself) and None returned."""
    if weight_grad_stream is None:
        return matmul_to_float32(grad_y_rows.T, x_rows)
    weight_grad_stream.queue(weight, grad_y_rows, x_rows)
    return None
