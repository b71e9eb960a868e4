"""Which kernels a training step launches, with which launch configurations: recorded, not guessed.

For one target GPU and one size preset, each model path below is built on meta tensors (shapes and dtypes, no
data), and a whole training step (forward, backward, and version 4's Triton optimizer) runs with Triton's
launch (JITFunction.run) replaced by a recorder: the kernels' own Python code chooses block sizes, warps and
grids exactly as it would on that GPU (triton_support.use_known_gpu makes it answer from the target's published
limits), and the recorder keeps what Triton's compiler needs, nothing runs. Meta tensors and stand-ins keep what
specialisation depends on: the dtype and whether the address is a multiple of 16 bytes (a real allocation
starts aligned, so a view's alignment follows from its storage offset).

The step is the eager one: a CUDA/HIP-graph replay (version 4's GraphedStep) replays the launches of the same
eager step, so it needs no kernel and no configuration of its own. Stages 1 and 3 of version 3's
performance-debugging exercise launch version 3's kernels unchanged; stages 2 and 4 bring their own.

This must run in a process whose kernels were defined for the GPU, not for Triton's CPU interpreter: the
command (cli.py) removes TRITON_INTERPRET before the model modules are imported; tests start it as a process.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import sys
from pathlib import Path

import torch

from tinytransformer import triton_support
from tinytransformer.config import ModelConfig, TrainConfig, preset_settings

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch."""
    kernel: str        # the kernel function's name
    source: str        # its file, relative to the repository root
    path: str          # the model path that launched it ("v4", "v3 --stage 4", ...)
    fn: object         # the JITFunction
    args: tuple        # tensors replaced by TensorStandIn
    kwargs: dict       # constexprs and launch options (num_warps, num_stages)
    grid: tuple | None


class TensorStandIn:
    """What Triton's specialisation reads of a tensor argument: its dtype and its address (for alignment)."""

    ALIGNED_BASE = 1 << 20   # any multiple of 256: the caching allocators' blocks start at least that aligned

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._address = self.ALIGNED_BASE + tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


def _stand_in(value):
    return TensorStandIn(value) if isinstance(value, torch.Tensor) else value


def preset_configs(preset: str) -> tuple[ModelConfig, TrainConfig]:
    model, train = preset_settings(preset)
    config = ModelConfig(**model)
    config.validate()
    return config, TrainConfig(**train)


def import_versions():
    """The model modules of versions 3 and 4, with their kernels defined for a GPU (not the interpreter)."""
    os.environ.pop("TRITON_INTERPRET", None)
    if str(REPO) not in sys.path:   # the version directories are packages of the repository, not installed
        sys.path.insert(0, str(REPO))
    saved = triton_support.enable_interpreter_if_no_gpu
    triton_support.enable_interpreter_if_no_gpu = lambda verbose=False: False
    try:
        from version3_triton.exercises.performance_debugging import run_stage
        from version4_triton_ultra import tiny_llama_v4 as v4
        from version4_triton_ultra.kernels import embedding_backward
    finally:
        triton_support.enable_interpreter_if_no_gpu = saved
    from triton.runtime.jit import JITFunction
    if not isinstance(embedding_backward._embedding_backward_kernel, JITFunction):
        raise RuntimeError("the kernels were defined for Triton's CPU interpreter (TRITON_INTERPRET=1 at import); "
                           "run the kernel report in a process of its own")
    return run_stage, v4, embedding_backward


