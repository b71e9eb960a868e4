"""Version 4's output head + cross-entropy in chunks (kernels/linear_cross_entropy.py), the gradient computed
during the forward pass.

Against float64 PyTorch references, forward and every gradient, with every output buffer NaN-filled first
(v4_kernel_checks.poisoned_outputs). On CPU the kernels run in Triton's interpreter: shapes are small; the
full-size cases are gpu-marked.
"""
import math

import pytest
import torch

import torch.nn.functional as F

from version4_triton_ultra.kernels import linear_cross_entropy as lce

from .script_checks import assert_refused_in_one_line
# poisoned_outputs: this file's autouse fixture (every allocated output starts as NaN)
from .v4_kernel_checks import (  # noqa: F401
    as_float64_leaf, assert_matches, leaf, poisoned_outputs, random, relative_error)

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


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


def assert_matches_float64(loss, hidden, weight, targets, dtype, ignore_index=-100):
    """The loss and the gradients that reached hidden and weight, against reference_head, at dtype's tolerance."""
    ref_loss, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets, ignore_index)
    assert_matches(loss, ref_loss, dtype, "loss")
    assert_matches(hidden.grad, ref_grad_hidden, dtype, "grad hidden")
    assert_matches(weight.grad, ref_grad_weight, dtype, "grad weight")


def check_head(n, d, v, dtype, device, seed, chunk_size=None, ignore_index=-100, backward_once=False):
    hidden, weight, targets = make_head_inputs(n, d, v, dtype, device, seed, ignore_index=ignore_index)
    loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, ignore_index=ignore_index,
                                    backward_once=backward_once)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward()
    assert hidden.grad.dtype == dtype and weight.grad.dtype == torch.float32
    assert_matches_float64(loss, hidden, weight, targets, dtype, ignore_index)
    return loss, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, d, v, chunk_size", [
    (37, 48, 1000, None),   # one chunk
    (37, 48, 1003, 8),      # odd V; 5 chunks, the last one of 5 rows
    (20, 200, 257, 7),      # non-power-of-two D and V
])
@pytest.mark.parametrize("backward_once", [True, False], ids=["backward once (in place)", "scaled copies"])
def test_linear_cross_entropy_matches_float64(n, d, v, chunk_size, dtype, backward_once, device, poisoned_outputs):
    check_head(n, d, v, dtype, device, seed=n + d + v, chunk_size=chunk_size, backward_once=backward_once)
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


@pytest.mark.parametrize("launch", [(64, 1), (256, 2), (2048, 4)], ids=["64 a block", "256, 2 warps", "one block"])
def test_every_launch_of_the_loss_kernel_gives_the_loss_and_gradient(launch, device):
    """Blocks shorter than the row (the two-pass loop) or holding all of it, other warps: the same loss and
    gradient within float32 rounding (the sums run in another order). What tune_cross_entropy.py's check relies on."""
    logits = random((9, 1003), torch.float32, device, seed=81, scale=3.0)
    targets = torch.tensor([0, 5, 1002, -100, 17, 400, 999, 3, 64], device=device)
    want_grad, want_loss = logits.clone(), torch.empty(9, device=device)
    lce.cross_entropy_rows_(want_grad, targets, want_loss)
    got_grad, got_loss = logits.clone(), torch.empty(9, device=device)
    lce.cross_entropy_rows_(got_grad, targets, got_loss, launch=launch)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)
    assert got_loss[3] == 0 and not got_grad[3].any()   # the ignored row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_loss_tuners_check_passes_the_kernel_as_the_step_runs_it(dtype, device):
    """tune_cross_entropy.py checks the gradient the step's kernel writes: divided by the rows in float32 (and
    bfloat16), undivided in float16; and it fails a gradient that is off."""
    from version4_triton_ultra import tune_cross_entropy
    logits = random((6, 300), dtype, device, seed=83, scale=3.0)
    targets = torch.tensor([0, 5, 299, 17, 100, 3], device=device)
    want = tune_cross_entropy.reference(logits, targets)
    assert (tune_cross_entropy.grad_scale_of(logits) is None) == (dtype == torch.float16)
    assert tune_cross_entropy.check(logits, targets, want, (64, 1)) == "ok"
    want_loss, want_grad = want
    assert tune_cross_entropy.check(logits, targets, (want_loss, want_grad * 1.1), (64, 1)) == "WRONG"


