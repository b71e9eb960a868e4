"""Version 3's Triton kernels one at a time against the PyTorch code they replace: forward and backward time,
speed-up and the Triton kernel's achieved bandwidth.

    python run_triton_profiling.py                     (the seed config: batch 8, seq 128, hidden 256, ...)
    python run_triton_profiling.py --check --output-json kernels_v3.json
    python run_triton_profiling.py --dtype bfloat16 --batch-size 64 --seq-len 1024 --kernel rmsnorm,swiglu

Ops: rmsnorm, rope, swiglu (the fused gate/up layout the model uses), flash_attention (against version 1's
matmul-softmax-matmul and against F.scaled_dot_product_attention). Without a GPU there is nothing to time:
`--check` then verifies the kernels in Triton's CPU interpreter at a small size.

This file only describes the ops; how they are checked, timed and reported (and why that way) is in
tinytransformer/kernel_bench/, shared with version 4's run_kernel_benchmarks.py.
"""
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # without a GPU: Triton's interpreter, chosen before the kernels import triton

from tinytransformer.kernel_bench import ops as kb  # noqa: E402
from tinytransformer.kernel_bench.cli import main as benchmark_main  # noqa: E402
from version3_triton.kernels import flash_attention as attention_kernels  # noqa: E402
from version3_triton.kernels import rmsnorm as rmsnorm_kernels  # noqa: E402
from version3_triton.kernels import rope as rope_kernels  # noqa: E402
from version3_triton.kernels.flash_attention import flash_attention  # noqa: E402
from version3_triton.kernels.rmsnorm import rms_norm  # noqa: E402
from version3_triton.kernels.rope import apply_rope, rope_tables  # noqa: E402
from version3_triton.kernels.swiglu import swiglu_fused  # noqa: E402

EPS = 1e-6   # the model's RMSNorm epsilon

# ----------------------------------------------------------------------------------------------------------
# rmsnorm: x [N, D], weight [D] -> y [N, D]
# ----------------------------------------------------------------------------------------------------------
RMSNORM = kb.OpBench(
    name="rmsnorm",
    make_inputs=lambda s, device: kb.InputSet([kb.random_tensor((s.N, s.D), s.dtype, device),
                                               kb.random_norm_weight(s.D, s.dtype, device)]),
    triton=lambda x, weight: rms_norm(x, weight, EPS),
    pytorch={"torch (v1 RMSNorm)": lambda x, weight: kb.torch_rms_norm(x, weight, EPS)},
    output_names=("y",), input_names=("x", "weight"),
    # Byte model. Forward: read x and weight, write y and the float32 rstd per row (kept for the backward).
    # Backward: read dy, x, weight and rstd, write dx and dweight.
    byte_model={
        "fwd": ("2*N*D*e + D*e + 4*N (read x, weight; write y, rstd)",
                lambda s: 2 * s.N * s.D * s.e + s.D * s.e + 4 * s.N),
        "bwd": ("3*N*D*e + 2*D*e + 4*N (read dy, x, weight, rstd; write dx, dweight)",
                lambda s: 3 * s.N * s.D * s.e + 2 * s.D * s.e + 4 * s.N),
    },
    validate=lambda s: rmsnorm_kernels.shape_problem(s.D),
)


# ----------------------------------------------------------------------------------------------------------
# rope: q, k [B, H, S, Dh] and float32 tables cos, sin [S, Dh] -> q_rot, k_rot
# ----------------------------------------------------------------------------------------------------------
def rope_inputs(s, device):
    q = kb.random_tensor((s.B, s.H, s.S, s.Dh), s.dtype, device)
    k = kb.random_tensor((s.B, s.H, s.S, s.Dh), s.dtype, device)
    cos, sin = rope_tables(s.S, s.Dh, device=device)
    return kb.InputSet([q, k], [cos, sin])


