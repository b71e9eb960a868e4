"""Version 4's add_rmsnorm kernels (kernels/add_rmsnorm.py): residual + delta and RMSNorm in one kernel (and
delta=None: plain RMSNorm), and the embedding lookup + RMSNorm of the first layer (embedding_rms_norm).

Against float64 PyTorch references, forward and every gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size and bfloat16 cases are gpu-marked.
"""
import pytest
import torch

from tinytransformer import triton_support
from version4_triton_ultra.kernels import add_rmsnorm as arn

from .script_checks import assert_refused_in_one_line
# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    EPS, as_float64_leaf, assert_matches, leaf, poisoned_outputs, random)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


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


def mixed_dtype_backward(device, seed):
    """A float32 stream plus a bfloat16 sub-layer output (AMP's case: the kernel also writes grad_h's 16-bit copy),
    checked against float64; returns the gradients of residual, delta and weight."""
    shape = (29, 96)
    residual = leaf(random(shape, torch.float32, device, seed))
    delta = leaf(random(shape, torch.bfloat16, device, seed + 1))
    weight = leaf(random((96,), torch.float32, device, seed + 2, scale=0.1) + 1.0)
    grad_new_residual = random(shape, torch.float32, device, seed + 3)
    grad_normed = random(shape, torch.float32, device, seed + 4)
    torch.autograd.backward(arn.add_rms_norm(residual, delta, weight, EPS), [grad_new_residual, grad_normed])
    inputs64 = [as_float64_leaf(t) for t in (residual, delta, weight)]
    torch.autograd.backward(reference_add_rms_norm(*inputs64), [grad_new_residual.double(), grad_normed.double()])
    assert_matches(residual.grad, inputs64[0].grad, torch.float32, "grad residual")
    assert_matches(delta.grad, inputs64[1].grad, torch.bfloat16, "grad delta")
    assert_matches(weight.grad, inputs64[2].grad, torch.float32, "grad weight")
    return residual.grad, delta.grad, weight.grad


def test_both_backward_loops_match_float64_and_each_other(monkeypatch, device, small_interpreter_blocks):
    """The backward kernel's two loops (see PREFETCH_FROM_FEATURES) compute the same values in the same order:
    each matches float64, through the residual add (with and without the 16-bit copy of grad_h) and through the
    embedding's scatter, and the gradients of residual, delta and weight are equal bit for bit. 29 rows in the
    small blocks of the interpreter: 4 programs of two 4-row tiles each, the last one partial."""
    gradients = {}
    for prefetch in (True, False):
        monkeypatch.setattr(arn, "PREFETCH_FROM_FEATURES", 0 if prefetch else 10**9)
        check_add_rms_norm((29, 96), torch.float32, device, seed=5)
        check_embedding_rms_norm((1, 29), 7, 48, device, seed=6)
        gradients[prefetch] = mixed_dtype_backward(device, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(gradients[True], gradients[False]))


@pytest.mark.parametrize("group_size, one_group_up_to, d, sum_elements",
                         [(10**6, 10**6, 96, 64), (2, 0, 96, 64), (3, 0, 96, 64), (3, 0, 1500, 128)],
                         ids=["one group", "two levels, even groups", "two levels, short last group",
                              "two levels, several passes per sum"])
def test_add_rms_norm_weight_grad_summed_by_the_programs(group_size, one_group_up_to, d, sum_elements, monkeypatch,
                                                         device):
    """The partial weight gradients are added by the last program (one group), or per group of programs and then
    across the groups (two levels); either way right, the same on every run (which only a GPU, where programs
    finish in any order, can really test), and the counters left at zero. At D = 1500 (a 2048 block) with 128
    values a thread a summing program loads 2 partial sums at a time in the interpreter (16 on a GPU, where the
    groups' sums are many), so a group of 3 takes two passes, the last one partial."""
    monkeypatch.setattr(arn, "GROUP_SIZE", group_size)
    monkeypatch.setattr(arn, "ONE_GROUP_UP_TO", one_group_up_to)
    monkeypatch.setattr(arn, "SUM_ELEMENTS_PER_THREAD", sum_elements)
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


class GatheringStandIn:
    def __init__(self, everyone, calls):
        self.everyone, self.calls = everyone, calls

    def wait(self):
        self.calls.append("wait")
        return self.everyone


class OtherRankStandIn:
    """EmbeddingRowExchange's interface, as if a second rank had looked up `ids` and sent `rows` of gradient:
    what is gathered is this rank's tensor, then the other's (rank order)."""

    def __init__(self, ids, rows):
        self.ids, self.rows, self.calls = ids, rows, []

    def start(self, tensor):
        self.calls.append("start")
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float32 and tensor.shape[1] == self.rows.shape[1]
            return GatheringStandIn(torch.cat([tensor, self.rows]), self.calls)
        return GatheringStandIn(torch.cat([tensor, self.ids]), self.calls)