def test_the_loss_kernels_launch_rule():
    assert lce.cross_entropy_launch(32000)[0] == lce.MAX_BLOCK_V   # a long row loops over blocks
    assert lce.cross_entropy_launch(1000)[0] == 1024               # a short one is one block
    assert all(1 <= lce.cross_entropy_launch(v)[1] <= lce.MAX_WARPS for v in (10, 1000, 4096, 32000, 128256))


def test_the_loss_tuners_candidates():
    from version4_triton_ultra import tune_cross_entropy
    assert tune_cross_entropy.candidate("4096,8") == (4096, 8)
    with pytest.raises(ValueError, match="power of two"):
        tune_cross_entropy.candidate("4000,8")
    assert all(block <= 4096 for block, _ in tune_cross_entropy.default_candidates(4096))
    assert {block for block, _ in tune_cross_entropy.default_candidates(32000)} == {2048, 4096, 8192}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--candidates", "4096"], ["--dtype", "float64"],
                                   ["--output-json", "/dev/null/x.json"]])
def test_the_loss_tuner_needs_a_gpu_and_good_flags(flags):
    assert_refused_in_one_line("tune_cross_entropy.py", flags)


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


@pytest.mark.parametrize("backward_once", [True, False])
def test_linear_cross_entropy_scales_by_grad_output(backward_once, device):
    hidden, weight, targets = make_head_inputs(15, 32, 200, torch.float32, device, seed=91)
    (3.5 * lce.linear_cross_entropy(hidden, weight, targets, chunk_size=4, backward_once=backward_once)).backward()
    _, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(hidden.grad, 3.5 * ref_grad_hidden, torch.float32, "grad hidden")
    assert_matches(weight.grad, 3.5 * ref_grad_weight, torch.float32, "grad weight")


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_scaled_pair_scales_in_place_and_leaves_a_scale_of_one_alone(scale, device):
    """Without in_place every result is a new tensor; with it, a gradient already in its dtype is scaled in place
    (no copy; that a scale of exactly 1 is not even read or written shows in the GPU profiles, not in the
    values), one in another dtype into a new tensor."""
    same = random((5, 70), torch.float32, device, seed=141)
    other = random((3, 33), torch.float16, device, seed=142)
    same_before, other_before = same.clone(), other.clone()
    grad_output = torch.tensor([scale], device=device)
    copied, _ = lce.scaled_pair(same, torch.float32, None, torch.float32, grad_output)   # not in place
    assert copied is not same and torch.equal(copied, same_before * scale) and torch.equal(same, same_before)
    got_same, got_other = lce.scaled_pair(same, torch.float32, other, torch.float32, grad_output, in_place=True)
    assert got_same is same and got_other is not other and got_other.dtype == torch.float32
    assert torch.equal(same, same_before * scale)
    assert torch.equal(got_other, other_before.float() * scale)
    got_none, got_one = lce.scaled_pair(None, torch.float32, other, torch.float32, grad_output, torch.tensor(
        [0.25], device=device), in_place=True)
    assert got_none is None and torch.equal(got_one, other_before.float() * (scale * 0.25))


@pytest.mark.parametrize("backward_once", [True, False])
def test_a_retained_graph_is_differentiated_again_unless_backward_once(backward_once, device):
    """backward_once (the model's training path) hands the gradients over, scaled in place, in the first backward:
    a second one through the same loss says so instead of returning them scaled twice. Without it (the default,
    what the kernel benchmark times) every backward returns fresh, equal gradients."""
    hidden, weight, targets = make_head_inputs(12, 16, 40, torch.float32, device, seed=151)
    loss = lce.linear_cross_entropy(hidden, weight, targets, backward_once=backward_once)
    first = torch.autograd.grad(2.0 * loss, (hidden, weight), retain_graph=True)
    if backward_once:
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.grad(loss, (hidden, weight))
        return
    second = torch.autograd.grad(2.0 * loss, (hidden, weight))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    _, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(second[1], 2.0 * ref_grad_weight, torch.float32, "grad weight")


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

    def recording_launch(logits, targets, row_loss, ignore_index, compute_grad, **kwargs):
        launches.append(compute_grad)
        return launch(logits, targets, row_loss, ignore_index, compute_grad, **kwargs)

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
    assert_matches_float64(loss, hidden, weight, targets, torch.float16)


