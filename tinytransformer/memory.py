"""Sizes checked against the machine before anything is allocated.

`estimate_run_bytes` adds up what one training process holds at its peak: weights, gradients and AdamW's two
moments (float32 master copies, also under autocast), the activations kept for the backward pass, the logits and
their gradient, the position tables sized by max_seq_len (RoPE's cos/sin, and the causal mask where a version keeps
one), and the data (the token corpus on the host and on the device, and the batch positions computed
1024 steps at a time). `check_fits` compares it with the device's free memory (GPU) or the host's available
memory (CPU) and refuses, with one line, a request whose estimate exceeds REFUSE_ABOVE times what is there: the
margin keeps runs whose estimate is pessimistic; a request off by orders of magnitude (a typo'd --batch-size) is
refused in a second instead of failing in the allocator, or in numpy, minutes later.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .checks import ConfigError
from .config import ModelConfig, TrainConfig
from .data import MARKOV_ROW_LEN, MARKOV_ROWS, RANDOM_ROWS, STEPS_PER_REFILL, text_file_of
from .weights import parameter_count

REFUSE_ABOVE = 1.5
TOKEN_BYTES = 8   # int64 token ids


@dataclass
class Estimate:
    weights_and_optimizer: int
    activations: int
    data_device: int
    data_host: int
    position_tables: int = 0   # built on the host, then moved to the device

    @property
    def device_total(self) -> int:
        return self.weights_and_optimizer + self.activations + self.data_device + self.position_tables

    @property
    def host_total(self) -> int:
        """What the host holds when the model runs on a GPU: the data, and the position tables while they are built."""
        return self.data_host + self.position_tables


def activation_bytes(model: ModelConfig, batch: int, seq: int, element_bytes: int,
                     score_matrix: bool = True) -> int:
    """What autograd keeps for the backward pass, per process. Per token and layer: the norms' inputs and
    outputs, q, k, v and their rotated copies, the attention output, the residuals (~12 x D), the SwiGLU gate, up,
    activation and product (4 x F); with `score_matrix` (version 1's unfused attention) the S x S probabilities
    per head. Plus the logits, their float32 copy for the loss and its gradient (3 x V per token)."""
    tokens = batch * seq
    per_layer = tokens * (12 * model.hidden_dim + 4 * model.intermediate_size) * element_bytes
    if score_matrix:
        # Only the softmax's output is kept (masked_fill keeps its mask, not the scores): in float32, where the
        # softmax runs, and under autocast also the 16-bit copy that the probabilities @ v matmul saves.
        kept_bytes = 4 + (element_bytes if element_bytes < 4 else 0)
        per_layer += batch * model.num_heads * seq * seq * kept_bytes
    logits = tokens * model.vocab_size * (element_bytes + 2 * 4)
    return model.num_layers * per_layer + logits


def position_table_bytes(model: ModelConfig, causal_mask: bool = False) -> int:
    """The tables every model builds for max_seq_len positions, whatever --seq-len is: RoPE's angles are computed in
    float64 (the angles and one cos/sin table at a time, 3 x 8 bytes per entry) and kept as up to three float32
    tables (cos, sin and version 2's signed sin); with `causal_mask` (versions 1 and 2) also a boolean
    max_seq_len x max_seq_len mask."""
    entries = model.max_seq_len * model.head_dim
    mask = model.max_seq_len ** 2 if causal_mask else 0
    return entries * (3 * 8 + 3 * 4) + mask


def data_bytes(train: TrainConfig, world_size: int = 1) -> tuple[int, int]:
    """(device, host) bytes of the data: the training and held-out corpora (a text file: about its size), and
    the host arrays of batch positions (several uint64 temporaries of STEPS_PER_REFILL x global batch)."""
    row_len = max(MARKOV_ROW_LEN, 2 * (train.seq_len + 1))
    rows = RANDOM_ROWS if train.data == "random" else MARKOV_ROWS
    corpus = int(rows * 1.25) * row_len * TOKEN_BYTES
    if text_file_of(train.data) is not None:
        try:
            corpus = os.path.getsize(text_file_of(train.data)) * TOKEN_BYTES
        except OSError:
            pass   # data.py reports a missing file with its own line
    positions = 4 * STEPS_PER_REFILL * train.batch_size * world_size * 8
    return corpus + STEPS_PER_REFILL * train.batch_size * 8, corpus + positions


def estimate_run_bytes(model: ModelConfig, train: TrainConfig, world_size: int = 1,
                       score_matrix: bool = True, causal_mask: bool = True) -> Estimate:
    params = parameter_count(model)
    element_bytes = 2 if train.use_amp else 4
    device_data, host_data = data_bytes(train, world_size)
    return Estimate(weights_and_optimizer=16 * params,
                    activations=activation_bytes(model, train.batch_size, train.seq_len, element_bytes,
                                                 score_matrix),
                    data_device=device_data, data_host=host_data,
                    position_tables=position_table_bytes(model, causal_mask))


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else physical memory from sysconf; None when neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_free_bytes(device) -> int | None:
    import torch
    if device.type != "cuda":
        return None
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except RuntimeError:
        return None
    return free


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count < 2**40 else f"{count / 2**40:.2f} TiB"


def check_fits(estimate: Estimate, device) -> None:
    """ConfigError (one line with the estimate) when the run cannot fit: on a GPU its device part against the
    GPU's free memory, and the host part against the host; on the CPU everything against the host."""
    host = host_available_bytes()
    if device.type == "cuda":
        needs = [("host", estimate.host_total, host), ("GPU", estimate.device_total, device_free_bytes(device))]
    else:
        needs = [("host", estimate.device_total + estimate.data_host, host)]
    for where, needed, available in needs:
        if available is not None and needed > REFUSE_ABOVE * available:
            raise ConfigError(
                f"this run needs about {_gib(needed)} of {where} memory (weights, gradients and optimizer state "
                f"{_gib(estimate.weights_and_optimizer)}, activations {_gib(estimate.activations)}, data "
                f"{_gib(estimate.data_host if where == 'host' and device.type == 'cuda' else estimate.data_device)}"
                f", position tables {_gib(estimate.position_tables)}) but {_gib(available)} is available; reduce "
                f"--batch-size, --seq-len, --max-seq-len or the model size")
