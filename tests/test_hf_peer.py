"""tinytransformer/hf/model.py: Hugging Face's LlamaForCausalLM computes the workshop's function.

From version 1's canonical weights, the Hugging Face model gives version 1's logits, loss and every gradient
(against version 1 in float64 on the CPU; in float32 and bfloat16 on a GPU, with Liger-Kernel too, whose Triton
kernels do not run in Triton's CPU interpreter). Skipped where `transformers` is not installed (CI installs it).
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer.hf import model as hf
from tinytransformer.config import ConfigError, ModelConfig
from tinytransformer.equivalence import canonical, compare, forward_backward, random_batch

from .test_versions import model_class

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import hf_llama  # noqa: E402  (benchmarks/hf_llama.py: how the benchmark builds each peer row)

transformers = pytest.importorskip("transformers")
HAS_GPU = torch.cuda.is_available()

# Odd sizes on purpose: vocabulary and FFN width not powers of two, sequence shorter than the maximum.
SHAPES = [
    ModelConfig(vocab_size=97, hidden_dim=64, num_layers=2, num_heads=4, intermediate_size=96, max_seq_len=32),
    ModelConfig(vocab_size=50, hidden_dim=48, num_layers=1, num_heads=2, intermediate_size=80, max_seq_len=16),
]


def float64_reference(config, weights, inputs, targets):
    v1 = model_class("v1")(config).double()
    return forward_backward(v1, {k: v.double() for k, v in weights.items()}, inputs, targets)


@pytest.mark.parametrize("config", SHAPES, ids=["h64", "h48"])
def test_hf_matches_version1_on_cpu(config):
    weights = canonical(config, seed=3)
    inputs, targets = random_batch(config, batch=3, seq=config.max_seq_len - 3, device="cpu", seed=1)
    reference = float64_reference(config, weights, inputs, targets)
    candidate = forward_backward(hf.HFTinyLlama(config), weights, inputs, targets)
    assert not compare(reference, candidate, tolerance=1e-5)


def test_the_weights_go_in_and_come_back_unchanged():
    config = SHAPES[0]
    weights = canonical(config, seed=5)
    model = hf.HFTinyLlama(config)
    model.load_canonical(weights)
    back = model.canonical_state_dict()
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[name], weights[name]) for name in weights)
    assert len(hf.name_table(config.num_layers)) == len(weights)


def test_configs_round_trip_and_foreign_llamas_are_refused():
    config = SHAPES[1]
    assert hf.model_config_of(hf.hf_config(config)) == config
    grouped = hf.hf_config(config)
    grouped.num_key_value_heads = 1
    with pytest.raises(ConfigError, match="grouped-query attention"):
        hf.model_config_of(grouped)
    tied = hf.hf_config(config)
    tied.tie_word_embeddings = True
    with pytest.raises(ConfigError, match="tied embeddings"):
        hf.model_config_of(tied)


def test_an_unknown_tensor_name_is_one_clear_error():
    with pytest.raises(ConfigError, match="unexpected Hugging Face tensor model.layers.0.self_attn.q_proj.bias"):
        hf.to_canonical_names({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, num_layers=1)


def test_missing_packages_say_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("transformers", "liger_kernel") else real(name, *a))
    with pytest.raises(ConfigError, match="pip install -r requirements-peers.txt"):
        hf.require_transformers()
    assert not hf.liger_available()


@pytest.fixture
def restore_transformers_llama():
    """Liger-Kernel patches transformers' Llama module for the whole process (RoPE is a module-level function
    that every Llama calls): put it back, so that the plain Hugging Face model of a later test stays plain."""
    from transformers.models.llama import modeling_llama
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {name: getattr(modeling_llama, name) for name in names}
    forward = modeling_llama.LlamaForCausalLM.forward
    yield
    for name, value in saved.items():
        setattr(modeling_llama, name, value)
    modeling_llama.LlamaForCausalLM.forward = forward


def liger_module(method) -> bool:
    return getattr(method, "__module__", "").startswith("liger_kernel")


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="Liger-Kernel is not installed")
def test_liger_replaces_norms_feed_forward_rope_and_loss(restore_transformers_llama):
    from transformers.models.llama import modeling_llama
    model = hf.HFTinyLlama(SHAPES[1])
    hf.apply_liger(model)
    assert liger_module(model.hf.model.norm.forward) and liger_module(model.hf.model.layers[0].mlp.forward)
    assert liger_module(model.hf.forward) and liger_module(modeling_llama.apply_rotary_pos_emb)


def peer_arguments(liger, compiled):
    return argparse.Namespace(liger=liger, enable_torch_compile=compiled, torch_compile_mode="default",
                              device="cpu", tf32=True)


def test_the_peer_has_the_versions_tf32_switch():
    """A float32 row of the peer does the arithmetic of versions 2 and 4: the same --tf32 / --no-tf32 switch,
    on by default, named in the row's description."""
    from tinytransformer.cli import build_parser
    assert build_parser(hf_llama.SPEC).parse_args([]).tf32 is True
    assert build_parser(hf_llama.SPEC).parse_args(["--no-tf32"]).tf32 is False
    assert hf_llama.describe(peer_arguments(False, False))["matmuls"].startswith("exact float32")   # on the CPU


def test_with_liger_compile_takes_the_decoder_and_leaves_the_fused_loss_eager(monkeypatch):
    """Liger's fused linear cross-entropy cannot be traced by torch.compile (benchmarks/hf_llama.py says why):
    the hf+liger+compile row compiles the decoder only; hf+compile compiles the whole model."""
    monkeypatch.setattr(hf_llama, "apply_liger", lambda model: None)   # its kernels need a GPU; not the point here
    whole = hf_llama.build_model(SHAPES[1], peer_arguments(liger=False, compiled=True))
    decoder = hf_llama.build_model(SHAPES[1], peer_arguments(liger=True, compiled=True))
    assert whole.hf._compiled_call_impl is not None
    assert decoder.hf._compiled_call_impl is None and decoder.hf.model._compiled_call_impl is not None
    assert "of the decoder; Liger's fused loss eager" in hf_llama.describe(peer_arguments(True, True))["execution"]


@pytest.mark.gpu
@pytest.mark.parametrize("liger, compiled", [(False, False), (True, False), (True, True)],
                         ids=["hf", "hf+liger", "hf+liger+compile"])
@pytest.mark.parametrize("autocast_dtype, tolerance", [(None, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_hf_matches_version1_on_gpu(liger, compiled, autocast_dtype, tolerance, restore_transformers_llama):
    if liger and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("Liger-Kernel is not installed")
    config = ModelConfig(vocab_size=1000, hidden_dim=256, num_layers=4, num_heads=8, intermediate_size=512)
    weights = canonical(config, seed=7)
    inputs, targets = random_batch(config, batch=4, seq=128, device="cpu", seed=2)
    reference = float64_reference(config, weights, inputs, targets)
    model = hf_llama.build_model(config, peer_arguments(liger, compiled)).cuda()
    candidate = forward_backward(model, {k: v.cuda() for k, v in weights.items()}, inputs.cuda(), targets.cuda(),
                                 autocast_dtype=autocast_dtype)
    assert not compare(reference, candidate, tolerance=tolerance)
