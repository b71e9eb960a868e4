"""Version 4's graph-captured step, its bookkeeping checked on the CPU in host order.

GraphedStep (version4_triton_ultra/graphed_step.py) updates each layer's weights and starts each layer's
all-reduces from hooks inside the backward pass. Which group is updated when, and which gradient is summed
when, is decided on the host; the GPU only runs it in that order. So this test replaces the two GPU-only pieces
with stand-ins that act at once, in host order: the weight-gradient stream (its GEMM runs when queued) and the
all-reduce (it counts, and its handles record the wait). Then, for one, two, three and five layers, with and
without data parallel, with and without the second stream, with TritonAdamW and torch's AdamW, one step must:
- update every optimizer group exactly once, each after its gradients were summed and waited for;
- all-reduce every gradient exactly once, and wait for every all-reduce it started;
- never let the backward pass read a weight, or write a gradient, after that weight was updated;
- never update a weight on the second stream before that stream has waited for the main stream's last read of it.
The stream ordering itself (events between the streams) is what the GPU tests check.
"""
import itertools

import pytest
import torch

from tinytransformer.config import ModelConfig, TrainConfig
from version4_triton_ultra import graphed_step
from version4_triton_ultra.tiny_llama_v4 import TinyLlama

# The stand-ins run the model's Triton kernels on CPU tensors.
pytestmark = pytest.mark.interpreter


class StreamStandIn:
    """The weight-gradient stream, with every GEMM run when it is queued. It also tracks which stream the host is
    issuing work to (the second one inside run_after_queued) and which gradients the second stream has written
    since the main stream last joined it: the main stream must not read those before it joins."""

    def __init__(self, on_gemm):
        self.on_gemm = on_gemm
        self.on_second_stream = False
        self.unjoined = set()          # ids of weights whose gradient the second stream wrote since the last join
        self.work_since_join = False   # the step must end with the main stream joined to the second
        self.unwaited_reads = set()    # ids of weights the main stream read since the second stream last waited
        self.gradient_slots = {}       # as WeightGradientStream's: where a first gradient is written

    def queue(self, weight, grad_y, x):
        self.on_gemm(weight)
        gradient = grad_y.T.float() @ x.float()
        if weight.grad is None:
            slot = self.gradient_slots.pop(id(weight), None)
            weight.grad = gradient if slot is None else slot.copy_(gradient)
        else:
            weight.grad = weight.grad + gradient
        self.unjoined.add(id(weight))
        self.work_since_join = True

    def run_after_queued(self, work):
        self.unwaited_reads.clear()   # the second stream waits for the main stream's work so far
        self.on_second_stream, self.work_since_join = True, True
        try:
            work()
        finally:
            self.on_second_stream = False

    def join(self):
        self.unjoined.clear()
        self.work_since_join = False

    def read_too_early(self, param) -> bool:
        """Whether reading param's gradient now, on the stream the host issues to, would race the second stream."""
        return not self.on_second_stream and id(param) in self.unjoined


class Handle:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


class AllReduceStandIn:
    """GradientAllReduce's interface: counts each parameter's all-reduces and keeps every handle. Two ranks, as
    far as the rule for the embedding's row exchange goes: its gather counts as the table's sum."""
    loss_scale = 1.0
    world_size = 2

    def __init__(self, on_read=lambda param: None):
        self.counts, self.handles = {}, {}
        self.on_read = on_read   # an all-reduce reads the gradient
        self.table = None        # the embedding's weight, whose gradient a row exchange sums
        self.exchanges = 0

    def row_exchange(self):
        return RowExchangeStandIn(self)

    def _count(self, param):
        self.on_read(param)
        self.counts[id(param)] = self.counts.get(id(param), 0) + 1

    def sum_(self, params):
        for param in params:
            if param.grad is not None:
                self._count(param)

    def start_sum(self, params):
        started = []
        for param in params:
            if param.grad is not None:
                self._count(param)
                started.append(self.handles.setdefault(id(param), Handle()))
        return started

    @staticmethod
    def finish(handles):
        for handle in handles:
            handle.wait()
        handles.clear()


class RowExchangeStandIn:
    """EmbeddingRowExchange's interface on one rank: what is gathered is what was given; the rows' gather counts
    as the sum of the table's gradient (which the backward pass then writes), once it is waited for."""

    def __init__(self, sync):
        self.sync = sync

    def start(self, tensor):
        return RowGatheringStandIn(self.sync, tensor)


class RowGatheringStandIn:
    def __init__(self, sync, tensor):
        self.sync, self.tensor = sync, tensor

    def wait(self):
        if self.tensor.is_floating_point():   # the rows
            self.sync.exchanges += 1
            self.sync.counts[id(self.sync.table)] = self.sync.counts.get(id(self.sync.table), 0) + 1
        return self.tensor


