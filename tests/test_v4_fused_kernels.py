"""Version 4's fused ops against float64 PyTorch references: forward and every gradient.

- add_rmsnorm: residual + delta and RMSNorm in one kernel (and delta=None: plain RMSNorm), and the embedding
  lookup + RMSNorm of the first layer (embedding_rms_norm).
- linear_cross_entropy: output head + cross-entropy in chunks, the gradient computed during forward.
- embedding_backward: the token-embedding gradient as one scatter-add kernel.
- swiglu_gemm: the feed-forward GEMMs with SwiGLU (forward) and its backward in their epilogues.
- qkv_rope_gemm: the fused QKV GEMM with RoPE in its epilogue, and the attention Function built on it.

Every buffer the wrappers allocate is filled with NaN first (the autouse fixture below), so an element a
kernel forgets to write fails the test. On CPU the kernels run in Triton's interpreter: shapes are small;
the full-size and bfloat16 cases are gpu-marked.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tinytransformer import triton_support
from version4_triton_ultra.kernels import add_rmsnorm as arn
from version4_triton_ultra.kernels import embedding_backward as emb
from version4_triton_ultra.kernels import linear_cross_entropy as lce
from version4_triton_ultra.kernels import qkv_rope_gemm as qr
from version4_triton_ultra.kernels import swiglu_gemm as sg

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the wrappers allocate starts as NaN. Returns the list of allocated shapes."""
    allocated = []

    def nan_filled(shape, dtype, device):
        allocated.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(arn, "_new_output", nan_filled)
    monkeypatch.setattr(lce, "_new_output", nan_filled)
    monkeypatch.setattr(sg, "_new_output", nan_filled)
    monkeypatch.setattr(qr, "_new_output", nan_filled)
    return allocated


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64; infinite when out holds a NaN or inf, so NaN never passes."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(ref).all(), "the reference itself is not finite"
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


def assert_matches(out, ref, dtype, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3g} >= {TOLERANCE[dtype]:g} ({dtype})"


