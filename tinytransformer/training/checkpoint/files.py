"""Checkpoint files: their names, listing them, the atomic write, rotation, and leftovers of interrupted writes."""
from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import torch

from ...outputs import write_atomically
from . import CheckpointError

FILE_PATTERN = re.compile(r"^ckpt_step(\d+)\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt_step{step:08d}.pt"


def _entries_named_like_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every entry of `directory` with a checkpoint's name, whatever it is (file or not)."""
    if not directory.is_dir():
        return []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:   # removed since the check: a starting run removes the directory its probe made
        return []
    found = []
    for path in entries:
        match = FILE_PATTERN.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `directory`, oldest first; temporary files are not listed."""
    return [(step, path) for step, path in _entries_named_like_checkpoints(Path(directory)) if path.is_file()]


def is_planned_save(step: int, num_steps: int, save_every: int, after_step: int = 0) -> bool:
    """Whether a run of `num_steps` steps (resumed after `after_step`) writes the checkpoint of `step`: every
    `save_every` steps and at the end (the trainer's rule), none when save_every is 0."""
    return bool(save_every) and after_step < step <= num_steps and (step % save_every == 0 or step == num_steps)


def newest_planned_saves(num_steps: int, save_every: int, count: int) -> list[int]:
    """The `count` newest steps whose checkpoints a run of `num_steps` steps writes (is_planned_save's rule),
    newest first, found without walking every step (a run may plan two billion)."""
    if not save_every or count <= 0:
        return []
    last_multiple = num_steps - num_steps % save_every
    final = [num_steps] if last_multiple != num_steps else []
    return (final + list(itertools.islice(range(last_multiple, 0, -save_every), count)))[:count]


def planned_checkpoints_present(directory: str | Path, num_steps: int, save_every: int,
                                after_step: int = 0) -> list[tuple[int, Path]]:
    """The entries already in `directory` under the name of a checkpoint this run will write: a file there is
    replaced; anything else (a directory) would make that save fail after the training it records."""
    return [(step, path) for step, path in _entries_named_like_checkpoints(Path(directory))
            if is_planned_save(step, num_steps, save_every, after_step)]


def _write_payload(payload: dict, file) -> None:
    """Serialise into an open file (a separate function so that tests can interrupt a write half-way)."""
    torch.save(payload, file)


def save_atomically(payload: dict, path: str | Path) -> Path:
    """Write the checkpoint through a temporary file in the same directory, fsync it, then rename it over `path`
    (outputs.write_atomically): a reader (or a crash) sees the old file or the new one, never half of one. A kill
    before the rename leaves only a temporary file, which the checkpoint listing ignores."""
    try:
        return write_atomically(path, lambda file: _write_payload(payload, file), binary=True, durable=True)
    except OSError as error:
        raise CheckpointError(f"cannot write checkpoint {path}: {error.strerror or error}") from None


def remove_temporary_files(directory: str | Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that never finished (a run killed during a write, or
    interrupted twice); returns them. This process's own temporary file, if it is writing one, stays."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for leftover in directory.glob(".ckpt_step*.pt.tmp-*"):
        if not leftover.name.endswith(f".tmp-{os.getpid()}"):
            leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return removed


def remove_old_checkpoints(directory: str | Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints (0: keep all), and no temporary file of an interrupted write."""
    directory = Path(directory)
    if keep_last > 0:
        for _, path in list_checkpoints(directory)[:-keep_last]:
            path.unlink(missing_ok=True)
    remove_temporary_files(directory)
