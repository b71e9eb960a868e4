"""Version 4's 16-bit weight gradients: TritonAdamW reading them (kernels/adamw.py) and the fused loss summing the
output head's in bfloat16 (kernels/linear_cross_entropy.py), on the CPU in Triton's interpreter; the
graph-captured step that writes them on its second stream (backward_overlap.py), on the GPU. How they compare
with autograd's float32 gradients, one backward pass at a time: tests/test_v4_graph.py."""
import pytest
import torch

from version4_triton_ultra.kernels import linear_cross_entropy as lce
from version4_triton_ultra.kernels.adamw import TritonAdamW

from .test_v4_adamw import HYPER, assert_same_training, clone_params, fresh_gradients, make_params
from .test_v4_linear_cross_entropy import make_head_inputs, reference_head
from .v4_kernel_checks import assert_matches, relative_error
from .v4_training import train_frozen_embedding

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py), as in test_v4_adamw.py.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_reads_16bit_gradients_as_torch_reads_them_widened(grad_dtype, device):
    """Parameters 0 and 2 have 16-bit gradients (in sixteen_bit_gradients, as the weight-gradient stream writes
    them), 1 and 3 float32 .grad, in one launch: the same training as torch's AdamW given the 16-bit gradients
    widened to float32 (exactly: widening is exact)."""
    params = make_params(device, seed=6)
    reference = clone_params(params)
    gradients16 = {}
    optimizer = TritonAdamW(params, sixteen_bit_gradients=gradients16, **HYPER)
    reference_optimizer = torch.optim.AdamW(reference, **HYPER)
    for step in range(3):
        optimizer.zero_grad()
        for index, (p, q, grad) in enumerate(zip(params, reference, fresh_gradients(step, params))):
            if index % 2 == 0:
                gradients16[p] = grad.to(grad_dtype)
                q.grad = gradients16[p].float()
            else:
                p.grad, q.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference_optimizer.step()
    assert_same_training(params, reference, optimizer, reference_optimizer)


def test_zero_grad_clears_the_16bit_gradients_too(device):
    params = make_params(device)
    gradients16 = {params[0]: torch.ones(params[0].shape, dtype=torch.bfloat16, device=device)}
    params[1].grad = torch.ones_like(params[1])
    optimizer = TritonAdamW(params, sixteen_bit_gradients=gradients16, **HYPER)
    optimizer.zero_grad(set_to_none=False)
    assert not gradients16[params[0]].any() and not params[1].grad.any()
    optimizer.zero_grad()
    assert gradients16 == {} and params[1].grad is None
    before = [p.detach().clone() for p in params]
    optimizer.step()   # no gradient left: nothing is updated
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_the_models_zero_grad_clears_the_16bit_gradients_too():
    """A 16-bit gradient left from an earlier backward pass would be added into the next one (the stream takes it
    for the first half of an accumulation): the model's zero_grad drops them, or zeroes them, with .grad."""
    from tinytransformer.config import ModelConfig
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    model = TinyLlama(ModelConfig(hidden_dim=32, num_heads=2, num_layers=1, intermediate_size=32, vocab_size=64))
    weight = model.layers[0].attention.qkv_proj.weight
    model.sixteen_bit_gradients[weight] = torch.ones(weight.shape, dtype=torch.bfloat16)
    model.norm.weight.grad = torch.ones_like(model.norm.weight)
    model.zero_grad(set_to_none=False)
    assert not model.sixteen_bit_gradients[weight].any() and not model.norm.weight.grad.any()
    model.zero_grad()
    assert model.sixteen_bit_gradients == {} and model.norm.weight.grad is None


