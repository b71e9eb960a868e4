"""Version 2 computes version 1's model: every fusion combination, same canonical weights, same outputs."""
import itertools

import pytest
import torch

from tinytransformer.config import ModelConfig
from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama as V1
from version2_pytorch_fused.tiny_llama_v2 import Fusions, TinyLlama as V2
from version2_pytorch_fused.tiny_llama_v2 import SPEC, fusions_from_args
from tinytransformer.cli import build_parser

from .equivalence import canonical, compare, forward_backward, random_batch

SMALL = ModelConfig(vocab_size=101, hidden_dim=64, num_layers=2, num_heads=4, intermediate_size=96, max_seq_len=48)
COMBINATIONS = [Fusions(*flags) for flags in itertools.product([False, True], repeat=3)]


@pytest.mark.parametrize("fusions", COMBINATIONS, ids=lambda f: f"qkv{int(f.qkv)}-flash{int(f.flash_attention)}"
                                                          f"-swiglu{int(f.swiglu)}")
def test_v2_matches_v1_in_float32(fusions):
    weights = canonical(SMALL, seed=1)
    inputs, targets = random_batch(SMALL, batch=3, seq=37, device="cpu", seed=2)
    reference = forward_backward(V1(SMALL), weights, inputs, targets)
    candidate = forward_backward(V2(SMALL, fusions), weights, inputs, targets)
    assert compare(reference, candidate, tolerance=1e-5) == []


def test_canonical_round_trip_through_fused_layout():
    weights = canonical(SMALL, seed=4)
    model = V2(SMALL, Fusions())
    model.load_canonical(weights)
    assert "layers.0.attention.qkv_proj.weight" in model.state_dict()
    back = model.canonical_state_dict()
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)


@pytest.mark.parametrize("argv, expected", [
    ([], Fusions(True, True, True)),
    (["--disable-all-fusion"], Fusions(False, False, False)),
    (["--disable-all-fusion", "--enable-flash-attention"], Fusions(False, True, False)),
    (["--disable-qkv-fusion"], Fusions(False, True, True)),
    (["--enable-all-fusion", "--disable-swiglu-fusion"], Fusions(True, True, False)),
])
def test_fusion_switches(argv, expected):
    args = build_parser(SPEC).parse_args(argv)
    assert fusions_from_args(args) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("fusions", [Fusions(), Fusions(False, False, False)], ids=["all", "none"])
def test_v2_matches_v1_under_bf16_autocast_on_gpu(fusions):
    config = ModelConfig()   # the seed config, full size
    weights = canonical(config, seed=1)
    inputs, targets = random_batch(config, batch=8, seq=128, device="cuda", seed=2)
    reference = forward_backward(V1(config).cuda(), weights, inputs, targets, autocast_dtype=torch.bfloat16)
    candidate = forward_backward(V2(config, fusions).cuda(), weights, inputs, targets,
                                 autocast_dtype=torch.bfloat16)
    assert compare(reference, candidate, tolerance=2e-2) == []


@pytest.mark.gpu
def test_v2_matches_v1_in_float32_on_gpu():
    config = ModelConfig()
    weights = canonical(config, seed=1)
    inputs, targets = random_batch(config, batch=8, seq=128, device="cuda", seed=2)
    reference = forward_backward(V1(config).cuda(), weights, inputs, targets)
    candidate = forward_backward(V2(config, Fusions()).cuda(), weights, inputs, targets)
    # SDPA's fused kernels may use different (but float32) accumulation orders: float32 tolerance applies.
    assert compare(reference, candidate, tolerance=1e-4) == []


@pytest.mark.slow
def test_torch_compile_matches_eager_on_cpu():
    """torch.compile (inductor, C++ code generation on CPU) computes the same model. Slow: compilation."""
    weights = canonical(SMALL, seed=1)
    inputs, targets = random_batch(SMALL, batch=2, seq=16, device="cpu", seed=2)
    reference = forward_backward(V1(SMALL), weights, inputs, targets)
    compiled = V2(SMALL, Fusions())
    compiled.compile()
    assert compare(reference, forward_backward(compiled, weights, inputs, targets), tolerance=1e-5) == []


def test_torch_compile_captures_the_whole_model_in_one_graph(graph_counting_backend):
    """A graph break (an untraceable call anywhere in the forward pass, e.g. in a profiling range) would split
    the model into many small graphs or make torch.compile give up, and `--enable-torch-compile` would
    quietly lose its speed. Tracing only (a counting backend, no code generation): fast."""
    counting_backend, graphs = graph_counting_backend
    model = V2(SMALL, Fusions())
    model.load_canonical(canonical(SMALL, seed=1))
    inputs, targets = random_batch(SMALL, batch=2, seq=16, device="cpu", seed=2)
    compiled = torch.compile(model, backend=counting_backend)
    _, loss = compiled(inputs, targets)
    loss.backward()
    assert len(graphs) == 1, f"the forward pass was split into {len(graphs)} graphs"
