"""Version 4's training step: forward + backward + optimizer captured once in a CUDA/HIP graph and replayed
(item 9 of tiny_llama_v4.py's docstring). The harness reaches it through version 4's VersionSpec: make_step
below is the spec's make_step hook, as the other step strategies are reached through theirs.
"""
import torch

from tinytransformer.device import release
from tinytransformer.gradient_sync import rows_cheaper_than_table
from tinytransformer.profiling.ranges import profile_range
from tinytransformer.training.captured_step import GraphReplayedStep, captures_step
from tinytransformer.training.step import EagerStep

# The main stream's priority in the captured step (GraphedStep.capture_stream). CUDA counts down: 0, every stream's
# default and the second stream's, is the lowest; -1 is above it. Under torchrun the collectives' high-priority
# stream (distributed.nccl_options) stays above both: PyTorch gives it the top of its range, -3 where the device
# allows (unless TORCH_NCCL_HIGH_PRIORITY=0: then it sits with the second stream). What it buys, per preset:
# version 4's MEASUREMENTS.md, "The critical path first".
CAPTURE_PRIORITY = -1

# The first PyTorch release whose CUDA graphs run each kernel at the priority it was captured with.
NODE_PRIORITY_TORCH = (2, 10)


def graph_priorities_apply() -> bool:
    """Whether this PyTorch build's replayed graphs run each kernel at the priority of the stream it was captured
    on (node_priorities_in)."""
    return node_priorities_in(torch.__version__, torch.version.hip)


def node_priorities_in(torch_version: str, hip_version) -> bool:
    """On CUDA from PyTorch 2.10, which instantiates graphs with cudaGraphInstantiateFlagUseNodePriority (before it,
    every kernel of a replay ran at the launching stream's priority); not on ROCm (hip_version set), where PyTorch
    instantiates HIP graphs without that flag."""
    return hip_version is None and release(torch_version) >= NODE_PRIORITY_TORCH


# --embedding-grad-sync: how the embedding's gradient is summed over the ranks (GraphedStep._embedding_row_exchange).
EMBEDDING_GRAD_SYNC = ("auto", "rows", "table")


def exchanges_embedding_rows(mode: str, world_size: int, tokens_per_rank: int, vocab_size: int) -> bool:
    """--embedding-grad-sync's rule: whether the embedding's gradient is summed by exchanging rows ("rows" always,
    "auto" while gradient_sync.rows_cheaper_than_table says so) rather than by all-reducing the table."""
    return mode == "rows" or (mode == "auto" and rows_cheaper_than_table(world_size, tokens_per_rank, vocab_size))


def writes_sixteen_bit_weight_gradients(requested: bool, on_second_stream: bool, summed_across_ranks: bool,
                                        optimizer_reads_them: bool) -> bool:
    """The one rule for the graph-captured step's 16-bit weight gradients under autocast, which GraphedStep follows
    and the run's header states. The second stream writes the projections' weight gradients in their GEMMs' 16-bit
    dtype only where all four hold: they were asked for (no --float32-weight-grads), that stream computes the weight
    gradients, no all-reduce has to sum them (gradient_sync sums float32 .grad), and the optimizer reads them from
    the model's dict (TritonAdamW from configure_optimizer)."""
    return requested and on_second_stream and not summed_across_ranks and optimizer_reads_them


def uses_graph(args, device) -> bool:
    """The same rule as version 2's --cuda-graph: on a GPU, unless float16 AMP's GradScaler makes host-side
    decisions every step, which a replayed graph cannot."""
    return captures_step(args, device)