@pytest.mark.parametrize("backward_once", [True, False])
def test_the_models_path_bfloat16_autocast_with_a_16bit_weight(backward_once, device):
    """What version 4's model runs: bfloat16 hidden under bfloat16 autocast, its float32 head weight with the
    bfloat16 copy the optimizer keeps, the gradient divided by n_valid in the loss kernel and, with backward_once,
    scaled in place by a backward that skips a scale of exactly 1."""
    hidden, weight, targets = make_head_inputs(24, 64, 300, torch.bfloat16, device, seed=171)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=10,
                                        weight16=weight.detach().bfloat16(), backward_once=backward_once)
    loss.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    assert_matches_float64(loss, hidden, weight, targets, torch.bfloat16)


def test_linear_cross_entropy_uses_a_given_16bit_weight(device):
    """weight16 (the model's per-step 16-bit copy) replaces the cast inside; gradients still reach weight."""
    hidden, weight, targets = make_head_inputs(24, 64, 300, torch.float16, device, seed=122)
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=10, weight16=weight.detach().half())
    loss.backward()
    assert weight.grad.dtype == torch.float32
    assert_matches_float64(loss, hidden, weight, targets, torch.float16)


def test_matmul_to_float32_of_16bit_operands(device):
    a = random((40, 70), torch.bfloat16, device, seed=5)
    b = random((70, 30), torch.bfloat16, device, seed=6)
    product = lce.matmul_to_float32(a, b)
    assert product.dtype == torch.float32
    assert_matches(product, a.double() @ b.double(), torch.bfloat16, "a @ b")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accumulate_matmul_adds_in_place(dtype, device):
    """The second chunk's weight gradient is added into the first's float32 buffer (on a GPU in the GEMM's
    epilogue for 16-bit operands), and the sum is right."""
    a, c = random((40, 70), dtype, device, seed=7), random((40, 70), dtype, device, seed=9)
    b, d = random((70, 30), dtype, device, seed=8), random((70, 30), dtype, device, seed=10)
    total = lce.accumulate_matmul(None, a, b)
    address = total.data_ptr()
    total = lce.accumulate_matmul(total, c, d)
    assert total.dtype == torch.float32 and total.data_ptr() == address
    want = a.double() @ b.double() + c.double() @ d.double()
    tf32_or_16bit = dtype == torch.bfloat16 or device.type == "cuda"   # float32 GEMMs may run in TF32 on a GPU
    assert_matches(total, want, torch.bfloat16 if tf32_or_16bit else torch.float32, "a @ b + c @ d")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.version.hip:
        assert lce._FLOAT32_OUTPUT_ADDMM["supported"], "the GEMM's float32-output add is off on this GPU"
    with pytest.raises(ValueError, match="float32"):
        lce.accumulate_matmul(total.double(), c, d)


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
    all_ignored, inv_none = lce.mean_loss(row_loss * 0, torch.full_like(targets, -100))
    assert torch.isnan(all_ignored) and inv_none == 0   # 0, not 1/0: what the gradient is multiplied by
    torch.testing.assert_close(lce.inverse_count(targets), 1.0 / valid.sum().float().reshape(1))
    assert lce.inverse_count(torch.full_like(targets, -100)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backward_once", [True, False])
# The interpreter computes the mean's 0 / 0 with NumPy, which warns: that nan is the point.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_every_target_ignored_gives_a_nan_loss_and_zero_gradients(dtype, backward_once, device):
    """As F.cross_entropy: the mean over no rows is nan, and no row pushes any gradient. (Whichever pass divides
    by n_valid, forward or backward, must not turn the zeros into zero times infinity.)"""
    hidden, weight, targets = make_head_inputs(9, 16, 40, dtype, device, seed=161)
    targets = torch.full_like(targets, -100)
    loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=4, backward_once=backward_once)
    loss.backward()
    ref_loss = F.cross_entropy(hidden.detach().double() @ weight.detach().double().T, targets)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert not hidden.grad.any() and not weight.grad.any()


def test_default_chunk_rows():
    assert lce.default_chunk_rows(32000, torch.bfloat16) == 4160  # 256 MiB of bf16 logits, in 64-row steps
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
    # V = 32000 (the large configs), in chunks of 512 rows: N is not a multiple of it, and every chunk after the
    # first adds its 16-bit product into the float32 weight gradient. (The default chunk, 4160 rows of bf16
    # logits here, would hold all 1100 rows at once.)
    check_head(1100, 512, 32000, dtype, device, seed=141, chunk_size=512)


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
    assert_matches_float64(loss, hidden, weight, targets, torch.bfloat16)