def test_refuses_two_gradients_or_mixed_16bit_gradients(device):
    p, q = (torch.nn.Parameter(torch.randn(8, device=device)) for _ in range(2))
    p.grad = torch.randn_like(p)
    both = {p: torch.zeros(8, dtype=torch.bfloat16, device=device)}
    with pytest.raises(ValueError, match="two gradients"):
        TritonAdamW([p], sixteen_bit_gradients=both).step()
    p.grad = None
    mixed = {p: torch.zeros(8, dtype=torch.bfloat16, device=device), q: torch.zeros(8, dtype=torch.half, device=device)}
    with pytest.raises(ValueError, match="share one dtype"):
        TritonAdamW([p, q], sixteen_bit_gradients=mixed).step()
    wrong_shape = {p: torch.zeros(4, dtype=torch.bfloat16, device=device)}
    with pytest.raises(ValueError, match="gradient of shape"):
        TritonAdamW([p], sixteen_bit_gradients=wrong_shape).step()


def head_gradients(device, gradients16, backward_passes=1, backward_once=True, autocast_dtype=torch.bfloat16,
                   chunk_size=8, losses_per_backward=1, loss_scale=1.0, weight_of=None):
    """(hidden, weight, targets) after backward_passes backward passes through the fused head (29 rows in chunks of
    chunk_size) under CPU/GPU autocast to autocast_dtype (None: float32, no autocast), handing the weight's gradient
    to the dict gradients16. Each pass differentiates loss_scale times the sum of losses_per_backward losses; the
    head multiplies by weight_of(weight) (default: the weight itself, the leaf)."""
    hidden, weight, targets = make_head_inputs(29, 24, 70, torch.float32, device, seed=171)
    for _ in range(backward_passes):
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            losses = [lce.linear_cross_entropy(hidden, weight if weight_of is None else weight_of(weight), targets,
                                               chunk_size=chunk_size, backward_once=backward_once,
                                               sixteen_bit_gradients=gradients16)
                      for _ in range(losses_per_backward)]
        (loss_scale * sum(losses)).backward()
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [8, None], ids=["4 chunks", "one chunk"])
def test_head_gradient_summed_in_bfloat16_goes_to_the_dict(chunk_size, device):
    """Under bfloat16 autocast with the dict, the head's gradient is summed over the chunks in bfloat16 and handed to
    the dict, not to .grad; it is the float32 sum's within bfloat16's rounding (one rounding a chunk), and float64's
    within bfloat16's tolerance. hidden's gradient is the same either way."""
    gradients16 = {}
    hidden, weight, targets = head_gradients(device, gradients16, chunk_size=chunk_size)
    assert weight.grad is None and list(gradients16) == [weight]
    assert gradients16[weight].dtype == torch.bfloat16
    float32_hidden, float32_weight, _ = head_gradients(device, None, chunk_size=chunk_size)
    assert relative_error(gradients16[weight], float32_weight.grad) < 2 ** -7
    assert torch.equal(hidden.grad, float32_hidden.grad)
    _, ref_grad_hidden, ref_grad_weight = reference_head(hidden, weight, targets)
    assert_matches(gradients16[weight], ref_grad_weight, torch.bfloat16, "grad weight")
    assert_matches(hidden.grad, ref_grad_hidden, torch.bfloat16, "grad hidden")


def test_a_second_backward_pass_adds_the_heads_gradients_in_float32(device):
    """The first pass leaves a bfloat16 gradient in the dict; the second, finding it, sums its own in float32 and
    the first one widened into .grad (as the weight-gradient stream does): twice one pass's gradient."""
    gradients16 = {}
    _, weight, _ = head_gradients(device, gradients16, backward_passes=2)
    assert gradients16 == {} and weight.grad.dtype == torch.float32
    _, once, _ = head_gradients(device, None)
    assert relative_error(weight.grad, 2 * once.grad) < 2 ** -7


@pytest.mark.parametrize("case", ["float32", "float16", "scaled copies", "not a leaf"])
def test_head_gradient_stays_float32_where_it_is_not_summed_in_bfloat16(case, device):
    """Only a bfloat16 step that differentiates its loss once sums the head's gradient in bfloat16, for the leaf
    weight the dict is keyed by: in float32 there is nothing to gain, float16's is divided by n_valid in the backward
    pass (a second rounding), a graph kept for a second backward needs the float32 sum it scales copies of, and a
    weight computed from the parameter must pass its gradient on through autograd. There the dict stays empty and
    .grad is the float32 sum, bit for bit the one without the dict."""
    if case == "float16" and device.type == "cpu":
        pytest.skip("CPU autocast takes bfloat16 only")
    dtype = {"float32": None, "float16": torch.float16}.get(case, torch.bfloat16)
    flags = dict(backward_once=case != "scaled copies", autocast_dtype=dtype,
                 weight_of=(lambda w: w * 1.0) if case == "not a leaf" else None)
    gradients16 = {}
    _, weight, _ = head_gradients(device, gradients16, **flags)
    _, without_dict, _ = head_gradients(device, None, **flags)
    assert gradients16 == {} and weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, without_dict.grad)


