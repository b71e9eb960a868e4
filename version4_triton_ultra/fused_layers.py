"""The autograd Functions of version 4's two fused layers, each a chain of its fused kernels with their
backward (items 2 and 4 of tiny_llama_v4.py's docstring):

    RotaryQKVAttention    QKV GEMM with RoPE in its epilogue (kernels/qkv_rope_gemm.py) -> flash attention
                          (kernels/flash_attention.py); backward: attention backward rotating dq, dk back, then
                          two vendor GEMMs. With separate_rope: the vendor QKV GEMM, then RoPE as a kernel of its own
                          (kernels/qk_rotation.py); separate_rope_pays says at which sizes that is faster
    RotatedQKV            the same QKV GEMM and RoPE without the attention, for the vendor's attention after it
                          (vendor_attention: PyTorch's scaled_dot_product_attention on cuDNN); its backward rotates
                          the gradients of q and k back (kernels/qk_rotation.py, inverse), then the same two GEMMs.
                          vendor_attention_pays says where that is faster than our attention kernels
    SwiGLUFeedForward     gate/up GEMM with SwiGLU in its epilogue -> down GEMM (kernels/swiglu_gemm.py); backward:
                          the down GEMM's input gradient with d(gate_up) in its epilogue, then vendor GEMMs.
                          With separate_swiglu: vendor GEMMs only, and SwiGLU a kernel of its own each way
                          (kernels/swiglu_elementwise.py); separate_swiglu_pays says at which sizes that is faster

Weight operands as in backward_overlap.ProjectionMatmul: a `*_gemm_weight` is the float32 weight or its 16-bit
copy under autocast; the weight gradients come out in float32, on the weight-gradient stream when there is one.
"""
import torch

from tinytransformer.device import is_rocm
from version4_triton_ultra.backward_overlap import weight_gradient
from version4_triton_ultra.kernels.flash_attention import packed_attention_backward, packed_attention_forward
from version4_triton_ultra.kernels.qk_rotation import rotate_qk_
from version4_triton_ultra.kernels.qkv_rope_gemm import qkv_rope
from version4_triton_ultra.kernels.swiglu_elementwise import swiglu, swiglu_backward
from version4_triton_ultra.kernels.swiglu_gemm import down_swiglu_backward, gate_up_swiglu


# Which of SwiGLUFeedForward's two forms is faster depends on the size of its GEMMs. Measured on one H100 (bfloat16
# autocast, graph-captured training step, two interleaved rounds; version 4's README), rows x hidden x intermediate:
#   tiny    1,024 x   256 x   512  (0.13 G multiply-adds)   SwiGLU in the epilogues 0.41 ms, separate 0.42 ms
#   small   4,096 x   512 x 1,376  (2.9 G)                                            2.33 ms           2.31 ms
#   medium  8,192 x 1,024 x 2,816  (23.6 G)                                          23.88 ms          23.48 ms
#   large   8,192 x 2,048 x 5,632  (94.5 G)                                         109.8 ms          105.3 ms
# Small GEMMs are bound by launches and latency: the epilogue saves a kernel each way and a pass over gate_up. Large
# ones are bound by the tensor cores, where the vendor BLAS's GEMM beats our Triton GEMM by more than the extra
# pass costs. The threshold lies between the two smallest shapes. In float32 (TF32) on an H200 the epilogues took
# 4.2% longer at small and 10.7% at medium (compare_step_forms.py). Not measured on AMD (hipBLASLt).
# Each kernel alone on an H200, under 10 launches (small, medium, large) and in Hopper forms (tensor descriptors,
# one program per SM; medium, large), the epilogue GEMMs still lost to the vendor form (version 4's MEASUREMENTS.md,
# "Can a Triton GEMM beat cuBLAS here?").
SEPARATE_SWIGLU_FROM_MULTIPLY_ADDS = 2 ** 30


def separate_swiglu_pays(rows: int, hidden_dim: int, intermediate_size: int) -> bool:
    """True where the vendor GEMMs with SwiGLU as a kernel of its own beat SwiGLU in our GEMMs' epilogues: from
    about a billion multiply-adds in the gate/up GEMM (rows x hidden_dim x intermediate_size, per half)."""
    return rows * hidden_dim * intermediate_size >= SEPARATE_SWIGLU_FROM_MULTIPLY_ADDS


