"""The numbers written in TINY_LLAMA_ARCHITECTURE.md (and in appendix E of TECHNICAL_APPENDICES.md) agree with
the code.

How a number is marked. In the markdown source, a checked number is followed immediately (an optional % in
between) by an HTML comment that names it, invisible when rendered:

    | **total** | **3,135,744<!-- check:params_total -->** |

Integers must match exactly (commas are ignored). A number written with decimals must match to the digits
written: "19.5" accepts anything that rounds to it, i.e. within 0.05.

Where the expected values come from:
- tinytransformer.weights (parameter shapes and count, initialisation) and tinytransformer.flops (the FLOP
  formulas), for the default configuration (ModelConfig() and TrainConfig()'s batch size and sequence length);
- an instantiated version-1 model: its parameters are counted one by one, and one forward and one backward
  pass on the CPU are measured with torch.utils.flop_counter.FlopCounterMode;
- tinytransformer.device for the peak FLOP/s and bandwidth figures of appendix E.

Expected agreement between the analytic count and FlopCounterMode: exact. FlopCounterMode counts 2 FLOPs per
multiply-add of mm/bmm, like flops.py. Version 1 computes the attention products over the full S x S matrix
(the causal mask is applied after the product, so the upper half is computed and then discarded), which is
what flops.py counts; the useful causal work is only S(S+1)/2 of the S^2 entries. The backward pass is exactly
2 x forward because every linear layer's input requires a gradient (the embedding output does), so each product
has two backward products. FlopCounterMode does not count the embedding lookup, norms, softmax or loss,
and neither does flops.py. (It would NOT agree for versions 2-4: it has no formula for fused attention kernels
on the CPU or for Triton kernels, and would report less.)
"""
from __future__ import annotations

import decimal
import importlib
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tinytransformer import device as device_mod
from tinytransformer import flops
from tinytransformer.config import ModelConfig, TrainConfig
from tinytransformer.weights import INIT_STD, canonical_shapes, init_canonical_weights, parameter_count

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE_DOC = REPO / "TINY_LLAMA_ARCHITECTURE.md"
APPENDICES_DOC = REPO / "TECHNICAL_APPENDICES.md"
MARKER = re.compile(r"(?P<value>\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)%?\s*<!--\s*check:(?P<key>\w+)\s*-->")

CONFIG = ModelConfig()
BATCH, SEQ = TrainConfig().batch_size, TrainConfig().seq_len


def v1_module():
    sys.path.insert(0, str(REPO))
    return importlib.import_module("version1_pytorch_baseline.tiny_llama_v1")


# ------------------------------------------------------------------------------------------------------
# Measurements on an instantiated version-1 model (CPU)
# ------------------------------------------------------------------------------------------------------
def flop_counter_measurement(config: ModelConfig, batch: int, seq: int) -> dict:
    """FLOPs of one forward and one backward pass of version 1, counted by FlopCounterMode."""
    torch.manual_seed(0)
    model = v1_module().TinyLlama(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
    with FlopCounterMode(display=False) as forward:
        _, loss = model(ids[:, :-1], ids[:, 1:])
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops(),
            "parameters": sum(p.numel() for p in model.parameters())}


@pytest.fixture(scope="module")
def measured():
    return flop_counter_measurement(CONFIG, BATCH, SEQ)


