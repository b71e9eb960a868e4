"""The embedding's gradient kept from step to step and zeroed and read by the rows a batch touches
(table_gradient.py, through embedding_rms_norm's backward, and TritonAdamW's row flags in kernels/adamw.py).

On the CPU in Triton's interpreter against the gradient zeroed whole (the plain way), step after step, with a second
backward pass and with a .grad from elsewhere; TritonAdamW with row flags against torch's AdamW, the unflagged rows
of its gradient NaN so that reading one would show. On the GPU, the graph-captured step both ways.
"""
import pytest
import torch

from version4_triton_ultra.kernels import add_rmsnorm as arn
from version4_triton_ultra.kernels.adamw import TritonAdamW
from version4_triton_ultra.table_gradient import RowTrackedGradient

from .test_v4_adamw import HYPER
from .v4_kernel_checks import random

pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")

VOCAB, FEATURES = 40, 16


class Table:
    """A float32 table and norm weight, with fixed output gradients, differentiated through embedding_rms_norm
    with or without a RowTrackedGradient."""

    def __init__(self, device, tracked: bool):
        self.table = torch.nn.Parameter(random((VOCAB, FEATURES), torch.float32, device, seed=1))
        self.weight = torch.nn.Parameter(random((FEATURES,), torch.float32, device, seed=2, scale=0.1) + 1.0)
        self.rows = {}
        self.tracked = RowTrackedGradient(self.rows) if tracked else None

    def backward(self, ids, seed):
        h, normed = arn.embedding_rms_norm(ids, self.table, self.weight, tracked_gradient=self.tracked)
        grads = [random(h.shape, torch.float32, ids.device, seed + k) for k in (0, 1)]
        torch.autograd.backward([h, normed], grads)

    def flagged_rows(self):
        return set(torch.nonzero(self.rows[self.table]).flatten().tolist())


def batch(step, device, tokens=12):
    """Ids of a step: a few of the 40 rows, some twice, different from step to step."""
    generator = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, VOCAB // 2, (tokens,), generator=generator).add_(step * 5 % VOCAB).to(device)


