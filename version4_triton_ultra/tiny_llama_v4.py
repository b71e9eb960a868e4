"""Version 4: ultra-fused TinyLlama. Fewest kernels per step, and the whole step replayed from one graph.

What changed from version 3 (`diff ../version3_triton/tiny_llama_v3.py tiny_llama_v4.py`):
  1. Residual add + RMSNorm in one kernel (kernels/add_rmsnorm.py): writes the new residual stream AND the
     normalised activations of the next sub-layer in one pass; the backward is one pass too.
  2. RoPE inside the QKV GEMM (kernels/qkv_rope_gemm.py): the GEMM rotates q and k in its epilogue, and the
     attention backward rotates the gradients back as it stores them, so the separate RoPE pass of version 3
     disappears (RotaryQKVAttention in fused_layers.py). --rope-in-attention instead rotates q and k as the
     flash-attention kernel loads them (kernels/flash_attention.py, version 4's copy of version 3's), the way
     version 4 first did it: slower, because every key block is rotated once per query block that reads it
     (the README measures both). From about a billion multiply-adds in the QKV GEMM (the small preset and up) the
     form the epilogue replaces is faster: the vendor QKV GEMM, then RoPE as a kernel of its own
     (kernels/qk_rotation.py), one more pass over q and k; the layer uses it there (fused_layers.separate_rope_pays,
     measured); --rope-in-gemm and --separate-rope choose one form at every size, to compare.
  3. Attention reads q, k, v straight from the fused QKV output and writes its output in the layout the output
     projection reads: no copies (version 3 transposes q, k, v and the output, and again in the backward pass).
     On a Hopper GPU from head dim 128 (the large preset), in 16-bit, cuDNN's fused attention is faster than our
     kernels (its backward is written for that GPU), and the layers take it, on views of the same packed qkv
     (fused_layers.vendor_attention_pays, measured); --cudnn-attention and --triton-attention choose one.
  4. SwiGLU inside the feed-forward GEMMs (kernels/swiglu_gemm.py): the gate/up GEMM computes h = silu(gate) * up
     in its epilogue, and the down projection's input-gradient GEMM computes d(gate_up) in its epilogue, so
     version 3's SwiGLU kernels (forward and backward) disappear (SwiGLUFeedForward in fused_layers.py).
     From about a billion multiply-adds per GEMM (the small preset and up) the vendor GEMMs with SwiGLU as a kernel
     of its own each way are faster, and the layer uses them (fused_layers.separate_swiglu_pays, measured);
     --swiglu-in-gemms and --separate-swiglu choose one form at every size, to compare.
  5. LM head + cross-entropy fused and chunked (kernels/linear_cross_entropy.py): the float32 logits of the
     whole batch never exist; the loss kernel writes d(loss)/d(logits) in place, so backward is two GEMMs.
  6. Token embedding + the first RMSNorm in one kernel each way (embedding_rms_norm in kernels/add_rmsnorm.py):
     the norm reads the table rows itself, and its backward adds each row's gradient into the table's gradient
     with atomics (the scatter-add of kernels/embedding_backward.py), instead of PyTorch's gather and sort-based
     backward around a separate norm.
  7. Under autocast, the fused norm writes its output directly in bfloat16 for the GEMM that reads it, and
     the projections multiply with bfloat16 copies of their weights that the optimizer writes (item 8) as it
     updates the weights (autocast casts each weight in its own kernel and, in backward, widens each weight
     gradient in another); weight gradients come out of their GEMM in float32 directly or, on the second stream
     of item 9, in bfloat16: the gradient that autocast itself gives (its backward widens the 16-bit product), which
     the optimizer reads as it is, 2 bytes a weight fewer each way (--float32-weight-grads to compare). The fused
     loss of item 5 then sums the output head's weight gradient over its chunks in bfloat16 too, into the same
     place (--float32-head-grad to compare).
  8. AdamW in one Triton kernel for all parameters (kernels/adamw.py), which also writes the bfloat16 weight
     copies of item 7 from the updated values: no separate copy pass before the next forward pass.
     --torch-adamw uses torch.optim.AdamW(fused=True) and one copy kernel per step instead, to compare.
  9. CUDA/HIP graph: after a few eager warm-up steps, forward + backward + optimizer are captured ONCE and every
     later step is a single graph replay: no Python, no per-kernel launch cost (graphed_step.py, the training
     step version 4's spec gives the harness; --no-cuda-graph to compare). Inside it, the weight-gradient GEMMs
     of the backward pass run on a second stream, at the same time as the rest of the backward pass
     (WeightGradientStream in backward_overlap.py; --no-weight-grad-stream to compare), at a lower priority
     than the main stream's (--equal-stream-priority to compare). Once the backward
     pass has left a layer, its projection weights (for the last layer, the output head's too) have their final
     gradients and nothing reads them any more: the optimizer updates them one layer later, on the second
     stream, while the main stream runs the backward pass of the layers below (CallDuringBackward, one
     optimizer group per layer); layer 0 and the rest (the norms, the embedding) after the backward pass. With
     --torch-adamw the bfloat16 weight copy runs on the second stream instead, beside the embedding lookup and
     first norm, which do not need it. Under torchrun the step also averages the gradients over the ranks with
     all-reduces captured in the graph, instead of the DDP wrapper
     (tinytransformer/gradient_sync.py): each layer's start on the second stream as soon as the backward pass
     has queued its weight gradients, beside the backward pass of the layers below. On Hopper and later NVIDIA
     GPUs each Triton kernel may be launched before the kernel before it has completed, and waits for it first
     (kernels/programmatic_launch.py; --no-programmatic-launch to compare).
 10. TF32 tensor cores for float32 matmuls (--no-tf32 for exact float32): the same precision Triton already
     uses for float32 tl.dot.

The function is still version 1's model: tests load the same canonical weights and compare logits, loss and
every gradient. When `targets` are given the logits are not materialised and forward returns (None, loss).
"""
import functools
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.triton_support import enable_interpreter_if_no_gpu, interpreter_active  # noqa: E402

enable_interpreter_if_no_gpu()  # must precede the first `import triton` (inside the kernel modules)

from tinytransformer import distributed  # noqa: E402
from tinytransformer.cli import (GRAPH_WARMUP_LIMIT, VersionSpec, build_parser, graph_warmup_int,  # noqa: E402
                                 resolve_configs, run)
