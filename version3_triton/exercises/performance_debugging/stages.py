"""The five stages of the version 3 performance-debugging exercise (this directory).

    python run_stage.py --stage N        N = 1 ... 5; 5 (the default) is version 3 as it is

Version 3's model (../../tiny_llama_v3.py) knows nothing of this exercise: this file builds on its classes, and
run_stage.py is version 3's command line with a --stage flag added.

Stages 1-4 each plant ONE real, minimal defect into version 3; everything else is version 3 unchanged, so the
defect is the only difference a learner has to find. Stage 5 is the fixed model.

  stage  defect                                           symptom                          the fix
  1      the weights are never initialised: the loader     loss starts at several times     tensor.copy_(...) in
         copies nothing, parameters keep std-1 values      ln(V) and barely moves           load_canonical
  2      the FFN's gate/up activations arrive transposed   right values, slower SwiGLU      produce (or copy to)
         (non-contiguous) at a stride-aware Triton kernel  kernels (uncoalesced loads)      the row-major layout
  3      the step is timed with the host clock, read       a step time and samples/s that   synchronise before
         before the GPU has finished                       disagree with device events      reading the clock
  4      the FFN's matrix multiplies run on a naive        right values, much slower FFN    F.linear (cuBLAS /
         Triton kernel instead of the vendor BLAS          (no tensor / matrix cores)       hipBLASLt)

The file reads top to bottom in stage order. Each stage's Triton kernels come first, then the
torch.autograd.Function that launches them, then the module that uses them. At the end: the functions that
run_stage.py's command-line hooks call, and a small command that prints a model's weight statistics:

    python stages.py weights --stage 1       (run from this directory)
"""
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, when run as a script

from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the first `import triton`

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tinytransformer.config import ModelConfig  # noqa: E402
from tinytransformer.profiling.ranges import profile_range  # noqa: E402
from tinytransformer.training.step import EagerStep  # noqa: E402
from tinytransformer.triton_support import num_warps_for  # noqa: E402
from tinytransformer.weights import check_canonical, fuse, init_canonical_weights  # noqa: E402
from version3_triton.kernels.swiglu import swiglu_fused  # noqa: E402
from version3_triton.tiny_llama_v3 import WEIGHT_GROUPS, FeedForward, TinyLlama  # noqa: E402

# What each stage is, in the words the run's header, its metrics JSON and run_all_stages.sh's table use.
STAGES = {
    1: ("weights never initialised", "missing weight initialisation (the loader copies nothing)"),
    2: ("transposed gate/up into a stride-aware SwiGLU kernel", "non-contiguous tensor fed to a Triton kernel"),
    3: ("step timed with the host clock, no synchronisation", "timing without synchronisation"),
    4: ("FFN matrix multiplies on a naive Triton kernel", "naive Triton matmul instead of BLAS"),
    5: ("version 3 as it is", "none: Triton for memory-bound ops, BLAS for GEMMs"),
}

# Tests set this to True: every buffer a wrapper below allocates for a kernel to fill then starts as NaN, so an
# element a kernel forgets to write cannot pass as a plausible value.
FILL_NEW_BUFFERS_WITH_NAN = False


def _new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if FILL_NEW_BUFFERS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _new_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and, for a dense tensor, the same strides (the *_like factories preserve them)."""
    if FILL_NEW_BUFFERS_WITH_NAN:
        return torch.full_like(tensor, float("nan"))
    return torch.empty_like(tensor)


# ==========================================================================================================
# Stage 1: the weights are never initialised
# ==========================================================================================================
class UninitialisedTinyLlama(TinyLlama):
    """Version 3 whose initialisation never reaches the parameters.

    Like many models written from scratch, this one creates its weight matrices as `torch.randn` placeholders
    (standard deviation 1) and relies on a second step to put the real initialisation in: the harness calls
    load_canonical() with normal(0, 0.02) weights (output projections scaled by 1/sqrt(2 * layers)). That
    loader has a one-line bug, so the placeholders stay. With std-1 weights every layer multiplies the scale of
    its input by about sqrt(fan_in): logits of size ~sqrt(hidden) instead of ~0.3, a softmax that is certain
    and wrong (a loss several times ln(V), where a fresh model starts at about ln(V)), and AdamW steps of
    size ~lr that barely dent weights of size 1.
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config)   # its call to load_canonical() is the broken one below: nothing is copied
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                if not name.endswith("norm.weight"):   # norm weights start at 1 in every version
                    parameter.normal_(0.0, 1.0)        # the torch.randn placeholder

    def load_canonical(self, state_dict):
        check_canonical(state_dict, self.config)
        fused = fuse(state_dict, WEIGHT_GROUPS)
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                # DEFECT: this rebinds the loop variable `tensor` to the new weights; the parameter that
                # `tensor` referred to is never written. The fix is TinyLlama's line: tensor.copy_(fused[name])
                # pyflakes / flake8 report this very line: "local variable 'tensor' is assigned to but never used".
                tensor = fused[name]  # noqa: F841