def torch_rope(q, k, cos, sin):
    """Version 1's apply_rope: rotate-half written with slicing, negation and concatenation."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


ROPE = kb.OpBench(
    name="rope",
    make_inputs=rope_inputs,
    # q and k are contiguous here, so the wrapper's .contiguous() copies nothing and the kernel alone is timed.
    # The model calls the same kernel through apply_rope_packed on the fused [B, S, 3D] projection output,
    # where it also copies v alongside (1.5x these bytes); [B, H, S, Dh] here compares like with like.
    triton=apply_rope,
    pytorch={"torch (v1 apply_rope)": torch_rope},
    output_names=("q_rot", "k_rot"), input_names=("q", "k"),
    # Byte model: read q and k and the two float32 tables, write both rotated tensors; the backward is the
    # inverse rotation of the incoming gradients, so it moves the same bytes.
    byte_model={
        "fwd": ("4*N*D*e + 8*S*Dh (read q, k, cos, sin; write q_rot, k_rot)",
                lambda s: 4 * s.N * s.D * s.e + 8 * s.S * s.Dh),
        "bwd": ("4*N*D*e + 8*S*Dh (read dq_rot, dk_rot, cos, sin; write dq, dk)",
                lambda s: 4 * s.N * s.D * s.e + 8 * s.S * s.Dh),
    },
    validate=lambda s: rope_kernels.shape_problem(s.Dh),
)


# ----------------------------------------------------------------------------------------------------------
# swiglu: gate_up [N, 2F] (the fused gate/up projection's output) -> silu(gate) * up [N, F]
# ----------------------------------------------------------------------------------------------------------
def torch_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)   # views, no copy
    return F.silu(gate) * up


SWIGLU = kb.OpBench(
    name="swiglu",
    make_inputs=lambda s, device: kb.InputSet([kb.random_tensor((s.N, 2 * s.F), s.dtype, device)]),
    triton=swiglu_fused,
    pytorch={"torch (silu * up)": torch_swiglu},
    output_names=("out",), input_names=("gate_up",),
    # Byte model. Forward: read gate and up, write out. Backward: read dout, gate and up, write dgate, dup.
    byte_model={
        "fwd": ("3*N*F*e (read gate_up [N, 2F]; write out [N, F])", lambda s: 3 * s.N * s.F * s.e),
        "bwd": ("5*N*F*e (read dout, gate_up; write dgate_up)", lambda s: 5 * s.N * s.F * s.e),
    },
)


# ----------------------------------------------------------------------------------------------------------
# flash_attention: q, k, v [B, H, S, Dh] -> causal softmax(q k^T / sqrt(Dh)) v
# ----------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal (future keys). Built once, like version 1's model buffer."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def explicit_attention(q, k, v):
    """Version 1's attention: the [B, H, S, S] score matrix is built, masked, softmaxed in float32, reused."""
    seq_len, head_dim = q.shape[-2:]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
    scores = scores.masked_fill(causal_mask(seq_len, q.device), float("-inf"))
    probs = F.softmax(scores.to(kb.statistics_dtype(q.dtype)), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


FLASH_ATTENTION = kb.OpBench(
    name="flash_attention",
    make_inputs=lambda s, device: kb.InputSet([kb.random_tensor((s.B, s.H, s.S, s.Dh), s.dtype, device)
                                               for _ in range(3)]),
    # The model calls the same kernels through flash_attention_packed (other strides, same work).
    triton=lambda q, k, v: flash_attention(q, k, v, causal=True),
    pytorch={"v1 matmul-softmax-matmul": explicit_attention,
             "F.sdpa (is_causal)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)},
    output_names=("out",), input_names=("q", "k", "v"),
    # Byte model. Forward: read q, k, v; write out and the float32 log-sum-exp per row (for the backward).
    # Backward: read q, k, v, out, dout and lse; write dq, dk, dv (the per-row delta is scratch, not counted).
    byte_model={
        "fwd": ("4*N*D*e + 4*B*H*S (read q, k, v; write out, lse)",
                lambda s: 4 * s.N * s.D * s.e + 4 * s.B * s.H * s.S),
        "bwd": ("8*N*D*e + 4*B*H*S (read q, k, v, out, dout, lse; write dq, dk, dv)",
                lambda s: 8 * s.N * s.D * s.e + 4 * s.B * s.H * s.S),
    },
    # [B, H, S, Dh] inputs: rows Dh elements apart.
    validate=lambda s: attention_kernels.shape_problem(s.B * s.H, s.S, s.Dh, s.Dh),
    uses_tl_dot=True,
    tf32_dots=True,
    note="attention does ~2*B*H*S^2*Dh FLOPs forward (causal), so at long sequences it is compute-bound and "
         "its GB/s says little; the v1 baseline also writes and re-reads the [B, H, S, S] scores.",
)

OPS = [RMSNORM, ROPE, SWIGLU, FLASH_ATTENTION]


def main(argv=None) -> int:
    description = ("Version 3's Triton kernels against the PyTorch code they replace: forward and backward "
                   "median times, speed-up and achieved GB/s (see tinytransformer/kernel_bench/ for the method).")
    return benchmark_main(OPS, prog="run_triton_profiling.py", description=description, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
