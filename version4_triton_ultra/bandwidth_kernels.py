"""The kernels run_bandwidth_benchmarks.py times: version 4's memory-bound kernels, each with its inputs in the form and
dtypes of the training step under bfloat16 autocast, the launch that is timed, its formula in float64 for the check,
and its byte model (what one launch must read and write):

    norm_forward     residual add + RMSNorm: float32 stream + bfloat16 sub-layer output -> float32 stream,
                     bfloat16 normed rows, float32 rstd                             12 bytes an element of [N, D]
    norm_backward    its backward: reads the float32 stream, the bfloat16 gradient of the normed rows and the
                     float32 gradient of the stream; writes the stream's gradient in float32 and in bfloat16
                     (the sub-layer's), and the weight's gradient                   16 bytes an element of [N, D]
    swiglu_forward   h = silu(gate) * up from the bfloat16 [N, 2F] gate/up product   6 bytes an element of [N, F]
    swiglu_backward  d(gate), d(up) from the bfloat16 gradient of h and gate/up     10 bytes an element of [N, F]
    rope             q and k of a bfloat16 qkv [N, 3D] rotated in place            8 bytes an element of [N, D]
    adamw            one decoder layer's weights updated (float32 weight, gradient and moments read; weight and
                     moments written; the bfloat16 copy of every matrix written)   28 bytes a parameter + 2 a copy

The small tables and sums (rstd, the norm weight and its gradient, RoPE's cos and sin) are counted too. Shapes at
width D (Width): N rows, the feed-forward width F = 2.75 D rounded up to a multiple of 256 (the presets' ratio:
2,816 at 1,024, 5,632 at 2,048), the largest supported head dim that cuts D into 16 heads or more (the presets' 64
at 1,024 and 128 at 2,048; 128 at 4,096), sequences of up to 1,024 rows for RoPE's tables. The loss kernel is
left out: its width is the vocabulary, not D (tune_cross_entropy.py times it).

Import this after the choice of Triton's interpreter (tinytransformer.triton_support.enable_interpreter_if_no_gpu):
the kernels import triton.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tinytransformer.kernel_bench.correctness import TOLERANCE
from version4_triton_ultra.kernels import add_rmsnorm as norm
from version4_triton_ultra.kernels.adamw import TritonAdamW
from version4_triton_ultra.kernels.flash_attention import SUPPORTED_HEAD_DIMS
from version4_triton_ultra.kernels.qk_rotation import rotate_qk_
from version4_triton_ultra.kernels.qk_rotation import shape_problem as rope_shape_problem
from version4_triton_ultra.kernels.swiglu_elementwise import swiglu, swiglu_backward

EPS = 1e-6   # the model's RMSNorm epsilon
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# ----------------------------------------------------------------------------------------------------------
# The shapes at one width
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Width:
    rows: int           # N: tokens, one row of every [N, D] activation
    hidden: int         # D
    seq_len: int        # positions of RoPE's tables; rows are whole sequences of it

    @property
    def ffn(self) -> int:
        """F: the presets' 2.75 x D, rounded up to a multiple of 256 (of 16 below 256: the interpreter's widths)."""
        step = 256 if self.hidden >= 256 else 16
        return step * math.ceil(2.75 * self.hidden / step)

    @property
    def head_dim(self) -> int:
        """The largest head dim the attention kernels support that cuts D into 16 heads or more (the presets' 64 at
        1,024 and 128 at 2,048); 16 for widths under 256."""
        fitting = [d for d in SUPPORTED_HEAD_DIMS if self.hidden % d == 0 and d <= max(16, self.hidden // 16)]
        return max(fitting) if fitting else 0   # 0: width_problem says why

    def describe(self) -> str:
        return (f"hidden {self.hidden}: {self.rows} rows, feed-forward {self.ffn}, head dim {self.head_dim}, "
                f"sequences of {self.seq_len}")


def sequence_length(rows: int, wanted: int) -> int:
    """The longest sequence of at most `wanted` positions that cuts `rows` into whole sequences."""
    return max(s for s in range(1, min(rows, wanted) + 1) if rows % s == 0)


# ----------------------------------------------------------------------------------------------------------
# The kernels: inputs, the launch that is timed, the float64 reference, the byte model
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamingKernel:
    name: str
    make_inputs: Callable[[Width, torch.device], dict]
    run: Callable[[dict], tuple | None]     # launches the kernel on one input set (what the graph times)
    reference: Callable[[dict], tuple]      # its outputs from the formula, in float64
    bytes_moved: Callable[[Width], int]
    outputs: Callable[[dict], tuple] | None = None   # the outputs after run(), when run() returns none
    float32_tolerance: float = TOLERANCE[torch.float32]   # for its float32 outputs (the others: TOLERANCE)
    after_capture: Callable[[dict], None] | None = None   # what an input set needs once a graph has captured run()


def randn(shape, dtype, device, scale=1.0):
    return (scale * torch.randn(shape, device=device)).to(dtype)


def norm_weight(width, device):
    return 1.0 + 0.1 * torch.randn(width.hidden, device=device)   # near 1, as trained, but never exactly 1


# --- add + RMSNorm, forward
def norm_forward_inputs(w, device):
    return dict(residual=randn((w.rows, w.hidden), torch.float32, device),
                delta=randn((w.rows, w.hidden), torch.bfloat16, device), weight=norm_weight(w, device))


def norm_forward_run(x):
    h, normed, rstd = norm._rms_norm_forward(x["residual"], x["delta"], x["weight"], EPS, torch.float32,
                                             torch.bfloat16)
    return h, normed


def norm_forward_reference(x):
    h = x["residual"].double() + x["delta"].double()
    return h, x["weight"].double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


# --- add + RMSNorm, backward
def norm_backward_inputs(w, device):
    h = randn((w.rows, w.hidden), torch.float32, device)
    return dict(h=h, weight=norm_weight(w, device), rstd=torch.rsqrt(h.pow(2).mean(-1) + EPS),
                grad_normed=randn((w.rows, w.hidden), torch.bfloat16, device),
                grad_stream=randn((w.rows, w.hidden), torch.float32, device))


def norm_backward_run(x):
    return norm._rms_norm_backward(x["h"], x["weight"], x["rstd"], x["grad_normed"], x["grad_stream"],
                                   copy_dtype=torch.bfloat16)


def norm_backward_reference(x):
    h, weight, rstd, grad_normed, grad_stream = (x[k].double() for k in ("h", "weight", "rstd", "grad_normed",
                                                                         "grad_stream"))
    x_hat = h * rstd[:, None]
    g = grad_normed * weight
    grad_h = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) + grad_stream
    return grad_h, grad_h, (grad_normed * x_hat).sum(0)


# --- SwiGLU, both ways
def swiglu_inputs(w, device):
    return dict(gate_up=randn((w.rows, 2 * w.ffn), torch.bfloat16, device),
                grad_h=randn((w.rows, w.ffn), torch.bfloat16, device))


def swiglu_reference_forward(x):
    gate, up = x["gate_up"].double().chunk(2, dim=-1)
    return (F.silu(gate) * up,)


def swiglu_reference_backward(x):
    gate_up = x["gate_up"].double().requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    (grad,) = torch.autograd.grad(F.silu(gate) * up, gate_up, x["grad_h"].double())
    return (grad,)


# --- RoPE on q and k, in place
def rope_inputs(w, device):
    positions = torch.arange(w.seq_len, device=device, dtype=torch.float32)[:, None]
    inverse_frequency = 10000.0 ** (-torch.arange(0, w.head_dim, 2, device=device, dtype=torch.float32) / w.head_dim)
    angles = (positions * inverse_frequency).repeat(1, 2)   # [S, Dh]: each angle for column j and j + Dh/2
    return dict(qkv=randn((w.rows, 3 * w.hidden), torch.bfloat16, device), cos=angles.cos(), sin=angles.sin(),
                seq_len=w.seq_len, head_dim=w.head_dim)


def rope_run(x):
    return (rotate_qk_(x["qkv"], x["cos"], x["sin"], x["seq_len"], x["head_dim"]),)


def rope_reference(x):
    qkv, head_dim, seq_len = x["qkv"].double(), x["head_dim"], x["seq_len"]
    rows, dim = qkv.shape[0], qkv.shape[1] // 3
    heads = qkv[:, :2 * dim].reshape(rows, 2 * dim // head_dim, head_dim)   # every q head, then every k head
    position = torch.arange(rows, device=qkv.device) % seq_len
    cos, sin = x["cos"].double()[position][:, None], x["sin"].double()[position][:, None]
    first, second = heads.chunk(2, dim=-1)
    rotated = heads * cos + torch.cat([-second, first], dim=-1) * sin
    return (torch.cat([rotated.reshape(rows, 2 * dim), qkv[:, 2 * dim:]], dim=1),)


# --- AdamW over one decoder layer
def layer_shapes(w):
    """One decoder layer's parameters at this width: fused QKV, output, fused gate/up, down, and two norms."""
    d, f = w.hidden, w.ffn
    return [(3 * d, d), (d, d), (2 * f, d), (d, f), (d,), (d,)]


