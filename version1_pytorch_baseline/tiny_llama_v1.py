"""Version 1: TinyLlama in plain PyTorch, the baseline every later version must match.

Everything is written out the straightforward way, on purpose: separate q, k, v projections, attention as
matmul -> mask -> softmax -> matmul (which materialises the S x S score matrix), separate gate and up
projections in the SwiGLU feed-forward. Each of these is an optimisation target of version 2, 3 or 4.
This file also defines the CANONICAL weight layout (parameter names and shapes) shared by all versions.

Run:   python tiny_llama_v1.py                 (GPU if present, else CPU; the seed config)
       python tiny_llama_v1.py --help          (every option: sizes, data, AMP, profilers, output JSON)
"""
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import VersionSpec, run  # noqa: E402
from tinytransformer.config import ModelConfig  # noqa: E402
from tinytransformer.profiling.ranges import profile_range  # noqa: E402


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, with the statistics in float32 even under mixed precision."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with profile_range("rmsnorm"):
            x32 = x.float()
            variance = x32.pow(2).mean(-1, keepdim=True)
            return (self.weight * (x32 * torch.rsqrt(variance + self.eps))).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, [seq_len, head_dim], for the rotate-half convention.

    Pair (i, i + head_dim/2) of each head vector is rotated by angle pos * theta^(-2i/head_dim).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)   # [S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)                                 # [S, head_dim]
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(q, k, cos, sin):
    """Rotate query and key vectors by their position (RoPE); q, k: [B, H, S, head_dim]."""
    with profile_range("rope"):
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    """Causal multi-head self-attention, computed explicitly (the S x S matrix is materialised)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin, causal_mask):
        batch, seq, dim = x.shape
        with profile_range("attention"):
            # Three separate projections: three GEMM launches that each read x (version 2 fuses them).
            q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, k, cos, sin)
            # [B, H, S, S] scores: O(S^2) memory, the reason flash attention exists.
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(causal_mask, float("-inf"))
            probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs, v)
            out = out.transpose(1, 2).contiguous().view(batch, seq, dim)
            return self.o_proj(out)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with separate gate and up projections."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_dim, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        with profile_range("ffn"):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + ffn(norm(.))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, causal_mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, causal_mask)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = torch.triu(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        self._init_weights()

    def _init_weights(self):
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, 0.0, residual_std)
            else:
                nn.init.normal_(param, 0.0, 0.02)

    def forward(self, input_ids, targets=None):
        seq = input_ids.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        mask = self.causal_mask[:seq, :seq]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.norm(x)
        with profile_range("output_head"):
            logits = self.lm_head(x)
        loss = None
        if targets is not None:
            with profile_range("loss"):
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    # Version 1's own parameter names ARE the canonical layout.
    def load_canonical(self, state_dict):
        self.load_state_dict(state_dict, strict=True)

    def canonical_state_dict(self):
        return {name: tensor.detach().clone() for name, tensor in self.state_dict().items()}

    def to_canonical(self, tensors: dict) -> dict:
        """Any per-parameter tensors of this model (weights, gradients) in the canonical layout."""
        return dict(tensors)


SPEC = VersionSpec(name="v1", title="PyTorch baseline", build_model=lambda config, args: TinyLlama(config))


def main(argv=None):
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