# The same question for RotaryQKVAttention's two forms: RoPE in the Triton QKV GEMM's epilogue, or the vendor QKV
# GEMM and RoPE as a kernel of its own (one more pass over q and k). Measured on one H200 (bfloat16 autocast,
# graph-captured step, both forms built in one process, 3 interleaved rounds: compare_step_forms.py; version 4's
# README), rows x hidden x 3 hidden:
#   tiny    1,024 x   256 x   768  (0.2 G multiply-adds)   RoPE in the epilogue 0.409 ms, separate 0.413 ms
#   small   4,096 x   512 x 1,536  (3.2 G)                                       2.087 ms           2.038 ms
#   medium  8,192 x 1,024 x 3,072  (25.8 G)                                     22.417 ms          21.949 ms
#   large   8,192 x 2,048 x 6,144  (103 G)                                      92.992 ms          90.098 ms
# As for SwiGLU, the vendor GEMM wins from the small preset up by more than the extra pass costs, and the epilogue
# wins where launches and latency rule. In float32 (TF32) too, on the same GPU: the epilogue +1.0% at small, +1.6%
# at medium (SwiGLU's epilogues +4.2% and +10.7%). Not measured on AMD (hipBLASLt), nor on an H100.
SEPARATE_ROPE_FROM_MULTIPLY_ADDS = 2 ** 30


def separate_rope_pays(rows: int, hidden_dim: int) -> bool:
    """True where the vendor QKV GEMM with RoPE as a kernel of its own beats RoPE in our QKV GEMM's epilogue: from
    about a billion multiply-adds in the QKV GEMM (rows x hidden_dim x 3 hidden_dim)."""
    return rows * hidden_dim * 3 * hidden_dim >= SEPARATE_ROPE_FROM_MULTIPLY_ADDS


def rope_form_of(rope_in_attention: bool, separate_rope: bool | None, rows: int | None = None,
                 hidden_dim: int | None = None) -> str:
    """Where a layer rotates q and k, the one answer every caller asks: "attention" (--rope-in-attention: as the
    attention kernel loads them), "separate" (the vendor QKV GEMM, then a RoPE kernel) or "gemm" (the Triton QKV
    GEMM's epilogue). separate_rope True / False is --separate-rope / --rope-in-gemm; None: the faster form at
    this size (separate_rope_pays), which needs the rows and width of the layer's input."""
    if rope_in_attention:
        return "attention"
    if separate_rope is None and (rows is None or hidden_dim is None):
        raise ValueError("rope_form_of: the form by size needs rows and hidden_dim")
    separate = separate_rope_pays(rows, hidden_dim) if separate_rope is None else separate_rope
    return "separate" if separate else "gemm"


def uses_separate_swiglu(chosen: bool | None, rows: int, hidden_dim: int, intermediate_size: int) -> bool:
    """The feed-forward form a layer runs: the one chosen (True: separate, False: in the epilogues; the flags
    --separate-swiglu and --swiglu-in-gemms), or, with None, the faster one at this size."""
    if chosen is not None:
        return chosen
    return separate_swiglu_pays(rows, hidden_dim, intermediate_size)


# Which attention is faster, ours (a FlashAttention-2-style Triton kernel each way) or the vendor's (cuDNN's fused
# attention through PyTorch's scaled_dot_product_attention), depends on the head dim. Measured on one H200 (bfloat16,
# forward + backward of one layer, causal, on the packed QKV layout; compare_attention_backends.py,
# benchmarks/results/kernel_time/h200_attention_backends.json), ours against cuDNN's:
#   head dim 32  (tiny)     13.2 us against 23.3
#   head dim 64  (small)    47.6 us against 53.2;   (medium) 200.5 against 203.4
#   head dim 128 (large)   550.5 us against 415.5 (cuDNN's backward is written for Hopper: TMA loads and warp
#                          specialisation, which our kernels do not have)
# The vendor's backward returns dq and dk rotated; one more pass rotates them back (ours does it as it stores them).
# So from head dim 128, on an NVIDIA GPU of the Hopper generation (the one measured; cuDNN chooses its kernels per
# generation), in 16-bit, the layers take cuDNN's attention. ROCm has no cuDNN: ours everywhere there.
VENDOR_ATTENTION_FROM_HEAD_DIM = 128
VENDOR_ATTENTION_GPU_GENERATION = 9   # CUDA compute capability 9.x: H100, H200
VENDOR_ATTENTION_DTYPES = (torch.bfloat16, torch.float16)
_VENDOR_ATTENTION_RUNS = {}   # (device, dtype, head dim) -> whether cuDNN's attention ran there (probed once)


