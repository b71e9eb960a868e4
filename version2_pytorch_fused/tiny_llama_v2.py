"""Version 2: TinyLlama with PyTorch-level fusions. Same function as version 1, fewer and larger kernels.

What changed from version 1 (`diff ../version1_pytorch_baseline/tiny_llama_v1.py tiny_llama_v2.py`):
  1. QKV fusion: one [D -> 3D] projection instead of three [D -> D] ones: one GEMM reads x once.
  2. Flash attention: F.scaled_dot_product_attention(is_causal=True) picks a fused kernel (FlashAttention /
     memory-efficient / cuDNN on NVIDIA, CK or AOTriton flash kernels on AMD) that never stores the S x S matrix.
  3. SwiGLU fusion: one [D -> 2F] gate/up projection instead of two.
  4. Optional torch.compile: fuses the remaining element-wise work (RMSNorm, RoPE, SiLU*up, residual adds) and,
     with --torch-compile-mode reduce-overhead, replays the step's kernels from a CUDA/HIP graph.
Each fusion can be switched off; with all of them off this file computes exactly version 1's model.

Run:   python tiny_llama_v2.py                              (all fusions on)
       python tiny_llama_v2.py --enable-torch-compile --torch-compile-mode reduce-overhead
       python tiny_llama_v2.py --disable-all-fusion         (= version 1's computation)
       python fusion_ablation.py                            (every combination, one table)
"""
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import VersionSpec, run  # noqa: E402
from tinytransformer.config import ModelConfig  # noqa: E402
from tinytransformer.profiling.ranges import profile_range  # noqa: E402
from tinytransformer.weights import (GATE_UP_GROUP, QKV_GROUP, check_canonical, fuse,  # noqa: E402
                                     init_canonical_weights, split)


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
    """Causal multi-head self-attention with a fused QKV projection and a fused attention kernel."""

    def __init__(self, config: ModelConfig, fuse_qkv: bool, flash_attention: bool):
        super().__init__()
        d = config.hidden_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.fuse_qkv, self.flash_attention = fuse_qkv, flash_attention
        if fuse_qkv:
            self.qkv_proj = nn.Linear(d, 3 * d, bias=False)   # rows: [q; k; v]
        else:
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d, bias=False)
            self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def project(self, x):
        batch, seq, _ = x.shape
        if self.fuse_qkv:
            # One GEMM, then views: [B, S, 3, H, Dh] -> three [B, H, S, Dh] tensors, no copies.
            qkv = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim)
            return qkv.permute(2, 0, 3, 1, 4).unbind(0)
        split = lambda t: t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        return split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))

    def forward(self, x, cos, sin, causal_mask):
        batch, seq, dim = x.shape
        with profile_range("attention"):
            q, k, v = self.project(x)
            q, k = apply_rope(q, k, cos, sin)
            if self.flash_attention:
                # A fused kernel: scores live in on-chip memory one tile at a time, never as [B, H, S, S].
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
                scores = scores.masked_fill(causal_mask, float("-inf"))
                probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
                out = torch.matmul(probs, v)
            out = out.transpose(1, 2).contiguous().view(batch, seq, dim)
            return self.o_proj(out)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up computed by one GEMM when fused."""

    def __init__(self, config: ModelConfig, fuse_gate_up: bool):
        super().__init__()
        d, f = config.hidden_dim, config.intermediate_size
        self.fuse_gate_up = fuse_gate_up
        if fuse_gate_up:
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)   # rows: [gate; up]
        else:
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        with profile_range("ffn"):
            if self.fuse_gate_up:
                gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + ffn(norm(.))."""

    def __init__(self, config: ModelConfig, fusions: "Fusions"):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.attention = Attention(config, fusions.qkv, fusions.flash_attention)
        self.ffn_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.feed_forward = FeedForward(config, fusions.swiglu)

    def forward(self, x, cos, sin, causal_mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, causal_mask)
        return x + self.feed_forward(self.ffn_norm(x))