def random(shape, dtype, device, seed, scale=1.0):
    """Fresh random values drawn on the CPU (the same on every machine), moved to the device."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def as_float64_leaf(t):
    return t.detach().double().requires_grad_(True)


# ----------------------------------------------------------------------------------------------------------
# add_rms_norm
# ----------------------------------------------------------------------------------------------------------
def reference_add_rms_norm(residual, delta, weight, eps=EPS):
    h = residual if delta is None else residual + delta
    return h, weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def check_add_rms_norm(shape, dtype, device, seed, with_delta=True):
    d = shape[-1]
    residual = leaf(random(shape, dtype, device, seed))
    delta = leaf(random(shape, dtype, device, seed + 1, scale=0.5)) if with_delta else None
    weight = leaf(random((d,), torch.float32, device, seed + 2, scale=0.1) + 1.0)
    grad_new_residual = random(shape, dtype, device, seed + 3)
    grad_normed = random(shape, dtype, device, seed + 4)

    new_residual, normed = arn.add_rms_norm(residual, delta, weight, EPS)
    assert new_residual.dtype == normed.dtype == dtype
    torch.autograd.backward([new_residual, normed], [grad_new_residual, grad_normed])

    inputs64 = [as_float64_leaf(t) if t is not None else None for t in (residual, delta, weight)]
    h64, normed64 = reference_add_rms_norm(*inputs64)
    torch.autograd.backward([h64, normed64], [grad_new_residual.double(), grad_normed.double()])

    assert_matches(new_residual, h64, dtype, "new_residual")
    assert_matches(normed, normed64, dtype, "normed")
    assert_matches(residual.grad, inputs64[0].grad, dtype, "grad residual")
    if with_delta:
        assert_matches(delta.grad, inputs64[1].grad, dtype, "grad delta")
    assert_matches(weight.grad, inputs64[2].grad, dtype, "grad weight")
    return new_residual, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 200), (16, 64), (1, 33), (3, 1000), (2, 5, 96)])
def test_add_rms_norm_matches_float64(shape, dtype, device, poisoned_outputs):
    check_add_rms_norm(shape, dtype, device, seed=sum(shape))
    assert poisoned_outputs, "the wrapper did not allocate through the poisoning hook"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_without_delta_returns_its_input(dtype, device):
    new_residual, residual = check_add_rms_norm((9, 200), dtype, device, seed=5, with_delta=False)
    # No copy: the stream continues with the very same storage.
    assert new_residual.data_ptr() == residual.data_ptr()


def test_rms_norm_entry_point(device):
    x, w = leaf(random((6, 80), torch.float32, device, 11)), leaf(random((80,), torch.float32, device, 12))
    normed = arn.rms_norm(x, w, EPS)
    normed.backward(random((6, 80), torch.float32, device, 13))
    x64, w64 = as_float64_leaf(x), as_float64_leaf(w)
    ref = reference_add_rms_norm(x64, None, w64)[1]
    ref.backward(random((6, 80), torch.float64, device, 13))
    assert_matches(normed, ref, torch.float32, "normed")
    assert_matches(x.grad, x64.grad, torch.float32, "grad x")
    assert_matches(w.grad, w64.grad, torch.float32, "grad weight")


@pytest.mark.parametrize("used", ["normed only", "new_residual only"])
def test_add_rms_norm_one_output_unused(used, device):
    """Autograd passes None for an unused output; the other path alone must give the right gradients."""
    shape, dtype = (10, 200), torch.float32
    residual, delta = leaf(random(shape, dtype, device, 21)), leaf(random(shape, dtype, device, 22))
    weight = leaf(random((200,), dtype, device, 23) + 1.0)
    grad = random(shape, dtype, device, 24)
    inputs64 = [as_float64_leaf(t) for t in (residual, delta, weight)]
    outputs = arn.add_rms_norm(residual, delta, weight, EPS)
    outputs64 = reference_add_rms_norm(*inputs64)
    index = 1 if used == "normed only" else 0
    outputs[index].backward(grad)
    outputs64[index].backward(grad.double())
    assert_matches(residual.grad, inputs64[0].grad, dtype, "grad residual")
    assert_matches(delta.grad, inputs64[1].grad, dtype, "grad delta")
    if used == "normed only":
        assert_matches(weight.grad, inputs64[2].grad, dtype, "grad weight")
    else:
        assert weight.grad is None


def test_add_rms_norm_mixed_dtypes_follow_type_promotion(device):
    """A float32 stream plus a float16 sub-layer output gives a float32 stream; each grad keeps its dtype."""
    shape = (8, 128)
    residual = leaf(random(shape, torch.float32, device, 31))
    delta = leaf(random(shape, torch.float16, device, 32))
    weight = leaf(random((128,), torch.float32, device, 33) + 1.0)
    new_residual, normed = arn.add_rms_norm(residual, delta, weight, EPS)
    assert new_residual.dtype == normed.dtype == torch.float32
    (new_residual.sum() + (normed * normed).sum()).backward()
    assert residual.grad.dtype == torch.float32 and delta.grad.dtype == torch.float16
    inputs64 = [as_float64_leaf(t) for t in (residual, delta, weight)]
    h64, normed64 = reference_add_rms_norm(*inputs64)
    (h64.sum() + (normed64 * normed64).sum()).backward()
    assert_matches(normed, normed64, torch.float32, "normed")
    assert_matches(residual.grad, inputs64[0].grad, torch.float32, "grad residual")
    assert_matches(delta.grad, inputs64[1].grad, torch.float16, "grad delta")
    assert_matches(weight.grad, inputs64[2].grad, torch.float32, "grad weight")


def test_add_rms_norm_weight_grad_is_deterministic(device):
    shape = (13, 200)
    residual, delta = random(shape, torch.float32, device, 41), random(shape, torch.float32, device, 42)
    grads = []
    for _ in range(2):
        weight = leaf(random((200,), torch.float32, device, 43))
        arn.add_rms_norm(residual, delta, weight, EPS)[1].backward(random(shape, torch.float32, device, 44))
        grads.append(weight.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("group_size, one_group_up_to, d", [(10**6, 10**6, 96), (2, 0, 96), (3, 0, 96),
                                                          (3, 0, 1500)],
                         ids=["one group", "two levels, even groups", "two levels, short last group",
                              "two levels, several passes per sum"])
def test_add_rms_norm_weight_grad_summed_by_the_programs(group_size, one_group_up_to, d, monkeypatch, device):
    """The partial weight gradients are added by the last program (one group), or per group of programs and then
    across the groups (two levels); either way right, the same on every run (which only a GPU, where programs
    finish in any order, can really test), and the counters left at zero. At D = 1500 a summing program reads
    2 partial sums at a time, so its loop takes several passes, the last one partial."""
    monkeypatch.setattr(arn, "GROUP_SIZE", group_size)
    monkeypatch.setattr(arn, "ONE_GROUP_UP_TO", one_group_up_to)
    # 4 programs in the interpreter (and 37 rows make the last one short); on a GPU, 40000 rows make a few
    # hundred programs, so small groups give many of them.
    rows = 40000 if device.type == "cuda" else 37
    check_add_rms_norm((rows, d), torch.float32, device, seed=51)
    assert not arn._ticket_counters(device).any()   # left ready for the next launch
    shape = (rows, d)
    residual, delta = random(shape, torch.float32, device, 52), random(shape, torch.float32, device, 53)
    grad_normed = random(shape, torch.float32, device, 54)
    grads = []
    for _ in range(3):
        weight = leaf(random((d,), torch.float32, device, 55))
        arn.add_rms_norm(residual, delta, weight, EPS)[1].backward(grad_normed)
        grads.append(weight.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


# embedding_rms_norm: the lookup and the first norm in one kernel each way
def check_embedding_rms_norm(ids_shape, vocab, d, device, seed, normed_dtype=None, used=("h", "normed")):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, ids_shape, generator=g).to(device)   # repeats: rows share table rows
    table = leaf(random((vocab, d), torch.float32, device, seed + 1))
    weight = leaf(random((d,), torch.float32, device, seed + 2, scale=0.1) + 1.0)
    grads = {"h": random((*ids_shape, d), torch.float32, device, seed + 3),
             "normed": random((*ids_shape, d), normed_dtype or torch.float32, device, seed + 4)}

    h, normed = arn.embedding_rms_norm(ids, table, weight, EPS, normed_dtype=normed_dtype)
    assert h.shape == normed.shape == (*ids_shape, d)
    assert h.dtype == torch.float32 and normed.dtype == (normed_dtype or torch.float32)
    outputs = {"h": h, "normed": normed}
    torch.autograd.backward([outputs[k] for k in used], [grads[k] for k in used])

    table64, weight64 = as_float64_leaf(table), as_float64_leaf(weight)
    h64, normed64 = reference_add_rms_norm(table64[ids], None, weight64)
    outputs64 = {"h": h64, "normed": normed64}
    torch.autograd.backward([outputs64[k] for k in used], [grads[k].double() for k in used])

    assert torch.equal(h, table.detach()[ids])   # the lookup itself is exact
    assert_matches(normed, normed64, normed_dtype or torch.float32, "normed")
    assert_matches(table.grad, table64.grad, torch.float32, "grad table")
    if "normed" in used:
        assert_matches(weight.grad, weight64.grad, torch.float32, "grad weight")
    else:
        assert weight.grad is None


@pytest.mark.parametrize("ids_shape, vocab, d", [((3, 7), 11, 48), ((2, 33), 5, 200), ((1, 1), 3, 16)])
def test_embedding_rms_norm_matches_float64(ids_shape, vocab, d, device, poisoned_outputs):
    check_embedding_rms_norm(ids_shape, vocab, d, device, seed=vocab + d)


@pytest.mark.parametrize("used", [("h",), ("normed",)], ids=["rows only", "normed only"])
def test_embedding_rms_norm_with_one_output_used(used, device):
    check_embedding_rms_norm((4, 9), 13, 64, device, seed=61, used=used)


def test_embedding_rms_norm_of_a_16bit_table_takes_the_separate_ops(device):
    ids = torch.tensor([[1, 0, 1]], device=device)
    table = leaf(random((2, 32), torch.float16, device, 71))
    weight = leaf(torch.ones(32, device=device))
    h, normed = arn.embedding_rms_norm(ids, table, weight, EPS)
    (h.float().sum() + normed.float().sum()).backward()
    assert h.dtype == normed.dtype == torch.float16 and table.grad.dtype == torch.float16
    table64, weight64 = as_float64_leaf(table), as_float64_leaf(weight)
    h_ref, normed_ref = reference_add_rms_norm(table64[ids], None, weight64)
    (h_ref.sum() + normed_ref.sum()).backward()
    assert_matches(normed, normed_ref, torch.float16, "normed")
    assert_matches(table.grad, table64.grad, torch.float16, "grad table")


def test_embedding_rms_norm_of_no_tokens(device):
    table = leaf(random((5, 16), torch.float32, device, 72))
    weight = leaf(torch.ones(16, device=device))
    h, normed = arn.embedding_rms_norm(torch.zeros(0, 3, dtype=torch.long, device=device), table, weight, EPS)
    assert h.shape == normed.shape == (0, 3, 16)
    (h.sum() + normed.sum()).backward()
    assert torch.equal(table.grad, torch.zeros_like(table)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_embedding_rms_norm_marks_ids_outside_the_table(device):
    """An id outside [0, V) reads and writes nothing outside the table: its rows come out NaN (so the loss shows
    it), the other rows and the table's gradient are right."""
    ids = torch.tensor([[1, 5, 0, -1, 2]], device=device)   # V = 3: 5 and -1 are outside
    good = torch.tensor([True, False, True, False, True], device=device)
    table = leaf(random((3, 16), torch.float32, device, 73))
    weight = leaf(random((16,), torch.float32, device, 74) + 1.0)
    h, normed = arn.embedding_rms_norm(ids, table, weight, EPS)
    assert torch.isnan(h[0, ~good]).all() and torch.isnan(normed[0, ~good]).all()
    grad_normed = random((1, 5, 16), torch.float32, device, 75)
    normed.backward(grad_normed)
    table64, weight64 = as_float64_leaf(table), as_float64_leaf(weight)
    normed64 = reference_add_rms_norm(table64[ids[:, good]], None, weight64)[1]
    normed64.backward(grad_normed[:, good].double())
    assert_matches(h[:, good], table64.detach()[ids[:, good]], torch.float32, "rows")
    assert_matches(normed[:, good], normed64, torch.float32, "normed")
    assert_matches(table.grad, table64.grad, torch.float32, "grad table")