def vendor_attention_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why cuDNN's fused attention cannot run on q, k, v of this dtype and head dim on this device (one line), or
    None when it can. The first answer for a (device, dtype, head dim) runs a tiny causal attention forward and
    backward on cuDNN (outside a graph capture: there the answer is no, conservatively) and is kept."""
    if device.type != "cuda" or not torch.cuda.is_available() or is_rocm():
        return "cuDNN's fused attention needs an NVIDIA GPU"
    if dtype not in VENDOR_ATTENTION_DTYPES:
        return f"cuDNN's fused attention takes bfloat16 or float16 q, k, v (--use-amp), not {dtype}"
    if not (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()):
        return "this PyTorch build has cuDNN's fused attention off or missing"
    # cuda and cuda:0 are one GPU but two keys: the index is made explicit.
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    key = (device, dtype, head_dim)
    if key not in _VENDOR_ATTENTION_RUNS:
        if torch.cuda.is_current_stream_capturing():
            return "not probed before the graph capture"
        _VENDOR_ATTENTION_RUNS[key] = _cudnn_attention_runs(device, dtype, head_dim)
    return None if _VENDOR_ATTENTION_RUNS[key] else f"cuDNN's fused attention does not run at head dim {head_dim} here"


def _cudnn_attention_runs(device, dtype, head_dim) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        # With gradients whatever the caller's mode (the first forward pass of a model may run under no_grad).
        with torch.inference_mode(False), torch.enable_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            q = torch.ones(1, 1, 8, head_dim, device=device, dtype=dtype, requires_grad=True)   # no RNG drawn
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        return True
    except RuntimeError:   # no cuDNN kernel for these inputs on this GPU
        return False


def vendor_attention_pays(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True where cuDNN's attention beats ours (see VENDOR_ATTENTION_FROM_HEAD_DIM) and can run."""
    return (device.type == "cuda" and not is_rocm() and head_dim >= VENDOR_ATTENTION_FROM_HEAD_DIM
            and torch.cuda.get_device_capability(device)[0] == VENDOR_ATTENTION_GPU_GENERATION
            and vendor_attention_problem(device, dtype, head_dim) is None)


def uses_vendor_attention(chosen: bool | None, rope_form: str, device: torch.device, dtype: torch.dtype,
                          head_dim: int) -> bool:
    """The attention a layer runs: cuDNN's (True) or ours (False). chosen True / False is --cudnn-attention /
    --triton-attention; None: the faster one here (vendor_attention_pays). RoPE on load (rope_form "attention")
    exists in our kernel only."""
    if rope_form == "attention":
        return False
    return vendor_attention_pays(device, dtype, head_dim) if chosen is None else chosen