def _rms(tensor: torch.Tensor) -> float:
    """Root mean square: the standard deviation of a zero-mean weight, and 1 for a norm weight of ones."""
    return tensor.float().pow(2).mean().sqrt().item()


def weight_statistics(model: nn.Module, config: ModelConfig, seed: int = 42) -> list[tuple[str, float, float]]:
    """(canonical parameter name, actual RMS, intended RMS) for each parameter of `model`, in the canonical
    layout. `intended` is the RMS of the weights the harness's initialisation (seed `seed`) hands the model."""
    actual = model.canonical_state_dict()
    intended = init_canonical_weights(config, seed)
    return [(name, _rms(actual[name]), _rms(intended[name])) for name in intended]


# ==========================================================================================================
# Stage 2: a non-contiguous tensor fed to a stride-aware Triton kernel
# ==========================================================================================================
# Version 3's SwiGLU kernel (kernels/swiglu.py) assumes row r of gate_up starts at r * 2F with adjacent columns
# and asserts it. The variant below is "more general": it takes the row and column strides, so it accepts any
# layout without a copy, and it computes the right values for every layout. Its speed, however, depends on the
# layout: the lanes of a warp (wavefront on AMD) read adjacent columns, which are adjacent in memory only when
# the column stride is 1. The memory system moves whole 32-byte sectors (64- or 128-byte lines); with a column
# stride of `tokens` every lane lands in its own sector, so the kernel moves 8x (float32) or 16x (16-bit) the
# bytes it uses. The model then feeds it exactly that layout (TransposedGateUpFeedForward).
@triton.jit
def _strided_swiglu_forward_kernel(
    gate_up_ptr,      # [rows, 2F]: element (r, c) at r * in_row_stride + c * in_col_stride; gate = c < F
    out_ptr,          # [rows, F] contiguous
    n_cols,           # F
    in_row_stride, in_col_stride,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    # int64: with a transposed layout col * in_col_stride reaches rows * 2F, which can pass 2**31.
    gate_cols = cols.to(tl.int64)
    up_cols = gate_cols + n_cols
    gate = tl.load(gate_up_ptr + row * in_row_stride + gate_cols * in_col_stride, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_row_stride + up_cols * in_col_stride, mask=mask, other=0.0)
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _strided_swiglu_backward_kernel(
    dout_ptr,         # [rows, F] contiguous
    gate_up_ptr,      # [rows, 2F], strides (in_row_stride, in_col_stride): the forward input
    dgate_up_ptr,     # [rows, 2F], strides (grad_row_stride, grad_col_stride)
    n_cols,
    in_row_stride, in_col_stride, grad_row_stride, grad_col_stride,
    BLOCK_SIZE: tl.constexpr,
):
    """dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * silu(g), with s = sigmoid(g) (as kernels/swiglu.py)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    gate_cols = cols.to(tl.int64)
    up_cols = gate_cols + n_cols

    dout = tl.load(dout_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_up_ptr + row * in_row_stride + gate_cols * in_col_stride, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_row_stride + up_cols * in_col_stride, mask=mask, other=0.0)
    gate, up = gate.to(tl.float32), up.to(tl.float32)

    sig = tl.sigmoid(gate)
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dout * gate * sig
    out_type = dgate_up_ptr.dtype.element_ty
    tl.store(dgate_up_ptr + row * grad_row_stride + gate_cols * grad_col_stride, dgate.to(out_type), mask=mask)
    tl.store(dgate_up_ptr + row * grad_row_stride + up_cols * grad_col_stride, dup.to(out_type), mask=mask)


def _swiglu_launch_config(n_rows: int, n_cols: int):
    """Grid (rows, column blocks) and block size, as version 3's SwiGLU launcher chooses them."""
    block_size = min(triton.next_power_of_2(n_cols), 1024)
    return (n_rows, triton.cdiv(n_cols, block_size)), block_size


def strided_swiglu_forward(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2F] = [gate | up] with ANY strides (read in place, never copied).

    Returns out [rows, F], contiguous, in gate_up's dtype; out may be passed in (tests pass NaN-filled ones).
    """
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up must be [rows, 2F]"
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = _new_buffer((n_rows, n_cols), gate_up.dtype, gate_up.device) if out is None else out
    assert out.shape == (n_rows, n_cols) and out.is_contiguous() and out.dtype == gate_up.dtype
    if out.numel() == 0:
        return out
    grid, block_size = _swiglu_launch_config(n_rows, n_cols)
    _strided_swiglu_forward_kernel[grid](
        gate_up, out, n_cols, gate_up.stride(0), gate_up.stride(1),
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )
    return out


def strided_swiglu_backward(dout: torch.Tensor, gate_up: torch.Tensor,
                            dgate_up: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient of gate_up [rows, 2F] from dout [rows, F] (contiguous).

    The gradient is written in gate_up's own layout (a transposed gate_up gets a transposed gradient), the
    layout autograd hands back to the operation that produced gate_up. dgate_up may be passed in.
    """
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    assert dout.shape == (n_rows, n_cols) and dout.is_contiguous() and dout.dtype == gate_up.dtype
    dgate_up = _new_buffer_like(gate_up) if dgate_up is None else dgate_up
    assert dgate_up.shape == gate_up.shape and dgate_up.dtype == gate_up.dtype
    if dout.numel() == 0:
        return dgate_up
    grid, block_size = _swiglu_launch_config(n_rows, n_cols)
    _strided_swiglu_backward_kernel[grid](
        dout, gate_up, dgate_up, n_cols,
        gate_up.stride(0), gate_up.stride(1), dgate_up.stride(0), dgate_up.stride(1),
        BLOCK_SIZE=block_size, num_warps=num_warps_for(block_size),
    )
    return dgate_up


class StridedSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        # Version 3 starts with gate_up = gate_up.contiguous() here (a no-op for its row-major gate_up). This
        # stage does not: the kernel takes the strides, so any layout "just works", at whatever speed.
        ctx.save_for_backward(gate_up)
        return strided_swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        return strided_swiglu_backward(dout.contiguous(), gate_up)


def strided_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up [rows, 2F] with any strides -> [rows, F]; differentiable."""
    return StridedSwiGLUFunction.apply(gate_up)


class TransposedGateUpFeedForward(FeedForward):
    """Version 3's FFN (same parameters), with the gate/up product computed 'the way the maths is written'.

    h = W x, with the tokens as the columns of x, gives gate_up^T: a [2F, tokens] matrix. cuBLAS computes it
    as fast as the row-major product (a transposed GEMM is only a flag to BLAS), and `.t()` turns it into the
    [tokens, 2F] the SwiGLU wants without a copy. But that view is column-major: walking along a row of it
    jumps `tokens` elements at a time, and that is the direction the SwiGLU kernel walks.
    """

    def forward(self, x):
        batch, seq, dim = x.shape
        with profile_range("ffn"):
            tokens = x.reshape(batch * seq, dim)
            # DEFECT: a [2F, tokens] product, viewed as [tokens, 2F] (strides (1, tokens)) and handed on as is.
            gate_up = (self.gate_up_proj.weight @ tokens.t()).t()
            hidden = strided_swiglu(gate_up)
            return self.down_proj(hidden).view(batch, seq, dim)


# ==========================================================================================================
# Stage 3: timing without synchronisation
# ==========================================================================================================
class HostClockTimedStep(EagerStep):
    """The harness's training step, timed the way many training scripts time it:

        start = time.perf_counter()
        loss = train_step(inputs, targets)                 # forward, backward, optimizer
        step_ms = (time.perf_counter() - start) * 1000     # DEFECT: read while the GPU is still working
        losses.append(loss.item())                         # waits for the GPU, after the clock was read

    A GPU runs asynchronously: each PyTorch call only QUEUES its kernels and returns. So the clock measures
    how long Python took to queue the step. The .item() that follows (a progress print, a loss history) makes
    the CPU wait for the GPU, outside the timed region, so every step starts with an empty queue and every
    reading is "queueing time only". When the GPU is the bottleneck that is far less than the step takes;
    when Python is the bottleneck (tiny models) the GPU idles and both happen to agree. The harness times the
    same steps with device events (recorded in the GPU's queue), which are right in both cases; the fix is
    torch.cuda.synchronize() before reading the clock, or events. On the CPU everything runs synchronously,
    so there the host clock is right.

    The timer prints its result after the last step of a run that started at step 0 (not after --resume).
    """

    supports_breakdown = False   # the harness's --timing-breakdown needs its own step: it is not offered here

    def __init__(self, model, optimizer, device, train, out=None):
        super().__init__(model, optimizer, device, train)
        self.num_steps, self.warmup_steps, self.batch_size = train.num_steps, train.warmup_steps, train.batch_size
        self.host_ms: list[float] = []
        self.losses: list[float] = []
        self.out = out if out is not None else sys.stdout

    def __call__(self, inputs, targets):
        start = time.perf_counter()
        loss = super().__call__(inputs, targets)
        self.host_ms.append((time.perf_counter() - start) * 1e3)
        self.losses.append(loss.item())
        if len(self.host_ms) == self.num_steps:
            self.report()
        return loss

    def summary(self) -> dict | None:
        """Median (and spread) of the host-clock step times after the warm-up steps; None before any step."""
        if not self.host_ms:
            return None
        timed = self.host_ms[self.warmup_steps:] or self.host_ms
        ordered = sorted(timed)
        median = statistics.median(ordered)
        return {"median_ms": median, "p10_ms": ordered[int(0.1 * (len(ordered) - 1))],
                "p90_ms": ordered[int(0.9 * (len(ordered) - 1))], "count": len(ordered),
                "samples_per_s": self.batch_size / (median / 1e3) if median > 0 else None}

    def report(self) -> None:
        s = self.summary()
        rate = f"{s['samples_per_s']:.1f} samples/s" if s["samples_per_s"] else "n/a samples/s"
        indent = " " * len("stage 3 timer: ")
        self._print_line(f"stage 3 timer: median {s['median_ms']:.2f} ms/step -> {rate} "
                         f"(host clock around the step, no synchronisation before reading it)")
        if self.device.type == "cpu":
            self._print_line(f"{indent}on the CPU every operation finishes before Python moves on, so here the "
                             f"host clock is right")
        else:
            self._print_line(f"{indent}the summary below times the same steps with device events: compare")

    def _print_line(self, text: str) -> None:
        print(text, file=self.out, flush=True)


# ==========================================================================================================
# Stage 4: a naive Triton matmul instead of the vendor BLAS
# ==========================================================================================================
# The textbook triple loop, one program per BLOCK_M x BLOCK_N tile of C: for k in 0..K-1, C_tile += (column k
# of A) x (row k of B). It is correct, and slow on a GPU for three reasons a profile shows:
#   - no tl.dot: the multiply-adds run on the ordinary float units. tl.dot on [BLOCK_M, BLOCK_K] x
#     [BLOCK_K, BLOCK_N] tiles is what reaches the tensor cores (NVIDIA) / matrix cores (AMD MFMA): on an
#     H100 the peak is 67 TFLOP/s on the float units against 495 in TF32 and 989 in bfloat16 on the tensor
#     cores (the peak table in tinytransformer/device.py);
#   - one rank-1 update per loop iteration: a load, a wait, a few multiply-adds, and again, with no block of
#     K staged in shared memory for the warps to reuse;
#   - a column of row-major A is BLOCK_M scattered elements (each from a different row).
# cuBLAS / hipBLASLt (what F.linear calls) are tuned for each GPU, with tiles, pipelining and tensor cores.
@triton.jit
def _naive_matmul_kernel(
    a_ptr, b_ptr, c_ptr,      # a [M, K], b [K, N] with any strides; c [M, N] contiguous
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    # Pointers to element k = 0 of this tile's rows of A and columns of B, advanced by one k per iteration
    # (int64: row * stride can pass 2**31 for large matrices).
    a_ptrs = a_ptr + rows.to(tl.int64) * stride_am
    b_ptrs = b_ptr + cols.to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K):
        a = tl.load(a_ptrs, mask=row_mask, other=0.0).to(tl.float32)   # column k of the A tile
        b = tl.load(b_ptrs, mask=col_mask, other=0.0).to(tl.float32)   # row k of the B tile
        acc += a[:, None] * b[None, :]                                 # a rank-1 update, float32
        a_ptrs += stride_ak
        b_ptrs += stride_bk
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# A 32 x 32 tile: 1024 accumulators, a few per thread. (The tile size is not what makes this kernel slow.)
_NAIVE_BLOCK = 32


def naive_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] with any strides (so a.t() or b.t() costs no copy); float32 accumulation.

    Returns out [M, N], contiguous, in a's dtype; out may be passed in (tests pass NaN-filled ones).
    """
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], \
        f"shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied"
    assert a.dtype == b.dtype and a.device == b.device
    (m, k), n = a.shape, b.shape[1]
    out = _new_buffer((m, n), a.dtype, a.device) if out is None else out
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == a.dtype
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(m, _NAIVE_BLOCK), triton.cdiv(n, _NAIVE_BLOCK))
    _naive_matmul_kernel[grid](
        a, b, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BLOCK_M=_NAIVE_BLOCK, BLOCK_N=_NAIVE_BLOCK, num_warps=num_warps_for(_NAIVE_BLOCK * _NAIVE_BLOCK),
    )
    return out


