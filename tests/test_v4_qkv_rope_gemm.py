"""Version 4's fused QKV GEMM with RoPE in its epilogue (kernels/qkv_rope_gemm.py).

Against float64 PyTorch references, forward and every gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size and bfloat16 cases are gpu-marked.
"""
import pytest
import torch

from tinytransformer import triton_support
from version4_triton_ultra.kernels import qkv_rope_gemm as qr
from version4_triton_ultra.kernels import swiglu_gemm as sg
from version4_triton_ultra.kernels.whole_tiles import whole_tiles as real_whole_tiles

# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    assert_matches, poisoned_outputs, random, rope_reference)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def reference_qkv_rope(x, weight, cos, sin, seq_len, head_dim):
    """[N, 3D] = x @ weight^T with q and k rotated, in float64."""
    qkv = (x.double() @ weight.double().T).view(-1, seq_len, 3, weight.shape[0] // (3 * head_dim), head_dim)
    cos, sin = cos[:seq_len].double(), sin[:seq_len].double()
    q, k, v = qkv.unbind(2)
    return torch.stack([rope_reference(q, cos, sin), rope_reference(k, cos, sin), v], dim=2).reshape(x.shape[0], -1)


def check_qkv_rope(batch, seq_len, heads, head_dim, dtype, device, seed, n_in=None):
    from version3_triton.kernels.rope import rope_tables
    dim = heads * head_dim
    n_in = n_in or dim
    x = random((batch * seq_len, n_in), dtype, device, seed)
    weight = random((3 * dim, n_in), dtype, device, seed + 1, scale=n_in ** -0.5)
    cos, sin = rope_tables(seq_len + 3, head_dim, device=device)
    qkv = qr.qkv_rope(x, weight, cos, sin, seq_len, head_dim)
    assert qkv.dtype == dtype
    tolerance_dtype = torch.bfloat16 if sg.dot_precision(dtype) == "tf32" and x.is_cuda else dtype
    want = reference_qkv_rope(x, weight, cos, sin, seq_len, head_dim)
    for name, got, ref in zip("qkv", qkv.split(dim, dim=-1), want.split(dim, dim=-1)):
        assert_matches(got, ref, tolerance_dtype, name)


@pytest.mark.parametrize("batch, seq_len, heads, head_dim", [(2, 5, 3, 16), (1, 37, 2, 32), (3, 16, 1, 16)],
                         ids=["rows not a multiple of the tile", "two heads of 32", "one head, whole row tiles"])
def test_qkv_rope_matches_reference(batch, seq_len, heads, head_dim, device):
    check_qkv_rope(batch, seq_len, heads, head_dim, torch.float32, device, seed=211, n_in=40)


def test_qkv_rope_without_masks_on_whole_tiles(monkeypatch, device):
    """32 rows, 2 heads of 16 (96 columns) and 32 inputs are whole numbers of 16-wide tiles: the kernel then loads and
    stores without masks (whole_tiles.py), and must give the same result as the reference. The tiles are pinned to 16
    on every device (a GPU's own launch takes 64 or 128 rows, in which 32 rows are not whole)."""
    monkeypatch.setattr(qr, "_launch_config", lambda *args: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1,
                                                                    num_stages=1))
    monkeypatch.setattr(qr, "_fit_shared_memory", lambda config, *args: config)
    asked = []

    def recording(config, **sizes):
        asked.append(real_whole_tiles(config, **sizes))
        return asked[-1]
    monkeypatch.setattr(qr, "whole_tiles", recording)
    check_qkv_rope(2, 16, 2, 16, torch.float32, device, seed=215, n_in=32)
    check_qkv_rope(2, 5, 3, 16, torch.float32, device, seed=217, n_in=40)
    assert asked == [True, False]


@pytest.mark.parametrize("heads, block_n", [(4, 32), (3, 64)], ids=["two heads per tile", "a tile of k and v"])
def test_qkv_rope_tiles_of_several_heads(heads, block_n, monkeypatch, device):
    """On a GPU a column tile holds several heads (BLOCK_N 64 or 128, head dim 32): the same here with heads of
    16, so the per-head rotation inside one tile is checked on the CPU too; with 3 heads and 4 per tile, one
    tile holds k heads and v heads, and only the k heads may be rotated."""
    monkeypatch.setattr(qr, "_launch_config", lambda *args: dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=16,
                                                                    num_warps=1, num_stages=1))
    check_qkv_rope(2, 9, heads, 16, torch.float32, device, seed=221)