@dataclass(frozen=True)
class Fusions:
    qkv: bool = True
    flash_attention: bool = True
    swiglu: bool = True

    def weight_groups(self) -> dict:
        """The canonical matrices this configuration concatenates (see tinytransformer/weights.py)."""
        return {**(QKV_GROUP if self.qkv else {}), **(GATE_UP_GROUP if self.swiglu else {})}


class TinyLlama(nn.Module):
    def __init__(self, config: ModelConfig, fusions: Fusions = Fusions()):
        super().__init__()
        self.config, self.fusions = config, fusions
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.layers = nn.ModuleList(TransformerBlock(config, fusions) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = torch.triu(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        self._init_weights()

    def _init_weights(self):
        self.load_canonical(init_canonical_weights(self.config, seed=0))

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

    # Fused matrices are the canonical (version 1) ones concatenated along the output dimension.
    def load_canonical(self, state_dict):
        check_canonical(state_dict, self.config)
        fused = fuse(state_dict, self.fusions.weight_groups())
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                tensor.copy_(fused[name])

    def canonical_state_dict(self):
        return self.to_canonical({name: tensor.detach().clone() for name, tensor in self.state_dict().items()})

    def to_canonical(self, tensors: dict) -> dict:
        """Any per-parameter tensors of this model (weights, gradients) in the canonical layout."""
        return split(tensors, self.fusions.weight_groups())


# ----------------------------------------------------------------------------------------------------------
# Command line: the shared harness plus version 2's switches
# ----------------------------------------------------------------------------------------------------------
FUSION_NAMES = {"qkv": "qkv-fusion", "flash_attention": "flash-attention", "swiglu": "swiglu-fusion"}


def add_arguments(group):
    for field_name, flag in FUSION_NAMES.items():
        group.add_argument(f"--enable-{flag}", dest=field_name, action="store_true", default=None,
                           help=f"use {flag.replace('-', ' ')} (default: on)")
        group.add_argument(f"--disable-{flag}", dest=field_name, action="store_false",
                           help=f"do not use {flag.replace('-', ' ')}")
    group.add_argument("--enable-all-fusion", dest="all_fusion", action="store_true", default=None,
                       help="all three fusions on (the default)")
    group.add_argument("--disable-all-fusion", dest="all_fusion", action="store_false",
                       help="all fusions off: version 1's computation (single switches still apply)")
    group.add_argument("--enable-torch-compile", action="store_true", default=False,
                       help="compile the model with torch.compile (first steps are slow: compilation)")
    group.add_argument("--torch-compile-mode", choices=["default", "reduce-overhead", "max-autotune"],
                       default="default", help="reduce-overhead replays CUDA/HIP graphs")


def fusions_from_args(args) -> Fusions:
    """--enable/disable-all-fusion sets the baseline; a single switch given explicitly overrides it."""
    baseline = True if args.all_fusion is None else args.all_fusion
    pick = lambda value: baseline if value is None else value  # noqa: E731
    return Fusions(qkv=pick(args.qkv), flash_attention=pick(args.flash_attention), swiglu=pick(args.swiglu))


def build_model(config, args):
    model = TinyLlama(config, fusions_from_args(args))
    if args.enable_torch_compile:
        # Compiles forward (and, through AOTAutograd, backward) in place; the module keeps its methods.
        model.compile(mode=args.torch_compile_mode)
    return model


def describe(args) -> dict:
    fusions = fusions_from_args(args)
    on = [name for name, flag in FUSION_NAMES.items() if getattr(fusions, name)]
    compiled = f"torch.compile(mode={args.torch_compile_mode})" if args.enable_torch_compile else "eager"
    return {"fusions": ", ".join(on) if on else "none (version 1's computation)", "execution": compiled}


SPEC = VersionSpec(name="v2", title="PyTorch fused", build_model=build_model, add_arguments=add_arguments,
                   describe=describe)


def main(argv=None):
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
