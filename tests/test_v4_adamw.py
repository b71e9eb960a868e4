"""Version 4's TritonAdamW (kernels/adamw.py) against torch.optim.AdamW, and the 16-bit weight copies it writes.

On the CPU the kernel runs in Triton's interpreter, whose float-to-bfloat16 conversion truncates instead of
rounding to nearest: there the copies are checked to within one bfloat16 step, on the GPU bit for bit."""
import pytest
import torch

from tinytransformer import triton_support
from tinytransformer.config import ModelConfig, TrainConfig
from version4_triton_ultra.kernels import adamw
from version4_triton_ultra.kernels.adamw import TritonAdamW

from .v4_training import train_frozen_embedding

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")

# A parameter of several programs (of either launch, kernels/adamw.py) with a partial last one, a short one, a matrix.
SHAPES = [(adamw.BLOCK + 904,), (13,), (64, 48), (3, 5, 7)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in SHAPES]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def fresh_gradients(step, params):
    """Random gradients of the parameters' shapes, a function of `step`."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator).to(p.device) for p in params]


def set_fresh_gradients(step, *param_lists, skip=()):
    """The same random gradient for the i-th parameter of every list; new tensors each step, as autograd's
    are (so the optimizer sees new addresses). Parameters whose index is in `skip` get none."""
    for index, (grad, *group) in enumerate(zip(fresh_gradients(step, param_lists[0]), *param_lists)):
        for p in group:
            p.grad = None if index in skip else grad.clone()


def assert_same_training(params, reference, optimizer, reference_optimizer, rtol=1e-5, atol=1e-6):
    for index, (p, q) in enumerate(zip(params, reference)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=lambda m: f"param {index}: {m}")
        got, want = optimizer.state[p], reference_optimizer.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol,
                                       msg=lambda m: f"param {index} {key}: {m}")
        assert float(got["step"]) == float(want["step"])


@pytest.mark.parametrize("tensor_lr, betas", [(False, (0.9, 0.95)), (True, (0.9, 0.95)), (False, (0.9, 0.999))])
def test_matches_torch_adamw_over_several_steps(tensor_lr, betas, device):
    params = make_params(device)
    reference = clone_params(params)
    lr = torch.tensor(HYPER["lr"], device=device) if tensor_lr else HYPER["lr"]
    optimizer = TritonAdamW(params, **{**HYPER, "lr": lr, "betas": betas})
    reference_optimizer = torch.optim.AdamW(reference, **{**HYPER, "betas": betas})
    for step in range(5):
        # Parameter 1 has no gradient at step 2: it is skipped, and its step count lags, as in torch.
        set_fresh_gradients(step, params, reference, skip=(1,) if step == 2 else ())
        optimizer.step()
        reference_optimizer.step()
        if tensor_lr:   # a schedule writes the tensor in place between steps; the kernel reads it each time
            lr.mul_(0.5)
            for group in reference_optimizer.param_groups:
                group["lr"] *= 0.5
    assert_same_training(params, reference, optimizer, reference_optimizer)
    assert float(optimizer.state[params[1]]["step"]) == 4.0


def test_matches_torch_adamw_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """In a CPU run of the interpreter a program updates up to INTERPRETER_BLOCK elements: a parameter one element
    longer takes two programs, the others one each."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    generator = torch.Generator().manual_seed(5)
    shapes = [(adamw.INTERPRETER_BLOCK + 1,), (13,), (64, 48)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in shapes]
    reference = clone_params(params)
    optimizer = TritonAdamW(params, **HYPER)
    reference_optimizer = torch.optim.AdamW(reference, **HYPER)
    for step in range(3):
        set_fresh_gradients(step, params, reference)
        optimizer.step()
        reference_optimizer.step()
    assert_same_training(params, reference, optimizer, reference_optimizer)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_writes_the_16bit_copies_of_the_updated_weights(copy_dtype, device):
    params = make_params(device, seed=3)
    poisoned = {p: torch.full(p.shape, float("nan"), dtype=copy_dtype, device=device) for p in params[::2]}
    optimizer = TritonAdamW(params, sixteen_bit_copies=poisoned, **HYPER)
    set_fresh_gradients(0, params)
    optimizer.step()
    for p, copy in poisoned.items():
        rounded = p.detach().to(copy_dtype)
        if device.type == "cuda":
            assert torch.equal(copy, rounded)
        else:   # the interpreter truncates: less than one unit in the last place of the 16-bit format away
            weight = p.detach()
            mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[copy_dtype]
            ulp = torch.exp2(torch.floor(torch.log2(weight.abs())) - mantissa_bits)
            assert ((copy.float() - weight).abs() < ulp).all()