def test_embedding_rms_norm_rejects_bad_arguments(device):
    table, weight = torch.ones(3, 8, device=device), torch.ones(8, device=device)
    with pytest.raises(ValueError, match="integers"):
        arn.embedding_rms_norm(torch.zeros(2, device=device), table, weight)
    with pytest.raises(ValueError, match=r"\[V, D\]"):
        arn.embedding_rms_norm(torch.zeros(2, dtype=torch.long, device=device), table[0], weight)
    with pytest.raises(ValueError, match="must be"):
        arn.embedding_rms_norm(torch.zeros(2, dtype=torch.long, device=device), table, weight[:4])


@pytest.mark.gpu
@pytest.mark.parametrize("normed_dtype", [None, torch.bfloat16])
def test_embedding_rms_norm_full_size_gpu(normed_dtype, device):
    check_embedding_rms_norm((32, 512), 1000, 256, device, seed=81, normed_dtype=normed_dtype)


def test_add_rms_norm_rejects_too_wide_rows(device):
    x = torch.randn(1, arn.MAX_FEATURES + 1, device=device)
    with pytest.raises(ValueError, match="MAX_FEATURES"):
        arn.add_rms_norm(x, x, torch.ones(x.shape[-1], device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2048, 4096), (1024, 8192), (333, 5000), (4, 128, 256), (32, 512, 256)])
