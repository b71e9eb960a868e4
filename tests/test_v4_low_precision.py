"""Version 4 under autocast: projections multiply with 16-bit weight copies that the model refreshes once per
forward pass, and their weight gradients come back in float32. Checked on the CPU with torch matmuls (the
model's Triton kernels are not involved: Triton's interpreter cannot run bfloat16 dot products)."""
import pytest
import torch
import torch.nn.functional as F

from version4_triton_ultra.backward_overlap import ProjectionMatmul
from version4_triton_ultra.tiny_llama_v4 import Projection, TinyLlama
from tinytransformer.config import ModelConfig

BF16_TOLERANCE = 2e-2


def relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_low_precision_linear_matches_float64():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 48).bfloat16().requires_grad_()
    weight = torch.randn(32, 48, requires_grad=True)
    y = ProjectionMatmul.apply(x, weight, weight.detach().bfloat16(), None)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)

    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    y64 = x64 @ w64.T
    y64.backward(grad_y.double())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    for name, got, want in (("y", y, y64), ("grad x", x.grad, x64.grad), ("grad weight", weight.grad, w64.grad)):
        assert relative_error(got, want) < BF16_TOLERANCE, name


def test_projection_matmul_in_float32_matches_float64():
    """The float32 path (the weight itself as the GEMM operand), used with the weight-gradient stream."""
    torch.manual_seed(2)
    x = torch.randn(3, 5, 48, requires_grad=True)
    weight = torch.randn(32, 48, requires_grad=True)
    y = ProjectionMatmul.apply(x, weight, weight, None)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (x64 @ w64.T).backward(grad_y.double())
    assert y.dtype == x.grad.dtype == weight.grad.dtype == torch.float32
    for got, want in ((y, x64 @ w64.T), (x.grad, x64.grad), (weight.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_weight_gradient_stream_needs_a_gpu():
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64,
                                  max_seq_len=16))
    with pytest.raises(ValueError, match="needs a GPU"):
        model.use_weight_gradient_stream()
    model.use_weight_gradient_stream(False)   # switching it off is always possible
    assert all(projection.weight_grad_stream is None for projection in model.projections)


def test_projection_under_autocast_equals_nn_linear():
    torch.manual_seed(1)
    projection = Projection(48, 32)
    x = torch.randn(4, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(x, projection.weight)
        projection.weight16 = projection.weight.detach().bfloat16()
        got = projection(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # Outside autocast the float32 weight is used, whatever copy is lying around.
    assert projection(x).dtype == torch.float32


def test_refreshed_copies_follow_the_weights_and_reuse_their_memory():
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64,
                                  max_seq_len=16))
    model.refresh_16bit_weights(torch.bfloat16)
    assert len(model.weights16) == 5   # qkv, o, gate/up, down, output head
    pointers = [w.data_ptr() for w in model.weights16]
    with torch.no_grad():
        for projection in model.projections:
            projection.weight.add_(1.0)   # what an optimizer step does
    model.refresh_16bit_weights(torch.bfloat16)
    assert [w.data_ptr() for w in model.weights16] == pointers   # a captured graph keeps writing here
    for projection in model.projections:
        assert projection.weight16.dtype == torch.bfloat16
        torch.testing.assert_close(projection.weight16.float(), projection.weight.detach(), rtol=1e-2, atol=1e-2)
    model.refresh_16bit_weights(None)
    assert all(projection.weight16 is None for projection in model.projections)


def test_matmul_to_float32_refuses_an_output_it_cannot_fill():
    from version4_triton_ultra.kernels.linear_cross_entropy import matmul_to_float32
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    out = torch.empty(4, 5)
    assert matmul_to_float32(a, b, out=out) is out
    torch.testing.assert_close(out, a @ b)
    for bad in (torch.empty(4, 5, dtype=torch.bfloat16), torch.empty(5, 4)):
        with pytest.raises(ValueError, match="out must be float32"):
            matmul_to_float32(a, b, out=bad)
