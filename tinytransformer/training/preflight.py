"""What a run checks before it builds anything: every output path it will write, and whether its sizes fit the
machine (paths.py, memory.py). Both fail with one line (ConfigError, exit 2) before the first step."""
from __future__ import annotations

from pathlib import Path

from ..checks import check_input_file
from ..config import ModelConfig, TrainConfig, preset_path
from ..data import text_file_of
from ..memory import check_fits, estimate_run_bytes
from ..paths import prove_output_dir, prove_output_file, refuse_output_over_input
from .checkpoint.files import planned_checkpoints_present
from .checkpoint.lock import LOCK_NAME
from .checkpoint.manager import checkpoints_requested

# Versions whose default attention materialises the S x S score matrix (the others use a fused kernel).
SCORE_MATRIX_VERSIONS = ("v1",)
# Versions that keep a max_seq_len x max_seq_len causal mask beside their RoPE tables.
CAUSAL_MASK_VERSIONS = ("v1", "v2")


def settings_files(args) -> list[tuple[str, str | Path | None]]:
    """The settings files a command line reads: (flag, path or None) of --config and of --preset's YAML file."""
    preset = getattr(args, "preset", None)
    return [("--config", getattr(args, "config", None)), ("--preset", preset_path(preset) if preset else None)]


def run_inputs(train: TrainConfig, settings: list) -> list[tuple[str, str | Path | None]]:
    """Every file the run reads: its settings files, the --resume checkpoint, the text data and the DeepSpeed
    config. (`--resume auto` picks a checkpoint later; this run writes only checkpoints of later steps.)"""
    resume = train.resume if train.resume != "auto" else None
    return [*settings, ("--resume", resume), ("--data", text_file_of(train.data)),
            ("--deepspeed-config", train.deepspeed_config)]


def _run_outputs(train: TrainConfig) -> list[tuple[str, str | Path | None]]:
    """The files this run writes whose names are known now: the metrics JSON and the checkpoint directory's lock."""
    lock = Path(train.checkpoint_dir) / LOCK_NAME if checkpoints_requested(train) else None
    return [("--output-json", train.output_json), ("--checkpoint-dir", lock)]


def _checkpoints_to_replace(train: TrainConfig) -> list[tuple[str, Path]]:
    """The files in the checkpoint directory that this run's saves will replace (the others are new files)."""
    if not checkpoints_requested(train):
        return []
    present = planned_checkpoints_present(train.checkpoint_dir, train.num_steps, train.save_every)
    return [("--checkpoint-dir", path) for _, path in present]


def prove_run_outputs(train: TrainConfig, settings: list = ()) -> None:
    """Every file and directory this run may write, proven writable now (rank 0 alone writes them); none may be
    a file the run reads (`settings`: settings_files). The inputs are regular files first: a device or a pipe
    named as one is one line here, not a read that never ends."""
    inputs = run_inputs(train, list(settings))
    for flag, path in inputs:
        if path is not None and flag != "--resume":   # read_checkpoint checks its file, with hints of its own
            check_input_file(path, flag)
    refuse_output_over_input(_run_outputs(train), inputs)
    # Resuming from a checkpoint of the directory is the normal case: the run writes only later steps' files.
    refuse_output_over_input(_checkpoints_to_replace(train), [pair for pair in inputs if pair[0] != "--resume"])
    if train.output_json:
        prove_output_file(train.output_json, "--output-json")
    if checkpoints_requested(train):
        prove_output_dir(train.checkpoint_dir, "--checkpoint-dir")
    if train.tensorboard_dir:
        prove_output_dir(train.tensorboard_dir, "--tensorboard-dir")
    if train.enable_pytorch_profiler or train.profile_memory:
        prove_output_dir(train.profile_dir, "--profile-dir")


def check_run_fits(version: str, model: ModelConfig, train: TrainConfig, device, world_size: int) -> None:
    estimate = estimate_run_bytes(model, train, world_size, score_matrix=version in SCORE_MATRIX_VERSIONS,
                                  causal_mask=version in CAUSAL_MASK_VERSIONS)
    check_fits(estimate, device)