def test_qkv_rope_rejects_bad_inputs(device):
    from version3_triton.kernels.rope import rope_tables
    cos, sin = rope_tables(8, 16, device=device)
    x, weight = torch.ones(16, 32, device=device), torch.ones(96, 32, device=device)
    with pytest.raises(ValueError, match="whole sequences"):
        qr.qkv_rope(x, weight, cos, sin, 5, 16)
    with pytest.raises(ValueError, match="table"):
        qr.qkv_rope(x[:10], weight, cos, sin, 10, 16)
    with pytest.raises(ValueError, match="head_dim"):
        qr.qkv_rope(x, torch.ones(90, 32, device=device), cos, sin, 8, 16)
    with pytest.raises(ValueError, match="one dtype"):
        qr.qkv_rope(x, weight.half(), cos, sin, 8, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seq_len", [(8, 128), (32, 512)], ids=["small tiles", "large tiles"])
def test_qkv_rope_full_size_gpu(batch, seq_len, dtype, device):
    check_qkv_rope(batch, seq_len, 8, 32, dtype, device, seed=231)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_len, heads, head_dim, dtype", [
    (4, 128, 2, 128, torch.bfloat16), (8, 512, 3, 32, torch.bfloat16), (32, 512, 3, 32, torch.bfloat16),
    (8, 128, 3, 64, torch.float32)], ids=["head dim 128", "3 heads, 64-column tiles", "3 heads, 128-column tiles",
                                          "3 heads of 64, float32"])
def test_qkv_rope_head_layouts_gpu(batch, seq_len, heads, head_dim, dtype, device):
    """Compiled tiles across the q/k and k/v boundaries (3 heads: 2D is no multiple of the column tile)."""
    check_qkv_rope(batch, seq_len, heads, head_dim, dtype, device, seed=241)


def test_qkv_rope_tiles_fit_the_shared_memory(monkeypatch):
    """The H100's choices stay as they are with its 227 KiB; a 99 KiB card and AMD's 64 KiB get shallower tiles."""
    monkeypatch.setattr(qr, "interpreter_active", lambda: False)   # the GPU's choices, even on the CPU
    monkeypatch.setattr(qr, "is_rocm", lambda: False)
    h100, ampere_or_ada, mi300 = 232448, 101376, 65536
    for dtype, n_rows in [(torch.float32, 1024), (torch.bfloat16, 1024), (torch.bfloat16, 16384)]:
        config = qr._launch_config(dtype, n_rows, 32)
        itemsize = torch.tensor([], dtype=dtype).element_size()
        assert qr._fit_shared_memory(config, itemsize, h100) == config
        for budget in (ampere_or_ada, mi300):
            fitted = qr._fit_shared_memory(config, itemsize, budget)
            used = fitted["num_stages"] * (fitted["BLOCK_M"] + fitted["BLOCK_N"]) * fitted["BLOCK_K"] * itemsize
            assert used <= budget * 3 // 4 and fitted["BLOCK_K"] >= 16
    assert qr._fit_shared_memory(qr._launch_config(torch.float32, 1024, 32), 4, ampere_or_ada)["BLOCK_K"] == 32


def test_qkv_rope_refuses_a_column_tile_smaller_than_a_head(monkeypatch, device):
    monkeypatch.setattr(qr, "_launch_config", lambda *args: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16,
                                                                    num_warps=1, num_stages=1))
    monkeypatch.setattr(qr, "_fit_shared_memory", lambda config, *args: config)
    from version3_triton.kernels.rope import rope_tables
    cos, sin = rope_tables(4, 32, device=device)
    with pytest.raises(ValueError, match="whole heads"):
        qr.qkv_rope(torch.ones(8, 32, device=device), torch.ones(96, 32, device=device), cos, sin, 4, 32)




def test_qkv_rope_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """The GEMM tiles a CPU run takes in the interpreter (up to 128 rows x 256 columns x 256 deep): a problem
    larger than that spans several tiles in every direction."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_qkv_rope(3, 50, 6, 16, torch.float32, device, seed=215, n_in=300)