CASES = list(itertools.product([1, 2, 3, 5], [False, True], [True, False], [True, False]))
CASE_IDS = [f"L{n}-{'dp' if dp else 'one'}-{'2streams' if two else '1stream'}-{'triton' if triton else 'torch'}"
            for n, dp, two, triton in CASES]


def one_step(monkeypatch, layers, data_parallel, second_stream, triton_adamw, frozen=(), embedding_grad_sync="auto",
             tokens=16):
    """Build a model of `layers` layers (with the named parameters frozen), run one GraphedStep._step with the
    stand-ins, and return what the checks need: (model, optimizer, step, sync, stream, updates, problems)."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)   # GraphedStep's own side stream
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_dim=32, num_layers=layers, num_heads=2,
                                  intermediate_size=64, max_seq_len=16))
    for name, param in model.named_parameters():
        param.requires_grad_(not any(name.startswith(prefix) for prefix in frozen))
    model.use_triton_adamw = triton_adamw
    optimizer = model.configure_optimizer(TrainConfig())
    names = {id(p): name for name, p in model.named_parameters()}
    updated, problems, updates = set(), [], []

    def main_stream_reads(param):
        stream = model.weight_grad_stream
        if stream is not None and stream.read_too_early(param):
            problems.append(f"gradient of {names[id(param)]} read on the main stream before it joined the second")

    sync = AllReduceStandIn(main_stream_reads) if data_parallel else None
    if sync is not None:
        sync.table = model.embed_tokens.weight

    def gemm_writes(weight):
        if id(weight) in updated:
            problems.append(f"gradient of {names[id(weight)]} written after its update")

    def use_stream(enabled=True, sixteen_bit_gradients=False, sixteen_bit_head_gradient=True):   # float32 .grad only
        model.weight_grad_stream = StreamStandIn(gemm_writes) if enabled else None
        for projection in model.projections:
            if projection is not model.lm_head:
                projection.weight_grad_stream = model.weight_grad_stream
    monkeypatch.setattr(model, "use_weight_gradient_stream", use_stream)

    def update(params):
        for param in params:
            if param.grad is None:
                continue
            main_stream_reads(param)
            stream = model.weight_grad_stream
            if stream is not None and stream.on_second_stream and id(param) in stream.unwaited_reads:
                problems.append(f"{names[id(param)]} updated on the second stream before it waited for the main "
                                f"stream's read of it")
            if sync is not None:
                handle = sync.handles.get(id(param))   # None: summed synchronously (sum_)
                if sync.counts.get(id(param)) != 1 or (handle is not None and not handle.waited):
                    problems.append(f"{names[id(param)]} updated before its gradient was summed and waited for")
            updated.add(id(param))

    if triton_adamw:
        def step_groups(indices):
            for index in indices:
                updates.append(index)
                update(optimizer.param_groups[index]["params"])
        monkeypatch.setattr(optimizer, "step_groups", step_groups)
    else:
        def step(closure=None):
            updates.append(0)
            update(list(model.parameters()))
        monkeypatch.setattr(optimizer, "step", step)

    def unpack(saved):   # the backward pass reads a saved tensor: a weight must not have been updated yet
        for param in model.parameters():
            if saved is param and id(param) in updated:
                problems.append(f"{names[id(param)]} read by the backward pass after its update")
            if saved is param and model.weight_grad_stream is not None:
                model.weight_grad_stream.unwaited_reads.add(id(param))
        return saved

    step = graphed_step.GraphedStep(model, optimizer, torch.device("cpu"), TrainConfig(),
                                    weight_gradient_stream=second_stream, gradient_sync=sync,
                                    embedding_grad_sync=embedding_grad_sync)
    ids = torch.randint(0, 64, (tokens // 8, 8))
    with torch.autograd.graph.saved_tensors_hooks(lambda saved: saved, unpack):
        step._step(ids, ids)
    stream = model.weight_grad_stream
    if stream is not None and stream.work_since_join:
        problems.append("the step ended before the main stream joined the second stream")
    return model, optimizer, step, sync, stream, updates, problems


def assert_summed_once_and_waited(model, sync):
    with_gradients = {id(p) for p in model.parameters() if p.grad is not None}
    assert set(sync.counts) == with_gradients and set(sync.counts.values()) == {1}
    assert all(handle.waited for handle in sync.handles.values())


@pytest.mark.parametrize("layers, data_parallel, second_stream, triton_adamw", CASES, ids=CASE_IDS)
def test_one_step_updates_and_sums_everything_once_in_a_safe_order(layers, data_parallel, second_stream,
                                                                    triton_adamw, monkeypatch):
    model, optimizer, step, sync, _, updates, problems = one_step(monkeypatch, layers, data_parallel,
                                                                  second_stream, triton_adamw)
    assert not problems, problems
    assert sorted(updates) == list(range(len(optimizer.param_groups)))   # every group once
    if data_parallel:
        assert_summed_once_and_waited(model, sync)
    if second_stream and triton_adamw:
        # The layer groups were updated inside the step's backward part, layer 0's too under data parallel
        # (beside the rest's update); in one process layer 0's waits for the rest.
        expected = {index for layer, index in step.layer_groups.items() if data_parallel or layer > 0}
        assert step.updated_groups == expected


@pytest.mark.parametrize("layers", [1, 3])
def test_under_data_parallel_each_layers_gradients_lie_in_one_buffer(layers, monkeypatch):
    """Under data parallel the second stream writes each layer's projection gradients one after another into one
    buffer of that layer and nothing else (the output head's gradient, which the loss computes, has its own), so
    that GradientAllReduce sums each layer with one collective and no memory is left unused."""
    from tinytransformer.gradient_sync import adjacent
    model, _, _, _, _, _, problems = one_step(monkeypatch, layers, True, True, True)
    assert not problems, problems
    for k in range(layers):
        grads = [p.grad for p in model.layer_projection_parameters(k) if p is not model.lm_head.weight]
        assert all(grad is not None for grad in grads) and adjacent(*grads), f"layer {k}"
        assert grads[0].untyped_storage().nbytes() == sum(grad.numel() * grad.element_size() for grad in grads)
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("triton_adamw", [True, False], ids=["triton", "torch"])
def test_a_layer_whose_hook_never_comes_is_summed_and_updated_after_the_join(triton_adamw, monkeypatch):
    """Layers 0 and 1, the embedding and layer 2's first norm frozen: the backward pass stops inside layer 2, so
    the hook that would announce layer 2's gradients never comes. Its projections' gradients, written on the
    second stream, must still be summed once, and read on the main stream only after the join."""
    frozen = ("embed_tokens.", "layers.0.", "layers.1.", "layers.2.attention_norm.")
    model, optimizer, step, sync, stream, updates, problems = one_step(monkeypatch, 3, True, True, triton_adamw,
                                                                       frozen=frozen)
    assert not problems, problems
    assert model.layers[2].attention.qkv_proj.weight.grad is not None and model.embed_tokens.weight.grad is None
    assert_summed_once_and_waited(model, sync)
    assert sorted(updates) == list(range(len(optimizer.param_groups)))


@pytest.mark.parametrize("embedding_grad_sync, tokens_per_rank, exchanged", [
    ("auto", 16, True),     # 2 ranks x 16 tokens <= 64 rows: the rows are exchanged
    ("auto", 48, False),    # 2 x 48 > 64: the table is all-reduced
    ("rows", 48, True), ("table", 16, False)])
def test_the_embedding_is_summed_once_by_rows_or_by_the_table(embedding_grad_sync, tokens_per_rank, exchanged,
                                                              monkeypatch):
    """The embedding's gradient is summed exactly once, by the row exchange inside its backward pass or by an
    all-reduce after it, never both; which one follows --embedding-grad-sync and the size rule."""
    model, optimizer, step, sync, _, updates, problems = one_step(monkeypatch, 2, True, True, True,
                                                                  embedding_grad_sync=embedding_grad_sync,
                                                                  tokens=tokens_per_rank)
    assert not problems, problems
    assert sync.exchanges == int(exchanged)
    assert_summed_once_and_waited(model, sync)
    assert sorted(updates) == list(range(len(optimizer.param_groups)))
    # Exchanged, the embedding is updated (its own group) before the norms, whose sums it need not wait for.
    norms_group = step.embedding_group - 1
    assert (updates.index(step.embedding_group) < updates.index(norms_group)) == exchanged
    assert model.embedding_row_exchange is None   # set for the step only


def test_a_layers_gradient_buffer_is_made_when_its_first_gradient_is_written():
    """graphed_step.LayerGradientBuffers makes a layer's buffer only when one of its weights asks (in the backward
    pass), hands out each piece once, and has nothing for a weight it was not given."""
    layers = [[torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))],
              [torch.nn.Parameter(torch.zeros(5))]]
    buffers = graphed_step.LayerGradientBuffers(layers)
    assert buffers.pieces == {}   # nothing allocated before the backward pass
    second = buffers.pop(id(layers[0][1]))
    assert second.shape == (4,) and set(buffers.pieces) == {id(layers[0][0])}   # layer 0's buffer only
    first = buffers.pop(id(layers[0][0]))
    assert first.shape == (2, 3) and first.data_ptr() + 6 * first.element_size() == second.data_ptr()
    assert buffers.pop(id(layers[0][0])) is None and buffers.pop(12345, "none") == "none"
    assert buffers.pop(id(layers[1][0])).shape == (5,)