def test_two_losses_in_one_backward_pass_add_up(device):
    """Two losses of the head differentiated together: the first backward to reach the head puts its bfloat16 sum
    in the dict, the second finds it there and moves it, widened, into .grad beside its own: nothing lost."""
    gradients16 = {}
    _, weight, _ = head_gradients(device, gradients16, losses_per_backward=2)
    _, once, _ = head_gradients(device, None)
    assert gradients16 == {} and relative_error(weight.grad, 2 * once.grad) < 2 ** -7


def test_a_scaled_loss_scales_the_16bit_gradient_once(device):
    gradients16 = {}
    _, weight, _ = head_gradients(device, gradients16, loss_scale=3.0)
    _, once, _ = head_gradients(device, None)
    assert weight.grad is None and relative_error(gradients16[weight], 3 * once.grad) < 2 ** -7


def test_a_gradient_in_both_places_is_refused(device):
    """A float32 .grad set beside a 16-bit gradient in the dict: the head cannot tell which to add to."""
    gradients16 = {}
    _, weight, _ = head_gradients(device, gradients16)
    weight.grad = torch.zeros_like(weight)
    hidden, _, targets = make_head_inputs(29, 24, 70, torch.float32, device, seed=171)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=8, backward_once=True,
                                        sixteen_bit_gradients=gradients16)
    with pytest.raises(ValueError, match="two gradients"):
        loss.backward()


@pytest.mark.gpu
def test_graphed_step_with_16bit_weight_gradients_trains_like_the_eager_step():
    """The graph's default under autocast: the projections' and the head's weight gradients in bfloat16 (the eager
    step's float32 ones rounded; the 16-bit GEMM may also sum in another order), read by TritonAdamW as they are.
    Adam's update is normalised: where a gradient is nearly zero, its sign may differ between the two GEMMs and
    that weight then moves by up to the learning rate the other way (a few elements in ten thousand). So each
    weight's difference from the eager run is measured against how far the eager run moved it: a few percent at
    most, where a gradient lost or misread would make it as large as the move itself."""
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    runs = {graphed: train_frozen_embedding(graphed, num_layers=5, amp_dtype="bfloat16") for graphed in (True, False)}
    graphed = runs[True]
    assert graphed.step.sixteen_bit_weight_gradients
    # Every projection's, the output head's included (the fused loss sums it in bfloat16).
    projections = [p for k in range(5) for p in graphed.model.layer_projection_parameters(k)]
    assert any(p is graphed.model.lm_head.weight for p in projections)
    gradients16 = graphed.model.sixteen_bit_gradients
    assert set(map(id, gradients16)) == set(map(id, projections))   # written by the last replay, in bfloat16
    assert all(g.dtype == torch.bfloat16 for g in gradients16.values())
    assert all(p.grad is None for p in projections)
    for g, e in zip(graphed.losses, runs[False].losses):
        assert g == pytest.approx(e, rel=1e-3)
    initial = dict(TinyLlama(graphed.model.config).named_parameters())   # the canonical initial weights
    eager = dict(runs[False].model.named_parameters())
    for name, value in graphed.model.named_parameters():
        if not value.requires_grad:
            continue   # the frozen embedding
        moved = (eager[name].detach().cpu() - initial[name].detach()).norm()
        difference = (value.detach().cpu() - eager[name].detach().cpu()).norm()
        assert moved > 0 and difference <= 2 ** -4 * moved, f"{name}: {difference:.3e} off, moved {moved:.3e}"
