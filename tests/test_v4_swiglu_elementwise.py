"""Version 4's SwiGLU as a kernel of its own each way (kernels/swiglu_elementwise.py, --separate-swiglu).

Against float64 PyTorch references, forward and gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size cases are gpu-marked.
"""
import pytest
import torch
import torch.nn.functional as F

from tinytransformer import triton_support
from version4_triton_ultra.kernels import swiglu_elementwise as se

# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    assert_matches, poisoned_outputs, random)

pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def reference_swiglu(gate_up, grad_h):
    """h and d(gate_up) in float64 with autograd, from the same (rounded) values the kernels read."""
    gate_up = gate_up.detach().double().requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    h.backward(grad_h.detach().double())
    return h.detach(), gate_up.grad


def check_swiglu(n_rows, n_ffn, dtype, device, seed):
    gate_up = random((n_rows, 2 * n_ffn), dtype, device, seed)
    grad_h = random((n_rows, n_ffn), dtype, device, seed + 1)
    h = se.swiglu(gate_up)
    grad_gate_up = se.swiglu_backward(grad_h, gate_up)
    ref_h, ref_grad_gate_up = reference_swiglu(gate_up, grad_h)
    assert h.dtype == grad_gate_up.dtype == dtype
    assert_matches(h, ref_h, dtype, "h")
    assert_matches(grad_gate_up, ref_grad_gate_up, dtype, "grad gate_up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("n_rows, n_ffn", [(7, 37), (3, 16), (1, 5)],
                         ids=["columns not a multiple of the block", "one block", "fewer columns than a block"])
def test_swiglu_matches_reference(n_rows, n_ffn, dtype, device):
    check_swiglu(n_rows, n_ffn, dtype, device, seed=311)


def test_swiglu_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """A CPU run's block covers a row of up to 1,024 columns; wider rows span several blocks."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_swiglu(3, 1100, torch.float32, device, seed=313)


def test_swiglu_of_no_rows_is_empty(device):
    gate_up = torch.ones(0, 8, device=device)
    assert se.swiglu(gate_up).shape == (0, 4)
    assert se.swiglu_backward(torch.ones(0, 4, device=device), gate_up).shape == (0, 8)


def test_swiglu_rejects_mismatched_operands(device):
    with pytest.raises(ValueError, match="gate_up must be"):
        se.swiglu(torch.ones(4, 7, device=device))
    with pytest.raises(ValueError, match="grad_h must be"):
        se.swiglu_backward(torch.ones(4, 3, device=device), torch.ones(4, 8, device=device))
    with pytest.raises(ValueError, match="grad_h must be"):
        se.swiglu_backward(torch.ones(4, 4, device=device, dtype=torch.bfloat16), torch.ones(4, 8, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_rows, n_ffn", [(1000, 512), (8192, 2816)], ids=["seed", "medium"])
def test_swiglu_full_size_gpu(n_rows, n_ffn, dtype, device):
    check_swiglu(n_rows, n_ffn, dtype, device, seed=317)


# ----------------------------------------------------------------------------------------------------------
# Which form the feed-forward layer uses: chosen by size unless a flag chooses (fused_layers.separate_swiglu_pays)
# ----------------------------------------------------------------------------------------------------------
def preset_shape(name):
    """(rows, hidden_dim, intermediate_size) of a size preset's training batch."""
    from tinytransformer.cli import build_parser, resolve_configs
    from version4_triton_ultra import tiny_llama_v4 as v4
    args, _ = build_parser(v4.SPEC).parse_known_args(["--preset", name])
    config, train = resolve_configs(args)
    return train.batch_size * train.seq_len, config.hidden_dim, config.intermediate_size


@pytest.mark.parametrize("preset, separate", [("tiny", False), ("small", True), ("medium", True), ("large", True)])
def test_the_size_rule_picks_the_form_measured_faster_at_each_preset(preset, separate):
    from version4_triton_ultra.fused_layers import separate_swiglu_pays
    assert separate_swiglu_pays(*preset_shape(preset)) is separate


def test_the_size_rule_switches_between_the_tiny_and_small_shapes():
    """Rows of the small preset's model on either side of the threshold: 2,048 rows x 512 x 1,376 = 1.44 G
    multiply-adds take the vendor GEMMs, 1,024 rows (0.72 G) the epilogues; the tiny model never at its batch."""
    from version4_triton_ultra.fused_layers import separate_swiglu_pays
    assert separate_swiglu_pays(2048, 512, 1376) and not separate_swiglu_pays(1024, 512, 1376)
    assert not separate_swiglu_pays(1024, 256, 512) and separate_swiglu_pays(8192, 256, 512)


@pytest.mark.parametrize("flags, expected", [([], None), (["--separate-swiglu"], True),
                                             (["--swiglu-in-gemms"], False)])
def test_the_flags_choose_a_form_or_leave_it_to_the_size(flags, expected):
    from tinytransformer.cli import build_parser
    from version4_triton_ultra import tiny_llama_v4 as v4
    args, _ = build_parser(v4.SPEC).parse_known_args(flags)
    assert args.separate_swiglu is expected
    model = v4.build_model(v4.ModelConfig(vocab_size=64, hidden_dim=32, num_heads=2, num_layers=2,
                                          intermediate_size=48, max_seq_len=16), args)
    assert all(layer.feed_forward.separate_swiglu is expected for layer in model.layers)


def test_both_swiglu_flags_are_one_line_and_exit_2(capsys):
    from tinytransformer.cli import run as harness_run
    from version4_triton_ultra import tiny_llama_v4 as v4
    with pytest.raises(SystemExit) as exit_:
        harness_run(v4.SPEC, ["--separate-swiglu", "--swiglu-in-gemms"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "not allowed with argument" in err[0], err


@pytest.mark.parametrize("threshold, separate", [(1, True), (2 ** 62, False)], ids=["above", "below"])
def test_the_layer_without_a_flag_follows_the_size_rule(threshold, separate, monkeypatch, device):
    """The same layer, the same batch: which kernels run, forward and backward, follows the rule (its threshold
    moved to either side of the batch's size)."""
    from version4_triton_ultra import fused_layers
    from version4_triton_ultra import tiny_llama_v4 as v4
    monkeypatch.setattr(fused_layers, "SEPARATE_SWIGLU_FROM_MULTIPLY_ADDS", threshold)
    calls = []
    monkeypatch.setattr(fused_layers, "swiglu", lambda gate_up: calls.append("forward") or se.swiglu(gate_up))
    monkeypatch.setattr(fused_layers, "swiglu_backward",
                        lambda grad_h, gate_up: calls.append("backward") or se.swiglu_backward(grad_h, gate_up))
    layer = v4.FeedForward(v4.ModelConfig(vocab_size=64, hidden_dim=32, num_heads=2, num_layers=1,
                                          intermediate_size=48, max_seq_len=16)).to(device)
    assert layer.separate_swiglu is None
    layer(torch.randn(2, 5, 32, device=device, requires_grad=True)).sum().backward()
    assert calls == (["forward", "backward"] if separate else [])
