"""Analytic FLOP counts of TinyLlama (the formulas of TINY_LLAMA_ARCHITECTURE.md, in code).

Conventions (the usual ones for MFU, so numbers compare with published figures):
- a multiply-add is 2 FLOPs; only matrix products are counted (norms, RoPE, softmax, SwiGLU are < 1%);
- attention scores QK^T and the product with V are counted over the full S x S matrix, although causal
  attention needs only half of it (flash attention skips the upper half; the baseline computes it all);
- a training step costs 3x the forward pass: the backward computes two products for each forward product
  (gradient with respect to the input and to the weight).
"""
from __future__ import annotations

from .config import ModelConfig


def forward_flops_per_layer(config: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
    tokens = batch_size * seq_len
    d, f = config.hidden_dim, config.intermediate_size
    return {
        "q_proj": 2 * tokens * d * d,
        "k_proj": 2 * tokens * d * d,
        "v_proj": 2 * tokens * d * d,
        "attention_scores": 2 * batch_size * seq_len * seq_len * d,   # all heads: H * S * S * Dh = S*S*D
        "attention_values": 2 * batch_size * seq_len * seq_len * d,
        "o_proj": 2 * tokens * d * d,
        "gate_proj": 2 * tokens * d * f,
        "up_proj": 2 * tokens * d * f,
        "down_proj": 2 * tokens * f * d,
    }


def forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    per_layer = sum(forward_flops_per_layer(config, batch_size, seq_len).values())
    output_head = 2 * batch_size * seq_len * config.hidden_dim * config.vocab_size
    return config.num_layers * per_layer + output_head


def training_flops(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    return 3 * forward_flops(config, batch_size, seq_len)


def mfu(config: ModelConfig, batch_size: int, seq_len: int, step_seconds: float,
        peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak (None when the peak is unknown)."""
    if not peak_tflops or step_seconds <= 0:
        return None
    return training_flops(config, batch_size, seq_len) / step_seconds / (peak_tflops * 1e12)