def vendor_attention(qkv: torch.Tensor, num_heads: int, backend=None) -> torch.Tensor:
    """Causal attention of the packed qkv [B, S, 3D] (q and k already rotated) on cuDNN, through PyTorch's
    scaled_dot_product_attention and its autograd: out [B, S, D]. q, k and v are views of qkv (no copies); cuDNN
    writes its output in their memory order, [B, S, heads, Dh], which is [B, S, D] as it stands. In the backward
    pass autograd gathers dq, dk and dv into one new [B, S, 3D] gradient of qkv. backend: another of PyTorch's
    attention backends instead of cuDNN's (the CPU tests use its math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    batch, seq_len, width = qkv.shape
    dim = width // 3
    q, k, v = (t.transpose(1, 2) for t in qkv.view(batch, seq_len, 3, num_heads, dim // num_heads).unbind(2))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if backend is None else backend):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(batch, seq_len, dim)


def _rotated_qkv(x_rows, qkv_gemm_weight, cos, sin, seq_len, head_dim, separate_rope):
    """The QKV GEMM's output [N, 3D] with q and k rotated: the vendor GEMM then a RoPE kernel (separate_rope), or
    the Triton GEMM with RoPE in its epilogue."""
    if separate_rope:
        return rotate_qk_(x_rows @ qkv_gemm_weight.T, cos, sin, seq_len, head_dim)
    return qkv_rope(x_rows, qkv_gemm_weight, cos, sin, seq_len, head_dim)


def _qkv_gemm_backward(ctx, grad_rows, x_rows, qkv_gemm_weight):
    """(grad_x, grad_weight) of the QKV GEMM from the gradient of its unrotated output [N, 3D], for the Functions
    below: grad_x first (the critical path), then the weight gradient (float32, or queued on the weight-gradient
    stream when there is one, which hands back None); each only where autograd asks for it."""
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = (grad_rows @ qkv_gemm_weight).view(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        grad_weight = weight_gradient(ctx.weight, grad_rows, x_rows, ctx.weight_grad_stream)
    return grad_x, grad_weight


class RotatedQKV(torch.autograd.Function):
    """qkv = RoPE(x @ W_qkv^T) [B, S, 3D], q and k rotated, for an attention that is not ours (vendor_attention).

    Forward: RotaryQKVAttention's QKV GEMM and RoPE, without the attention. Backward: the incoming gradient of the
    rotated qkv has its q and k parts rotated back (the inverse rotation, in place), which makes it the gradient of
    the GEMM's unrotated output; then RotaryQKVAttention's two GEMMs (grad_x, and the weight gradient, on the
    weight-gradient stream when there is one)."""

    @staticmethod
    def forward(ctx, x, qkv_weight, qkv_gemm_weight, cos, sin, num_heads, weight_grad_stream, separate_rope=False):
        batch, seq_len, dim = x.shape
        x_rows = x.reshape(-1, dim).to(qkv_gemm_weight.dtype)
        qkv = _rotated_qkv(x_rows, qkv_gemm_weight, cos, sin, seq_len, dim // num_heads, separate_rope)
        ctx.save_for_backward(x_rows, qkv_gemm_weight, cos, sin)
        ctx.weight, ctx.weight_grad_stream = qkv_weight, weight_grad_stream
        ctx.seq_len, ctx.head_dim, ctx.x_shape = seq_len, dim // num_heads, x.shape
        return qkv.view(batch, seq_len, 3 * dim)

    @staticmethod
    def backward(ctx, grad_qkv):
        x_rows, qkv_gemm_weight, cos, sin = ctx.saved_tensors
        # A gradient of our own to rotate in place: autograd's gathering of dq, dk, dv (vendor_attention's
        # backward) makes a new tensor, which contiguous() keeps; any other layout is copied first. (So qkv must
        # not be used elsewhere: a gradient that autograd also hands to another consumer would be rotated too.)
        grad_rows = grad_qkv.contiguous().view(-1, grad_qkv.shape[-1])
        rotate_qk_(grad_rows, cos, sin, ctx.seq_len, ctx.head_dim, inverse=True)
        grad_x, grad_weight = _qkv_gemm_backward(ctx, grad_rows, x_rows, qkv_gemm_weight)
        return grad_x, grad_weight, None, None, None, None, None, None


class RotaryQKVAttention(torch.autograd.Function):
    """out = attention(RoPE(x @ W_qkv^T)), causal, with RoPE in the QKV GEMM's epilogue (kernels/qkv_rope_gemm.py).

    Forward: one Triton GEMM writes qkv [B, S, 3D] with q and k already rotated; the flash-attention forward reads
    it as it is (no RoPE in its loops). The backward reads the same qkv, which is all attention saves besides
    out and lse; its kernels rotate dq and dk back as they store them, which makes grad_qkv the gradient of the
    GEMM's unrotated output, and the GEMM's backward is two vendor GEMMs: grad_x, and the float32 weight
    gradient (on the weight-gradient stream when there is one). Weight operands as in backward_overlap.ProjectionMatmul.

    separate_rope: the same function with the vendor BLAS's QKV GEMM and RoPE as a kernel of its own after it
    (kernels/qk_rotation.py: q and k read and written once more); the backward pass is the same.
    """

    @staticmethod
    def forward(ctx, x, qkv_weight, qkv_gemm_weight, cos, sin, num_heads, precise_fp32, weight_grad_stream,
                separate_rope=False):
        batch, seq_len, dim = x.shape
        x_rows = x.reshape(-1, dim).to(qkv_gemm_weight.dtype)
        qkv = _rotated_qkv(x_rows, qkv_gemm_weight, cos, sin, seq_len, dim // num_heads, separate_rope)
        qkv = qkv.view(batch, seq_len, 3 * dim)
        out, lse = packed_attention_forward(qkv, num_heads, causal=True, precise_fp32=precise_fp32)
        ctx.save_for_backward(x_rows, qkv_gemm_weight, qkv, out, lse, cos, sin)
        ctx.weight, ctx.weight_grad_stream = qkv_weight, weight_grad_stream
        ctx.num_heads, ctx.precise_fp32, ctx.x_shape = num_heads, precise_fp32, x.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_rows, qkv_gemm_weight, qkv, out, lse, cos, sin = ctx.saved_tensors
        grad_qkv = packed_attention_backward(qkv, out, lse, grad_out, ctx.num_heads, causal=True,
                                             precise_fp32=ctx.precise_fp32, rope=(cos, sin))
        grad_rows = grad_qkv.view(-1, grad_qkv.shape[-1])
        grad_x, grad_weight = _qkv_gemm_backward(ctx, grad_rows, x_rows, qkv_gemm_weight)
        return grad_x, grad_weight, None, None, None, None, None, None, None


class SwiGLUFeedForward(torch.autograd.Function):
    """y = down(silu(gate) * up) with [gate | up] = x @ W_gu^T, where both SwiGLU passes ride on a GEMM
    (kernels/swiglu_gemm.py) instead of running as kernels of their own.

    Forward: one Triton GEMM writes gate_up (saved) and h = silu(gate) * up; the down GEMM (vendor BLAS) reads h.
    Backward: one Triton GEMM computes dh = grad_y @ W_down and, from the same registers, d(gate_up); the
    gate/up projection's input gradient is a vendor GEMM. Weight operands as in
    backward_overlap.ProjectionMatmul: `*_gemm_weight` is the float32 weight or its 16-bit copy under autocast;
    the weight gradients come out in float32 (on the weight-gradient stream when there is one).

    separate_swiglu: the same function with vendor GEMMs only, SwiGLU and its backward as kernels of their own
    between them (gate_up read back once more forward, dh written and read backward).
    """

    @staticmethod
    def forward(ctx, x, gate_up_weight, gate_up_gemm_weight, down_weight, down_gemm_weight, weight_grad_stream,
                separate_swiglu=False):
        x_rows = x.reshape(-1, x.shape[-1]).to(gate_up_gemm_weight.dtype)
        if separate_swiglu:
            gate_up = x_rows @ gate_up_gemm_weight.T
            h = swiglu(gate_up)
        else:
            gate_up, h = gate_up_swiglu(x_rows, gate_up_gemm_weight)
        y = h @ down_gemm_weight.T
        ctx.save_for_backward(x_rows, gate_up, h, gate_up_gemm_weight, down_gemm_weight)
        ctx.weights, ctx.weight_grad_stream, ctx.x_shape = (gate_up_weight, down_weight), weight_grad_stream, x.shape
        ctx.separate_swiglu = separate_swiglu
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x_rows, gate_up, h, gate_up_gemm_weight, down_gemm_weight = ctx.saved_tensors
        gate_up_weight, down_weight = ctx.weights
        needs_x, needs_gate_up_weight, needs_down_weight = (ctx.needs_input_grad[i] for i in (0, 1, 3))
        grad_y_rows = grad_y.reshape(-1, grad_y.shape[-1]).to(h.dtype)
        grad_down_weight = grad_gate_up_weight = grad_x = None
        # The fused kernel first: on the second stream, a weight GEMM queued before it would start at the same
        # moment and take SMs from it. The down projection's weight GEMM then runs beside grad_x's GEMM.
        grad_gate_up = None
        if needs_x or needs_gate_up_weight:
            if ctx.separate_swiglu:
                grad_gate_up = swiglu_backward(grad_y_rows @ down_gemm_weight, gate_up)
            else:
                grad_gate_up = down_swiglu_backward(grad_y_rows, down_gemm_weight, gate_up)
        if needs_down_weight:
            grad_down_weight = weight_gradient(down_weight, grad_y_rows, h, ctx.weight_grad_stream)
        if needs_x:
            grad_x = (grad_gate_up @ gate_up_gemm_weight).view(ctx.x_shape)
        if needs_gate_up_weight:
            grad_gate_up_weight = weight_gradient(gate_up_weight, grad_gate_up, x_rows, ctx.weight_grad_stream)
        return grad_x, grad_gate_up_weight, None, grad_down_weight, None, None, None
