"""Version 4's training step: forward + backward + optimizer captured once in a CUDA/HIP graph and replayed
(item 9 of tiny_llama_v4.py's docstring). The harness reaches it through version 4's VersionSpec: make_step
below is the spec's make_step hook, as the other step strategies are reached through theirs.
"""
import torch

from tinytransformer.profiling.ranges import profile_range
from tinytransformer.training.step import EagerStep


def uses_graph(args, device) -> bool:
    # GradScaler (float16 AMP) makes host-side decisions every step, which a replayed graph cannot.
    return device.type == "cuda" and args.cuda_graph and not (args.use_amp and args.amp_dtype == "float16")


class GraphedStep:
    """forward + backward + optimizer captured once in a CUDA/HIP graph, then replayed every step.

    The first `warmup_steps` steps run eagerly on a side stream: they are real training steps (their losses
    count) and they make every lazy allocation (optimizer state, cuBLAS workspaces, Triton compilation) happen
    before the capture, as graph capture requires. Then the step is captured reading its batch from static
    buffers; each later call copies the batch in and replays the graph. The loss stays on the device: the
    trainer reads it only when it prints. With `weight_gradient_stream` (the default) the graph holds two
    streams: the projections' weight-gradient GEMMs run beside the rest of the backward pass (this switches the
    model's WeightGradientStream on or off).

    Under torchrun (DDP), `gradient_sync` (tinytransformer/gradient_sync.py) averages the gradients over the ranks
    inside the step, so the graph captures the all-reduces too; the model is not wrapped in DDP, whose hooks
    would miss the gradients the weight-gradient stream writes. The loss is scaled by 1/ranks before backward and
    the gradients are summed. With the weight-gradient stream, layer by layer during the backward pass: once the
    pass has queued layer k's weight-gradient GEMMs (the model's layer_gradients_queued hook), the all-reduces
    of layer k's projection weights start on the second stream after them, and run while the layers below
    compute theirs, as DDP's gradient buckets do. (At the medium preset the projections and the output head are
    85% of the parameters; all-reduced after the backward pass, they cost a two-GPU step ~4 ms of its ~29.) The
    early update (below) waits for those all-reduces before it updates the first group. The embedding's and the
    norms' all-reduces start on the main stream as soon as backward() returns, beside the second stream's last
    work; layer 0's projections are summed after the join. The eager warm-up steps take the
    same path: their all-reduces are real, and they set NCCL's communication up before the capture
    (check_arguments requires --graph-warmup-steps >= 1).
    """

    supports_breakdown = False

    def __init__(self, model, optimizer, device, train, warmup_steps: int = 3, weight_gradient_stream=True,
                 gradient_sync=None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.gradient_sync = gradient_sync
        model.use_weight_gradient_stream(weight_gradient_stream)
        self.autocast_dtype = getattr(torch, train.amp_dtype) if train.use_amp else None
        self.warmup_steps, self.calls = warmup_steps, 0
        self.graph = None
        self.side_stream = torch.cuda.Stream(device)
        # With the second stream and TritonAdamW's two groups, the first group (the weights of layers 1 and up,
        # and the output head) is updated on the second stream while the main stream still runs layer 0's
        # backward: that part of the optimizer no longer waits for the end of the backward pass.
        self.updates_early = (weight_gradient_stream and hasattr(optimizer, "step_groups")
                              and len(optimizer.param_groups) > 1)
        # Layer-by-layer all-reduces need the second stream: only there are a layer's weight gradients known to
        # be queued when the backward pass leaves the layer (autograd accumulates its own when it sees fit).
        self.sums_by_layer = gradient_sync is not None and weight_gradient_stream
        self.started_sums, self.summed_params = [], set()   # this step's all-reduce handles and their params

    def _sum_gradients(self, group_indices) -> None:
        """Under data parallel: these groups' gradients summed over the ranks (already scaled by 1/ranks), on the
        current stream: those no layer started (_start_layer_sums), then a wait for those that were."""
        if self.gradient_sync is not None:
            for index in group_indices:
                params = self.optimizer.param_groups[index]["params"]
                self.gradient_sync.sum_(p for p in params if id(p) not in self.summed_params)
            self.gradient_sync.finish(self.started_sums)

    def _start_layer_sums(self, k: int) -> None:
        # Called by the backward pass once layer k's weight-gradient GEMMs are queued on the second stream: the
        # all-reduces of those gradients start there, after the GEMMs, without holding up the GEMMs queued later.
        params = self.model.layer_projection_parameters(k)

        def start():
            # Only gradients that exist now are started (all of them: the stream set each .grad as it queued
            # its GEMM); any other is left to the sums after the backward pass, so none is ever skipped.
            started = [p for p in params if p.grad is not None]
            self.summed_params.update(id(p) for p in started)
            self.started_sums += self.gradient_sync.start_sum(started)
        self.model.weight_grad_stream.run_after_queued(start)

    def _start_main_stream_sums(self) -> None:
        # Called once backward() has returned: the main stream has queued the gradients autograd computes itself
        # (the embedding's, the norms'), while the weight-gradient stream may still be busy with the early update
        # and layer 0's GEMMs. Those gradients' all-reduces start now, beside that work, instead of after the join;
        # layer 0's projections (written by the second stream) are left to the sums after it.
        on_second_stream = {id(p) for p in self.model.layer_projection_parameters(0)}
        ready = [p for p in self.model.parameters() if p.grad is not None
                 and id(p) not in self.summed_params and id(p) not in on_second_stream]
        self.summed_params.update(id(p) for p in ready)
        self.started_sums += self.gradient_sync.start_sum(ready)

    def _update_first_group(self):
        # On the weight-gradient stream, after its GEMMs: the first group's all-reduces (or the wait for those the
        # layers started), then its update, both beside layer 0's backward pass on the main stream.
        def sum_and_update():
            self._sum_gradients([0])
            self.optimizer.step_groups([0])
        self.model.weight_grad_stream.run_after_queued(sum_and_update)

    def _step(self, inputs, targets):
        # The model calls back during the backward pass of THIS step only: set for the step, then removed, so
        # that no other backward pass through the model (an eager step, a check) updates the first group.
        self.model.early_update = self._update_first_group if self.updates_early else None
        self.model.layer_gradients_queued = self._start_layer_sums if self.sums_by_layer else None
        self.started_sums, self.summed_params = [], set()
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
                    self._start_main_stream_sums()
                self.model.join_weight_gradients()   # with the second stream: its GEMMs finish before the optimizer
        finally:
            self.model.early_update = self.model.layer_gradients_queued = None
        with profile_range("optimizer"):
            if self.updates_early:   # the first group was summed and updated during the backward pass
                rest = range(1, len(self.optimizer.param_groups))
                self._sum_gradients(rest)
                self.optimizer.step_groups(rest)
            else:
                self._sum_gradients(range(len(self.optimizer.param_groups)))
                self.optimizer.step()
        return loss.detach()

    def _capture(self, inputs, targets):
        self.static_inputs, self.static_targets = inputs.clone(), targets.clone()
        self.graph = torch.cuda.CUDAGraph()
        # Gradients set to None: the captured backward allocates them in the graph's memory pool and every
        # replay overwrites them in place, so no zero_grad is needed inside the graph.
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self.static_loss = self._step(self.static_inputs, self.static_targets)
        if hasattr(self.optimizer, "finish_capture"):   # TritonAdamW: the graph's gradient addresses
            self.optimizer.finish_capture()

    def __call__(self, inputs, targets):
        self.calls += 1
        if self.calls <= self.warmup_steps:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._step(inputs, targets)
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            return loss
        if self.graph is None:
            self._capture(inputs, targets)   # recording does not execute: the replay below runs this step
        self.static_inputs.copy_(inputs)
        self.static_targets.copy_(targets)
        self.graph.replay()
        return self.static_loss


def make_step(model, optimizer, device, train, args, gradient_sync=None):
    """Version 4's make_step hook. gradient_sync comes only where uses_graph says True (version 4's
    averages_gradients hook): under DDP otherwise, the model arrives wrapped and the eager step needs none."""
    if uses_graph(args, device):
        return GraphedStep(model, optimizer, device, train, warmup_steps=args.graph_warmup_steps,
                           weight_gradient_stream=args.weight_grad_stream, gradient_sync=gradient_sync)
    return EagerStep(model, optimizer, device, train)