@contextlib.contextmanager
def recording(gpu, launches: list, path_name: list):
    """Within: Triton launches are recorded into `launches` (labelled path_name[0]), meta tensors stand in for
    `gpu`'s tensors, and autocast questions about the meta device are answered "off" (the presets train in
    float32; torch has no autocast for meta tensors)."""
    from triton.runtime.jit import JITFunction

    def record(self, *args, grid, warmup, **kwargs):
        source = Path(inspect.getsourcefile(self.fn)).resolve()
        launches.append(Launch(self.fn.__name__, source.relative_to(REPO).as_posix(), path_name[0], self,
                               tuple(_stand_in(a) for a in args), {k: _stand_in(v) for k, v in kwargs.items()},
                               None if callable(grid) else tuple(int(g) for g in grid)))

    saved = JITFunction.run, torch.is_autocast_enabled, torch.autocast
    autocast_enabled, autocast = saved[1], saved[2]
    JITFunction.run = record
    torch.is_autocast_enabled = lambda *a: False if a and str(a[0]) == "meta" else autocast_enabled(*a)
    torch.autocast = (lambda device_type, *a, **k: contextlib.nullcontext() if device_type == "meta"
                      else autocast(device_type, *a, **k))
    triton_support.use_known_gpu(gpu)
    try:
        with torch.device("meta"):
            yield
    finally:
        JITFunction.run, torch.is_autocast_enabled, torch.autocast = saved
        triton_support.use_known_gpu(None)


def _train_step(model, optimizer, train: TrainConfig):
    tokens = torch.zeros(train.batch_size, train.seq_len, dtype=torch.long)
    _, loss = model(tokens, tokens)
    loss.backward()
    if optimizer is not None:
        optimizer.step()


def model_paths(run_stage, v4, embedding_backward):
    """The ways a training run reaches Triton kernels: (label, function(config, train) that runs one step).
    Version 3 is reached through the performance-debugging exercise's run_stage.py: stage 5 is version 3 itself,
    stages 2 and 4 launch kernels of their own."""
    def v3_stage(stage):
        def step(config, train):
            _train_step(run_stage.build_model(config, argparse.Namespace(stage=stage)), None, train)
        return step   # version 3's optimizer is torch's AdamW: no Triton kernel

    def v4_model(rope_in_attention=False, separate_rope=None, separate_swiglu=None):   # None: the form by size
        def step(config, train):
            args = argparse.Namespace(cuda_graph=False, torch_adamw=False, rope_in_attention=rope_in_attention,
                                      separate_rope=separate_rope, separate_swiglu=separate_swiglu)
            model = v4.build_model(config, args)
            _train_step(model, model.configure_optimizer(train), train)
        return step

    def v4_embedding_backward(config, train):
        # The kernel the model uses when only the looked-up rows receive a gradient, or the table is not
        # float32; a float32 training step never does, so it is called directly at the preset's shapes.
        rows = train.batch_size * train.seq_len
        embedding_backward.embedding_backward(torch.zeros(rows, dtype=torch.long),
                                              torch.empty(rows, config.hidden_dim), config.vocab_size)

    def v4_embedding_rows_of_two_ranks(config, train):
        # Under torchrun with --embedding-grad-sync rows, each rank adds both ranks' gathered rows in a fixed
        # order; a one-process step never does, so it is called directly, at two ranks' rows.
        rows = 2 * train.batch_size * train.seq_len
        ordered_ids = embedding_backward.token_order(torch.zeros(rows, dtype=torch.long))
        embedding_backward.embedding_backward_in_order(ordered_ids, torch.empty(rows, config.hidden_dim),
                                                       config.vocab_size)

    return [("v3", v3_stage(5)), ("v3 --stage 2", v3_stage(2)), ("v3 --stage 4", v3_stage(4)),
            ("v4", v4_model()), ("v4 --rope-in-attention", v4_model(rope_in_attention=True)),
            ("v4 --separate-rope", v4_model(separate_rope=True)), ("v4 --rope-in-gemm", v4_model(separate_rope=False)),
            ("v4 --separate-swiglu", v4_model(separate_swiglu=True)),
            ("v4 --swiglu-in-gemms", v4_model(separate_swiglu=False)),
            ("v4 embedding_backward()", v4_embedding_backward),
            ("v4 --embedding-grad-sync rows, 2 ranks", v4_embedding_rows_of_two_ranks)]


def discover(gpu, preset: str, modules=None) -> list[Launch]:
    """Every launch of every model path at `preset`, with the launch configurations chosen for `gpu`."""
    run_stage, v4, embedding_backward = modules or import_versions()
    config, train = preset_configs(preset)
    launches, label = [], [""]
    with recording(gpu, launches, label):
        for name, step in model_paths(run_stage, v4, embedding_backward):
            label[0] = name
            step(config, train)
    return launches