def test_add_rms_norm_full_size_gpu(shape, dtype, device):
    check_add_rms_norm(shape, dtype, device, seed=len(shape) + shape[-1])


@pytest.mark.gpu
def test_rms_norm_without_delta_bfloat16_gpu(device):
    check_add_rms_norm((512, 2048), torch.bfloat16, device, seed=7, with_delta=False)


# ----------------------------------------------------------------------------------------------------------
# linear_cross_entropy
# ----------------------------------------------------------------------------------------------------------
def make_head_inputs(n, d, v, dtype, device, seed, n_ignored=3, ignore_index=-100):
    hidden = leaf(random((n, d), dtype, device, seed))
    weight = leaf(random((v, d), torch.float32, device, seed + 1, scale=1.0 / math.sqrt(d) * 2))
    g = torch.Generator().manual_seed(seed + 2)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:n_ignored]] = ignore_index
    return hidden, weight, targets.to(device)


def reference_head(hidden, weight, targets, ignore_index=-100):
    """Float64 loss and gradients (of hidden and weight) of F.cross_entropy(hidden @ weight.T, targets)."""
    hidden64, weight64 = as_float64_leaf(hidden), as_float64_leaf(weight)
    loss = F.cross_entropy(hidden64 @ weight64.T, targets, ignore_index=ignore_index)
    loss.backward()
    return loss, hidden64.grad, weight64.grad


