"""Version 1: the building blocks against hand-written references, causality, the canonical layout."""
import math

import pytest
import torch

from tinytransformer.config import ModelConfig
from tinytransformer.weights import canonical_shapes, init_canonical_weights, parameter_count
from version1_pytorch_baseline.tiny_llama_v1 import RMSNorm, TinyLlama, apply_rope, rope_tables

SMALL = ModelConfig(vocab_size=97, hidden_dim=48, num_layers=2, num_heads=3, intermediate_size=80, max_seq_len=40)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_rmsnorm_matches_definition():
    x = torch.randn(3, 5, 48, dtype=torch.float64)
    norm = RMSNorm(48, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    # Definition, element by element: y_i = w_i * x_i / sqrt(mean_j x_j^2 + eps)
    rms = torch.sqrt((x ** 2).sum(-1, keepdim=True) / 48 + 1e-6)
    expected = norm.weight * x / rms
    assert rel_err(norm(x), expected) < 1e-6   # statistics are computed in float32 by design


def test_rmsnorm_keeps_bfloat16_input_dtype_with_float32_statistics():
    x = (torch.randn(4, 64) * 30).to(torch.bfloat16)
    y = RMSNorm(64, eps=1e-6)(x)
    assert y.dtype == torch.bfloat16
    reference = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(y, reference) < 1e-2


def test_rope_matches_complex_rotation():
    """RoPE (rotate-half) rotates each pair (x_i, x_{i+d/2}) by pos * theta^(-2i/d): a complex multiply."""
    batch, heads, seq, dim = 2, 3, 11, 16
    q = torch.randn(batch, heads, seq, dim, dtype=torch.float64)
    k = torch.randn(batch, heads, seq, dim, dtype=torch.float64)
    cos, sin = rope_tables(seq, dim, 10000.0)
    q_rot, k_rot = apply_rope(q, k, cos.double(), sin.double())
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        pairs = torch.complex(x[..., : dim // 2], x[..., dim // 2:])
        freqs = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs[None, :]
        rotated = pairs * torch.polar(torch.ones_like(angles), angles)
        expected = torch.cat([rotated.real, rotated.imag], dim=-1)
        assert rel_err(x_rot, expected) < 1e-6   # the tables are float32


def test_rope_preserves_relative_positions():
    """<rot(q, m), rot(k, n)> depends on m - n only: the property RoPE is built for."""
    dim = 32
    cos, sin = rope_tables(20, dim, 10000.0)
    q, k = torch.randn(dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    def dot_at(m, n):
        qm, _ = apply_rope(q.expand(1, 1, 20, dim), q.expand(1, 1, 20, dim), cos.double(), sin.double())
        kn, _ = apply_rope(k.expand(1, 1, 20, dim), k.expand(1, 1, 20, dim), cos.double(), sin.double())
        return (qm[0, 0, m] * kn[0, 0, n]).sum().item()
    assert dot_at(7, 3) == pytest.approx(dot_at(14, 10), rel=1e-5)


def test_changing_a_token_never_changes_earlier_logits():
    torch.manual_seed(0)
    model = TinyLlama(SMALL).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 30))
    t = 17
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
    with torch.no_grad():
        before, _ = model(ids)
        after, _ = model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_canonical_layout_is_v1_layout():
    model = TinyLlama(SMALL)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    assert shapes == canonical_shapes(SMALL)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(SMALL)


def test_canonical_weights_round_trip_and_seeded():
    weights = init_canonical_weights(SMALL, seed=3)
    assert all(torch.equal(weights[k], v) for k, v in init_canonical_weights(SMALL, seed=3).items())
    model = TinyLlama(SMALL)
    model.load_canonical(weights)
    back = model.canonical_state_dict()
    assert all(torch.equal(back[k], weights[k]) for k in weights)


def test_initial_loss_is_near_log_vocab():
    model = TinyLlama(SMALL)
    model.load_canonical(init_canonical_weights(SMALL, seed=0))
    ids = torch.randint(0, SMALL.vocab_size, (4, 33))
    _, loss = model(ids[:, :-1], ids[:, 1:])
    assert abs(loss.item() - math.log(SMALL.vocab_size)) < 0.1


def test_every_parameter_gets_a_finite_nonzero_gradient():
    model = TinyLlama(SMALL)
    model.load_canonical(init_canonical_weights(SMALL, seed=0))
    ids = torch.randint(0, SMALL.vocab_size, (2, 21))
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