class NaiveLinearFunction(torch.autograd.Function):
    """y = x W^T (a bias-free nn.Linear) with the naive kernel for the forward product and both gradients:

        dx = dy W        dW = dy^T x

    Each operand is passed as a strided view (W.t(), dy.t()): the kernel takes strides, so no copies.
    """

    @staticmethod
    def forward(ctx, x, weight):
        x_2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_2d, weight)
        ctx.x_shape = x.shape
        return naive_matmul(x_2d, weight.t()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_2d, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = naive_matmul(grad_2d, weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = naive_matmul(grad_2d.t(), x_2d)
        return grad_x, grad_weight


def naive_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T -> [..., out] on the naive kernel; differentiable.

    Under autocast both operands are cast to the autocast dtype first, as autocast does for F.linear (it does
    not reach inside a custom autograd.Function by itself).
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
    return NaiveLinearFunction.apply(x, weight)


class NaiveMatmulFeedForward(FeedForward):
    """Version 3's FFN (same parameters and SwiGLU kernel) with both projections on the naive Triton matmul."""

    def forward(self, x):
        with profile_range("ffn"):
            gate_up = naive_linear(x, self.gate_up_proj.weight)               # instead of self.gate_up_proj(x)
            return naive_linear(swiglu_fused(gate_up), self.down_proj.weight)  # instead of self.down_proj(...)


# ==========================================================================================================
# Building a stage: what run_stage.py's command-line hooks call
# ==========================================================================================================
_STAGE_FEED_FORWARD = {2: TransposedGateUpFeedForward, 4: NaiveMatmulFeedForward}


def build_model(stage: int, config: ModelConfig) -> nn.Module:
    """Version 3 with stage `stage`'s defect (stage 3's lives in the training step, see make_step)."""
    if stage == 1:
        return UninitialisedTinyLlama(config)
    model = TinyLlama(config)
    feed_forward_class = _STAGE_FEED_FORWARD.get(stage)
    if feed_forward_class is not None:
        for layer in model.layers:
            layer.feed_forward = feed_forward_class(config)
        # The replacements have the same parameter names; give them the weights TinyLlama starts with.
        model.load_canonical(init_canonical_weights(config, seed=0))
    return model


def make_step(stage: int, model, optimizer, device, train, args):
    """The training step: stage 3's host-clock-timed step; None for the others, which tells the harness to use
    its own EagerStep (which also supports --timing-breakdown)."""
    if stage == 3:
        step = HostClockTimedStep(model, optimizer, device, train)
        args.stage3_step = step   # describe() reads its summary into the metrics JSON
        return step
    return None


def describe(stage: int, args) -> dict:
    """Header lines and metrics-JSON fields of a stage run; for stage 3, after the run, its timer's result."""
    title, issue = STAGES[stage]
    info = {"stage": f"{stage} of 5: {title}", "defect": issue}
    step = getattr(args, "stage3_step", None)
    summary = step.summary() if step is not None else None
    if summary is not None:
        info["host_clock_timer"] = summary
    return info


# ==========================================================================================================
# A diagnostic for stage 1: are the weights what the initialisation says they should be?
# ==========================================================================================================
def print_weight_statistics(stage: int, seed: int = 42) -> None:
    """Build a stage's model at the default size, initialise it as the harness does, print each weight's RMS."""
    config = ModelConfig()
    model = build_model(stage, config) if stage != 5 else TinyLlama(config)
    model.load_canonical(init_canonical_weights(config, seed))   # what the harness does before training
    print(f"stage {stage}: root mean square of each weight after the harness's initialisation (seed {seed})")
    print(f"{'parameter':<40} {'actual':>9} {'intended':>9}")
    for name, actual, intended in weight_statistics(model, config, seed):
        differs = not math.isclose(actual, intended, rel_tol=0.05)
        print(f"{name:<40} {actual:9.4f} {intended:9.4f}" + ("   <-- not what was loaded" if differs else ""))


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description="Diagnostics for the performance-debugging exercise.")
    commands = parser.add_subparsers(dest="command", required=True)
    weights = commands.add_parser("weights", help="print the RMS of every weight of a stage's model")
    weights.add_argument("--stage", type=int, choices=sorted(STAGES), default=1)
    weights.add_argument("--seed", type=int, default=42, help="the training run's --seed")
    args = parser.parse_args(argv)
    print_weight_statistics(args.stage, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