def check_head(n, d, v, dtype, device, seed, chunk_size=None, ignore_index=-100):
    hidden, weight, targets = make_head_inputs(n, d, v, dtype, device, seed, ignore_index=ignore_index)
    loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, ignore_index=ignore_index)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward()
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets, ignore_index)
    assert_matches(loss, ref_loss, dtype, "loss")
    assert hidden.grad.dtype == dtype and weight.grad.dtype == torch.float32
    assert_matches(hidden.grad, ref_grad_hidden, dtype, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, dtype, "grad weight")
    return loss, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, d, v, chunk_size", [
    (37, 48, 1000, None),   # one chunk
    (37, 48, 1003, 8),      # odd V; 5 chunks, the last one of 5 rows
    (20, 200, 257, 7),      # non-power-of-two D and V
])
def test_linear_cross_entropy_matches_float64(n, d, v, chunk_size, dtype, device, poisoned_outputs):
    check_head(n, d, v, dtype, device, seed=n + d + v, chunk_size=chunk_size)
    assert poisoned_outputs, "the wrapper did not allocate through the poisoning hook"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_cross_entropy_several_chunks_equal_one_chunk(dtype, device):
    n, d, v = 50, 40, 300
    one = check_head(n, d, v, dtype, device, seed=51, chunk_size=n)
    several = check_head(n, d, v, dtype, device, seed=51, chunk_size=16)  # 16 + 16 + 16 + 2 rows
    # Per-row losses do not depend on the chunking. grad_weight sums per-chunk products in float32, and in
    # float16 each chunk's product is rounded to float16 before it is added: close, not bit-equal.
    torch.testing.assert_close(several[0], one[0], rtol=1e-6, atol=0)
    agreement = 1e-6 if dtype == torch.float32 else 1e-3
    assert relative_error(several[1], one[1]) < agreement, "grad hidden depends on the chunking"
    assert relative_error(several[2], one[2]) < agreement, "grad weight depends on the chunking"


def test_linear_cross_entropy_loops_over_vocab_blocks(monkeypatch, device):
    """Force 8 blocks over V=1003 (the last one partial) to exercise the online max and sum."""
    monkeypatch.setattr(lce, "MAX_BLOCK_V", 128)
    check_head(21, 32, 1003, torch.float32, device, seed=61, chunk_size=8)


def test_linear_cross_entropy_large_logits_are_stable(device):
    """Logits in the hundreds: exp() would overflow without subtracting the running max."""
    hidden, weight, targets = make_head_inputs(12, 16, 500, torch.float32, device, seed=71)
    hidden = leaf(hidden * 100)
    loss = lce.linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(loss, ref_loss, torch.float32, "loss")
    assert_matches(hidden.grad, ref_grad_hidden, torch.float32, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, torch.float32, "grad weight")


def test_linear_cross_entropy_custom_ignore_index_and_batched_shape(device):
    b, t, d, v = 3, 7, 24, 130
    hidden, weight, targets = make_head_inputs(b * t, d, v, torch.float32, device, seed=81, n_ignored=5,
                                               ignore_index=0)
    hidden3, targets2 = leaf(hidden.view(b, t, d)), targets.view(b, t)
    loss = lce.linear_cross_entropy(hidden3, weight, targets2, chunk_size=5, ignore_index=0)
    loss.backward()
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets, ignore_index=0)
    assert_matches(loss, ref_loss, torch.float32, "loss")
    assert_matches(hidden3.grad.view(b * t, d), ref_grad_hidden, torch.float32, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, torch.float32, "grad weight")


def test_linear_cross_entropy_scales_by_grad_output(device):
    hidden, weight, targets = make_head_inputs(15, 32, 200, torch.float32, device, seed=91)
    (3.5 * lce.linear_cross_entropy(hidden, weight, targets, chunk_size=4)).backward()
    _, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(hidden.grad, 3.5 * ref_grad_hidden, torch.float32, "grad hidden")
    assert_matches(weight.grad, 3.5 * ref_grad_weight, torch.float32, "grad weight")