def adamw_inputs(w, device):
    # Weights of the model's initial size (a standard deviation of 0.02): the check takes the update as the
    # difference of two float32 weights, which then adds about 1e-6 of the update's size, not more.
    params = [(0.02 * torch.randn(shape, device=device)).requires_grad_() for shape in layer_shapes(w)]
    for param in params:
        param.grad = 1e-3 * torch.randn_like(param)
    copies = {p: p.detach().to(torch.bfloat16) for p in params if p.dim() == 2}   # autocast's matrix copies
    return dict(optimizer=TritonAdamW(params, sixteen_bit_copies=copies, **ADAMW), params=params, copies=copies,
                before=[p.detach().clone() for p in params])


def adamw_run(x):
    x["optimizer"].step()


def adamw_after_capture(x):
    x["optimizer"].finish_capture()   # the addresses the capture recorded (kernels/adamw.py)


def adamw_outputs(x):
    """What one step changed: each weight's update, both moments, the 16-bit copies."""
    state = [x["optimizer"].state[p] for p in x["params"]]
    return (*[p.detach() - b for p, b in zip(x["params"], x["before"])], *[s["exp_avg"] for s in state],
            *[s["exp_avg_sq"] for s in state], *x["copies"].values())


def adamw_reference(x):
    """One step of torch.optim.AdamW from fresh state, in float64, on the weights as they were before run()."""
    params = [b.double().requires_grad_() for b in x["before"]]
    for param, original in zip(params, x["params"]):
        param.grad = original.grad.double()
    reference = torch.optim.AdamW(params, foreach=False, **ADAMW)
    reference.step()
    state = [reference.state[p] for p in params]
    copies = [p.detach() for p in params if p.dim() == 2]   # the copies' order: the matrices' (adamw_inputs)
    return (*[p.detach() - b.double() for p, b in zip(params, x["before"])], *[s["exp_avg"] for s in state],
            *[s["exp_avg_sq"] for s in state], *copies)


