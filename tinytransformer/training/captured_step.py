"""A whole training step captured once in a CUDA/HIP graph and replayed: PyTorch's own "whole-network capture".

Where a step is small, the GPU finishes each kernel before Python has queued the next one: the step's time is the
host's time to launch it. torch.compile's reduce-overhead mode replays the forward and the backward pass from
graphs, but Python still runs around them (its wrappers, the autograd engine, the optimizer step), and at the seed
size that Python is most of the step. Capturing everything - forward, backward and the optimizer step - in ONE graph
leaves one replay call per step. Version 2 offers it as --cuda-graph (with or without torch.compile's default
mode); version 4's own step (graphed_step.py there) goes further and overlaps the parts of its step.

The rules a captured step must follow, and how this file follows them:
- Nothing may be allocated lazily during the capture: the first `warmup_steps` steps run eagerly on a side stream
  (they are real training steps; their losses count), which creates the optimizer state, cuBLAS workspaces and any
  torch.compile code before the capture.
- The graph reads fixed addresses: each batch is copied into the graph's input buffers; the gradients are
  allocated once in the graph's memory pool and overwritten in place by every replay.
- Whatever changes between steps must live on the device: the optimizer must be `capturable` (its step counter a
  tensor) and a learning-rate schedule must write a tensor (schedule.make_learning_rate_a_tensor).
- No host decision inside the step: float16 AMP's GradScaler decides on the host whether to skip a step, so that
  configuration runs the eager step (captures_step says which).
"""
from __future__ import annotations

import torch

from tinytransformer.profiling.ranges import profile_range


def captures_step(args, device: torch.device) -> bool:
    """True where --cuda-graph asks for the captured step and it can run: on a GPU, without float16's GradScaler."""
    float16_amp = getattr(args, "use_amp", False) and getattr(args, "amp_dtype", None) == "float16"
    return device.type == "cuda" and bool(getattr(args, "cuda_graph", False)) and not float16_amp


class GraphReplayedStep:
    """What every graph-captured step shares (this file's CapturedStep, version 4's GraphedStep): `warmup_steps`
    eager steps on a side stream, then one capture of `_step` by the subclass's `_capture` (which fills
    static_inputs, static_targets, static_loss and graph), then a copy of each batch into the graph's input
    buffers and a replay per call."""

    supports_breakdown = False   # one replay: there are no phases to put marks between

    def __init__(self, model, optimizer, device, train, warmup_steps: int = 3):
        if warmup_steps < 1:
            raise ValueError("a captured step needs at least one eager step first (the optimizer state)")
        self.model, self.optimizer, self.device = model, optimizer, device
        self.autocast_dtype = getattr(torch, train.amp_dtype) if train.use_amp else None
        self.warmup_steps, self.calls = warmup_steps, 0
        self.graph = None
        self.side_stream = torch.cuda.Stream(device)

    def _step(self, inputs, targets):
        raise NotImplementedError

    def _capture(self, inputs, targets):
        raise NotImplementedError

    def __call__(self, inputs, targets):
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return eager_step_before_capture(self.side_stream, self.device, self.optimizer, self._step, inputs,
                                             targets)
        if self.graph is None:
            self._capture(inputs, targets)   # recording does not run the step: the replay below does
        self.static_inputs.copy_(inputs)
        self.static_targets.copy_(targets)
        self.graph.replay()
        return self.static_loss


class CapturedStep(GraphReplayedStep):
    """forward -> backward -> optimizer.step(), captured in one graph after `warmup_steps` eager steps."""

    def _step(self, inputs, targets):
        # cache_enabled=False: autocast's cache of weight casts would hold tensors made outside the graph.
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None, cache_enabled=False):
            with profile_range("forward"):
                _, loss = self.model(inputs, targets)
        with profile_range("backward"):
            loss.backward()
        with profile_range("optimizer"):
            self.optimizer.step()
        return loss.detach()

    def _capture(self, inputs, targets):
        # The graph's input buffers keep the batch's strides (the targets are a view shifted by one token):
        # torch.compile's code guards on strides, and different ones would make it recompile during capture.
        self.static_inputs, self.static_targets = _same_layout(inputs), _same_layout(targets)
        # Gradients set to None: the captured backward pass allocates them in the graph's pool, and every replay
        # writes them there again, so no zero_grad is needed inside the graph.
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        # Captured on the warm-up steps' stream: torch.compile's code may guard on the current stream, and a
        # recompilation during capture would fail (compiling copies to and from the host). Should anything
        # else make it recompile, error_on_recompile says why in one message instead of a CUDA capture error.
        with torch._dynamo.config.patch(error_on_recompile=True), \
                torch.cuda.graph(self.graph, stream=self.side_stream):
            self.static_loss = self._step(self.static_inputs, self.static_targets)


def eager_step_before_capture(side_stream, device, optimizer, step, inputs, targets):
    """One eager training step (gradients cleared, then `step(inputs, targets)`) on `side_stream`, ordered after
    the current stream's work and before its later work: graph capture requires the work before it to run on a
    side stream (PyTorch's CUDA graphs notes). Used by every graph-captured step (this file's, version 4's)."""
    side_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side_stream):
        optimizer.zero_grad(set_to_none=True)
        loss = step(inputs, targets)
    torch.cuda.current_stream(device).wait_stream(side_stream)
    return loss


def _same_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor with the size, strides and values of `tensor` (clone() makes a non-dense view contiguous)."""
    copy = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    return copy.copy_(tensor)


def make_step(model, optimizer, device, train, args, gradient_sync=None):
    """A VersionSpec.make_step hook: the captured step where captures_step says so, else None (the harness's
    eager step). gradient_sync is never given: the spec has no averages_gradients hook, so under data parallel
    the harness wraps the model in DDP and distributed.graph_capture_note has switched --cuda-graph off."""
    if captures_step(args, device):
        return CapturedStep(model, optimizer, device, train, warmup_steps=args.graph_warmup_steps)
    return None