def test_copies_added_later_are_written_from_then_on(device):
    """The model fills the copies dict at its first forward pass, after the optimizer was made."""
    params = make_params(device, seed=4)
    copies = {}
    optimizer = TritonAdamW(params, sixteen_bit_copies=copies, **HYPER)
    set_fresh_gradients(0, params)
    optimizer.step()
    copies[params[2]] = torch.zeros(params[2].shape, dtype=torch.bfloat16, device=device)
    set_fresh_gradients(1, params)
    optimizer.step()
    torch.testing.assert_close(copies[params[2]].float(), params[2].detach(), rtol=2 ** -7, atol=0)


def test_state_moves_between_this_optimizer_and_torchs(device):
    """Checkpoints store torch's AdamW state: a run may resume with either optimizer."""
    params = make_params(device, seed=5)
    reference = clone_params(params)
    optimizer = TritonAdamW(params, **HYPER)
    reference_optimizer = torch.optim.AdamW(reference, **HYPER)
    for step in range(2):
        set_fresh_gradients(step, params, reference)
        optimizer.step()
        reference_optimizer.step()
    # Swap: each optimizer continues from the other's state (new state tensors: new addresses), loaded the
    # way tinytransformer/checkpoint.py does: the state only, with the step counter coming from the CPU.
    resumed = TritonAdamW(params, **HYPER)
    load_state_only(resumed, reference_optimizer)
    resumed_reference = torch.optim.AdamW(reference, **HYPER)
    load_state_only(resumed_reference, optimizer)
    for step in range(2, 4):
        set_fresh_gradients(step, params, reference)
        resumed.step()
        resumed_reference.step()
    assert_same_training(params, reference, resumed, resumed_reference)


def load_state_only(target, source):
    full = target.state_dict()
    full["state"] = {index: {key: value.cpu() if key == "step" else value for key, value in entry.items()}
                     for index, entry in source.state_dict()["state"].items()}
    target.load_state_dict(full)


def test_refuses_what_it_cannot_update(device):
    with pytest.raises(ValueError, match="betas"):
        TritonAdamW(make_params(device), betas=(1.0, 0.9))
    half = torch.nn.Parameter(torch.randn(8, device=device).half())
    half.grad = torch.randn_like(half)
    with pytest.raises(ValueError, match="float32"):
        TritonAdamW([half]).step()
    p = torch.nn.Parameter(torch.randn(8, device=device))
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="16-bit copy"):
        TritonAdamW([p], sixteen_bit_copies={p: torch.empty(4, dtype=torch.bfloat16, device=device)}).step()
    q = torch.nn.Parameter(torch.randn(8, device=device))
    q.grad = torch.randn_like(q)
    mixed = {p: torch.empty(8, dtype=torch.bfloat16, device=device), q: torch.empty(8, dtype=torch.half, device=device)}
    with pytest.raises(ValueError, match="share one dtype"):
        TritonAdamW([p, q], sixteen_bit_copies=mixed).step()
    with pytest.raises(ValueError, match="0-dim float32"):
        TritonAdamW([p], lr=torch.tensor([1e-3]))


# ----------------------------------------------------------------------------------------------------------
# The model's copies: made in forward unless the optimizer keeps them current
# ----------------------------------------------------------------------------------------------------------
def tiny_model():
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    return TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64,
                                 max_seq_len=16))


def test_model_skips_the_copy_while_triton_adamw_keeps_it_current():
    model = tiny_model()
    model.configure_optimizer(TrainConfig())
    assert model.optimizer_writes_copies
    model.refresh_16bit_weights(torch.bfloat16)
    first = model.projections[0]
    first.weight16.zero_()   # stands for "written by the optimizer": a refresh must leave it alone
    model.refresh_16bit_weights(torch.bfloat16)
    assert not first.weight16.any()
    with torch.no_grad():
        first.weight.add_(1.0)   # changed outside the optimizer (loading weights): copied again
    model.refresh_16bit_weights(torch.bfloat16)
    torch.testing.assert_close(first.weight16.float(), first.weight.detach(), rtol=1e-2, atol=1e-2)
    # A float32 forward pass in between: the optimizer stops writing, so the next 16-bit pass copies.
    model.refresh_16bit_weights(None)
    assert model.sixteen_bit_copies == {}
    first.weight16 = None
    model.weights16[0].zero_()
    model.refresh_16bit_weights(torch.bfloat16)
    assert first.weight16.any()


