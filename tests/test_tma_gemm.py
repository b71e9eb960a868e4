"""The Hopper GEMM of benchmarks/tma_gemm.py (tensor descriptors, persistent programs), which
benchmarks/compare_gemm_backends.py times against cuBLAS.

Against float64 PyTorch products, in each of the step's operand layouts (a row-major or transposed, b row-major or
transposed), with a 16-bit and a float32 output, every output buffer NaN-filled first. On the CPU the kernel runs
in Triton's interpreter in float16 (the interpreter's tl.dot gets bfloat16 wrong, as for every kernel here: the
bfloat16 and full-size cases are gpu-marked). Also: the refusals, one line each, and the launch rules.
"""
import pytest
import torch

from benchmarks import tma_gemm as tg

from .v4_kernel_checks import assert_matches, random


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output starts as NaN, so an element the kernel forgets to write fails the comparison."""
    monkeypatch.setattr(tg, "_new_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))

LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]
LAYOUT_IDS = ["a rows, b rows (input gradient)", "a rows, b transposed (forward)",
              "a transposed, b rows (weight gradient)", "both transposed"]


def operands(m, n, k, a_transposed, b_transposed, dtype, device, seed):
    """a [m, k] and b [k, n], each stored row-major or as the transpose of a row-major matrix."""
    a = random((k, m), dtype, device, seed).T if a_transposed else random((m, k), dtype, device, seed)
    b = random((n, k), dtype, device, seed + 1).T if b_transposed else random((k, n), dtype, device, seed + 1)
    return a, b


def check_product(m, n, k, a_transposed, b_transposed, dtype, out_dtype, device, seed=401):
    a, b = operands(m, n, k, a_transposed, b_transposed, dtype, device, seed)
    out = tg.tma_gemm(a, b, out_dtype)
    assert out.dtype == (out_dtype or dtype) and out.is_contiguous()
    # A 16-bit output is the float32 sum rounded once; a float32 output keeps the sum (float16 products are exact
    # in float32, so only the order of the additions differs from float64).
    tolerance = dtype if out.dtype != torch.float32 else torch.float32
    assert_matches(out, a.double() @ b.double(), tolerance, f"a @ b, {m} x {n} x {k}")


@pytest.mark.usefixtures("small_interpreter_blocks")
@pytest.mark.parametrize("a_transposed, b_transposed", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["float16 output", "float32 output"])
def test_product_matches_float64(a_transposed, b_transposed, out_dtype, device):
    """40 x 24 x 56 in tiles of 16: a partial row block, a partial column block, a partial k step, and three
    programs for six tiles (each program takes two)."""
    check_product(40, 24, 56, a_transposed, b_transposed, torch.float16, out_dtype, device)


def test_product_with_the_tiles_of_a_cpu_run(device):
    """A CPU run's tiles (up to 128 a side): an output of more than one tile each way."""
    check_product(136, 144, 72, True, False, torch.float16, torch.float32, device, seed=411)


@pytest.mark.usefixtures("small_interpreter_blocks")
def test_empty_products(device):
    a, b = operands(8, 16, 0, False, False, torch.float16, device, 421)
    assert torch.equal(tg.tma_gemm(a, b, torch.float32), torch.zeros(8, 16, device=device))   # no k: zeros
    a, b = operands(0, 16, 8, False, False, torch.float16, device, 422)
    assert tg.tma_gemm(a, b).shape == (0, 16)


@pytest.mark.usefixtures("small_interpreter_blocks")
def test_column_slices_are_read_in_place(device):
    """Rows further apart than their length (a column slice of a wider matrix, and its transpose) need no copy."""
    wide = random((40, 48), torch.float16, device, 461)
    other = random((56, 40), torch.float16, device, 462)
    a = wide[:, :32]                        # [40, 32], rows 96 bytes apart
    b = other[:32].T.contiguous().T         # [32, 40] stored as the transpose of a row-major [40, 32]
    assert_matches(tg.tma_gemm(a, b, torch.float32), a.double() @ b.double(), torch.float32, "slices")
    a_transposed, b_sliced = wide[:, :32].T, wide[:, 8:40]   # [32, 40] and [40, 32], both of `wide`'s storage
    assert_matches(tg.tma_gemm(a_transposed, b_sliced, torch.float32), a_transposed.double() @ b_sliced.double(),
                   torch.float32, "a transposed slice")