from tinytransformer.config import ConfigError, ModelConfig, head_dim_advice  # noqa: E402
from tinytransformer.cublas_workspace import (  # noqa: E402
    add_cublas_workspace_argument, apply_cublas_workspace_argument, describe_cublas_workspace)
from tinytransformer.precision import (  # noqa: E402
    add_tf32_arguments, apply_tf32_argument, describe_float32_matmuls)
from tinytransformer.profiling.ranges import profile_range  # noqa: E402
from tinytransformer.weights import (GATE_UP_GROUP, QKV_GROUP, check_canonical, fuse,  # noqa: E402
                                     init_canonical_weights, split)
from version3_triton.kernels.rope import rope_tables  # noqa: E402
from version4_triton_ultra import graphed_step  # noqa: E402
from version4_triton_ultra.backward_overlap import (  # noqa: E402
    CallDuringBackward, ProjectionMatmul, WeightGradientStream)
from version4_triton_ultra.fused_layers import (  # noqa: E402
    RotaryQKVAttention, RotatedQKV, SwiGLUFeedForward, rope_form_of, separate_swiglu_pays, uses_separate_swiglu,
    uses_vendor_attention, vendor_attention, vendor_attention_problem)
from version4_triton_ultra.kernels import add_rmsnorm as norm_kernels  # noqa: E402
from version4_triton_ultra.kernels import flash_attention as attention_kernels  # noqa: E402
from version4_triton_ultra.kernels import qk_rotation as rotation_kernels  # noqa: E402
from version4_triton_ultra.kernels import qkv_rope_gemm as qkv_kernels  # noqa: E402
from version4_triton_ultra.kernels import swiglu_gemm as ffn_kernels  # noqa: E402
from version4_triton_ultra.kernels.adamw import TritonAdamW  # noqa: E402
from version4_triton_ultra.kernels.add_rmsnorm import add_rms_norm, embedding_rms_norm  # noqa: E402
from version4_triton_ultra.kernels.flash_attention import flash_attention_packed  # noqa: E402
from version4_triton_ultra.kernels.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from version4_triton_ultra.kernels.programmatic_launch import set_programmatic_launch  # noqa: E402
from version4_triton_ultra.kernels.sixteen_bit_gradients import clear_16bit_gradients  # noqa: E402