@pytest.mark.parametrize("needs_grad", ["weight", "hidden"])
def test_linear_cross_entropy_only_one_input_needs_grad(needs_grad, device):
    """The backward's one scaling kernel then scales the one gradient there is."""
    hidden, weight, targets = make_head_inputs(15, 32, 200, torch.float32, device, seed=101)
    if needs_grad == "weight":
        hidden = hidden.detach()
    else:
        weight = weight.detach()
    (2.5 * lce.linear_cross_entropy(hidden, weight, targets, chunk_size=6)).backward()
    _, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    if needs_grad == "weight":
        assert_matches(weight.grad, 2.5 * ref_grad_weight, torch.float32, "grad weight")
    else:
        assert_matches(hidden.grad, 2.5 * ref_grad_hidden, torch.float32, "grad hidden")


@pytest.mark.parametrize("how", ["no_grad", "no input requires grad"])
def test_linear_cross_entropy_inference_computes_loss_only(how, monkeypatch, device):
    hidden, weight, targets = make_head_inputs(17, 32, 150, torch.float32, device, seed=111)
    launches = []
    launch = lce.cross_entropy_rows_

    def recording_launch(logits, targets, row_loss, ignore_index, compute_grad):
        launches.append(compute_grad)
        return launch(logits, targets, row_loss, ignore_index, compute_grad)

    monkeypatch.setattr(lce, "cross_entropy_rows_", recording_launch)
    if how == "no_grad":
        with torch.no_grad():
            loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    else:
        loss = lce.linear_cross_entropy(hidden.detach(), weight.detach(), targets, chunk_size=8)
    assert launches == [False, False, False]
    assert not loss.requires_grad
    assert_matches(loss, reference_head(hidden, weight, targets)[0], torch.float32, "loss")


def test_linear_cross_entropy_under_autocast_float16(device):
    """float32 hidden under autocast: the logits are computed in float16, as nn.Linear would."""
    hidden, weight, targets = make_head_inputs(24, 64, 300, torch.float32, device, seed=121)
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=10)
    loss.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(loss, ref_loss, torch.float16, "loss")
    assert_matches(hidden.grad, ref_grad_hidden, torch.float16, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, torch.float16, "grad weight")


def test_linear_cross_entropy_uses_a_given_16bit_weight(device):
    """weight16 (the model's per-step 16-bit copy) replaces the cast inside; gradients still reach weight."""
    hidden, weight, targets = make_head_inputs(24, 64, 300, torch.float16, device, seed=122)
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=10, weight16=weight.detach().half())
    loss.backward()
    assert weight.grad.dtype == torch.float32
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(loss, ref_loss, torch.float16, "loss")
    assert_matches(hidden.grad, ref_grad_hidden, torch.float16, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, torch.float16, "grad weight")


def test_matmul_to_float32_of_16bit_operands(device):
    a = random((40, 70), torch.bfloat16, device, seed=5)
    b = random((70, 30), torch.bfloat16, device, seed=6)
    product = lce.matmul_to_float32(a, b)
    assert product.dtype == torch.float32
    assert_matches(product, a.double() @ b.double(), torch.bfloat16, "a @ b")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the all-ignored 0/0 below
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("n_rows", [1, 1023, 1025, 3000, 40000])
def test_mean_loss_counts_only_targets_not_ignored(n_rows, device):
    g = torch.Generator().manual_seed(n_rows)
    row_loss = torch.rand(n_rows, generator=g).to(device)
    targets = torch.randint(0, 50, (n_rows,), generator=g)
    targets[torch.rand(n_rows, generator=g) < 0.3] = -100
    targets = targets.to(device)
    loss, inv_count = lce.mean_loss(row_loss, targets)
    valid = targets != -100
    torch.testing.assert_close(loss, row_loss.sum() / valid.sum())   # ignored rows carry loss 0 already
    torch.testing.assert_close(inv_count, 1.0 / valid.sum().float())
    all_ignored, _ = lce.mean_loss(row_loss * 0, torch.full_like(targets, -100))
    assert torch.isnan(all_ignored)


def test_default_chunk_rows():
    assert lce.default_chunk_rows(32000, torch.bfloat16) == 512  # 32 MiB of bf16 logits
    rows = lce.default_chunk_rows(10**7, torch.float32)  # a huge vocabulary still gets a usable chunk
    assert rows == lce.CHUNK_ROW_MULTIPLE


