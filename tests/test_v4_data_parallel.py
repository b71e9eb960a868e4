"""Version 4's graph-captured step under torchrun: the gradients averaged by all-reduces captured in the graph,
without the DDP wrapper (tinytransformer/gradient_sync.py). GPU only; the CPU side of this path (the all-reduce,
the trainer's choice) is tested in test_gradient_sync.py.

Five layers, so that TritonAdamW has a group per layer and a layer's update runs while several layers of the
backward pass are still to come: each on the weight-gradient stream one layer after the backward pass left it, after
the all-reduces that layer started there (graphed_step.GraphedStep._layer_gradients_queued); layer 1's once
backward() has returned.
"""
import json
import sys

import numpy as np
import pytest
import torch

from .test_distributed import RUN, SCRIPTS, TORCHRUN, run

GPU_RUN = [arg if arg != "cpu" else "cuda" for arg in RUN]
GPU_RUN[GPU_RUN.index("--num-layers") + 1] = "5"
GRAPH_NOTE = "version 4 averages gradients inside its CUDA/HIP-graph step"


def v4_losses(tmp_path, name, ranks, batch, *flags):
    out = tmp_path / f"{name}.json"
    launcher = [sys.executable] if ranks is None else TORCHRUN + ["--standalone", "--nproc-per-node", ranks]
    result = run(launcher + [SCRIPTS["v4"], *GPU_RUN, "--batch-size", batch, "--output-json", out, *flags],
                 cwd=tmp_path, on_gpu=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout, np.array(json.loads(out.read_text())["loss"]["history"])


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [[], ["--use-amp", "--amp-dtype", "bfloat16"], ["--no-weight-grad-stream"],
                                   ["--torch-adamw"], ["--embedding-grad-sync", "rows"]],
                         ids=["fp32", "bf16", "one-stream", "torch-adamw", "embedding-rows"])
def test_torchrun_one_gpu_keeps_the_graph_and_trains_like_one_process(flags, tmp_path):
    """At one rank the loss scale is exactly 1 and the in-place SUM all-reduce is the identity: the same losses
    as a plain process (up to the embedding backward's atomics, which may add in another order). Under autocast,
    torchrun keeps float32 weight gradients (its all-reduces sum .grad), so the plain process is asked for them too:
    with the 16-bit ones it would take a slightly different step (per-step losses about 1e-5 apart on an H100)."""
    amp = "--use-amp" in flags
    _, single = v4_losses(tmp_path, "single", None, 8, *flags, *(["--float32-weight-grads"] if amp else []))
    out, one_rank = v4_losses(tmp_path, "one_rank", 1, 8, *flags)
    assert GRAPH_NOTE in out and "eager step" not in out
    assert ("reading float32 weight gradients" in out) == amp
    assert "gradients averaged in v4's own step (all-reduce, no DDP wrapper) over 1 rank(s) (nccl" in out
    assert "step        : CUDA/HIP graph replay" in out
    assert single.shape == one_rank.shape == (6,) and np.isfinite(single).all()
    relative = np.abs(one_rank - single) / np.abs(single)
    assert relative.max() < 1e-6, f"per-step relative loss differences {relative}"


@pytest.mark.gpu
def test_torchrun_without_the_graph_keeps_ddp(tmp_path):
    out, _ = v4_losses(tmp_path, "eager", 1, 8, "--no-cuda-graph")
    assert "DistributedDataParallel over 1 rank(s) (nccl" in out and GRAPH_NOTE not in out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("flags", [[], ["--use-amp", "--amp-dtype", "bfloat16"], ["--torch-adamw"],
                                   ["--embedding-grad-sync", "table"],
                                   ["--use-amp", "--amp-dtype", "bfloat16", "--embedding-grad-sync", "rows"]],
                         ids=["fp32", "bf16", "torch-adamw", "embedding-table", "bf16-embedding-rows"])
def test_two_gpus_in_the_graph_equal_one_gpu(flags, tmp_path):
    """2 ranks x batch 4 == 1 process x batch 8, with test_two_gpus_equal_one_gpu's tolerance (TF32 and the
    embedding backward's atomics). The embedding's gradient summed by gathering the ranks' rows (2 x 64 tokens
    against a 300-row vocabulary: auto, the default, picks the rows), or all-reduced (table)."""
    _, single = v4_losses(tmp_path, "single", None, 8, *flags)
    out, two = v4_losses(tmp_path, "two", 2, 4, *flags)
    assert GRAPH_NOTE in out and "over 2 rank(s) (nccl" in out
    # The same bits on both ranks: the all-reduces' sums are, and so are the rows, added in a fixed order.
    assert "ranks       : the weights are the same bits on all 2 ranks" in out
    by_rows = "table" not in flags   # auto, the default, picks the rows here
    assert ("embed grad  : the table all-reduced" in out) != by_rows
    assert ("embed grad  : summed by gathering every rank's token rows (2 x 64 rows" in out) == by_rows
    assert two.shape == single.shape and np.isfinite(two).all()
    assert np.abs(two - single).max() < 1e-3 * np.abs(single).max()
    assert single[-1] < single[0]   # and it trains


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [["--use-amp", "--amp-dtype", "bfloat16"], ["--no-cuda-graph"]],
                         ids=["graph", "ddp-hook"])
def test_torchrun_one_gpu_summing_in_bfloat16(flags, tmp_path):
    """--grad-reduce-dtype bfloat16, captured in the graph (the bfloat16 buffers and their write-back on both
    streams) or through DDP's hook: it runs, says so, and follows the plain process to bfloat16's rounding."""
    _, single = v4_losses(tmp_path, "single", None, 8, *flags)
    out, one_rank = v4_losses(tmp_path, "one_rank", 1, 8, "--grad-reduce-dtype", "bfloat16", *flags)
    assert "summed in bfloat16" in out
    assert (GRAPH_NOTE in out) if "--no-cuda-graph" not in flags else ("DistributedDataParallel over 1" in out)
    assert one_rank.shape == single.shape and np.isfinite(one_rank).all()
    assert (np.abs(one_rank - single) / np.abs(single)).max() < 1e-2
    assert one_rank[-1] < one_rank[0]