def test_step_after_step_the_gradient_is_the_plain_ones(device):
    plain, tracked = Table(device, tracked=False), Table(device, tracked=True)
    for step in range(4):
        ids = batch(step, device)
        for t in (plain, tracked):
            t.table.grad = None   # zero_grad(set_to_none=True), as the training step does
            t.backward(ids, seed=10 * step)
        torch.testing.assert_close(tracked.table.grad, plain.table.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(tracked.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-7)
        assert tracked.flagged_rows() == set(ids.tolist())
        untouched = [r for r in range(VOCAB) if r not in set(ids.tolist())]
        assert not tracked.table.grad[untouched].any()   # the last step's rows were zeroed
    assert tracked.table.grad is tracked.tracked.gradient   # one tensor, kept


def test_a_second_backward_pass_adds_to_the_first_and_the_next_step_starts_from_zero(device):
    plain, tracked = Table(device, tracked=False), Table(device, tracked=True)
    first, second, third = (batch(step, device) for step in range(3))
    for t in (plain, tracked):
        t.backward(first, seed=0)
        t.backward(second, seed=5)   # accumulated: no zero_grad in between
    torch.testing.assert_close(tracked.table.grad, plain.table.grad, rtol=1e-6, atol=1e-7)
    assert tracked.flagged_rows() == set(first.tolist()) | set(second.tolist())
    for t in (plain, tracked):
        t.table.grad = None
        t.backward(third, seed=9)
    torch.testing.assert_close(tracked.table.grad, plain.table.grad, rtol=1e-6, atol=1e-7)
    assert tracked.flagged_rows() == set(third.tolist())


def test_a_gradient_from_elsewhere_is_added_to_and_read_whole(device):
    """A .grad that is not the kept tensor (set by the user): the plain way, autograd adding into it, and no row
    flags left for the optimizer."""
    tracked = Table(device, tracked=True)
    tracked.backward(batch(0, device), seed=0)
    assert tracked.table in tracked.rows
    tracked.table.grad = torch.ones_like(tracked.table)
    plain = Table(device, tracked=False)
    plain.table.grad = torch.ones_like(plain.table)
    for t in (plain, tracked):
        t.backward(batch(1, device), seed=3)
    torch.testing.assert_close(tracked.table.grad, plain.table.grad, rtol=1e-6, atol=1e-7)
    assert tracked.rows == {}


def test_a_frozen_table_leaves_the_kept_gradient_alone(device):
    tracked = Table(device, tracked=True)
    tracked.table.requires_grad_(False)
    tracked.backward(batch(0, device), seed=0)
    assert tracked.table.grad is None and tracked.rows == {} and tracked.tracked.gradient is None


def test_adamw_reads_only_the_flagged_rows(device):
    """Rows not flagged hold NaN in the gradient: TritonAdamW must take 0 for them without reading, and then trains
    like torch's AdamW given those rows zero (weight decay and both moments decaying, as for any zero gradient)."""
    table = torch.nn.Parameter(random((VOCAB, FEATURES), torch.float32, device, seed=3))
    reference = torch.nn.Parameter(table.detach().clone())
    flags = torch.zeros(VOCAB, dtype=torch.uint8, device=device)
    optimizer = TritonAdamW([table], gradient_rows={table: flags}, **HYPER)
    reference_optimizer = torch.optim.AdamW([reference], **HYPER)
    for step in range(3):
        touched = batch(step, device)
        flags.zero_().index_fill_(0, touched, 1)
        gradient = random((VOCAB, FEATURES), torch.float32, device, seed=20 + step)
        reference.grad = torch.zeros_like(gradient)
        reference.grad[touched] = gradient[touched]
        table.grad = torch.full_like(gradient, float("nan"))
        table.grad[touched] = gradient[touched]
        optimizer.step()
        reference_optimizer.step()
    torch.testing.assert_close(table.detach(), reference.detach(), rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(optimizer.state[table][key], reference_optimizer.state[reference][key],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags", ["int8", "short", "matrix"])
def test_adamw_refuses_row_flags_of_another_shape_or_dtype(flags, device):
    table = torch.nn.Parameter(torch.zeros(VOCAB, FEATURES, device=device))
    table.grad = torch.zeros_like(table)
    bad = {"int8": torch.zeros(VOCAB, dtype=torch.int8, device=device),
           "short": torch.zeros(VOCAB - 1, dtype=torch.uint8, device=device),
           "matrix": torch.zeros(VOCAB, FEATURES, dtype=torch.uint8, device=device)}[flags]
    with pytest.raises(ValueError, match="row flags"):
        TritonAdamW([table], gradient_rows={table: bad}, **HYPER).step()


def train_embedding(rows: bool, steps=6):
    """`steps` graph-captured float32 steps of a 2-layer model with its embedding trained, its gradient by rows
    (rows) or whole. Returns (losses, model)."""
    from tinytransformer.config import ModelConfig, TrainConfig
    from version4_triton_ultra.graphed_step import GraphedStep
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    config = ModelConfig(num_layers=2)
    train = TrainConfig(batch_size=8, seq_len=128)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (8, 129), device="cuda", generator=generator)
               for _ in range(steps)]
    model = TinyLlama(config).cuda()
    model.capturable_optimizer = True
    step = GraphedStep(model, model.configure_optimizer(train), torch.device("cuda"), train, warmup_steps=2,
                       embedding_gradient_rows=rows)
    losses = [step(b[:, :-1].contiguous(), b[:, 1:].contiguous()).item() for b in batches]
    return losses, model, batches[-1][:, :-1]


@pytest.mark.gpu
def test_graphed_step_with_the_embeddings_rows_trains_like_the_whole_gradient():
    """Both ways the same step: the same losses, and the embedding (whose gradient's atomic additions may sum in
    another order) within a small part of how far training moved it. The kept gradient is zero outside the last
    batch's rows, which are the flagged ones."""
    (by_rows, model, last_ids), (whole, reference, _) = train_embedding(rows=True), train_embedding(rows=False)
    for r, w in zip(by_rows, whole):
        assert r == pytest.approx(w, rel=1e-4)
    table = model.embed_tokens.weight
    assert model.gradient_rows[table].sum().item() == last_ids.unique().numel()
    untouched = model.gradient_rows[table] == 0
    assert not table.grad[untouched].any() and reference.gradient_rows == {}
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    initial = dict(TinyLlama(model.config).named_parameters())
    for name, value in model.named_parameters():
        other = dict(reference.named_parameters())[name].detach().cpu()
        moved = (other - initial[name].detach()).norm()
        difference = (value.detach().cpu() - other).norm()
        assert moved > 0 and difference <= 2 ** -6 * moved, f"{name}: {difference:.3e} off, moved {moved:.3e}"