class GraphedStep(GraphReplayedStep):
    """forward + backward + optimizer captured once in a CUDA/HIP graph, then replayed every step.

    The first `warmup_steps` steps run eagerly on a side stream: they are real training steps (their losses
    count) and they make every lazy allocation (optimizer state, cuBLAS workspaces, Triton compilation) happen
    before the capture, as graph capture requires. Then the step is captured reading its batch from static
    buffers; each later call copies the batch in and replays the graph. The loss stays on the device: the
    trainer reads it only when it prints. With `weight_gradient_stream` (the default) the graph holds two
    streams: the projections' weight-gradient GEMMs run beside the rest of the backward pass (this switches the
    model's WeightGradientStream on or off); with `sixteen_bit_weight_gradients` (the default) that stream writes
    them, under autocast, in the GEMMs' 16-bit dtype, for TritonAdamW to read as they are (not under data
    parallel, whose all-reduces sum float32 gradients), and under bfloat16 the fused loss sums the output head's in
    bfloat16 beside them (unless `sixteen_bit_head_gradient` is False). With `main_stream_first` (the default) the
    main stream's kernels are captured at a higher priority than the second stream's (CAPTURE_PRIORITY): where both
    have kernels waiting for an SM, the block scheduler starts the main stream's, the critical path, first.

    The optimizer runs mostly inside the backward pass. TritonAdamW gets one parameter group per layer from the
    last down to layer 0 (the output head with the last), then the rest (the norms, then the embedding in a group of
    its own): model.configure_optimizer tags each group with its layer. Once the backward pass has queued layer k's
    weight-gradient GEMMs (the model's layer_gradients_queued hook), the second stream updates layer k+1's
    weights, whose gradients are complete and which no later part of the backward pass reads; layer 1's are
    updated when only layer 0's backward is left (the model's early_update hook). So the update of ~79% of the
    parameters at the medium preset runs beside the backward pass instead of after it; the rest is updated after
    the backward pass. (One layer late: under data parallel the update of layer k+1 waits for its all-reduces,
    which then have had layer k's weight GEMMs to finish. Layer 1's would have had nothing to hide behind, so
    under data parallel it is updated once backward() has returned, after layer 0's GEMMs.)

    Under torchrun (DDP), `gradient_sync` (tinytransformer/gradient_sync.py) averages the gradients over the ranks
    inside the step, so the graph captures the all-reduces too; the model is not wrapped in DDP, whose hooks
    would miss the gradients the weight-gradient stream writes. The loss is scaled by 1/ranks before backward and
    the gradients are summed, as early as each is complete: layer k's projection weights (with the last layer,
    the output head) on the second stream right after their GEMMs, at the same hook, while the layers below
    compute theirs, as DDP's gradient buckets do; once backward() has returned, layer 0's projections on the second
    stream after their GEMMs, then the embedding's and the norms' (the norms' in one buffer) on the main stream.
    A layer's projection gradients are written into one buffer of that layer (LayerGradientBuffers), so that each
    layer is summed by one all-reduce, not four.
    The second stream updates layers 1 and 0 (layer 0's once its sums are done, beside the embedding's
    all-reduce), the main stream the embedding and the norms once theirs are, and only then joins the second
    stream: the tail after the backward pass is layer 0's all-reduces, the embedding's (or its rows' exchange,
    below) and its update.
    The eager warm-up steps take the same path: their all-reduces are real, and they set NCCL's communication up
    before the capture (check_arguments requires --graph-warmup-steps >= 1).

    The embedding's gradient, the largest (32,000 x 1,024 floats at the medium preset) and the last the backward
    pass computes, can be summed another way, which moves less where ranks x tokens per rank is below the
    vocabulary size (`embedding_grad_sync` "rows", or "auto", the default, for the rule of
    gradient_sync.rows_cheaper_than_table; "table" all-reduces it): the ranks gather each other's token ids
    (during the forward pass) and rows of gradient (at the end of the backward pass), and every rank adds all of them, in a fixed order, into
    its table's gradient, which then comes out of the backward pass summed (EmbeddingRMSNormFunction in
    kernels/add_rmsnorm.py); its update (a TritonAdamW group of its own) starts at once, while layer 0's and the
    norms' all-reduces run: the tail shrinks to the rows' gather, their addition and the update.
    """

    def __init__(self, model, optimizer, device, train, warmup_steps: int = 3, weight_gradient_stream=True,
                 gradient_sync=None, embedding_grad_sync: str = "auto", main_stream_first: bool = True,
                 sixteen_bit_weight_gradients: bool = True, sixteen_bit_head_gradient: bool = True):
        super().__init__(model, optimizer, device, train, warmup_steps)
        self.main_stream_first = main_stream_first
        if embedding_grad_sync not in EMBEDDING_GRAD_SYNC:
            raise ValueError(f"embedding_grad_sync must be one of {EMBEDDING_GRAD_SYNC}, got {embedding_grad_sync!r}")
        self.gradient_sync = gradient_sync
        self.embedding_grad_sync = embedding_grad_sync
        reads_them = getattr(optimizer, "sixteen_bit_gradients", None) is model.sixteen_bit_gradients
        self.sixteen_bit_weight_gradients = writes_sixteen_bit_weight_gradients(
            sixteen_bit_weight_gradients, weight_gradient_stream, summed_across_ranks=gradient_sync is not None,
            optimizer_reads_them=reads_them)
        model.use_weight_gradient_stream(weight_gradient_stream,
                                         sixteen_bit_gradients=self.sixteen_bit_weight_gradients,
                                         sixteen_bit_head_gradient=sixteen_bit_head_gradient)
        # Layer k -> the index of the optimizer group holding its weights (TritonAdamW from configure_optimizer).
        # Updating during the backward pass needs the second stream, where a layer's weight gradients are known
        # to be queued when the backward pass leaves the layer (autograd accumulates its own when it sees fit).
        self.layer_groups = {group["layer"]: index for index, group in enumerate(optimizer.param_groups)
                             if group.get("layer") is not None}
        self.embedding_group = next((index for index, group in enumerate(optimizer.param_groups)
                                     if group.get("embedding")), None)
        self.updates_early = weight_gradient_stream and hasattr(optimizer, "step_groups") and bool(self.layer_groups)
        self.sums_by_layer = gradient_sync is not None and weight_gradient_stream
        self.layer_sums, self.main_sums = {}, []   # this step's all-reduce handles: per layer, main stream's
        self.summed_params = set()                 # the parameters whose all-reduces have started this step
        self.updated_groups = set()                # the groups updated during this step's backward pass

    def _embedding_row_exchange(self, inputs):
        """The EmbeddingRowExchange this step's embedding backward sums with, or None (summed by all-reduce, or
        no data parallel)."""
        if self.gradient_sync is None:
            return None
        table = self.model.embed_tokens.weight
        if table.dtype != torch.float32 or not table.requires_grad:
            return None   # the fused lookup's backward (which exchanges) needs a float32 table to train
        if not exchanges_embedding_rows(self.embedding_grad_sync, self.gradient_sync.world_size, inputs.numel(),
                                        table.shape[0]):
            return None
        return self.gradient_sync.row_exchange()

    def _layer_gradient_buffers(self) -> "LayerGradientBuffers":
        """Under data parallel: where the second stream writes each layer's projection gradients (the output head
        is left out: the loss computes its gradient, which autograd then hands over)."""
        written_on_second_stream = {id(m.weight) for m in self.model.projections if m.weight_grad_stream is not None}
        return LayerGradientBuffers([[p for p in self.model.layer_projection_parameters(k)
                                      if id(p) in written_on_second_stream and p.requires_grad and p.grad is None]
                                     for k in range(len(self.model.layers))])

    def _start_sums(self, params) -> list:
        started = [p for p in params if p.grad is not None and id(p) not in self.summed_params]
        self.summed_params.update(id(p) for p in started)
        return self.gradient_sync.start_sum(started)

    def _sum_and_finish(self, params, handles) -> None:
        """On the current stream: all-reduce those of params no hook started (none is ever skipped), then wait
        for the handles of those that were."""
        self.gradient_sync.sum_(p for p in params if id(p) not in self.summed_params)
        self.summed_params.update(id(p) for p in params)
        self.gradient_sync.finish(handles)

    def _update_layer(self, k: int) -> None:
        # On the second stream: layer k's weights, once their all-reduces (under data parallel) are done.
        index = self.layer_groups[k]
        if self.gradient_sync is not None:
            self._sum_and_finish(self.optimizer.param_groups[index]["params"], self.layer_sums.pop(k, []))
        self.optimizer.step_groups([index])
        self.updated_groups.add(index)

    def _layer_gradients_queued(self, k: int) -> None:
        # Called by the backward pass once layer k's weight-gradient GEMMs are queued on the second stream: there,
        # after them, layer k's all-reduces start and layer k+1 (if any) is updated.
        def work():
            if self.sums_by_layer:
                self.layer_sums[k] = self._start_sums(self.model.layer_projection_parameters(k))
            if self.updates_early and k + 1 in self.layer_groups:
                self._update_layer(k + 1)
        self.model.weight_grad_stream.run_after_queued(work)

    def _update_layer_one(self) -> None:
        # Layer 1's weights, on the second stream after everything queued so far: called when only layer 0's
        # backward is left. Under data parallel _sum_and_update_bottom_layers updates it instead.
        self.model.weight_grad_stream.run_after_queued(lambda: self._update_layer(1))

    def _sum_and_update_bottom_layers(self) -> None:
        """Under data parallel, once backward() has returned: on the second stream, after layer 0's weight GEMMs,
        start layer 0's all-reduces, update layer 1 (whose sums finished during layer 0's backward) and, once its
        sums are done, layer 0, while the embedding's and the norms' all-reduces (started next, so queued after
        layer 0's) run. The main stream then updates the embedding and the norms (the optimizer step's rest) once
        their sums are done (the embedding at once if its rows were exchanged), instead of one update of everything
        left after all of the sums."""
        def work():
            # Layer 0's, and those of any layer whose hook never came (the layers below it frozen): every gradient
            # the second stream writes (and the output head's) is summed on it.
            self.layer_sums[0] = self._start_sums(self._second_stream_parameters())
            for k in (1, 0):   # layer 1's all-reduces have had layer 0's weight GEMMs to finish
                if self.updates_early and k in self.layer_groups:
                    self._update_layer(k)
        self.model.weight_grad_stream.run_after_queued(work)

    def _second_stream_parameters(self) -> list:
        """The parameters summed on the second stream, layer 0's first: every layer's projections, whose gradients
        it writes, and with the last layer the output head, whose gradient the loss computed first."""
        return [p for k in range(len(self.model.layers)) for p in self.model.layer_projection_parameters(k)]

    def _start_main_stream_sums(self) -> None:
        # backward() has returned: the main stream has queued the gradients autograd computes itself (the
        # embedding's, the norms'). The projections' are written by the second stream, and summed there
        # (_layer_gradients_queued, _sum_and_update_bottom_layers): the main stream has not joined it yet.
        on_second_stream = {id(p) for p in self._second_stream_parameters()}
        self.main_sums = self._start_sums(p for p in self.model.parameters() if id(p) not in on_second_stream)

    def _finish_after_backward(self, group_indices) -> None:
        """Under data parallel, on the main stream: these groups' gradients all summed (the projections' were
        started on the second stream, which the main stream has joined if any of these groups holds them)."""
        if self.gradient_sync is None:
            return
        params = [p for index in group_indices for p in self.optimizer.param_groups[index]["params"]]
        handles = self.main_sums + [h for k in sorted(self.layer_sums) for h in self.layer_sums[k]]
        self._sum_and_finish(params, handles)
        self.layer_sums.clear()

    def _step(self, inputs, targets):
        # The model calls back during the backward pass of THIS step only: set for the step, then removed, so
        # that no other backward pass through the model (an eager step, a check) updates or sums anything.
        hooked = self.updates_early or self.sums_by_layer
        # Under data parallel with early updates, the main stream updates the rest before it joins the second
        # stream, which meanwhile sums and updates layers 1 and 0 (_sum_and_update_bottom_layers).
        joins_after_rest = self.sums_by_layer and self.updates_early
        self.model.early_update = self._update_layer_one if self.updates_early and not joins_after_rest else None
        self.model.layer_gradients_queued = self._layer_gradients_queued if hooked else None
        self.layer_sums, self.main_sums, self.summed_params, self.updated_groups = {}, [], set(), set()
        self.model.embedding_row_exchange = self._embedding_row_exchange(inputs)
        exchanged = self.model.embedding_row_exchange is not None
        if self.sums_by_layer:
            self.model.weight_grad_stream.gradient_slots = self._layer_gradient_buffers()
        if exchanged:   # its backward sums the embedding's gradient itself
            self.summed_params.add(id(self.model.embed_tokens.weight))
        try:
            # cache_enabled=False: autocast's weight-cast cache would hold tensors created outside the graph.
            with torch.autocast("cuda", dtype=self.autocast_dtype or torch.bfloat16,
                                enabled=self.autocast_dtype is not None, cache_enabled=False):
                with profile_range("forward"):
                    _, loss = self.model(inputs, targets)
            with profile_range("backward"):
                # Under data parallel the gradients come out divided by the number of ranks, so that their sum
                # over the ranks is the average (gradient_sync.py); at one rank the scale is exactly 1.
                (loss * self.gradient_sync.loss_scale if self.gradient_sync is not None else loss).backward()
                if self.sums_by_layer:
                    # Layer 0's all-reduces first, then the norms' and (unless the row exchange summed it) the
                    # embedding's: the longest, it then runs while layer 0 is updated.
                    self._sum_and_update_bottom_layers()
                    self._start_main_stream_sums()
                if not joins_after_rest:
                    self.model.join_weight_gradients()   # the second stream's GEMMs finish before the optimizer
        finally:
            self.model.early_update = self.model.layer_gradients_queued = self.model.embedding_row_exchange = None
            if self.sums_by_layer:
                # Pieces never written (a backward pass that stopped before their layer) are let go.
                self.model.weight_grad_stream.gradient_slots = {}
        with profile_range("optimizer"):
            # The groups the backward pass did not update: the rest, and any layer whose hook never came (a
            # backward pass that stops early, e.g. with the layers below frozen, leaves them to this point).
            rest = [index for index in range(len(self.optimizer.param_groups)) if index not in self.updated_groups]
            if joins_after_rest and any(index in self.layer_groups.values() for index in rest):
                self.model.join_weight_gradients()   # a layer left to here: its gradients come from the second stream
            if exchanged and self.updated_groups and self.embedding_group in rest:
                # Summed already (the row exchange): updated while the norms' and layer 0's sums run.
                rest.remove(self.embedding_group)
                self.optimizer.step_groups([self.embedding_group])
            self._finish_after_backward(rest)   # the updated groups' sums were finished before their updates
            if self.updated_groups:
                self.optimizer.step_groups(rest)
            else:
                self.optimizer.step()
            if joins_after_rest:
                self.model.join_weight_gradients()   # layers 1 and 0, updated on the second stream beside the rest
        return loss.detach()

    def capture_stream(self):
        """The stream the step is captured on: one of priority CAPTURE_PRIORITY with main_stream_first (on CUDA),
        else None (torch.cuda.graph's own, of the default priority, the second stream's).

        A captured kernel keeps the priority of the stream it was captured on, and PyTorch instantiates CUDA graphs
        to run each kernel at that priority (cudaGraphInstantiateFlagUseNodePriority). Priority decides only which
        waiting kernel's blocks the scheduler starts when an SM frees up; it stops nothing that is running. So the
        weight GEMMs and updates of the second stream fill what the main stream leaves free instead of taking SMs
        the next kernel of the backward pass waits for. Where the priority would not apply (ROCm, PyTorch before
        2.10: graph_priorities_apply), the step is captured as with equal priorities."""
        if not (self.main_stream_first and graph_priorities_apply()):
            return None
        return torch.cuda.Stream(self.device, priority=CAPTURE_PRIORITY)

    def _capture(self, inputs, targets):
        self.static_inputs, self.static_targets = inputs.clone(), targets.clone()
        self.graph = torch.cuda.CUDAGraph()
        # Gradients set to None: the captured backward allocates them in the graph's memory pool and every
        # replay overwrites them in place, so no zero_grad is needed inside the graph.
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph, stream=self.capture_stream()):
            self.static_loss = self._step(self.static_inputs, self.static_targets)
        if hasattr(self.optimizer, "finish_capture"):   # TritonAdamW: the graph's gradient addresses
            self.optimizer.finish_capture()