def test_linear_cross_entropy_rejects_bad_shapes(device):
    hidden, weight, targets = make_head_inputs(8, 16, 50, torch.float32, device, seed=131)
    with pytest.raises(ValueError):
        lce.linear_cross_entropy(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError):
        lce.linear_cross_entropy(hidden, weight, targets[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_full_size_gpu(dtype, device):
    # V = 32000 (the large configs), N not a multiple of the default chunk (512 rows of bf16 logits).
    check_head(1100, 512, 32000, dtype, device, seed=141)


@pytest.mark.gpu
def test_linear_cross_entropy_full_size_float32_gpu(device):
    check_head(700, 256, 32000, torch.float32, device, seed=151, chunk_size=256)


@pytest.mark.gpu
def test_linear_cross_entropy_under_autocast_bfloat16_gpu(device):
    hidden, weight, targets = make_head_inputs(2048, 1024, 32000, torch.float32, device, seed=161,
                                               n_ignored=100)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        loss = lce.linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(loss, ref_loss, torch.bfloat16, "loss")
    assert_matches(hidden.grad, ref_grad_hidden, torch.bfloat16, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, torch.bfloat16, "grad weight")


# ----------------------------------------------------------------------------------------------------------
# embedding_backward
# ----------------------------------------------------------------------------------------------------------
def check_embedding(ids_shape, vocab_size, dim, device, seed):
    """The lookup's output and weight gradient against F.embedding in float64, on ids with many repeats."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, ids_shape, generator=generator).to(device)
    weight64 = torch.randn(vocab_size, dim, generator=generator, dtype=torch.float64).to(device)
    grad_out64 = torch.randn(*ids_shape, dim, generator=generator, dtype=torch.float64).to(device)
    weight = weight64.float().requires_grad_()
    rows = emb.embedding_lookup(ids, weight)
    rows.backward(grad_out64.float())
    reference = weight64.clone().requires_grad_()
    F.embedding(ids, reference).backward(grad_out64)
    assert_matches(rows, F.embedding(ids, weight64), torch.float32, "rows")
    assert_matches(weight.grad, reference.grad, torch.float32, "grad weight")
    return weight.grad


@pytest.mark.parametrize("ids_shape, vocab_size, dim", [((2, 37), 11, 40), ((1, 5), 1000, 256), ((3, 17), 3, 8)],
                         ids=["repeats, D not a power of two", "mostly unused rows", "every id many times"])
def test_embedding_backward_matches_reference(ids_shape, vocab_size, dim, device):
    grad = check_embedding(ids_shape, vocab_size, dim, device, seed=171)
    assert grad.dtype == torch.float32


def test_embedding_backward_rows_never_looked_up_are_zero(device):
    ids = torch.tensor([[3, 3, 5]], device=device)
    grad = emb.embedding_backward(ids, torch.ones(1, 3, 4, device=device), vocab_size=8)
    assert grad[[0, 1, 2, 4, 6, 7]].eq(0).all() and grad[3].eq(2).all() and grad[5].eq(1).all()


def test_embedding_backward_16bit_gradient_uses_index_add(device):
    ids = torch.tensor([0, 2, 0], device=device)
    grad = emb.embedding_backward(ids, torch.ones(3, 4, dtype=torch.float16, device=device), vocab_size=3)
    assert grad.dtype == torch.float16 and grad[0].eq(2).all() and grad[1].eq(0).all() and grad[2].eq(1).all()


def test_embedding_backward_rejects_mismatched_rows(device):
    with pytest.raises(ValueError, match="3 token ids for 2 gradient rows"):
        emb.embedding_backward(torch.zeros(3, dtype=torch.long, device=device), torch.ones(2, 4, device=device), 5)


@pytest.mark.gpu
def test_embedding_backward_full_size_gpu(device):
    # batch 32 x seq 512 tokens over the seed vocabulary: ~16 additions into every row.
    check_embedding((32, 512), 1000, 256, device, seed=181)


# ----------------------------------------------------------------------------------------------------------
# swiglu_gemm
# ----------------------------------------------------------------------------------------------------------
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


@pytest.mark.parametrize("n_rows, n_in, n_ffn", [(37, 40, 24), (16, 16, 16), (5, 48, 40)],
                         ids=["nothing a multiple of the tile", "one tile", "fewer rows than a tile"])
def test_swiglu_gemm_matches_reference(n_rows, n_in, n_ffn, device):
    check_swiglu_gemm(n_rows, n_in, n_ffn, torch.float32, device, seed=191)


def test_fused_kernels_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """The tiles a CPU run takes in the interpreter (fitted to the problem, up to 128 rows x 256 columns x 256 deep
    for the GEMMs; norm tiles of up to 16384 elements, all walked by one backward program): problems larger than
    that span several tiles in every direction."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_swiglu_gemm(300, 300, 300, torch.float32, device, seed=195)
    check_qkv_rope(3, 50, 6, 16, torch.float32, device, seed=215, n_in=300)
    check_add_rms_norm((300, 200), torch.float32, device, seed=15)


def test_swiglu_gemm_rejects_mismatched_operands(device):
    x = torch.ones(4, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        sg.gate_up_swiglu(x, torch.ones(6, 7, device=device))
    with pytest.raises(ValueError, match="gate_up must be"):
        sg.down_swiglu_backward(x, torch.ones(8, 3, device=device), torch.ones(4, 5, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_rows", [1000, 16400], ids=["small tiles", "large tiles"])
def test_swiglu_gemm_full_size_gpu(n_rows, dtype, device):
    check_swiglu_gemm(n_rows, 256, 512, dtype, device, seed=201)


def test_swiglu_gemm_refuses_more_row_blocks_than_the_grid_allows(monkeypatch, device):
    monkeypatch.setattr(sg, "MAX_ROW_BLOCKS", 2)
    x, weight = torch.ones(200, 16, device=device), torch.ones(32, 16, device=device)
    with pytest.raises(ValueError, match="row blocks"):
        sg.gate_up_swiglu(x, weight)


# ----------------------------------------------------------------------------------------------------------
# qkv_rope_gemm, and version 4's attention Function on it
# ----------------------------------------------------------------------------------------------------------
def rope_reference(t, cos, sin):
    """Version 1's RoPE (rotate-half) on [..., S, H, Dh] in float64; cos, sin: [S, Dh]."""
    half = t.shape[-1] // 2
    rotated_half = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, None, :] + rotated_half * sin[:, None, :]


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
                         ids=["rows not a multiple of the tile", "two heads of 32", "one head, whole tiles"])
def test_qkv_rope_matches_reference(batch, seq_len, heads, head_dim, device):
    check_qkv_rope(batch, seq_len, heads, head_dim, torch.float32, device, seed=211, n_in=40)


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


def check_rotary_qkv_attention(batch, seq_len, heads, head_dim, dtype, device, seed):
    """Version 4's RotaryQKVAttention (QKV GEMM + RoPE epilogue -> flash attention) against float64 autograd of
    attention(RoPE(x @ W^T)): the output and the gradients of x and W."""
    from version3_triton.kernels.rope import rope_tables
    from version4_triton_ultra.fused_layers import RotaryQKVAttention
    dim = heads * head_dim
    x = leaf(random((batch, seq_len, dim), dtype, device, seed))
    weight = leaf(random((3 * dim, dim), torch.float32, device, seed + 1, scale=dim ** -0.5))
    grad_out = random((batch, seq_len, dim), dtype, device, seed + 2)
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    gemm_weight = weight if dtype == torch.float32 else weight.detach().to(dtype)
    precise = dtype == torch.float32
    out = RotaryQKVAttention.apply(x, weight, gemm_weight, cos, sin, heads, precise, None)
    out.backward(grad_out)

    x64, weight64 = as_float64_leaf(x), as_float64_leaf(weight)
    qkv = (x64 @ weight64.T).view(batch, seq_len, 3, heads, head_dim)
    q, k, v = qkv.unbind(2)
    q, k = rope_reference(q, cos.double(), sin.double()), rope_reference(k, cos.double(), sin.double())
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(head_dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)
    probabilities = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    want = torch.einsum("bhst,bthd->bshd", probabilities, v).reshape(batch, seq_len, dim)
    want.backward(grad_out.double())

    tolerance_dtype = torch.bfloat16 if sg.dot_precision(dtype) == "tf32" and x.is_cuda else dtype
    assert out.dtype == dtype
    assert_matches(out, want, tolerance_dtype, "out")
    assert_matches(x.grad, x64.grad, tolerance_dtype, "grad x")
    assert_matches(weight.grad, weight64.grad, tolerance_dtype, "grad weight")


def test_rotary_qkv_attention_matches_float64(device):
    check_rotary_qkv_attention(2, 19, 2, 16, torch.float32, device, seed=251)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_qkv_attention_full_size_gpu(dtype, device):
    check_rotary_qkv_attention(4, 512, 8, 32, dtype, device, seed=261)
