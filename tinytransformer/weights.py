"""The canonical weight layout (version 1's) and conversions to the fused layouts of later versions.

Every version computes the same function. To prove it, tests load ONE set of weights into all four versions
and compare logits, loss and gradients. That set is stored in version 1's layout, where q, k, v and gate, up
are separate matrices; fused versions concatenate them on load and split them on save.

The training scripts also initialise through this module, so every version starts from identical weights for
the same --seed, and their loss curves can be compared step by step.
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig

INIT_STD = 0.02


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, in version 1's layout (nn.Linear weights are [out, in])."""
    d, f, v = config.hidden_dim, config.intermediate_size, config.vocab_size
    shapes = {"embed_tokens.weight": (v, d)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention_norm.weight": (d,),
            p + "attention.q_proj.weight": (d, d),
            p + "attention.k_proj.weight": (d, d),
            p + "attention.v_proj.weight": (d, d),
            p + "attention.o_proj.weight": (d, d),
            p + "ffn_norm.weight": (d,),
            p + "feed_forward.gate_proj.weight": (f, d),
            p + "feed_forward.up_proj.weight": (f, d),
            p + "feed_forward.down_proj.weight": (d, f),
        })
    shapes["norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def parameter_count(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in canonical_shapes(config).values())


def init_canonical_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Fresh weights: normal(0, 0.02); the projections that write into the residual stream (o_proj, down_proj)
    are scaled by 1/sqrt(2 * layers) so the residual stream's variance does not grow with depth; norms are 1.

    Drawn on the CPU from one seeded generator in a fixed order, so the result is the same on every machine.
    """
    generator = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * config.num_layers)
    weights = {}
    for name, shape in canonical_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            weights[name] = torch.empty(shape).normal_(0.0, std, generator=generator)
    return weights


def check_canonical(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped tensor."""
    expected = canonical_shapes(config)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"canonical state dict lacks {missing[0]} (and {len(missing) - 1} more)")
    if unexpected:
        raise ValueError(f"canonical state dict has unexpected key {unexpected[0]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(state[name].shape)}, expected {shape}")


def fuse(state: dict[str, torch.Tensor], groups: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Concatenate along the output dimension: groups maps a fused-name SUFFIX to the suffixes it replaces,
    e.g. {"attention.qkv_proj.weight": ["attention.q_proj.weight", "attention.k_proj.weight", ...]}."""
    out = dict(state)
    for fused_suffix, part_suffixes in groups.items():
        for name in [n for n in state if n.endswith(part_suffixes[0])]:
            prefix = name[: -len(part_suffixes[0])]
            out[prefix + fused_suffix] = torch.cat([out.pop(prefix + s) for s in part_suffixes], dim=0)
    return out


def split(state: dict[str, torch.Tensor], groups: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse`: split fused matrices back into equal parts along the output dimension."""
    out = dict(state)
    for fused_suffix, part_suffixes in groups.items():
        for name in [n for n in state if n.endswith(fused_suffix)]:
            prefix = name[: -len(fused_suffix)]
            parts = out.pop(name).chunk(len(part_suffixes), dim=0)
            out.update({prefix + s: p.contiguous() for s, p in zip(part_suffixes, parts)})
    return out


QKV_GROUP = {"attention.qkv_proj.weight": ["attention.q_proj.weight", "attention.k_proj.weight",
                                            "attention.v_proj.weight"]}
GATE_UP_GROUP = {"feed_forward.gate_up_proj.weight": ["feed_forward.gate_proj.weight",
                                                      "feed_forward.up_proj.weight"]}
