"""What a run checks before it builds anything: every output path it will write, and whether its sizes fit the
machine (paths.py, memory.py). Both fail with one line (ConfigError, exit 2) before the first step."""
from __future__ import annotations

from pathlib import Path

from ..checks import ConfigError, check_input_file
from ..config import ModelConfig, TrainConfig, preset_path
from ..data import text_file_of
from ..memory import check_fits, estimate_run_bytes
from ..paths import (prove_output_dir, prove_output_file, refuse_output_over_input, refuse_shared_outputs,
                     same_file)
from ..profiling.session import profile_files
from .checkpoint.files import FILE_PATTERN, list_checkpoints, newest_planned_saves, planned_checkpoints_present
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


def _records_a_profile(train: TrainConfig) -> bool:
    return train.enable_pytorch_profiler or train.profile_memory


def _run_outputs(train: TrainConfig, version: str) -> list[tuple[str, str | Path | None]]:
    """The files this run writes whose names are known now: the metrics JSON, the checkpoint directory's lock and
    the profiler's trace and reports."""
    lock = Path(train.checkpoint_dir) / LOCK_NAME if checkpoints_requested(train) else None
    profile = profile_files(train.profile_dir, version, train.profile_memory) if _records_a_profile(train) else []
    return [("--output-json", train.output_json), ("--checkpoint-dir", lock),
            *[("--profile-dir", path) for path in profile]]


def _checkpoints_to_replace(train: TrainConfig) -> list[tuple[str, Path]]:
    """The files in the checkpoint directory that this run's saves will replace (the others are new files)."""
    if not checkpoints_requested(train):
        return []
    present = planned_checkpoints_present(train.checkpoint_dir, train.num_steps, train.save_every)
    return [("--checkpoint-dir", path) for _, path in present]


def _checkpoints_rotated_away(train: TrainConfig) -> list[Path]:
    """The checkpoint files already in the directory that --keep-last N deletes during this run: after the last
    save only the N newest of (those present, those this run plans) remain. A resumed run writes fewer than
    counted here (its step is not known yet): this may name a file such a run would keep. (The extra checkpoint
    of a run stopped by a signal, at a step of its own, is not foreseen.)"""
    if not checkpoints_requested(train) or train.keep_last == 0:
        return []
    present = dict(list_checkpoints(train.checkpoint_dir))
    written = newest_planned_saves(train.num_steps, train.save_every, train.keep_last)
    kept = sorted(set(present) | set(written))[-train.keep_last:]
    return [path for step, path in present.items() if step not in kept]


def refuse_rotating_away_inputs(train: TrainConfig, inputs: list) -> None:
    """--keep-last N deletes the oldest checkpoints of the directory as new ones arrive: a file the run reads
    (other than --resume, whose rotation is the normal case) that sits there under a checkpoint's name would be
    deleted too. One line now, not a lost input later."""
    for checkpoint in _checkpoints_rotated_away(train):
        for flag, path in inputs:
            if path is not None and flag != "--resume" and same_file(checkpoint, Path(path)):
                raise ConfigError(f"{flag} {path} is a checkpoint file of --checkpoint-dir {train.checkpoint_dir}, "
                                  f"which --keep-last {train.keep_last} deletes as newer ones are written; "
                                  f"copy it elsewhere or raise --keep-last (0 keeps all)")


def refuse_output_named_like_a_checkpoint(train: TrainConfig) -> None:
    """--output-json in the checkpoint directory under a checkpoint's name would be listed (and rotated, resumed
    from, replaced) as one."""
    if not train.output_json or not checkpoints_requested(train):
        return
    output = Path(train.output_json)
    if FILE_PATTERN.match(output.name) and same_file(output.parent, Path(train.checkpoint_dir)):
        raise ConfigError(f"--output-json {output} has a checkpoint's name in --checkpoint-dir "
                          f"{train.checkpoint_dir}; name the metrics file otherwise")


def prove_run_outputs(train: TrainConfig, version: str, settings: list = ()) -> None:
    """Every file and directory this run may write, proven writable now (rank 0 alone writes them); none may be
    a file the run reads (`settings`: settings_files). The inputs are regular files first: a device or a pipe
    named as one is one line here, not a read that never ends."""
    inputs = run_inputs(train, list(settings))
    for flag, path in inputs:
        if path is not None and flag != "--resume":   # read_checkpoint checks its file, with hints of its own
            check_input_file(path, flag)
    outputs = _run_outputs(train, version)
    refuse_shared_outputs(outputs)
    refuse_output_over_input(outputs, inputs)
    refuse_output_named_like_a_checkpoint(train)
    # Resuming from a checkpoint of the directory is the normal case: the run writes only later steps' files.
    refuse_output_over_input(_checkpoints_to_replace(train), [pair for pair in inputs if pair[0] != "--resume"])
    refuse_rotating_away_inputs(train, inputs)
    if train.output_json:
        prove_output_file(train.output_json, "--output-json")
    if checkpoints_requested(train):
        prove_output_dir(train.checkpoint_dir, "--checkpoint-dir")
    if train.tensorboard_dir:
        prove_output_dir(train.tensorboard_dir, "--tensorboard-dir")
    if _records_a_profile(train):
        prove_output_dir(train.profile_dir, "--profile-dir")


def check_run_fits(version: str, model: ModelConfig, train: TrainConfig, device, world_size: int) -> None:
    estimate = estimate_run_bytes(model, train, world_size, score_matrix=version in SCORE_MATRIX_VERSIONS,
                                  causal_mask=version in CAUSAL_MASK_VERSIONS)
    check_fits(estimate, device)
