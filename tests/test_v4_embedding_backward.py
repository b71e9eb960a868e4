"""Version 4's token-embedding gradient as one scatter-add kernel (kernels/embedding_backward.py).

Against float64 PyTorch references, forward and every gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size and bfloat16 cases are gpu-marked.
"""
import pytest
import torch

import torch.nn.functional as F

from version4_triton_ultra.kernels import embedding_backward as emb

# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    assert_matches, poisoned_outputs)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


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


def test_embedding_backward_ids_outside_the_table_add_nothing(device):
    """An id outside [0, V) (a bad batch) adds its row nowhere, in particular not outside the gradient's memory."""
    if not (device.type == "cuda" or emb.interpreter_active()):
        pytest.skip("the Triton kernel runs on a GPU or in the interpreter (index_add_ raises for a bad id)")
    ids = torch.tensor([1, 4, -1, 1], device=device)
    grad = emb.embedding_backward(ids, torch.ones(4, 8, device=device), vocab_size=3)
    assert grad[1].eq(2).all() and grad[[0, 2]].eq(0).all()


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


# embedding_backward_in_order: the same bits on every run (what the data-parallel row exchange needs)
def sequential_reference(ids, rows, vocab_size):
    """Each table row = 0 + its tokens' rows, added one at a time in the order the tokens come (float32)."""
    out = torch.zeros(vocab_size, rows.shape[1])
    for token, row in zip(ids.tolist(), rows.cpu()):
        if 0 <= token < vocab_size:
            out[token] = out[token] + row
    return out


def test_embedding_backward_in_order_adds_each_tokens_rows_in_the_order_they_come(device):
    """Bit for bit the sequential float32 sum: with rows 1, 1e8, -1e8 for one id the order decides the result
    (1 + 1e8 rounds to 1e8, so in this order the sum is 0; in reverse it would be 1). Ids outside the table add
    nothing; rows no token looked up stay zero."""
    rows = torch.tensor([[1.0, 2.0], [5.0, 5.0], [1e8, 3.0], [-1e8, -4.0], [7.0, 7.0], [9.0, 9.0]])
    ids = torch.tensor([3, 0, 3, 3, -1, 6])   # V = 5: -1 and 6 are outside
    got = emb.embedding_backward_in_order(emb.token_order(ids.to(device)), rows.to(device), vocab_size=5)
    expected = sequential_reference(ids, rows, 5)
    assert torch.equal(got.cpu(), expected)
    assert got[3, 0].item() == 0.0   # not 1.0: the order was kept
    assert sequential_reference(ids.flip(0), rows.flip(0), 5)[3, 0].item() == 1.0   # (the test can fail)


@pytest.mark.parametrize("n_tokens, vocab_size, dim", [(200, 7, 40), (64, 1000, 256)],
                         ids=["long runs, D not a power of two", "mostly unused rows"])
def test_embedding_backward_in_order_matches_the_sequential_sum(n_tokens, vocab_size, dim, device):
    generator = torch.Generator().manual_seed(n_tokens + dim)
    ids = torch.randint(0, vocab_size, (n_tokens,), generator=generator)
    rows = torch.randn(n_tokens, dim, generator=generator)
    out = torch.zeros(vocab_size, dim, device=device)
    got = emb.embedding_backward_in_order(emb.token_order(ids.to(device)), rows.to(device), vocab_size, out=out)
    assert got is out   # added into the tensor given
    assert torch.equal(got.cpu(), sequential_reference(ids, rows, vocab_size))


def test_embedding_backward_rejects_a_wrong_out(device):
    with pytest.raises(ValueError, match=r"out must be \[5, 4\] torch.float32"):
        emb.embedding_backward_in_order(emb.token_order(torch.zeros(2, dtype=torch.long, device=device)),
                                        torch.ones(2, 4, device=device), 5, out=torch.zeros(5, 3, device=device))


@pytest.mark.gpu
def test_embedding_backward_in_order_is_the_same_every_run_gpu(device):
    """The row exchange's shape at the medium preset on two GPUs (16,384 rows of 1,024), over a small vocabulary
    so that every id has ~330 rows: two runs agree bit for bit (atomic additions need not), and the sum matches
    float64."""
    generator = torch.Generator().manual_seed(191)
    ids = torch.randint(0, 50, (16384,), generator=generator).to(device)
    rows64 = torch.randn(16384, 1024, generator=generator, dtype=torch.float64).to(device)
    first = emb.embedding_backward_in_order(emb.token_order(ids), rows64.float(), 50)
    second = emb.embedding_backward_in_order(emb.token_order(ids), rows64.float(), 50)
    assert torch.equal(first, second)
    reference = torch.zeros(50, 1024, dtype=torch.float64, device=device).index_add_(0, ids, rows64)
    assert_matches(first, reference, torch.float32, "grad weight")