class LayerGradientBuffers:
    """WeightGradientStream.gradient_slots under data parallel: each layer's projection gradients as pieces of one
    flat buffer of that layer, so that the layer's all-reduce is one collective (GradientAllReduce sums adjacent
    gradients as one), as DDP's buckets are: a quarter of the collectives, each moving more.

    A layer's buffer is allocated when the first of its gradients is written, in the backward pass: there it can
    take memory the activations have freed, as the separate gradients did. Allocated when the step starts, all of
    the buffers would live beside the forward pass's activations and raise the step's peak (+600 MiB per GPU at
    the medium preset)."""

    def __init__(self, layers: list[list[torch.nn.Parameter]]):
        self.layer_of = {id(param): params for params in layers for param in params}
        self.pieces = {}   # id(weight) -> its piece, once its layer's buffer exists

    def pop(self, weight_id: int, default=None):
        """The piece for this weight's gradient (its layer's buffer made the first time one of its weights asks),
        or default for a weight that has none."""
        params = self.layer_of.get(weight_id)
        if weight_id not in self.pieces and params is not None:
            # The second stream writes float32 gradients of float32 weights only (WeightGradientStream.queue).
            flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            for param, piece in zip(params, flat.split([p.numel() for p in params])):
                self.pieces[id(param)] = piece.view_as(param)
                del self.layer_of[id(param)]
        return self.pieces.pop(weight_id, default)


def make_step(model, optimizer, device, train, args, gradient_sync=None):
    """Version 4's make_step hook. gradient_sync comes only where uses_graph says True (version 4's
    averages_gradients hook): under DDP otherwise, the model arrives wrapped and the eager step needs none."""
    if uses_graph(args, device):
        return GraphedStep(model, optimizer, device, train, warmup_steps=args.graph_warmup_steps,
                           weight_gradient_stream=args.weight_grad_stream, gradient_sync=gradient_sync,
                           embedding_grad_sync=args.embedding_grad_sync,
                           main_stream_first=not args.equal_stream_priority,
                           sixteen_bit_weight_gradients=args.sixteen_bit_weight_grads,
                           sixteen_bit_head_gradient=args.sixteen_bit_head_grad)
    return EagerStep(model, optimizer, device, train)