def test_the_copies_the_model_uses_are_the_ones_triton_adamw_writes(device):
    """Forward pass (the model makes its copies), optimizer step (TritonAdamW updates weights and copies),
    next forward pass (the model copies nothing): every projection multiplies with its updated weight."""
    model = tiny_model().to(device)
    optimizer = model.configure_optimizer(TrainConfig())
    model.refresh_16bit_weights(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = [projection.weight.detach().clone() for projection in model.projections]
    optimizer.step()
    model.refresh_16bit_weights(torch.bfloat16)
    for projection, old in zip(model.projections, before):
        weight = projection.weight.detach()
        assert not torch.equal(weight, old)
        # Within one bfloat16 step of the updated weight (the interpreter truncates; a GPU rounds to nearest).
        ulp = torch.exp2(torch.floor(torch.log2(weight.abs())) - 7)
        assert ((projection.weight16.float() - weight).abs() < ulp).all()


def test_model_copies_every_time_with_torch_adamw():
    """torch's fused AdamW updates the weights without bumping their version counters: with it the model must
    copy at every forward pass, whatever the counters say."""
    model = tiny_model()
    model.use_triton_adamw = False
    optimizer = model.configure_optimizer(TrainConfig())
    assert isinstance(optimizer, torch.optim.AdamW) and not model.optimizer_writes_copies
    model.refresh_16bit_weights(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    model.refresh_16bit_weights(torch.bfloat16)
    for projection in model.projections:
        torch.testing.assert_close(projection.weight16.float(), projection.weight.detach(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------------------
# GPU: the model's parameters at full size, and inside a captured graph
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_model_parameters_match_torch_fused_adamw_and_copies_are_exact():
    model = tiny_model_full_size()
    params = list(model.parameters())
    reference = clone_params(params)
    copies = {p: torch.empty_like(p, dtype=torch.bfloat16) for p in params if p.dim() == 2}
    optimizer = TritonAdamW(params, sixteen_bit_copies=copies, **HYPER)
    reference_optimizer = torch.optim.AdamW(reference, fused=True, **HYPER)
    for step in range(3):
        set_fresh_gradients(step, params, reference)
        optimizer.step()
        reference_optimizer.step()
    assert_same_training(params, reference, optimizer, reference_optimizer)
    for p, copy in copies.items():
        assert torch.equal(copy, p.detach().bfloat16())


def tiny_model_full_size():
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    return TinyLlama(ModelConfig()).cuda()


@pytest.mark.gpu
def test_captured_step_uses_the_graphs_gradients():
    """finish_capture writes the addresses of the gradients the graph allocated: replays update like eager
    steps given the same gradients."""
    params = make_params(torch.device("cuda"), seed=7)
    reference = clone_params(params)
    optimizer = TritonAdamW(params, **{**HYPER, "lr": torch.tensor(HYPER["lr"], device="cuda")})
    reference_optimizer = torch.optim.AdamW(reference, **HYPER)
    source = [torch.zeros_like(p) for p in params]   # the graph's gradients are computed from these

    def step():
        for p, s in zip(params, source):
            p.grad = s * 1.0   # a new tensor, allocated inside the graph during capture
        optimizer.step()

    def next_gradients(index):
        for s, q, grad in zip(source, reference, fresh_gradients(index, params)):
            s.copy_(grad)
            q.grad = grad.clone()

    next_gradients(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()   # the eager step before capture
    torch.cuda.current_stream().wait_stream(side)
    reference_optimizer.step()
    graph = torch.cuda.CUDAGraph()
    for p in params:
        p.grad = None
    with torch.cuda.graph(graph):
        step()
    optimizer.finish_capture()
    for index in range(1, 4):
        next_gradients(index)
        graph.replay()
        reference_optimizer.step()
    torch.cuda.synchronize()
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_step_groups_updates_only_the_named_groups(device):
    params = make_params(device, seed=9)
    reference = clone_params(params)
    optimizer = TritonAdamW([{"params": params[:2]}, {"params": params[2:]}], **HYPER)
    reference_optimizer = torch.optim.AdamW(reference, **HYPER)
    set_fresh_gradients(0, params, reference)
    before = [p.detach().clone() for p in params]
    optimizer.step_groups([1])
    assert all(torch.equal(p, b) for p, b in zip(params[:2], before[:2]))
    assert not any(torch.equal(p, b) for p, b in zip(params[2:], before[2:]))
    optimizer.step_groups([0])   # the two halves of one step, in the other order: the same as one step
    reference_optimizer.step()
    assert_same_training(params, reference, optimizer, reference_optimizer)


PROJECTIONS = ("attention.qkv_proj", "attention.o_proj", "feed_forward.gate_up_proj", "feed_forward.down_proj")


def weights_final_before_layer0(model) -> list:
    """By name: the weights whose gradients are complete once the backward pass reaches layer 0, i.e. the
    projections of layers 1 and up and the output head (the norms' are not: layer 0's last norm is layer 1's
    attention norm)."""
    by_name = dict(model.named_parameters())
    names = [f"layers.{k}.{m}.weight" for k in range(1, len(model.layers)) for m in PROJECTIONS]
    return [by_name[name] for name in names + ["lm_head.weight"]]


def test_model_groups_each_layers_weights_complete_before_layer0s_backward():
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=3, num_heads=2, intermediate_size=64,
                                  max_seq_len=16))
    optimizer = model.configure_optimizer(TrainConfig())
    last, middle, bottom, rest, embedding = optimizer.param_groups
    # The order backward reaches them, then the rest (the norms), then the embedding in a group of its own.
    assert (last["layer"], middle["layer"], bottom["layer"], rest.get("layer"), embedding.get("layer")) == (
        2, 1, 0, None, None)
    assert embedding["embedding"] and embedding["params"] == [model.embed_tokens.weight]
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in last["params"]) == sorted(
        [f"layers.2.{m}.weight" for m in PROJECTIONS] + ["lm_head.weight"])
    assert sorted(names[id(p)] for p in middle["params"]) == sorted(f"layers.1.{m}.weight" for m in PROJECTIONS)
    assert sorted(names[id(p)] for p in bottom["params"]) == sorted(f"layers.0.{m}.weight" for m in PROJECTIONS)
    early = last["params"] + middle["params"]
    assert sorted(map(id, early)) == sorted(map(id, weights_final_before_layer0(model)))
    every = early + bottom["params"] + rest["params"] + embedding["params"]
    assert sorted(names[id(p)] for p in every) == sorted(names.values())
    assert all("norm" in names[id(p)] for p in rest["params"])
    one_layer = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=1, num_heads=2,
                                      intermediate_size=64, max_seq_len=16))
    groups = one_layer.configure_optimizer(TrainConfig()).param_groups
    assert [group.get("layer") for group in groups] == [0, None, None]