class Projection(nn.Linear):
    """A bias-free nn.Linear that, under autocast, multiplies with the 16-bit copy of its weight that the model
    refreshes once per forward pass for all projections together (TinyLlama.refresh_16bit_weights), and whose
    weight gradient may be computed on a second stream (TinyLlama.use_weight_gradient_stream)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.weight16 = None
        self.weight_grad_stream = None   # a WeightGradientStream, or None: autograd computes the weight gradient

    def gemm_weight(self, device_type: str) -> torch.Tensor:
        """What a GEMM multiplies with: under autocast the 16-bit copy (made now if the model has none), else
        the float32 weight itself."""
        if not torch.is_autocast_enabled(device_type):
            return self.weight
        if self.weight16 is not None:
            return self.weight16
        return self.weight.to(torch.get_autocast_dtype(device_type))

    def forward(self, x):
        autocast = torch.is_autocast_enabled(x.device.type)
        if autocast and self.weight16 is not None:
            return ProjectionMatmul.apply(x, self.weight, self.weight16, self.weight_grad_stream)
        if not autocast and self.weight_grad_stream is not None:
            return ProjectionMatmul.apply(x, self.weight, self.weight, self.weight_grad_stream)
        return super().forward(x)


def gemm_input_dtype(device_type: str):
    """The dtype the next GEMM computes in: autocast's (bf16/fp16) when it is on, else None (keep float32)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class Attention(nn.Module):
    """Fused QKV GEMM with RoPE in its epilogue -> flash attention, on the GEMMs' [B, S, *] layout -> output GEMM.

    With rope_in_attention (--rope-in-attention), the way version 4 first fused RoPE: a vendor QKV GEMM, and
    the attention kernel rotates q and k as it loads them. separate_rope: the vendor QKV GEMM, then a RoPE kernel of
    its own, the form the epilogue replaces, faster from about a billion multiply-adds in the QKV GEMM
    (separate_rope_pays): None (the default) chooses by the batch's size, True (--separate-rope) or False
    (--rope-in-gemm) one form at every size. All compute the same function.

    vendor_attention: after the QKV GEMM and RoPE, cuDNN's fused attention instead of ours (RotatedQKV +
    vendor_attention in fused_layers.py), faster on Hopper GPUs from head dim 128 (vendor_attention_pays). None
    (the default) chooses by GPU, dtype and head dim; True (--cudnn-attention) or False (--triton-attention) one.
    """

    exact_float32 = False   # True: float32 dot products in IEEE float32 instead of TF32 (tests, debugging)

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv_proj = Projection(d, 3 * d)   # rows: [q; k; v]
        self.o_proj = Projection(d, d)
        self.rope_in_attention = False
        self.separate_rope = None   # without rope_in_attention: None by size, True the vendor GEMM + a RoPE kernel
        self.vendor_attention = None   # None: cuDNN's attention where it is faster, True / False: always / never

    def forward(self, x, cos, sin):
        with profile_range("attention"):
            # qkv is [B, S, 3D]: per token the q heads, then the k heads, then the v heads. The kernels read each
            # head in place (row stride 3D) instead of transposing q, k, v into [B, H, S, Dh] first.
            dim = x.shape[-1]
            form = rope_form_of(self.rope_in_attention, self.separate_rope, x.numel() // dim, dim)
            dtype = gemm_input_dtype(x.device.type) or x.dtype   # q, k and v's
            if uses_vendor_attention(self.vendor_attention, form, x.device, dtype, self.head_dim):
                qkv = RotatedQKV.apply(x, self.qkv_proj.weight, self.qkv_proj.gemm_weight(x.device.type), cos, sin,
                                       self.num_heads, self.qkv_proj.weight_grad_stream, form == "separate")
                out = vendor_attention(qkv, self.num_heads)
            elif form != "attention":   # qkv_proj's weight (and 16-bit copy, stream) in RotaryQKVAttention
                out = RotaryQKVAttention.apply(x, self.qkv_proj.weight, self.qkv_proj.gemm_weight(x.device.type),
                                               cos, sin, self.num_heads, self.exact_float32,
                                               self.qkv_proj.weight_grad_stream, form == "separate")
            else:
                out = flash_attention_packed(self.qkv_proj(x), self.num_heads, causal=True, rope=(cos, sin),
                                             precise_fp32=self.exact_float32)
            # out: [B, S, D], head h in columns h*Dh:(h+1)*Dh, which is exactly what o_proj reads. The backward
            # pass writes dq, dk, dv into one [B, S, 3D] gradient of qkv, so no copies either way.
            return self.o_proj(out)


class FeedForward(nn.Module):
    """gate/up GEMM with SwiGLU in its epilogue -> down GEMM (SwiGLUFeedForward); the backward likewise.

    Or vendor GEMMs, with SwiGLU as a kernel of its own each way: the same function, faster from about a billion
    multiply-adds per GEMM (separate_swiglu_pays). separate_swiglu None (the default) chooses by the batch's
    size; True (--separate-swiglu) or False (--swiglu-in-gemms) chooses one form at every size.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_dim, config.intermediate_size
        self.gate_up_proj = Projection(d, 2 * f)   # rows: [gate; up]
        self.down_proj = Projection(f, d)
        self.separate_swiglu = None

    def forward(self, x):
        device_type = x.device.type
        hidden_dim, intermediate_size = self.down_proj.weight.shape   # down: intermediate -> hidden
        separate = uses_separate_swiglu(self.separate_swiglu, x.numel() // hidden_dim, hidden_dim, intermediate_size)
        with profile_range("ffn"):
            return SwiGLUFeedForward.apply(x, self.gate_up_proj.weight, self.gate_up_proj.gemm_weight(device_type),
                                           self.down_proj.weight, self.down_proj.gemm_weight(device_type),
                                           self.gate_up_proj.weight_grad_stream, separate)


class Norm(nn.Module):
    """Holds an RMSNorm weight; the computation happens in the fused add + RMSNorm kernel of the caller."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class TransformerBlock(nn.Module):
    """Pre-norm block whose norms are fused with the residual adds around them.

    Version 1 computes  h = h + attn(norm1(h));  h = h + ffn(norm2(h)).
    Here each block receives the residual stream h AND norm1(h) (computed by the previous kernel), and returns
    the new h and the next block's normalised input, produced by one add + RMSNorm kernel each time.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attention_norm = Norm(config.hidden_dim)
        self.attention = Attention(config)
        self.ffn_norm = Norm(config.hidden_dim)
        self.feed_forward = FeedForward(config)

    def forward(self, h, normed, cos, sin, next_norm_weight):
        gemm_dtype = gemm_input_dtype(h.device.type)
        attn_out = self.attention(normed, cos, sin)
        with profile_range("rmsnorm"):
            h, normed = add_rms_norm(h, attn_out, self.ffn_norm.weight, self.eps, normed_dtype=gemm_dtype)
        ffn_out = self.feed_forward(normed)
        with profile_range("rmsnorm"):
            # The add closing this block and the norm opening the next one (or the final norm): one kernel.
            return add_rms_norm(h, ffn_out, next_norm_weight, self.eps, normed_dtype=gemm_dtype)


WEIGHT_GROUPS = {**QKV_GROUP, **GATE_UP_GROUP}


class TinyLlama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = Norm(config.hidden_dim)
        self.lm_head = Projection(config.hidden_dim, config.vocab_size)
        self.projections = [m for m in self.modules() if isinstance(m, Projection)]
        self.weights16 = []   # the 16-bit copies of the projection weights, reused from step to step
        self.sixteen_bit_copies = {}   # {weight: its copy} while autocast is on: what TritonAdamW keeps current
        # {weight: its 16-bit gradient}, which the weight-gradient stream writes instead of weight.grad when asked
        # to (use_weight_gradient_stream) and TritonAdamW reads.
        self.sixteen_bit_gradients = {}
        # Whether the fused loss puts the output head's gradient there too, in bfloat16 (use_weight_gradient_stream).
        self.sixteen_bit_head_gradient = False
        self.optimizer_writes_copies = False   # set by configure_optimizer when it returns a TritonAdamW
        self.copied_versions = None   # the weights' version counters when the copies were last made
        self.early_update = None   # called during backward once layer 0's is all that is left (GraphedStep)
        # Called during backward with k once layer k's projection weight gradients are all queued (k = L-1 down
        # to 1; GraphedStep starts their all-reduces there under data parallel, and updates layer k+1's weights).
        # Needs the weight-gradient stream.
        self.layer_gradients_queued = None
        self.weight_grad_stream = None   # a WeightGradientStream once use_weight_gradient_stream() is called
        # Under data parallel, a gradient_sync.EmbeddingRowExchange: the embedding's gradient then comes out of the
        # backward pass summed over the ranks (set by GraphedStep for its step, see EmbeddingRMSNormFunction).
        self.embedding_row_exchange = None
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.use_triton_adamw = True   # False: torch.optim.AdamW (fused on the GPU), copies made in forward
        self.capturable_optimizer = False
        self.load_canonical(init_canonical_weights(config, seed=0))

    def refresh_16bit_weights(self, dtype):
        """Make sure every projection has a current 16-bit copy of its weight for this forward pass (dtype None:
        autocast is off, the projections use their float32 weights). The buffers are allocated on first use and
        then overwritten in place, so a captured graph keeps writing the same memory.

        With TritonAdamW (configure_optimizer's default) the optimizer writes the copies as it updates the
        weights, so nothing is copied here once the copies exist, unless the weights changed some other way
        since (loading weights bumps their version counters; TritonAdamW's writes do not). Otherwise, and with
        torch's AdamW, every forward pass copies all weights in one multi-tensor kernel. (A captured graph holds
        the decision made at capture: weights loaded while a TritonAdamW graph is replayed are multiplied with the
        old copies for one step, until the optimizer writes new ones.)

        When this pass copies and there is a second stream (use_weight_gradient_stream), the copy runs on it,
        beside the embedding lookup and the first norm, which do not need the copies: the returned event marks its
        end, and the main stream must wait for it before the first projection. Else the copy runs on the current
        stream; returns None. Measured on an H100 (batch 32 x seq 512, bfloat16): beside the ~12 us lookup + norm,
        the copy takes ~25 us, and the main stream waits ~16 us for it. Still, the two ways tried to hide the rest
        made the step slower: one copy kernel per layer, each waited for before its layer (~9 us slower), and a
        first copy of layer 0's attention weights then one of the others, waited for before layer 0's feed-forward
        (no more waiting on the main stream, yet ~8 us slower, in three alternating rounds).
        """
        if dtype is None:
            for projection in self.projections:
                projection.weight16 = None
            self.sixteen_bit_copies.clear()   # an optimizer step now leaves the copies behind
            self.copied_versions = None
            return None
        weights = [projection.weight for projection in self.projections]
        if not self.weights16 or self.weights16[0].dtype != dtype or self.weights16[0].device != weights[0].device:
            self.weights16 = [torch.empty_like(w, dtype=dtype) for w in weights]
            self.copied_versions = None
        for projection, weight16 in zip(self.projections, self.weights16):
            projection.weight16 = weight16
        self.sixteen_bit_copies.update(zip(weights, self.weights16))
        versions = [w._version for w in weights]
        if self.optimizer_writes_copies and versions == self.copied_versions:
            return None   # the optimizer's last step wrote them
        self.copied_versions = versions
        if self.weight_grad_stream is None:
            with torch.no_grad():
                torch._foreach_copy_(self.weights16, weights)
            return None
        side = self.weight_grad_stream.stream
        side.wait_stream(torch.cuda.current_stream(side.device))   # the optimizer's last update of the weights
        with torch.cuda.stream(side), torch.no_grad():
            torch._foreach_copy_(self.weights16, weights)
            copied = torch.cuda.Event()
            copied.record()
        return copied

    def use_weight_gradient_stream(self, enabled: bool = True, sixteen_bit_gradients: bool = False,
                                   sixteen_bit_head_gradient: bool = True) -> None:
        """Compute the projections' weight gradients on a second stream (see WeightGradientStream); GPU only.
        The caller must then call join_weight_gradients() after each loss.backward(). With sixteen_bit_gradients,
        under autocast the stream writes them in the GEMMs' 16-bit dtype into self.sixteen_bit_gradients (for
        TritonAdamW, which reads them there) instead of float32 into .grad; and with sixteen_bit_head_gradient
        too, under bfloat16 autocast the fused loss sums the output head's gradient in bfloat16 into the same dict
        (kernels/linear_cross_entropy.py's docstring)."""
        device = self.embed_tokens.weight.device
        if enabled and device.type != "cuda":
            raise ValueError("a second stream for the weight gradients needs a GPU")
        gradients = self.sixteen_bit_gradients if sixteen_bit_gradients else None
        self.weight_grad_stream = WeightGradientStream(device, sixteen_bit_gradients=gradients) if enabled else None
        self.sixteen_bit_head_gradient = enabled and sixteen_bit_gradients and sixteen_bit_head_gradient
        for projection in self.projections:
            if projection is not self.lm_head:   # the fused loss computes the head's gradient itself
                projection.weight_grad_stream = self.weight_grad_stream

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's zero_grad, for the 16-bit weight gradients too: one left from an earlier backward pass would
        be taken for the first half of an accumulation and added into the next one (WeightGradientStream.queue)."""
        super().zero_grad(set_to_none=set_to_none)
        clear_16bit_gradients(self.sixteen_bit_gradients, list(self.sixteen_bit_gradients), set_to_none)

    def join_weight_gradients(self) -> None:
        """After loss.backward(): the main stream waits for the weight-gradient GEMMs still running on the second
        stream, so that the optimizer reads finished gradients. Nothing to do without the stream."""
        if self.weight_grad_stream is not None:
            self.weight_grad_stream.join()

    def forward(self, input_ids, targets=None):
        seq = input_ids.shape[1]
        weights_copied = self.refresh_16bit_weights(gemm_input_dtype(input_ids.device.type))
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        with profile_range("rmsnorm"):
            # The lookup and the first norm in one kernel each way (kernels/add_rmsnorm.py).
            h, normed = embedding_rms_norm(input_ids, self.embed_tokens.weight,
                                           self.layers[0].attention_norm.weight, self.config.rms_norm_eps,
                                           normed_dtype=gemm_input_dtype(input_ids.device.type),
                                           row_exchange=self.embedding_row_exchange)
        if weights_copied is not None:   # the copy ran on the second stream: the projections need it now
            torch.cuda.current_stream(h.device).wait_event(weights_copied)
        for i, layer in enumerate(self.layers):
            is_last = i + 1 == len(self.layers)
            next_weight = self.norm.weight if is_last else self.layers[i + 1].attention_norm.weight
            h, normed = layer(h, normed, cos, sin, next_weight)
            if is_last or not torch.is_grad_enabled():
                continue
            # The backward pass reaches this point once layers i+1 and up have run theirs. The hooks applied last
            # here run first there: the all-reduces of layer i+1's gradients start before the early update.
            if i == 0 and self.early_update is not None:
                h, normed = CallDuringBackward.apply(self.early_update, h, normed)
            if self.layer_gradients_queued is not None:
                h, normed = CallDuringBackward.apply(functools.partial(self.layer_gradients_queued, i + 1), h, normed)
        if targets is None:
            with profile_range("output_head"):
                return self.lm_head(normed), None
        with profile_range("loss"):
            # Output head and loss in one chunked op: the [B*S, V] float32 logits are never built. A training
            # step differentiates the loss once: its gradients, computed here, are then scaled in place.
            head_gradients = self.sixteen_bit_gradients if self.sixteen_bit_head_gradient else None
            return None, linear_cross_entropy(normed, self.lm_head.weight, targets,
                                              weight16=self.lm_head.weight16, backward_once=True,
                                              sixteen_bit_gradients=head_gradients)

    def layer_projection_parameters(self, k: int) -> list:
        """The projection weights of layer k, and with the last layer the output head's (whose gradient the loss
        computes in the forward pass): what layer_gradients_queued(k) announces as final."""
        params = [p for m in self.layers[k].modules() if isinstance(m, Projection) for p in m.parameters()]
        return params + [self.lm_head.weight] if k == len(self.layers) - 1 else params

    def configure_optimizer(self, train):
        """TritonAdamW (kernels/adamw.py): one Triton kernel updates every parameter and writes the 16-bit
        weight copies. With use_triton_adamw False, torch's AdamW: fused on the GPU (one multi-tensor kernel),
        `capturable` there to keep the step counter on the device, which a CUDA/HIP graph replay needs.
        DeepSpeed gets torch's AdamW too: it re-groups the parameters into flat buffers of its own (and, under
        bf16, keeps the weights themselves in bfloat16), so there are no copies for this optimizer to write."""
        hyper = dict(lr=train.learning_rate, betas=(0.9, 0.95), weight_decay=train.weight_decay)
        self.optimizer_writes_copies = self.use_triton_adamw and not train.uses_deepspeed
        if self.optimizer_writes_copies:
            # One group per layer from the last down to layer 0, tagged with its layer: GraphedStep updates each
            # during the backward pass, once the layer below has queued its weight gradients (layer 0's, and
            # under data parallel layer 1's, once backward() has returned). Then the norms, and the embedding in
            # a group of its own: under data parallel its gradient may come out of the backward pass summed
            # (embedding_row_exchange), and then it is updated while the norms' are still being summed.
            by_layer = [{"params": self.layer_projection_parameters(k), "layer": k}
                        for k in range(len(self.layers) - 1, -1, -1)]
            early_ids = {id(p) for group in by_layer for p in group["params"]} | {id(self.embed_tokens.weight)}
            rest = [p for p in self.parameters() if id(p) not in early_ids]
            embedding = {"params": [self.embed_tokens.weight], "embedding": True}
            return TritonAdamW(by_layer + [{"params": rest}, embedding], sixteen_bit_copies=self.sixteen_bit_copies,
                               sixteen_bit_gradients=self.sixteen_bit_gradients, **hyper)
        on_gpu = next(self.parameters()).is_cuda
        return torch.optim.AdamW(self.parameters(), fused=on_gpu or None,
                                 capturable=on_gpu and self.capturable_optimizer, **hyper)

    def use_rope_in_attention(self, enabled: bool = True):
        """RoPE as the attention kernel loads q and k (True), or where use_separate_rope says (False, the default:
        in the QKV GEMM's epilogue or a kernel of its own after it)."""
        for layer in self.layers:
            layer.attention.rope_in_attention = enabled

    def use_separate_rope(self, enabled: bool | None = True):
        """RoPE as a kernel of its own after the vendor QKV GEMM (True), in the Triton QKV GEMM's epilogue (False),
        or whichever is faster at the batch's size (None, the default)."""
        for layer in self.layers:
            layer.attention.separate_rope = enabled

    def use_vendor_attention(self, enabled: bool | None = True):
        """cuDNN's fused attention after the QKV GEMM and RoPE (True), our attention kernels (False), or whichever
        is faster on this GPU at this head dim and dtype (None, the default)."""
        for layer in self.layers:
            layer.attention.vendor_attention = enabled

    def use_separate_swiglu(self, enabled: bool | None = True):
        """SwiGLU as a kernel of its own between vendor GEMMs (True), in the Triton GEMMs' epilogues (False), or
        whichever is faster at the batch's size (None, the default)."""
        for layer in self.layers:
            layer.feed_forward.separate_swiglu = enabled

    def use_exact_float32(self, exact: bool = True):
        """Float32 attention dot products in IEEE float32 rather than TF32 (equivalence tests use this)."""
        for layer in self.layers:
            layer.attention.exact_float32 = exact

    # Fused matrices are the canonical (version 1) ones concatenated along the output dimension.
    def load_canonical(self, state_dict):
        check_canonical(state_dict, self.config)
        fused = fuse(state_dict, WEIGHT_GROUPS)
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                tensor.copy_(fused[name])

    def canonical_state_dict(self):
        return self.to_canonical({name: tensor.detach().clone() for name, tensor in self.state_dict().items()})

    def to_canonical(self, tensors: dict) -> dict:
        """Any per-parameter tensors of this model (weights, gradients) in the canonical layout."""
        return split(tensors, WEIGHT_GROUPS)


# ----------------------------------------------------------------------------------------------------------
# Command line: the shared harness plus version 4's switches
# ----------------------------------------------------------------------------------------------------------
def add_arguments(group):
    group.add_argument("--cuda-graph", dest="cuda_graph", action="store_true", default=True,
                       help="capture the training step in a CUDA/HIP graph and replay it (default on a GPU)")
    group.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                       help="launch every kernel from Python each step (to measure what the graph saves)")
    add_tf32_arguments(group)
    add_cublas_workspace_argument(group)
    group.add_argument("--no-weight-grad-stream", dest="weight_grad_stream", action="store_false", default=True,
                       help="in the graph-captured step, compute the weight gradients on the main stream instead "
                            "of a second one (to measure what the overlap saves)")
    group.add_argument("--equal-stream-priority", action="store_true",
                       help="in the graph-captured step, give the main stream no priority over the second one "
                            "(to measure what the priority saves)")
    add_weight_gradient_dtype_arguments(group)
    add_rope_arguments(group)
    add_swiglu_arguments(group)
    add_attention_arguments(group)
    add_launch_arguments(group)
    group.add_argument("--torch-adamw", action="store_true",
                       help="update the weights with torch.optim.AdamW(fused=True) and copy the bfloat16 weights "
                            "in a kernel of their own, instead of version 4's Triton AdamW (to compare)")
    group.add_argument("--graph-warmup-steps", type=graph_warmup_int, default=3,
                       help=f"eager steps before the graph is captured; at most {GRAPH_WARMUP_LIMIT}")
    group.add_argument("--embedding-grad-sync", choices=graphed_step.EMBEDDING_GRAD_SYNC, default="auto",
                       help="under torchrun, in the graph-captured step: sum the embedding's gradient over the "
                            "ranks by all-reducing the table (table) or by gathering every rank's token rows (rows); "
                            "auto (the default): rows while ranks x tokens per rank <= vocabulary size")


