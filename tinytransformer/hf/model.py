"""Hugging Face `transformers`' LlamaForCausalLM as a peer of the workshop's versions: the same function, the
model most practitioners would train instead.

Our architecture IS a Llama: pre-norm RMSNorm blocks, rotate-half RoPE, SwiGLU, no biases, an untied output head.
So a `LlamaConfig` built from our ModelConfig, with our canonical weights renamed (one table, CANONICAL_TO_HF),
computes the same logits; tests check logits, loss and every gradient against version 1. Nothing is downloaded:
the config is built in code and the weights come from our own state dict.

`HFTinyLlama` wraps the Hugging Face model in the contract every version keeps (`forward(input_ids, targets)`
-> (logits, loss), `load_canonical`, `canonical_state_dict`, `to_canonical`), so the shared harness trains it
on the same data, schedule and timing as our versions (benchmarks/hf_llama.py).

`transformers` is optional (requirements-peers.txt): `require_transformers()` turns its absence into one line.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

from ..config import ConfigError, ModelConfig

INSTALL_HINT = "pip install -r requirements-peers.txt"


def require_transformers():
    """The `transformers` module, or a ConfigError that says how to install it."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"Hugging Face transformers is not installed ({INSTALL_HINT})")
    import transformers
    return transformers


def hf_config(config: ModelConfig):
    """The LlamaConfig of our architecture: plain multi-head attention (as many key/value heads as heads),
    SiLU-gated feed-forward, no biases, untied output head, SDPA attention (no hub access, no download)."""
    transformers = require_transformers()
    hf = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_dim, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        use_cache=False)
    hf._attn_implementation = "sdpa"
    return hf


def model_config_of(hf) -> ModelConfig:
    """Our ModelConfig from a LlamaConfig, refusing what our architecture does not have."""
    def get(name, default=None):
        return getattr(hf, name, default)
    kv_heads = get("num_key_value_heads") or hf.num_attention_heads
    # transformers 5 keeps RoPE's settings in rope_parameters, 4.x in rope_theta and rope_scaling.
    rope = get("rope_parameters") or get("rope_scaling") or {}
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    problems = []
    if kv_heads != hf.num_attention_heads:
        problems.append(f"grouped-query attention ({kv_heads} key/value heads for {hf.num_attention_heads})")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append("scaled RoPE")
    if get("tie_word_embeddings", False):
        problems.append("tied embeddings")
    if get("attention_bias", False) or get("mlp_bias", False):
        problems.append("biases")
    if get("hidden_act", "silu") != "silu":
        problems.append(f"activation {hf.hidden_act}")
    head_dim = get("head_dim") or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        problems.append(f"head_dim {head_dim} x {hf.num_attention_heads} heads != hidden size {hf.hidden_size}")
    if problems:
        raise ConfigError("this Llama model is not the workshop's architecture: " + ", ".join(problems))
    return ModelConfig(vocab_size=hf.vocab_size, hidden_dim=hf.hidden_size, num_layers=hf.num_hidden_layers,
                       num_heads=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
                       max_seq_len=hf.max_position_embeddings, rms_norm_eps=float(hf.rms_norm_eps),
                       rope_theta=float(theta))


# Our canonical names (version 1's) -> Hugging Face's. "{i}" is the layer index.
CANONICAL_TO_HF = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def name_table(num_layers: int) -> dict[str, str]:
    """Every canonical parameter name -> its Hugging Face name, for a model of `num_layers` layers."""
    table = {}
    for ours, theirs in CANONICAL_TO_HF.items():
        layers = range(num_layers) if "{i}" in ours else [None]
        for i in layers:
            table[ours.format(i=i)] = theirs.format(i=i)
    return table


def to_hf_names(tensors: dict, num_layers: int) -> dict:
    table = name_table(num_layers)
    return {table[name]: tensor for name, tensor in tensors.items()}


def to_canonical_names(tensors: dict, num_layers: int) -> dict:
    back = {theirs: ours for ours, theirs in name_table(num_layers).items()}
    unknown = sorted(set(tensors) - set(back))
    if unknown:
        raise ConfigError(f"unexpected Hugging Face tensor {unknown[0]} (the workshop's Llama has no such weight)")
    return {back[name]: tensor for name, tensor in tensors.items()}


class HFTinyLlama(nn.Module):
    """LlamaForCausalLM behind the workshop's model contract.

    The loss is Hugging Face's own (float32 cross-entropy, mean over tokens), with our targets passed as the
    already-shifted labels: our targets[t] is the token after input_ids[t], so nothing is shifted again. With
    Liger-Kernel's fused linear cross-entropy patched in, that same call never materialises the logits.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        transformers = require_transformers()
        self.config = config
        self.hf = transformers.LlamaForCausalLM(hf_config(config))

    def forward(self, input_ids, targets=None):
        if targets is None:
            return self.hf(input_ids=input_ids).logits, None
        targets = targets.contiguous()   # Hugging Face flattens it with view()
        out = self.hf(input_ids=input_ids, labels=targets, shift_labels=targets)
        return out.logits, out.loss

    def configure_optimizer(self, train):
        """torch's fused AdamW, what a practitioner picks for this model (the Hugging Face Trainer's
        optim="adamw_torch_fused"); the multi-tensor one where this build has no fused kernel for the device."""
        hyper = dict(lr=train.learning_rate, betas=(0.9, 0.95), weight_decay=train.weight_decay)
        try:
            return torch.optim.AdamW(self.parameters(), fused=True, **hyper)
        except RuntimeError:
            return torch.optim.AdamW(self.parameters(), **hyper)

    def load_canonical(self, state_dict):
        self.hf.load_state_dict(to_hf_names(state_dict, self.config.num_layers), strict=True)

    def canonical_state_dict(self):
        named = {name: tensor.detach().clone() for name, tensor in self.hf.state_dict().items()}
        return to_canonical_names(named, self.config.num_layers)

    def to_canonical(self, tensors: dict) -> dict:
        """Per-parameter tensors of this module (named `hf.<Hugging Face name>`) in the canonical layout."""
        stripped = {name.removeprefix("hf."): tensor for name, tensor in tensors.items()}
        return to_canonical_names(stripped, self.config.num_layers)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def require_liger() -> None:
    if not liger_available():
        raise ConfigError(f"Liger-Kernel is not installed ({INSTALL_HINT})")


def apply_liger(model: HFTinyLlama) -> None:
    """Liger-Kernel's Triton RMSNorm, RoPE, SwiGLU and fused linear cross-entropy, patched into this model.

    Liger patches transformers' Llama module itself (its RoPE is a module-level function every Llama calls), so
    in this process every Llama model runs Liger's RoPE from now on: a benchmark runs each peer in its own
    process."""
    require_liger()
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model.hf)

