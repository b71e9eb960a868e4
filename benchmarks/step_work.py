"""The work one training step of TinyLlama must do, by family: matrix products, attention, and the bytes of
every memory-bound pass, counted from the model's sizes (no GPU, nothing run).

These are the two numbers to count before timing anything, for a whole step: the operations and the bytes.
step_floor.py divides them by what a GPU can do (its measured ceilings) to get the time no implementation of
this step can beat with kernels of those speeds run one after another.

What counts as the step's function (every version computes it; bfloat16 autocast, as the presets are benchmarked):
- GEMMs in 16-bit with float32 accumulation: per projection the forward, the input gradient and the weight
  gradient (three products of 2 M N K FLOPs each); the output head too.
- Causal attention as flash attention computes it, over the visible pairs (S(S+1)/2, counted as S^2/2): two
  products in the forward pass (the scores, and the probabilities times V) and five in the backward (the scores
  once more, dP = dO V^T, and dq, dk, dv).
- A residual stream in float32 (autocast adds each sub-layer's 16-bit output to it), float32 master weights with
  AdamW's two float32 moments, and a 16-bit copy of every projection weight for the GEMMs.

The memory-bound families are counted as one pass each way, each input read once and each output written once:
bytes per element in the comments below. That is what a kernel of its own per family needs at the least. A
family fused into a GEMM's prologue or epilogue would cost less (version 4 does that for RoPE and SwiGLU below
the small preset, where its Triton GEMMs are faster than the vendor's and the floor is launch-bound anyway).
RoPE's backward is not here: it is part of the attention's backward where the attention kernels rotate dq and
dk back as they store them, and step_floor.py adds it to any attention that does not.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinytransformer.config import ModelConfig

ACTIVATION_BYTES = 2   # bfloat16
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Gemm:
    """One matrix product of the step: [m, k] @ [k, n], `count` times a step."""
    name: str
    m: int
    n: int
    k: int
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


def step_gemms(config: ModelConfig, batch: int, seq: int) -> list[Gemm]:
    """Every GEMM of a training step: forward, input gradient and weight gradient of each projection."""
    tokens, d, f = batch * seq, config.hidden_dim, config.intermediate_size
    projections = [("qkv", d, 3 * d, config.num_layers), ("o", d, d, config.num_layers),
                   ("gate_up", d, 2 * f, config.num_layers), ("down", f, d, config.num_layers),
                   ("head", d, config.vocab_size, 1)]
    gemms = []
    for name, n_in, n_out, count in projections:
        gemms += [Gemm(f"{name} forward", tokens, n_out, n_in, count),
                  Gemm(f"{name} input gradient", tokens, n_in, n_out, count),
                  Gemm(f"{name} weight gradient", n_out, n_in, tokens, count)]
    return gemms


def attention_flops(config: ModelConfig, batch: int, seq: int) -> int:
    """Causal attention, forward and backward, all layers: 7 products of B * H * (S^2 / 2) * Dh multiply-adds."""
    per_product = 2 * batch * config.num_heads * (seq * seq // 2) * config.head_dim
    return 7 * per_product * config.num_layers


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(parameters with a 16-bit GEMM copy: the projections and the head; the others: embedding, norm weights)."""
    d, f, layers = config.hidden_dim, config.intermediate_size, config.num_layers
    with_copy = layers * (3 * d * d + d * d + 2 * d * f + f * d) + config.vocab_size * d
    without_copy = config.vocab_size * d + (2 * layers + 1) * d
    return with_copy, without_copy


def rope_pass_bytes(config: ModelConfig, batch: int, seq: int) -> int:
    """One rotation pass of RoPE, all layers: q and k (2D of each token's 3D) read and written once, in 16 bits.
    The forward pass rotates q and k; an attention whose backward does not rotate dq and dk back needs the same
    pass again for them (step_floor.py)."""
    return config.num_layers * batch * seq * 2 * config.hidden_dim * 2 * ACTIVATION_BYTES


def memory_passes(config: ModelConfig, batch: int, seq: int) -> dict[str, int]:
    """{family: bytes a step} of the memory-bound passes, each input read once, each output written once."""
    tokens, d, f, v = batch * seq, config.hidden_dim, config.intermediate_size, config.vocab_size
    layers, b16, f32 = config.num_layers, ACTIVATION_BYTES, FLOAT32_BYTES
    with_copy, without_copy = parameter_counts(config)
    # The 2L + 1 norms: the first after the embedding lookup, 2L - 1 inside the layers that add a sub-layer's
    # output to the residual stream, and the final norm, which adds too but whose sum nothing else reads.
    layer_norms = 2 * layers - 1
    first_forward = f32 + f32 + b16             # read the embedding rows; write the residual and normed
    add_norm_forward = f32 + b16 + f32 + b16    # read residual + sub-layer output; write residual + normed
    final_forward = f32 + b16 + b16             # read residual + sub-layer output; write normed
    # Backward: read dnormed (2), the norm's input h (4) and the residual's gradient (4); write the gradient (4)
    # and its 16-bit copy for the GEMM before it (2). The final norm has no residual gradient to read; the first
    # norm's gradient goes into the embedding table's (its row additions: "embedding gradient").
    add_norm_backward = b16 + f32 + f32 + f32 + b16
    final_backward = b16 + f32 + f32 + b16
    first_backward = b16 + f32 + f32
    norms = (first_forward + layer_norms * add_norm_forward + final_forward
             + first_backward + layer_norms * add_norm_backward + final_backward)
    return {
        "norms (add + RMSNorm)": tokens * d * norms,
        # forward: read gate and up (2 x 2), write h (2); backward: read dh, gate, up (3 x 2), write dgate, dup (2 x 2)
        "SwiGLU": layers * tokens * f * (3 * b16 + 5 * b16),
        "RoPE": rope_pass_bytes(config, batch, seq),   # the forward rotation of q and k
        # the 16-bit logits read once and overwritten by their gradient (version 4 reads a row twice where it is
        # longer than the 4,096 entries one program holds: the log-sum-exp first, then the gradient)
        "loss (softmax cross-entropy)": tokens * v * 2 * b16,
        # the table's float32 gradient written once, each token's row added into it (read and written)
        "embedding gradient": v * d * f32 + tokens * d * 2 * f32,
        # weight, gradient, two moments read; weight and moments written (7 x 4); a 16-bit copy written (2). The
        # gradient counted in float32, as the committed floors were measured: version 4's graph-captured step now
        # reads the projections' in bfloat16 (version4_triton_ultra/MEASUREMENTS.md, "16-bit weight gradients").
        "AdamW": with_copy * (7 * f32 + b16) + without_copy * 7 * f32,
    }