def add_weight_gradient_dtype_arguments(parser):
    parser.add_argument("--float32-weight-grads", dest="sixteen_bit_weight_grads", action="store_false",
                        default=True,
                        help="in the graph-captured step under autocast, write the projections' weight gradients in "
                             "float32 instead of the GEMMs' 16-bit dtype (to compare)")
    parser.add_argument("--float32-head-grad", dest="sixteen_bit_head_grad", action="store_false", default=True,
                        help="where the projections' weight gradients are 16-bit, still sum the output head's in "
                             "float32 rather than bfloat16 (to compare)")


def add_rope_arguments(parser):
    """The three RoPE switches, one at most (also profile_graphed_step.py's). Default (none of them): the form that
    is faster at the run's size, from about a billion multiply-adds in the QKV GEMM the vendor's
    (fused_layers.separate_rope_pays)."""
    rope = parser.add_mutually_exclusive_group()
    rope.add_argument("--rope-in-attention", action="store_true",
                      help="rotate q and k by RoPE as the attention kernel loads them, after a vendor QKV GEMM, "
                           "instead of in the QKV GEMM's epilogue (version 4's first fusion of RoPE; to compare)")
    rope.add_argument("--separate-rope", dest="separate_rope", action="store_const", const=True, default=None,
                      help="at every size, compute the QKV GEMM with the vendor BLAS and RoPE as a kernel of its "
                           "own (default: chosen by size, this from the small preset up)")
    rope.add_argument("--rope-in-gemm", dest="separate_rope", action="store_const", const=False,
                      help="at every size, rotate q and k in the epilogue of a Triton QKV GEMM (default: chosen by "
                           "size, this below the small preset)")


