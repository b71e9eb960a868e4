"""The work one training step of TinyLlama must do, by family: matrix products, attention, and the bytes of
every memory-bound pass, counted from the model's sizes (no GPU, nothing run).

This is the first of METHOD's "two numbers" for a whole step: the operations and the bytes. step_floor.py
divides them by what a GPU can do (its measured ceilings) to get the time no implementation of this step can
beat with kernels of those speeds.

What counts as the step's function (every version computes it; bfloat16 autocast, as the presets are benchmarked):
- GEMMs in 16-bit with float32 accumulation: per projection the forward, the input gradient and the weight
  gradient (three products of 2 M N K FLOPs each); the output head too.
- Causal attention as flash attention computes it: the score and value products over the S^2/2 visible pairs,
  two in the forward pass and five in the backward (dq, dk, dv, and the scores and dO V^T once more).
- A residual stream in float32 (autocast adds each sub-layer's 16-bit output to it), float32 master weights with
  AdamW's two float32 moments, and a 16-bit copy of every projection weight for the GEMMs.

The memory-bound families are counted as one pass each way, each input read once and each output written once
(the fusions version 4 has; a family fused into a GEMM would cost less, which no version here does at the
presets): bytes per element in the comments below.
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


def memory_passes(config: ModelConfig, batch: int, seq: int) -> dict[str, int]:
    """{family: bytes a step} of the memory-bound passes, each input read once, each output written once."""
    tokens, d, f, v = batch * seq, config.hidden_dim, config.intermediate_size, config.vocab_size
    layers, a, w = config.num_layers, ACTIVATION_BYTES, FLOAT32_BYTES
    add_norms = 2 * layers   # every norm after the first adds a sub-layer's output to the residual stream
    with_copy, without_copy = parameter_counts(config)
    return {
        # forward: read residual (4) + sub-layer output (2), write residual (4) + normed (2); the first norm reads
        # the embedding rows (4) and writes residual and normed. Backward: read dnormed (2), h (4), the residual's
        # gradient (4); write the gradient (4) and its 16-bit copy for the GEMM before it (2); the first norm's
        # gradient goes into the embedding table's instead (its row additions: below).
        "norms (add + RMSNorm)": tokens * d * (add_norms * (2 * w + 2 * a) + (2 * w + a)
                                               + add_norms * (a + 2 * w + w + a) + (a + 2 * w)),
        # forward: read gate and up (2 x 2), write h (2); backward: read dh, gate, up (3 x 2), write dgate, dup (2 x 2)
        "SwiGLU": layers * tokens * f * (3 * a + 5 * a),
        # q and k (2D of each token's 3D) read and written once, rotated (the backward's inverse rotation rides on
        # the attention backward's stores)
        "RoPE": layers * tokens * 2 * d * 2 * a,
        # the 16-bit logits: read for the log-sum-exp, read again and overwritten by their gradient
        "loss (softmax cross-entropy)": tokens * v * 3 * a,
        # the table's float32 gradient written once, each token's row added into it (read and written)
        "embedding gradient": v * d * w + tokens * d * 2 * w,
        # weight, gradient, two moments read; weight and moments written (7 x 4); a 16-bit copy written (2)
        "AdamW": with_copy * (7 * w + a) + without_copy * 7 * w,
    }
