"""What a run checks before it builds anything: every output path it will write, and whether its sizes fit the
machine (paths.py, memory.py). Both fail with one line (ConfigError, exit 2) before the first step."""
from __future__ import annotations

from ..config import ModelConfig, TrainConfig
from ..memory import check_fits, estimate_run_bytes
from ..paths import prove_output_dir, prove_output_file
from .checkpoint.manager import checkpoints_requested

# Versions whose default attention materialises the S x S score matrix (the others use a fused kernel).
SCORE_MATRIX_VERSIONS = ("v1",)


def prove_run_outputs(train: TrainConfig) -> None:
    """Every file and directory this run may write, proven writable now (rank 0 alone writes them)."""
    if train.output_json:
        prove_output_file(train.output_json, "--output-json")
    if checkpoints_requested(train):
        prove_output_dir(train.checkpoint_dir, "--checkpoint-dir")
    if train.tensorboard_dir:
        prove_output_dir(train.tensorboard_dir, "--tensorboard-dir")
    if train.enable_pytorch_profiler or train.profile_memory:
        prove_output_dir(train.profile_dir, "--profile-dir")


def check_run_fits(version: str, model: ModelConfig, train: TrainConfig, device, world_size: int) -> None:
    estimate = estimate_run_bytes(model, train, world_size, score_matrix=version in SCORE_MATRIX_VERSIONS)
    check_fits(estimate, device)