def add_attention_arguments(parser):
    """The two attention switches, one at most (also profile_graphed_step.py's). Default (neither): cuDNN's fused
    attention where it is faster (fused_layers.vendor_attention_pays: Hopper GPUs, 16-bit, head dim 128 and up),
    else ours."""
    attention = parser.add_mutually_exclusive_group()
    attention.add_argument("--cudnn-attention", dest="vendor_attention", action="store_const", const=True,
                           default=None,
                           help="at every size, cuDNN's fused attention (PyTorch's scaled_dot_product_attention) "
                                "after the QKV GEMM and RoPE; needs an NVIDIA GPU and --use-amp (default: chosen "
                                "by GPU and head dim, this on Hopper from head dim 128)")
    attention.add_argument("--triton-attention", dest="vendor_attention", action="store_const", const=False,
                           help="at every size, version 4's Triton flash-attention kernels (default: chosen by GPU "
                                "and head dim, these below head dim 128 and off Hopper)")


def add_launch_arguments(parser):
    """How version 4's Triton kernels are launched (also profile_graphed_step.py's)."""
    parser.add_argument("--no-programmatic-launch", dest="programmatic_launch", action="store_false", default=True,
                        help="launch every Triton kernel only once the kernel before it has completed (default on "
                             "Hopper and later NVIDIA GPUs: it may be launched before and waits for it first, "
                             "kernels/programmatic_launch.py; to compare)")


