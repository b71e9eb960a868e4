"""Version 4's feed-forward GEMMs with SwiGLU (forward) and its backward in their epilogues (kernels/swiglu_gemm.py).

Against float64 PyTorch references, forward and every gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size and bfloat16 cases are gpu-marked.
"""
import pytest
import torch
import torch.nn.functional as F

from tinytransformer import triton_support
from version4_triton_ultra.kernels import swiglu_gemm as sg
from version4_triton_ultra.kernels.whole_tiles import whole_tiles

# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    assert_matches, poisoned_outputs)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def reference_feed_forward(x, gate_up_weight, down_weight, grad_y):
    """gate_up, h and d(gate_up) of y = (silu(gate) * up) @ down_weight^T in float64 with autograd."""
    x, gate_up_weight, down_weight, grad_y = (t.detach().double() for t in (x, gate_up_weight, down_weight, grad_y))
    gate_up = (x @ gate_up_weight.T).requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    (h @ down_weight.T).backward(grad_y)
    return gate_up.detach(), h.detach(), gate_up.grad


def check_swiglu_gemm(n_rows, n_in, n_ffn, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(device=device, dtype=dtype)

    x, grad_y = draw(n_rows, n_in), draw(n_rows, n_in)
    gate_up_weight, down_weight = draw(2 * n_ffn, n_in, scale=n_in ** -0.5), draw(n_in, n_ffn, scale=n_ffn ** -0.5)
    gate_up, h = sg.gate_up_swiglu(x, gate_up_weight)
    grad_gate_up = sg.down_swiglu_backward(grad_y, down_weight, gate_up)
    ref_gate_up, ref_h, ref_grad_gate_up = reference_feed_forward(x, gate_up_weight, down_weight, grad_y)
    # float32 on an NVIDIA GPU multiplies in TF32 when torch's matmul switch says so: hold it to bfloat16's bound.
    tolerance_dtype = torch.bfloat16 if sg.dot_precision(dtype) == "tf32" and x.is_cuda else dtype
    assert_matches(gate_up, ref_gate_up, tolerance_dtype, "gate_up")
    assert_matches(h, ref_h, tolerance_dtype, "h")
    assert_matches(grad_gate_up, ref_grad_gate_up, tolerance_dtype, "grad gate_up")


@pytest.mark.parametrize("n_rows, n_in, n_ffn", [(37, 40, 24), (16, 16, 16), (5, 48, 40), (32, 48, 32)],
                         ids=["nothing a multiple of the tile", "one tile", "fewer rows than a tile",
                              "whole tiles in the interpreter's tiles"])
def test_swiglu_gemm_matches_reference(n_rows, n_in, n_ffn, device):
    check_swiglu_gemm(n_rows, n_in, n_ffn, torch.float32, device, seed=191)


def test_swiglu_gemm_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """The tiles a CPU run takes in the interpreter (fitted to the problem, up to 128 rows x 256 columns x 256 deep
    for the GEMMs): problems larger than that span several tiles in every direction."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_swiglu_gemm(300, 300, 300, torch.float32, device, seed=195)


def test_swiglu_gemm_rejects_mismatched_operands(device):
    x = torch.ones(4, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        sg.gate_up_swiglu(x, torch.ones(6, 7, device=device))
    with pytest.raises(ValueError, match="gate_up must be"):
        sg.down_swiglu_backward(x, torch.ones(8, 3, device=device), torch.ones(4, 5, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_rows", [1000, 16400, 1024, 16384],
                         ids=["small tiles", "large tiles", "small tiles, whole", "large tiles, whole"])
def test_swiglu_gemm_full_size_gpu(n_rows, dtype, device):
    check_swiglu_gemm(n_rows, 256, 512, dtype, device, seed=201)


def test_swiglu_gemm_refuses_more_row_blocks_than_the_grid_allows(monkeypatch, device):
    monkeypatch.setattr(sg, "MAX_ROW_BLOCKS", 2)
    x, weight = torch.ones(200, 16, device=device), torch.ones(32, 16, device=device)
    with pytest.raises(ValueError, match="row blocks"):
        sg.gate_up_swiglu(x, weight)


@pytest.mark.parametrize("sizes, whole", [(dict(M=1024, N=512, K=256), True), (dict(M=1000, N=512, K=256), False),
                                          (dict(M=1024, N=520, K=256), False), (dict(M=1024, N=512, K=250), False),
                                          (dict(M=64, N=64), True)])
def test_whole_tiles_only_when_every_size_is_a_whole_number_of_its_tile(sizes, whole):
    assert whole_tiles(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), **sizes) is whole


def test_each_launch_is_told_whether_its_tiles_are_whole(monkeypatch, device):
    """Both kernels ask whole_tiles with the sizes and tiles they launch with (then run without masks), and the
    results are right either way: 32 x 48 x 32 is whole in 16-wide tiles, 37 x 40 x 24 not. The tiles are pinned to
    16 on every device (a GPU's own launch takes 64 rows in float32, in which 32 rows are not whole)."""
    monkeypatch.setattr(sg, "_launch_config", lambda *args: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1,
                                                                    num_stages=1))
    asked = []

    def recording(config, **sizes):
        asked.append(whole_tiles(config, **sizes))
        return asked[-1]
    monkeypatch.setattr(sg, "whole_tiles", recording)
    check_swiglu_gemm(32, 48, 32, torch.float32, device, seed=197)
    check_swiglu_gemm(37, 40, 24, torch.float32, device, seed=199)
    assert asked == [True, True, False, False]   # forward, backward; then the same at the ragged size