@pytest.mark.parametrize("used", [("h", "normed"), ("h",)], ids=["both outputs", "rows only"])
def test_embedding_rms_norm_with_a_row_exchange_adds_every_ranks_rows(used, device, poisoned_outputs):
    """Under data parallel the backward writes each row's gradient, the ranks exchange them, and the table's
    gradient is this rank's plus the other rank's rows; the norm weight's gradient stays this rank's."""
    vocab, d = 11, 48
    g = torch.Generator().manual_seed(91)
    ids = torch.randint(0, vocab, (3, 7), generator=g).to(device)
    other_ids = torch.randint(0, vocab, (21,), generator=g).to(device)
    other_rows = random((21, d), torch.float32, device, 92)
    table = leaf(random((vocab, d), torch.float32, device, 93))
    weight = leaf(random((d,), torch.float32, device, 94, scale=0.1) + 1.0)
    grads = {"h": random((3, 7, d), torch.float32, device, 95), "normed": random((3, 7, d), torch.float32, device, 96)}
    exchange = OtherRankStandIn(other_ids, other_rows)

    h, normed = arn.embedding_rms_norm(ids, table, weight, EPS, row_exchange=exchange)
    assert exchange.calls == ["start"]   # the ids travel from the forward pass on
    outputs = {"h": h, "normed": normed}
    torch.autograd.backward([outputs[k] for k in used], [grads[k] for k in used])
    assert exchange.calls == ["start", "start", "wait", "wait"]   # the rows' gather started, then both waited

    table64, weight64 = as_float64_leaf(table), as_float64_leaf(weight)
    h64, normed64 = reference_add_rms_norm(table64[ids], None, weight64)
    outputs64 = {"h": h64, "normed": normed64}
    torch.autograd.backward([outputs64[k] for k in used], [grads[k].double() for k in used])
    expected = table64.grad.index_add(0, other_ids, other_rows.double())
    assert_matches(table.grad, expected, torch.float32, "grad table, both ranks' rows")
    if "normed" in used:
        assert_matches(weight.grad, weight64.grad, torch.float32, "grad weight, this rank's")


def test_embedding_rms_norm_row_exchange_needs_a_float32_table(device):
    table = leaf(random((4, 16), torch.float16, device, 97))
    with pytest.raises(ValueError, match="row exchange needs a float32 table"):
        arn.embedding_rms_norm(torch.tensor([[1]], device=device), table, torch.ones(16, device=device),
                               row_exchange=OtherRankStandIn(None, None))


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




def test_add_rms_norm_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """The norm tiles a CPU run takes in the interpreter (up to 16384 elements, all walked by one backward
    program): a problem larger than that spans several tiles."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_add_rms_norm((300, 200), torch.float32, device, seed=15)


@pytest.mark.parametrize("n_features, per_sm, tile_rows, warps, prefetch", [
    (256, 4, 16, 4, False), (512, 2, 4, 4, True), (1024, 2, 4, 8, True), (2048, 2, 2, 8, True),
    (4096, 2, 1, 8, True), (8192, 2, 1, 8, True)])
def test_backward_launch_follows_the_row_width(n_features, per_sm, tile_rows, warps, prefetch, known_gpu):
    """The launch an H100 gets (the rules measured in _backward_tile, _backward_program_count and at
    WIDE_FROM_FEATURES), asked on meta tensors standing in for it: rows of 512 features and more get 2 programs
    per SM, tiles of at most 4 rows and the next tile prefetched; narrower rows 4 programs per SM and one tile at
    a time; wide tiles get a warp per 512 elements (at most 8); the programs cover the rows once."""
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    meta = torch.device("meta")
    n_rows = 8192
    block_rows, num_warps = arn._backward_tile(n_features, n_rows, meta)
    assert (block_rows, num_warps, arn._prefetches(n_features)) == (tile_rows, warps, prefetch)
    programs, rows_per_program = arn._backward_program_count(n_rows, block_rows, n_features, meta)
    sms = triton_support.KNOWN_GPUS["sm_90"].multiprocessors
    assert (per_sm - 1) * sms < programs <= per_sm * sms
    assert (programs - 1) * rows_per_program < n_rows <= programs * rows_per_program


def test_a_summing_program_loads_many_partial_sums_at_once(monkeypatch):
    """[BLOCK_P, D] blocks of SUM_ELEMENTS_PER_THREAD values a thread (a power of two of rows), never more rows
    than the longest sum; AMD's 64-wide wavefronts hold twice as many."""
    assert arn._partial_sums_per_load(32, 1024, 8) == 16    # the medium preset: a group of 32 in two loads
    assert arn._partial_sums_per_load(9, 1024, 8) == 16     # the 9 groups' sums in one load
    assert arn._partial_sums_per_load(4, 1024, 8) == 4      # no more rows than there are partial sums
    assert arn._partial_sums_per_load(64, 256, 4) == 32     # the seed size's one group of 64
    assert arn._partial_sums_per_load(32, 2048, 8) == 8
    assert arn._partial_sums_per_load(32, 8192, 1) == 1     # at least one row
    assert arn._partial_sums_per_load(100, 1536, 8) == 8    # 10 rows fit: rounded down to a power of two
    monkeypatch.setattr(arn, "threads_per_warp", lambda: 64)
    assert arn._partial_sums_per_load(32, 1024, 8) == 32