def add_swiglu_arguments(parser):
    """The two SwiGLU switches, one at most (also profile_graphed_step.py's). Default (neither): the form that is
    faster at the run's size, from about a billion multiply-adds per feed-forward GEMM the vendor's
    (fused_layers.separate_swiglu_pays)."""
    swiglu = parser.add_mutually_exclusive_group()
    swiglu.add_argument("--separate-swiglu", dest="separate_swiglu", action="store_const", const=True, default=None,
                        help="at every size, compute the feed-forward GEMMs with the vendor BLAS and SwiGLU as a "
                             "kernel of its own each way (default: chosen by size, this from the small preset up)")
    swiglu.add_argument("--swiglu-in-gemms", dest="separate_swiglu", action="store_const", const=False,
                        help="at every size, compute SwiGLU in the epilogues of Triton feed-forward GEMMs "
                             "(default: chosen by size, this below the small preset)")


def shape_problem(config: ModelConfig, batch_size: int, seq_len: int, gemm_dtype: torch.dtype = torch.float32,
                  rope_form: str | None = None, swiglu_in_gemms: bool | None = None) -> str | None:
    """Why version 4's kernels cannot train this model on batches of batch_size x seq_len tokens whose GEMMs
    compute in gemm_dtype (one line that names the sizes to change), or None when they can. Each rule is asked
    of the kernel module that enforces it: flash attention (head dims, 32-bit offsets, grid), the fused norms
    (row width), the QKV + RoPE GEMM (head dims, weight size, column tiles of whole heads, row blocks) or the
    separate RoPE kernel (head blocks), whichever runs (rope_form "gemm", "separate" or "attention", the last
    --rope-in-attention; None: as the size rule picks), and the feed-forward GEMMs (weight size, row blocks; unless
    --separate-swiglu; swiglu_in_gemms None: where the size rule keeps them), so that a bad size is reported before
    anything is built instead of as a traceback from inside a kernel launch."""
    rows, dim, head_dim = batch_size * seq_len, config.hidden_dim, config.head_dim
    rope_form = rope_form or rope_form_of(False, None, rows, dim)
    if swiglu_in_gemms is None:
        swiglu_in_gemms = not separate_swiglu_pays(rows, dim, config.intermediate_size)
    sizes = f"batch {batch_size} x seq_len {seq_len} = {rows} rows, hidden_dim {dim}"
    checks = [
        ("flash attention", attention_kernels.shape_problem(batch_size * config.num_heads, seq_len, head_dim, 3 * dim),
         f"batch {batch_size} x {config.num_heads} heads, seq_len {seq_len}, hidden_dim {dim}"),
        ("QKV + RoPE GEMM", qkv_kernels.shape_problem(rows, dim, dim, head_dim, gemm_dtype) if rope_form == "gemm"
         else None, sizes),
        ("RoPE kernel", rotation_kernels.shape_problem(rows, dim, head_dim) if rope_form == "separate" else None,
         sizes),
        ("add + RMSNorm", norm_kernels.shape_problem(dim), "--hidden-dim"),
        ("SwiGLU GEMMs", ffn_kernels.shape_problem(rows, dim, config.intermediate_size, gemm_dtype)
         if swiglu_in_gemms else None, f"{sizes}, intermediate_size {config.intermediate_size}"),
    ]
    for kernel, problem, context in checks:
        if problem:
            if "head dim" in problem:
                context = head_dim_advice(config, attention_kernels.SUPPORTED_HEAD_DIMS)
            return f"version 4's Triton {kernel}: {problem} ({context})"
    return None


def shape_problem_of_args(args) -> str | None:
    """shape_problem for the model, batch and precision that this version's parsed command-line arguments
    describe (flags, --config and --preset resolved as the harness resolves them)."""
    return shape_problem_of_run(args, *resolve_configs(args))