# ------------------------------------------------------------------------------------------------------
# Expected values, computed from the code
# ------------------------------------------------------------------------------------------------------
def architecture_expected(measured: dict) -> dict:
    c, b, s = CONFIG, BATCH, SEQ
    d, f, v, h, n_layers, dh = c.hidden_dim, c.intermediate_size, c.vocab_size, c.num_heads, c.num_layers, c.head_dim
    tokens = b * s
    shapes = canonical_shapes(c)
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    layer0 = {name: n for name, n in numel.items() if name.startswith("layers.0.")}
    per_layer = flops.forward_flops_per_layer(c, b, s)
    layer_total = sum(per_layer.values())
    forward = flops.forward_flops(c, b, s)
    training = flops.training_flops(c, b, s)
    assert forward % tokens == 0
    matmul_params = sum(n for name, n in numel.items() if len(shapes[name]) == 2 and name != "embed_tokens.weight")
    attention_bytes = b * h * s * s * 4
    return {
        "batch_size": b, "seq_len": s, "hidden_dim": d, "num_heads": h, "head_dim": dh,
        "intermediate_size": f, "vocab_size": v, "num_layers": n_layers, "tokens": tokens,
        "rope_inv_freq_1": c.rope_theta ** (-2 * 1 / dh),
        "rope_inv_freq_15": c.rope_theta ** (-2 * 15 / dh),
        "params_embedding": numel["embed_tokens.weight"],
        "params_attention_per_layer": sum(n for name, n in layer0.items() if "_proj" in name and ".attention." in name),
        "params_ffn_per_layer": sum(n for name, n in layer0.items() if ".feed_forward." in name),
        "params_norms_per_layer": sum(n for name, n in layer0.items() if name.endswith("norm.weight")),
        "params_per_layer": sum(layer0.values()),
        "params_layers": sum(n for name, n in numel.items() if name.startswith("layers.")),
        "params_final_norm": numel["norm.weight"],
        "params_lm_head": numel["lm_head.weight"],
        "params_total": parameter_count(c),
        "init_residual_std": INIT_STD / math.sqrt(2 * n_layers),
        **{f"flops_{name}": count for name, count in per_layer.items()},
        "flops_per_layer": layer_total,
        "flops_layers_forward": n_layers * layer_total,
        "flops_lm_head": forward - n_layers * layer_total,
        "flops_forward": forward,
        "flops_backward": training - forward,
        "flops_training": training,
        "flops_forward_per_token": forward // tokens,
        "ffn_share_percent": 100 * sum(per_layer[k] for k in ("gate_proj", "up_proj", "down_proj")) / layer_total,
        "projections_share_percent": 100 * sum(per_layer[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
        / layer_total,
        "attention_share_percent": 100 * (per_layer["attention_scores"] + per_layer["attention_values"]) / layer_total,
        "params_matmul": matmul_params,
        "flops_training_6n": 6 * tokens * matmul_params,
        "flops_training_attention": 3 * n_layers * (per_layer["attention_scores"] + per_layer["attention_values"]),
        "flopcounter_forward": measured["forward"],
        "flopcounter_backward": measured["backward"],
        "causal_fraction_percent": 100 * (s * (s + 1) / 2) / (s * s),
        "flops_attention_causal": b * d * s * (s + 1),
        "attention_matrix_bytes": attention_bytes,
        "attention_matrix_bytes_all_layers": n_layers * attention_bytes,
        "hidden_state_bytes": b * s * d * 4,
        "attention_to_hidden_ratio": h * s // d,
        "flash_lse_bytes": b * h * s * 4,
    }


def intensity(m: int, k: int, n: int, count: int, element_bytes: int) -> float:
    """FLOPs per byte of `count` products [m, k] x [k, n], each operand read once and the result written once."""
    return (2 * m * k * n * count) / ((m * k + k * n + m * n) * count * element_bytes)


def appendix_expected() -> dict:
    c, b, s = CONFIG, BATCH, SEQ
    d, f, v, h, dh = c.hidden_dim, c.intermediate_size, c.vocab_size, c.num_heads, c.head_dim
    tokens = b * s
    training = flops.training_flops(c, b, s)
    out = {"flops_training": training}
    for label, name in (("h100", "NVIDIA H100 80GB HBM3"), ("mi300x", "AMD Instinct MI300X")):
        bandwidth = device_mod.peak_bandwidth_tbs(name)
        out[f"bandwidth_{label}"] = bandwidth
        for precision in ("float32", "tf32", "bfloat16"):
            peak = device_mod.peak_tflops(name, "float32", tf32=True) if precision == "tf32" \
                else device_mod.peak_tflops(name, precision)
            out[f"peak_{label}_{precision}"] = peak
            out[f"ideal_us_{label}_{precision}"] = training / (peak * 1e12) * 1e6
            out[f"ridge_{label}_{precision}"] = peak / bandwidth
    achieved_1ms = training / 1e-3 / 1e12
    out["tflops_at_1ms"] = achieved_1ms
    out["mfu_1ms_h100_bfloat16"] = 100 * achieved_1ms / out["peak_h100_bfloat16"]
    out["mfu_1ms_h100_float32"] = 100 * achieved_1ms / out["peak_h100_float32"]
    products = {
        "q_proj": (tokens, d, d, 1), "qkv_proj": (tokens, d, 3 * d, 1), "gate_proj": (tokens, d, f, 1),
        "gate_up_proj": (tokens, d, 2 * f, 1), "attention_scores": (s, dh, s, b * h), "lm_head": (tokens, d, v, 1),
    }
    for name, shape in products.items():
        out[f"ai_{name}_fp32"] = intensity(*shape, 4)
        out[f"ai_{name}_bf16"] = intensity(*shape, 2)
    attention_flops = 2 * 2 * b * h * s * s * dh
    out["ai_flash_attention_fp32"] = attention_flops / (4 * tokens * d * 4)   # q, k, v read, out written
    out["ai_flash_attention_bf16"] = attention_flops / (4 * tokens * d * 2)
    bf16_peak = out["peak_h100_bfloat16"] * 1e12
    out["ideal_us_gate_up_bf16"] = 2 * tokens * d * 2 * f / bf16_peak * 1e6
    out["ideal_us_q_proj_bf16"] = 2 * tokens * d * d / bf16_peak * 1e6
    out["memory_us_q_proj_bf16"] = (tokens * d + d * d + tokens * d) * 2 / (out["bandwidth_h100"] * 1e12) * 1e6
    tile = 128
    out["tiles_q_proj"] = math.ceil(tokens / tile) * math.ceil(d / tile)
    out["tiles_gate_up_proj"] = math.ceil(tokens / tile) * math.ceil(2 * f / tile)
    return out


# ------------------------------------------------------------------------------------------------------
# The code agrees with itself (formulas, counting, measuring)
# ------------------------------------------------------------------------------------------------------
def closed_form_parameters(c: ModelConfig) -> int:
    d, f, v, n_layers = c.hidden_dim, c.intermediate_size, c.vocab_size, c.num_layers
    return 2 * v * d + n_layers * (4 * d * d + 3 * d * f + 2 * d) + d


def closed_form_forward_flops(c: ModelConfig, b: int, s: int) -> int:
    d, f, v, n_layers, t = c.hidden_dim, c.intermediate_size, c.vocab_size, c.num_layers, b * s
    return n_layers * (8 * t * d * d + 4 * b * s * s * d + 6 * t * d * f) + 2 * t * d * v


SMALL = ModelConfig(vocab_size=300, hidden_dim=48, num_layers=2, num_heads=3, intermediate_size=80, max_seq_len=32)


@pytest.mark.parametrize("config", [CONFIG, SMALL], ids=["default", "small"])
def test_parameter_count_three_ways(config):
    counted = sum(p.numel() for p in v1_module().TinyLlama(config).parameters())
    assert parameter_count(config) == counted == closed_form_parameters(config)


@pytest.mark.parametrize("config, batch, seq", [(CONFIG, BATCH, SEQ), (SMALL, 3, 24)], ids=["default", "small"])
def test_flops_py_matches_the_documented_formulas(config, batch, seq):
    forward = flops.forward_flops(config, batch, seq)
    assert forward == closed_form_forward_flops(config, batch, seq)
    assert flops.training_flops(config, batch, seq) == 3 * forward


def test_flop_counter_on_version_1_equals_the_analytic_count(measured):
    assert measured["parameters"] == parameter_count(CONFIG)
    assert measured["forward"] == flops.forward_flops(CONFIG, BATCH, SEQ)
    assert measured["backward"] == 2 * flops.forward_flops(CONFIG, BATCH, SEQ)


def test_flop_counter_agreement_is_not_a_coincidence_of_the_default_sizes():
    got = flop_counter_measurement(SMALL, 3, 24)
    assert got["forward"] == flops.forward_flops(SMALL, 3, 24)
    assert got["backward"] == 2 * got["forward"]


def test_six_n_rule_plus_attention_is_the_training_count():
    e = architecture_expected({"forward": 0, "backward": 0})
    assert e["flops_training_6n"] + e["flops_training_attention"] == e["flops_training"]
    assert e["flops_forward"] == e["flops_layers_forward"] + e["flops_lm_head"]


def test_version_1_keeps_one_attention_matrix_per_layer_for_backward():
    """The memory section's claim: one [B, H, S, S] float32 tensor (the softmax output) saved per layer."""
    model = v1_module().TinyLlama(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1))
    square = {}
    attention_elements = BATCH * CONFIG.num_heads * SEQ * SEQ

    def pack(tensor):
        if tensor.dim() >= 2 and tensor.shape[-2:] == (SEQ, SEQ) and tensor.numel() == attention_elements:
            square[tensor.untyped_storage().data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids[:, :-1], ids[:, 1:])
    assert len(square) == CONFIG.num_layers
    assert sum(square.values()) == architecture_expected({"forward": 0, "backward": 0})[
        "attention_matrix_bytes_all_layers"]


def test_rope_tables_use_the_documented_frequencies():
    """angle[p, i] = p * theta^(-2i / Dh), written twice ([angles, angles]), as the document states."""
    cos, sin = v1_module().rope_tables(CONFIG.max_seq_len, CONFIG.head_dim, CONFIG.rope_theta)
    half = CONFIG.head_dim // 2
    positions = torch.arange(CONFIG.max_seq_len, dtype=torch.float64)[:, None]
    inv_freq = CONFIG.rope_theta ** (-2 * torch.arange(half, dtype=torch.float64) / CONFIG.head_dim)
    angles = positions * inv_freq
    for table, func in ((cos, torch.cos), (sin, torch.sin)):
        expected = func(angles).float()
        assert torch.equal(table[:, :half], expected) and torch.equal(table[:, half:], expected)


def test_rotate_half_is_the_documented_rotation():
    v1 = v1_module()
    dh, half = CONFIG.head_dim, CONFIG.head_dim // 2
    x = torch.randn(1, 1, 4, dh, dtype=torch.float64)
    cos, sin = v1.rope_tables(4, dh, CONFIG.rope_theta)
    rotated, _ = v1.apply_rope(x, x, cos.double(), sin.double())
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, :half].double(), sin[:, :half].double()
    assert torch.allclose(rotated[..., :half], a * c - b * s)
    assert torch.allclose(rotated[..., half:], b * c + a * s)