def test_the_early_update_runs_once_layer0_is_all_that_is_left(device):
    """CallDuringBackward calls back after layer 1's backward pass (its weights have gradients) and before
    layer 0's (none yet)."""
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=2, num_heads=2, intermediate_size=64,
                                  max_seq_len=16)).to(device)
    seen = []
    model.early_update = lambda: seen.append((model.layers[1].attention.qkv_proj.weight.grad is not None,
                                              model.layers[0].attention.qkv_proj.weight.grad is not None))
    ids = torch.randint(0, 64, (2, 8), device=device)
    _, loss = model(ids, ids)
    loss.backward()
    assert seen == [(True, False)]
    # At that moment every weight final before layer 0's backward had its gradient, and no weight of layer 0 had one.
    early = weights_final_before_layer0(model)
    model.zero_grad(set_to_none=True)
    seen_grads = []
    model.early_update = lambda: seen_grads.append(
        ([p.grad is not None for p in early], [p.grad is not None for p in model.layers[0].parameters()]))
    _, loss = model(ids, ids)
    loss.backward()
    (early_have, layer0_have), = seen_grads
    assert all(early_have) and not any(layer0_have)
    model.early_update = None
    with torch.no_grad():   # no backward pass coming: nothing is inserted
        model(ids, ids)
    assert len(seen_grads) == 1


def test_layer_hooks_announce_each_layer_once_its_gradients_exist(device):
    """layer_gradients_queued(k) comes for k = L-1 down to 1, each once layer k's projection weights (and, for
    the last layer, the output head) have gradients and before layer k-1's do; the early update comes last,
    after the hook for layer 1. Together the layers announce exactly the weights final before layer 0's backward."""
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=3, num_heads=2, intermediate_size=64,
                                  max_seq_len=16)).to(device)
    seen = []

    def layer_done(k):
        announced = model.layer_projection_parameters(k)
        below = model.layer_projection_parameters(k - 1)
        seen.append((k, all(p.grad is not None for p in announced), any(p.grad is not None for p in below)))

    model.layer_gradients_queued = layer_done
    model.early_update = lambda: seen.append("early update")
    ids = torch.randint(0, 64, (2, 8), device=device)
    _, loss = model(ids, ids)
    loss.backward()
    assert seen == [(2, True, False), (1, True, False), "early update"]
    announced = [p for k in (1, 2) for p in model.layer_projection_parameters(k)]
    assert sorted(map(id, announced)) == sorted(map(id, weights_final_before_layer0(model)))
    assert id(model.lm_head.weight) in map(id, model.layer_projection_parameters(2))
    model.layer_gradients_queued = model.early_update = None