def gemm_dtype_of(train) -> torch.dtype:
    """The dtype this run's GEMMs and attention compute in: autocast's under --use-amp, else float32."""
    return getattr(torch, train.amp_dtype) if train.use_amp else torch.float32


def shape_problem_of_run(args, config: ModelConfig, train) -> str | None:
    """shape_problem for this model and training configuration, with the RoPE and SwiGLU forms that args' switches
    (or, without them, the size rules) choose; also profile_graphed_step.py's check."""
    return shape_problem(config, train.batch_size, train.seq_len, gemm_dtype_of(train),
                         rope_form=rope_form_of_args(args, config, train),
                         swiglu_in_gemms=not separate_swiglu_of_args(args, config, train))


def rope_form_of_args(args, config: ModelConfig, train) -> str:
    """Where this run rotates q and k (fused_layers.rope_form_of): as a flag says, or else as the run's size decides
    (the layers decide the same way from the batch they get)."""
    return rope_form_of(getattr(args, "rope_in_attention", False), getattr(args, "separate_rope", None),
                        train.batch_size * train.seq_len, config.hidden_dim)


def separate_swiglu_of_args(args, config: ModelConfig, train) -> bool:
    """Whether this run's feed-forward layers use the vendor GEMMs and SwiGLU kernels of their own: as a flag
    says, or else as the run's size decides (the layers decide the same way from the batch they get)."""
    return uses_separate_swiglu(getattr(args, "separate_swiglu", None), train.batch_size * train.seq_len,
                                config.hidden_dim, config.intermediate_size)


def shape_problem_of_flags(flags: list[str]) -> str | None:
    """shape_problem for training flags meant for this script: for a script that starts it with them
    (run_ultra_profiling.py, compare_versions.py), so that a bad size stops that script before its first run.
    Flags of other versions are ignored; a flag this version refuses is a ConfigError."""
    args, _ = build_parser(SPEC).parse_known_args(flags)
    return shape_problem_of_args(args)


def check_arguments(args, device):
    config, train = resolve_configs(args)
    problem = shape_problem_of_run(args, config, train)   # first: a shape this version cannot run is wrong anywhere
    if problem:
        raise ConfigError(problem)
    if device.type == "cpu" and not interpreter_active():
        raise ConfigError("version 4's Triton kernels were compiled for the GPU; for a CPU run start with "
                          "TRITON_INTERPRET=1 (Triton's interpreter) or omit --device cpu")
    if device.type == "cpu" and args.use_amp:
        raise ConfigError("--use-amp with Triton's CPU interpreter is not supported: the interpreter computes "
                          "bfloat16 dot products wrongly; run float32 on the CPU or use a GPU")
    if args.graph_warmup_steps < 1:
        raise ConfigError("--graph-warmup-steps must be at least 1 (the optimizer state must exist before capture)")
    probed = device
    if device.type == "cuda":   # the GPU this rank will use (under torchrun before the harness selects it)
        probed = torch.device("cuda", distributed.launcher_int(os.environ, "LOCAL_RANK")
                              if "LOCAL_RANK" in os.environ else 0)
    problem = forced_attention_problem(args, probed, gemm_dtype_of(train), config.head_dim)
    if problem:
        raise ConfigError(problem)
    apply_tf32_argument(args, device)
    apply_cublas_workspace_argument(args, device)   # before the run's first GEMM


def forced_attention_problem(args, device, dtype, head_dim) -> str | None:
    """Why --cudnn-attention cannot run as asked (one line), or None: it needs RoPE before the attention (not
    --rope-in-attention) and cuDNN's attention on this device for q, k, v of this dtype and head dim. Also
    profile_graphed_step.py's check."""
    if getattr(args, "vendor_attention", None) is not True:
        return None
    if args.rope_in_attention:
        return "--cudnn-attention and --rope-in-attention: RoPE on load exists in version 4's attention kernel only"
    problem = vendor_attention_problem(device, dtype, head_dim)
    return f"--cudnn-attention: {problem}" if problem else None


def build_model(config, args):
    model = TinyLlama(config)
    model.capturable_optimizer = bool(args.cuda_graph)
    model.use_triton_adamw = not args.torch_adamw
    model.use_rope_in_attention(args.rope_in_attention)
    model.use_separate_rope(args.separate_rope)
    model.use_separate_swiglu(args.separate_swiglu)
    model.use_vendor_attention(getattr(args, "vendor_attention", None))   # callers' own Namespaces may lack it
    set_programmatic_launch(getattr(args, "programmatic_launch", True))   # every launch of this process
    return model


ROPE_DESCRIPTIONS = {"attention": "in the attention kernel, on load",
                     "separate": "a kernel of its own, after a vendor QKV GEMM",
                     "gemm": "in the QKV GEMM's epilogue"}


def describe_rope(args) -> str:
    """Where this run rotates q and k (the header's RoPE line)."""
    chosen_by_size = not args.rope_in_attention and getattr(args, "separate_rope", None) is None
    # Only a choice by size needs the run's configuration (a caller may describe flags without one); a form that
    # a flag chose does not depend on the size, so rows and width are then not looked at.
    form = (rope_form_of_args(args, *resolve_configs(args)) if chosen_by_size
            else rope_form_of(args.rope_in_attention, args.separate_rope))
    return ROPE_DESCRIPTIONS[form] + (" (the faster form at this size)" if chosen_by_size else "")


def attention_of_args(args, on_gpu: bool) -> tuple[bool, bool]:
    """(whether this run's layers take cuDNN's attention, whether the rule chose it rather than a flag)."""
    chosen = getattr(args, "vendor_attention", None)
    ours_only = not on_gpu or getattr(args, "rope_in_attention", False)   # cuDNN's needs a GPU and RoPE before it
    by_rule = chosen is None and not ours_only
    if by_rule:   # as the layers decide: by GPU, dtype and head dim
        config, train = resolve_configs(args)
        vendor = uses_vendor_attention(None, "gemm", torch.device("cuda"), gemm_dtype_of(train), config.head_dim)
    else:
        vendor = bool(chosen) and not ours_only
    return vendor, by_rule


def describe_attention(vendor: bool, by_rule: bool) -> str:
    """Which attention this run's layers take (the header's attention line), from attention_of_args."""
    text = ("cuDNN's fused attention (scaled_dot_product_attention), RoPE's backward a kernel of its own" if vendor
            else "version 4's Triton flash attention")
    return text + (" (the faster one here)" if by_rule else "")