# ----------------------------------------------------------------------------------------------------------
# tune_norm_backward.py: its float64 check passes the kernel under any launch and catches a wrong answer
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def norm_tuner():
    """tune_norm_backward, imported before a test switches the interpreter off (its import checks for a GPU)."""
    from version4_triton_ultra import tune_norm_backward
    return tune_norm_backward


@pytest.mark.parametrize("launch", [None, (2, 1, 2, True, None), (4, 1, 1, False, None), (2, 1, 2, True, 0),
                                    (4, 1, 1, False, 8)],
                         ids=["the rules", "prefetch", "no prefetch", "own layouts", "vector 8"])
def test_the_norm_tuners_check_passes_every_launch_and_catches_a_wrong_answer(launch, norm_tuner, device):
    """The backward under the rules and under overridden launches (2 or 4 rows a tile, several tiles a program,
    the last partial) against float64; a 1% error is caught; the rules are back afterwards."""
    tune = norm_tuner
    inputs = tune.make_inputs(37, 96, device=device)
    want = tune.reference(inputs)
    rules = (arn._backward_tile, arn._programs_per_sm, arn._prefetches, arn._shared_vector)
    with tune.Override(128, launch):
        outputs = tune.run_backward(inputs)
    assert (arn._backward_tile, arn._programs_per_sm, arn._prefetches, arn._shared_vector) == rules
    assert tune.largest_error(outputs, want) < tune.TOLERANCE
    grad_h, copy, grad_weight = outputs
    assert tune.largest_error((grad_h * 1.01, copy, grad_weight), want) > 100 * tune.TOLERANCE
    assert tune.largest_error((grad_h, copy * 1.05, grad_weight), want) > tune.TOLERANCE   # and in the 16-bit copy


def test_the_norm_tuners_override_reaches_only_its_width(norm_tuner, known_gpu):
    tune = norm_tuner
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    meta = torch.device("meta")
    with tune.Override(512, (2, 8, 1, False, None)):
        assert arn._shared_vector(torch.float32, torch.bfloat16) == 4   # the rule's, without VECTOR
        assert arn._backward_tile(512, 8192, meta) == (2, 8) and not arn._prefetches(512)
        programs, rows_per_program = arn._backward_program_count(8192, 2, 512, meta)   # 1 per SM
        assert programs <= triton_support.KNOWN_GPUS["sm_90"].multiprocessors < programs + 2
        assert (programs - 1) * rows_per_program < 8192 <= programs * rows_per_program
        assert arn._backward_tile(1024, 8192, meta) == (4, 8) and arn._prefetches(1024)   # the rules' own


def test_the_norm_tuners_candidates_may_name_the_vector(norm_tuner):
    """ROWS,WARPS,PROGRAMS_PER_SM,PREFETCH keeps the vector rule; a fifth field replaces it (0: each tensor's own
    layout, the kernel before the rule), at every width; the table's label says which."""
    tune = norm_tuner
    assert tune.candidate("4,8,2,1") == (4, 8, 2, True, None)
    assert tune.candidate("4,8,2,1,0") == (4, 8, 2, True, 0)
    assert tune.label((4, 8, 2, True, 0)) == "4 rows, 8 warps, 2/SM, prefetch, own layouts"
    assert tune.label((4, 8, 1, False, 8)) == "4 rows, 8 warps, 1/SM, vector 8"
    with tune.Override(1024, (4, 8, 2, True, 0)):
        assert arn._shared_vector(torch.float32, torch.bfloat16) == 0
    assert arn._shared_vector(torch.float32, torch.bfloat16) == 4
    for bad in ("4,8,2,1,3", "4,8,2,1,32", "4,8,2,1,0,0"):
        with pytest.raises(ValueError):
            tune.candidate(bad)


def test_one_vector_width_for_the_widest_dtype_of_a_tile():
    """16 bytes of the widest dtype among a tile's tensors: float32 with bfloat16 (the bfloat16 step) 4 columns,
    bfloat16 alone 8, float64 2."""
    assert arn._shared_vector(torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16) == 4
    assert arn._shared_vector(torch.bfloat16, torch.float16) == 8
    assert arn._shared_vector(torch.float32) == 4
    assert arn._shared_vector(torch.float64, torch.float32) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--candidates", "4,4,2"], ["--candidates", "4,3,2,1"],
                                   ["--candidates", "4,4,2,1,5"],
                                   ["--candidates", "3,4,2,1"], ["--features", "9000"], ["--in-step", "huge"],
                                   ["--in-step", "medium"]])
def test_the_norm_tuner_needs_a_gpu_and_good_flags(flags):
    assert_refused_in_one_line("tune_norm_backward.py", flags)
