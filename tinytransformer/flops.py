"""Analytic FLOP counts of TinyLlama (the formulas of TINY_LLAMA_ARCHITECTURE.md, in code).

Conventions (the usual ones for MFU, so numbers compare with published figures):
- a multiply-add is 2 FLOPs; only matrix products are counted (norms, RoPE, softmax, SwiGLU are < 1%);
- attention scores QK^T and the product with V are counted over the full S x S matrix, although causal
  attention needs only half of it (flash attention skips the upper half; the baseline computes it all);
- a training step costs 3x the forward pass: the backward computes two products for each forward product
  (gradient with respect to the input and to the weight).

Arithmetic intensity (FLOPs per byte moved) of each matrix product places it on the roofline: below the device's
ridge point (peak FLOP/s / memory bandwidth) a product is memory-bound (run_deepspeed_flops.py
--computational-intensity and --generate-roofline).
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


# ----------------------------------------------------------------------------------------------------------
# The count part by part, and arithmetic intensity
# ----------------------------------------------------------------------------------------------------------
ATTENTION_MATMULS = ("q_proj", "k_proj", "v_proj", "attention_scores", "attention_values", "o_proj")
FFN_MATMULS = ("gate_proj", "up_proj", "down_proj")


def analytic_counts(cfg: ModelConfig, batch: int, seq: int) -> dict:
    """The whole count of one step, part by part, as run_deepspeed_flops.py prints and saves it."""
    per_layer = forward_flops_per_layer(cfg, batch, seq)
    output_head = 2 * batch * seq * cfg.hidden_dim * cfg.vocab_size
    return {"per_layer": per_layer, "per_layer_total": sum(per_layer.values()), "num_layers": cfg.num_layers,
            "output_head": output_head, "forward_flops": forward_flops(cfg, batch, seq),
            "training_flops": training_flops(cfg, batch, seq),
            "conventions": "matrix products only, 2 FLOPs per multiply-add, full S x S attention; "
                           "training step = 3 x forward"}


BYTE_MODEL = ("bytes moved = (elements of A + elements of B + elements of C) x bytes per element: each operand "
              "is read from device memory once and the result written once (perfect on-chip reuse, the least "
              "traffic possible); the unfused rows are the computation as version 1 writes it")


def layer_matmuls(cfg: ModelConfig, batch: int, seq: int) -> list[tuple[str, int, int, int, int]]:
    """(name, M, K, N, count): each matrix product C[M, N] = A[M, K] @ B[K, N] of one layer, done `count`
    times (once per batch element and head for attention), then the output head (once per model)."""
    tokens, d, f = batch * seq, cfg.hidden_dim, cfg.intermediate_size
    heads, head_dim = cfg.num_heads, cfg.head_dim
    return [
        ("q_proj", tokens, d, d, 1),
        ("k_proj", tokens, d, d, 1),
        ("v_proj", tokens, d, d, 1),
        ("attention_scores", seq, head_dim, seq, batch * heads),    # Q K^T: the S x S scores per head
        ("attention_values", seq, seq, head_dim, batch * heads),    # P V
        ("o_proj", tokens, d, d, 1),
        ("gate_proj", tokens, d, f, 1),
        ("up_proj", tokens, d, f, 1),
        ("down_proj", tokens, f, d, 1),
        ("output_head (once per model)", tokens, d, cfg.vocab_size, 1),
    ]


def intensity_rows(cfg: ModelConfig, batch: int, seq: int, bytes_per_element: int,
                   ridge: float | None) -> list[dict]:
    """Arithmetic intensity (FLOPs per byte, BYTE_MODEL) of each matrix product of a layer, and of flash
    attention's fused scores + values; `bound` says which side of the ridge point (None: unknown) it falls on."""
    rows = []
    for name, m, k, n, count in layer_matmuls(cfg, batch, seq):
        flop = 2 * m * k * n * count
        moved = (m * k + k * n + m * n) * count * bytes_per_element
        rows.append({"matmul": name, "shape": f"{count} x [{m}x{k}] @ [{k}x{n}]" if count > 1 else
                     f"[{m}x{k}] @ [{k}x{n}]", "flops": flop, "bytes": moved})
    # Flash attention fuses scores -> softmax -> values: the S x S matrices never reach memory.
    scores = next(r for r in rows if r["matmul"] == "attention_scores")
    values = next(r for r in rows if r["matmul"] == "attention_values")
    rows.insert(rows.index(values) + 1, {"matmul": "attention fused (flash: Q,K,V in, O out)",
                                         "shape": "scores + values", "flops": scores["flops"] + values["flops"],
                                         "bytes": 4 * batch * seq * cfg.hidden_dim * bytes_per_element})
    for row in rows:
        row["flops_per_byte"] = row["flops"] / row["bytes"]
        row["bound"] = ("-" if ridge is None else "compute" if row["flops_per_byte"] >= ridge else "memory")
    return rows