@pytest.mark.gpu
@pytest.mark.parametrize("use_amp", [False, True])
def test_graphed_step_with_the_early_update_trains_like_the_eager_step(use_amp):
    """The graph (second stream, each layer updated during backward) against eager steps (one optimizer step
    after the backward pass): the same losses and, after eight steps, the same weights (embedding frozen, see
    v4_training.py). Float32 weight gradients in both, as the eager step computes them: the order of the work is
    what is checked here (the 16-bit ones: the next test)."""
    from tinytransformer.training.step import EagerStep
    runs = {graphed: train_frozen_embedding(graphed, num_layers=5, amp_dtype="bfloat16" if use_amp else None,
                                            sixteen_bit_weight_gradients=False)
            for graphed in (True, False)}
    graphed = runs[True]
    assert graphed.step.updates_early
    weights = {g: {name: p.detach().clone() for name, p in run.model.named_parameters()} for g, run in runs.items()}
    # The callback is removed after each graphed step: a later eager step updates every group once.
    assert graphed.model.early_update is None
    graphed.model.use_weight_gradient_stream(False)   # an eager step joins no second stream
    ids = torch.randint(0, graphed.model.config.vocab_size, (8, 129), device="cuda")
    EagerStep(graphed.model, graphed.optimizer, torch.device("cuda"), graphed.train)(ids[:, :-1].contiguous(),
                                                                                     ids[:, 1:].contiguous())
    counters = {float(graphed.optimizer.state[p]["step"]) for g in graphed.optimizer.param_groups
                for p in g["params"] if p in graphed.optimizer.state}
    assert counters == {len(graphed.losses) + 1.0}
    for g, e in zip(runs[True].losses, runs[False].losses):
        assert g == pytest.approx(e, rel=1e-3 if use_amp else 1e-4)
    for name, value in weights[True].items():
        torch.testing.assert_close(value, weights[False][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_capturing_before_any_eager_step_is_refused():
    params = make_params(torch.device("cuda"))
    optimizer = TritonAdamW(params, **HYPER)
    for p in params:   # the state must exist before capture (GraphedStep's warm-up steps make it)
        optimizer._state_of(p)
        p.grad = torch.zeros_like(p)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="eager step"):
        with torch.cuda.graph(graph):
            optimizer.step()


@pytest.mark.gpu
def test_step_counters_count_every_step_exactly_once():
    """The last program to finish advances every counter: once per step, never twice, for every tensor."""
    params = list(tiny_model_full_size().parameters())
    optimizer = TritonAdamW(params, **HYPER)
    for p in params:
        p.grad = torch.zeros_like(p)
    for _ in range(50):
        optimizer.step()
    assert [float(optimizer.state[p]["step"]) for p in params] == [50.0] * len(params)


@pytest.mark.gpu
def test_graph_with_triton_adamw_trains_like_eager_steps_with_torchs_adamw():
    """A reference that shares no optimizer code: eager steps, torch's fused AdamW, the model's own bfloat16 copy
    every forward pass. Stale copies or a wrong update would move the losses apart within a few steps."""
    # Float32 weight gradients in both: the update and the copies are checked here (the 16-bit gradients:
    # test_v4_sixteen_bit_gradients.py).
    ours = train_frozen_embedding(graphed=True, amp_dtype="bfloat16", sixteen_bit_weight_gradients=False).losses
    reference = train_frozen_embedding(graphed=False, amp_dtype="bfloat16", use_triton_adamw=False).losses
    for got, want in zip(ours, reference):   # H100: 1.2e-5 apart at most; with copies never written, 2.1e-3
        assert got == pytest.approx(want, rel=2e-4)


@pytest.mark.gpu
def test_float16_with_the_gradient_scaler_trains_like_torchs_adamw():
    """float16 autocast runs eager steps with a GradScaler: it unscales the gradients, then calls step() or, after
    an overflow, skips it; weights and copies must stay consistent either way."""
    ours = train_frozen_embedding(graphed=False, amp_dtype="float16").losses
    reference = train_frozen_embedding(graphed=False, amp_dtype="float16", use_triton_adamw=False).losses
    for got, want in zip(ours, reference):
        assert got == pytest.approx(want, rel=1e-3)