def test_initialisation_matches_the_document():
    weights = init_canonical_weights(CONFIG, seed=0)
    residual_std = INIT_STD / math.sqrt(2 * CONFIG.num_layers)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
            continue
        expected = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
        assert abs(tensor.mean().item()) < 0.05 * expected, name
        assert abs(tensor.std().item() / expected - 1) < 0.05, name


# ------------------------------------------------------------------------------------------------------
# The documents agree with the code
# ------------------------------------------------------------------------------------------------------
def markers(path: Path) -> list[tuple[str, str, int]]:
    """(key, written value, line number) of every marked number."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for match in MARKER.finditer(line):
            found.append((match.group("key"), match.group("value"), number))
    return found


def agrees(written: str, expected) -> bool:
    text = written.replace(",", "")
    if isinstance(expected, int) and not isinstance(expected, bool):
        return re.fullmatch(r"\d+", text) is not None and int(text) == expected
    exponent = decimal.Decimal(text).as_tuple().exponent
    return abs(float(text) - expected) <= 0.5 * 10.0**exponent + 1e-12 * abs(expected)


DOCS = {"architecture": ARCHITECTURE_DOC, "appendices": APPENDICES_DOC}


@pytest.mark.parametrize("doc", DOCS)
def test_marked_numbers_agree_with_the_code(doc, measured):
    path = DOCS[doc]
    if not path.is_file():
        pytest.fail(f"{path.name} is missing")
    expected = architecture_expected(measured) if doc == "architecture" else appendix_expected()
    known = {**architecture_expected(measured), **appendix_expected()}
    found = markers(path)
    wrong = [f"{path.name}:{line}: {key} is written {value}, the code gives {known[key]!r}"
             for key, value, line in found if key in known and not agrees(value, known[key])]
    unknown = [f"{path.name}:{line}: unknown check key {key!r}" for key, _, line in found if key not in known]
    missing = sorted(set(expected) - {key for key, _, _ in found})
    assert not unknown, "\n".join(unknown)
    assert not wrong, "\n".join(wrong)
    assert not missing, f"{path.name} no longer shows these checked numbers: {missing}"


def test_value_matching_rules():
    assert agrees("3,135,744", 3135744) and not agrees("3,135,745", 3135744)
    assert agrees("19.5", 19.496) and not agrees("19.4", 19.496)
    assert agrees("55", 54.54) and agrees("0.000177828", 1.7782794e-4)
    assert not agrees("6.43", 6429868032)   # an integer quantity must be written in full


def canonical_names_in_table(text: str) -> list[str]:
    """The first cell of each row of the parameter-name table (section 4.1)."""
    section = text.split("### 4.1", 1)[1].split("### 4.2", 1)[0]
    names = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and cells[0].startswith("`"):
            names.append(cells[0].strip("`"))
    return names


def test_parameter_name_table_lists_the_canonical_layout():
    documented = canonical_names_in_table(ARCHITECTURE_DOC.read_text(encoding="utf-8"))
    canonical = [n.replace("layers.0.", "layers.{i}.") for n in canonical_shapes(CONFIG)
                 if not n.startswith("layers.") or n.startswith("layers.0.")]
    assert documented == canonical


FUSED_VERSIONS = {
    "v2": "version2_pytorch_fused.tiny_llama_v2",
    "v3": "version3_triton.tiny_llama_v3",
    "v4": "version4_triton_ultra.tiny_llama_v4",
}


@pytest.mark.parametrize("version", FUSED_VERSIONS)
def test_fused_versions_store_q_k_v_and_gate_up_as_documented(version):
    """qkv_proj = [q; k; v] and gate_up_proj = [gate; up] along dim 0; every other name unchanged."""
    module_name = FUSED_VERSIONS[version]
    if not (REPO / (module_name.replace(".", "/") + ".py")).is_file():
        pytest.skip(f"{module_name} does not exist yet")
    sys.path.insert(0, str(REPO))
    model = importlib.import_module(module_name).TinyLlama(SMALL)
    canonical = init_canonical_weights(SMALL, seed=3)
    model.load_canonical(canonical)
    state = model.state_dict()
    d, f = SMALL.hidden_dim, SMALL.intermediate_size
    for i in range(SMALL.num_layers):
        p = f"layers.{i}."
        qkv = state[p + "attention.qkv_proj.weight"]
        gate_up = state[p + "feed_forward.gate_up_proj.weight"]
        assert qkv.shape == (3 * d, d) and gate_up.shape == (2 * f, d)
        for part, rows in zip(("q", "k", "v"), (slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d))):
            assert torch.equal(qkv[rows], canonical[p + f"attention.{part}_proj.weight"])
        assert torch.equal(gate_up[:f], canonical[p + "feed_forward.gate_proj.weight"])
        assert torch.equal(gate_up[f:], canonical[p + "feed_forward.up_proj.weight"])
    fused_parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    unchanged = {n for n in canonical if not n.endswith(tuple(f"{x}.weight" for x in fused_parts))}
    assert unchanged <= set(state)
    round_trip = model.canonical_state_dict()
    assert set(round_trip) == set(canonical)
    assert all(torch.equal(round_trip[n], canonical[n]) for n in canonical)