def test_bad_operands_are_refused_in_one_line(device):
    a, b = operands(16, 16, 16, False, False, torch.float16, device, 431)
    cases = [((a.float(), b.float()), {}, "share one dtype"),
             ((a, b.to(torch.bfloat16)), {}, "share one dtype"),
             ((a, b), {"out_dtype": torch.bfloat16}, "output is"),
             ((a, b[:8]), {}, r"need a \[M, K\] and b \[K, N\]"),
             ((a[:, ::2], b[:8]), {}, "row-major or the transpose"),
             ((random((16, 12), torch.float16, device, 432), random((12, 16), torch.float16, device, 433)), {},
              "16-byte boundaries")]   # rows of 24 bytes
    for (x, y), kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as raised:
            tg.tma_gemm(x, y, **kwargs)
        assert "\n" not in str(raised.value)
    misaligned = torch.empty(16 * 16 + 1, dtype=torch.float16, device=device)[1:].view(16, 16)   # starts 2 bytes in
    with pytest.raises(ValueError, match="16-byte boundaries"):
        tg.tma_gemm(misaligned, b)


def test_where_it_runs(monkeypatch):
    """The interpreter always; otherwise an NVIDIA GPU of compute capability 9 or newer, and nothing else."""
    monkeypatch.setattr(tg, "interpreter_active", lambda: True)
    assert tg.tma_gemm_problem(torch.device("cpu")) is None
    monkeypatch.setattr(tg, "interpreter_active", lambda: False)
    assert "NVIDIA GPU or in Triton's interpreter" in tg.tma_gemm_problem(torch.device("cpu"))
    monkeypatch.setattr(tg, "is_rocm", lambda: True)
    assert "not compiled for AMD" in tg.tma_gemm_problem(torch.device("cuda"))
    monkeypatch.setattr(tg, "is_rocm", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 9.0 or newer" in tg.tma_gemm_problem(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tg.tma_gemm_problem(torch.device("cuda")) is None


def test_launch_rules(monkeypatch):
    """On a GPU: float32 outputs one launch; 16-bit outputs 128 x 256 tiles unless waves of 128 x 128 tiles leave
    fewer SMs idle (the shapes of the measured table, 132 SMs); one program per SM, never more than the tiles."""
    monkeypatch.setattr(tg, "interpreter_active", lambda: False)
    monkeypatch.setattr(tg, "multiprocessor_count", lambda device: 132)
    gpu = torch.device("cuda")
    big, small = tg.HOPPER_LAUNCH["16-bit"], tg.HOPPER_LAUNCH["16-bit, few tiles"]
    for (m, n, k), launch in {(8192, 5632, 1024): big,     # medium gate/up forward: 10.7 waves of large tiles
                              (8192, 2816, 1024): small,   # medium down input gradient: 5.3 waves against 10.7
                              (8192, 1024, 1024): big,     # medium o forward: 2 waves against 4
                              (4160, 1024, 32000): big,    # medium head input gradient: 1 wave against 2
                              (4096, 1536, 512): small,    # small qkv forward: 2 waves against 3
                              (4096, 2752, 512): big,      # small gate/up forward: 3 waves against 6
                              (4096, 512, 4096): small,    # small head input gradient: 1 wave against 1
                              (1024, 768, 256): small}.items():   # tiny qkv forward
        assert tg.launch_for(torch.bfloat16, m, n, k, gpu) == launch, (m, n, k)
    weight_gradient = tg.launch_for(torch.float32, 1024, 1024, 8192, gpu)
    assert weight_gradient == tg.HOPPER_LAUNCH["float32"] and weight_gradient is not tg.HOPPER_LAUNCH["float32"]
    assert tg.program_count(gpu, 1408) == 132
    assert tg.program_count(gpu, 40) == 40


@pytest.mark.gpu
@pytest.mark.parametrize("a_transposed, b_transposed", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_product_on_the_gpu(a_transposed, b_transposed, dtype, device):
    """The table's launches on the GPU, at a shape that is not a multiple of their tiles, both output dtypes."""
    if tg.tma_gemm_problem(device):
        pytest.skip(tg.tma_gemm_problem(device))
    for out_dtype in (None, torch.float32):
        check_product(1000, 776, 520, a_transposed, b_transposed, dtype, out_dtype, device, seed=441)


@pytest.mark.gpu
def test_medium_preset_gemms_on_the_gpu(device):
    """The medium preset's feed-forward GEMMs in the step's layouts: forward, input gradient, weight gradient."""
    if tg.tma_gemm_problem(device):
        pytest.skip(tg.tma_gemm_problem(device))
    tokens, hidden, ffn = 8192, 1024, 2816
    check_product(tokens, 2 * ffn, hidden, False, True, torch.bfloat16, None, device, seed=451)
    check_product(tokens, hidden, 2 * ffn, False, False, torch.bfloat16, None, device, seed=452)
    check_product(2 * ffn, hidden, tokens, True, False, torch.bfloat16, torch.float32, device, seed=453)