def adamw_bytes(w):
    shapes = layer_shapes(w)
    parameters = sum(math.prod(s) for s in shapes)
    return 28 * parameters + 2 * sum(math.prod(s) for s in shapes if len(s) == 2)


KERNELS = [
    StreamingKernel("norm_forward", norm_forward_inputs, norm_forward_run, norm_forward_reference,
                    lambda w: 12 * w.rows * w.hidden + 4 * w.rows + 4 * w.hidden),
    StreamingKernel("norm_backward", norm_backward_inputs, norm_backward_run, norm_backward_reference,
                    lambda w: 16 * w.rows * w.hidden + 4 * w.rows + 8 * w.hidden),
    StreamingKernel("swiglu_forward", swiglu_inputs, lambda x: (swiglu(x["gate_up"]),), swiglu_reference_forward,
                    lambda w: 6 * w.rows * w.ffn),
    StreamingKernel("swiglu_backward", swiglu_inputs, lambda x: (swiglu_backward(x["grad_h"], x["gate_up"]),),
                    swiglu_reference_backward, lambda w: 10 * w.rows * w.ffn),
    StreamingKernel("rope", rope_inputs, rope_run, rope_reference,
                    lambda w: 8 * w.rows * w.hidden + 8 * w.seq_len * w.head_dim),
    # An update's float32 error is set by 1 - beta2 ** step, which cancels: one rounding of 1.0 (6e-8) against
    # 1 - 0.999 is 6e-5 of it, half of that after the square root: 1.3e-5 in Triton's interpreter, 3.0e-5 on an H200,
    # at the first step.
    StreamingKernel("adamw", adamw_inputs, adamw_run, adamw_reference, adamw_bytes, outputs=adamw_outputs,
                    float32_tolerance=1e-4, after_capture=adamw_after_capture),
]
KERNEL_NAMES = [k.name for k in KERNELS]


def width_problem(width: Width) -> str | None:
    """Why version 4's kernels cannot run at this width (one line), or None."""
    if not width.head_dim:
        return f"no head dim of {SUPPORTED_HEAD_DIMS} divides it"
    return norm.shape_problem(width.hidden) or rope_shape_problem(width.rows, width.hidden, width.head_dim)