def describe_attention_tiles(args) -> str:
    """The launches version 4's attention kernels take at this run's shape on this GPU (the header's "attn tiles"
    line, printed where the layers take version 4's attention)."""
    config, train = resolve_configs(args)
    return attention_kernels.launch_summary(config.head_dim, gemm_dtype_of(train), train.seq_len,
                                            torch.device("cuda"), rope_on_load=bool(args.rope_in_attention))


def runs_under_deepspeed(args) -> bool:
    """TrainConfig.uses_deepspeed, read from the flags (the header may describe flags without a configuration)."""
    return bool(getattr(args, "deepspeed", None) or getattr(args, "deepspeed_config", None))


def takes_torch_adamw(args) -> bool:
    """Whether this run's optimizer is torch's AdamW: --torch-adamw, or DeepSpeed, whose engine always gets it."""
    return bool(args.torch_adamw) or runs_under_deepspeed(args)


def sixteen_bit_weight_gradients_of_args(args) -> bool:
    """graphed_step.writes_sixteen_bit_weight_gradients, as a run with these flags meets it: under torchrun the step
    gets a gradient_sync (the all-reduces sum float32 .grad); torch's AdamW does not read them."""
    return graphed_step.writes_sixteen_bit_weight_gradients(
        getattr(args, "sixteen_bit_weight_grads", True), args.weight_grad_stream,
        summed_across_ranks=distributed.launched_by_torchrun(), optimizer_reads_them=not takes_torch_adamw(args))


def describe_weight_gradient_dtypes(args) -> str:
    """The header's words for the weight gradients the graph-captured step's optimizer reads under autocast."""
    if not sixteen_bit_weight_gradients_of_args(args):
        return "float32 weight gradients"
    # (Under float16 the head's would stay float32, but a float16 step has no graph: GradScaler decides on the host.)
    head_too = getattr(args, "sixteen_bit_head_grad", True)
    return "16-bit weight gradients" + (", the output head's too" if head_too else " (the output head's float32)")


def describe(args) -> dict:
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    step = "CUDA/HIP graph replay" if (on_gpu and args.cuda_graph) else "eager launches"
    if on_gpu and args.cuda_graph:
        step += ", weight gradients on " + ("a second stream" if args.weight_grad_stream else "the main stream")
        if args.weight_grad_stream and not args.equal_stream_priority and graphed_step.graph_priorities_apply():
            step += " of lower priority"
    if interpreter_active():
        step += " (in Triton's CPU interpreter: correct but slow)"
    rope = describe_rope(args)
    chosen_by_size = getattr(args, "separate_swiglu", None) is None
    # Only a choice by size needs the run's configuration (a caller may describe flags without one).
    separate = separate_swiglu_of_args(args, *resolve_configs(args)) if chosen_by_size else args.separate_swiglu
    swiglu = ("a kernel of its own each way, between vendor GEMMs" if separate
              else "in the feed-forward GEMMs' epilogues")
    if chosen_by_size:
        swiglu += " (the faster form at this size)"
    if takes_torch_adamw(args):
        optimizer = "torch AdamW (fused)" if on_gpu else "torch AdamW"
    elif getattr(args, "use_amp", False):
        optimizer = "Triton AdamW, writing the 16-bit weight copies"
        if on_gpu and graphed_step.uses_graph(args, torch.device("cuda")) and args.weight_grad_stream:
            optimizer += ", reading " + describe_weight_gradient_dtypes(args)
    else:
        optimizer = "Triton AdamW"
    # On the CPU, PyTorch's matmuls and the interpreter's tl.dot (NumPy) both compute in IEEE float32.
    matmuls = describe_float32_matmuls(
        args, on_gpu, on_cpu="exact float32 in PyTorch and Triton's CPU interpreter (TF32, --tf32, is for NVIDIA GPUs)")
    vendor_attention, attention_by_rule = attention_of_args(args, on_gpu)
    info = {"step": step, "matmuls": matmuls, "RoPE": rope,
            "attention": describe_attention(vendor_attention, attention_by_rule)}
    if on_gpu and not vendor_attention:
        info["attn tiles"] = describe_attention_tiles(args)
    info.update({"SwiGLU": swiglu, "optimizer": optimizer})
    workspace = describe_cublas_workspace(on_gpu)
    if workspace:
        info["cuBLAS workspace"] = workspace
    graphed = on_gpu and graphed_step.uses_graph(args, torch.device("cuda"))
    if graphed and distributed.launched_by_torchrun() and not runs_under_deepspeed(args):
        info["embed grad"] = embedding_grad_sync_of_args(args)
    return info


def embedding_grad_sync_of_args(args) -> str:
    """How the graph-captured step under torchrun sums the embedding's gradient (GraphedStep's rule), in words."""
    config, train = resolve_configs(args)
    ranks, tokens = distributed.launcher_int(os.environ, "WORLD_SIZE"), train.batch_size * train.seq_len
    if graphed_step.exchanges_embedding_rows(args.embedding_grad_sync, ranks, tokens, config.vocab_size):
        return (f"summed by gathering every rank's token rows ({ranks} x {tokens:,} rows, not the "
                f"{config.vocab_size:,}-row table; --embedding-grad-sync)")
    if args.embedding_grad_sync == "table" or ranks == 1:
        return "the table all-reduced (--embedding-grad-sync)"
    return (f"the table all-reduced ({config.vocab_size:,} rows: fewer than {ranks} x {tokens:,} token rows; "
            f"--embedding-grad-sync)")


# The training step is a strategy of its own (graphed_step.py): the graph-captured step on a GPU, else eager.
# Under torchrun the graph-captured step averages the gradients itself (all-reduces inside the graph), so the
# harness does not wrap the model in DDP whenever that step runs (averages_gradients).
SPEC = VersionSpec(name="v4", title="Triton ultra-fused", build_model=build_model, add_arguments=add_arguments,
                   check_arguments=check_arguments, describe=describe, make_step=graphed_step.make_step,
                   averages_gradients=graphed_step.uses_graph)


def main(argv=None):
    # Without a GPU the header says that the kernels run in Triton's CPU interpreter (describe); nothing is
    # printed before the arguments are checked, so that bad input is one line.
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
