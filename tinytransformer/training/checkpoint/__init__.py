"""Checkpoints: the file format, and everything an exact resume needs.

A checkpoint is one `torch.save` file that holds ONLY tensors and plain Python values (dicts, lists, numbers,
strings), so it is read with `torch.load(weights_only=True)`, which cannot run code hidden in a file:

    format, format_version        marks the file as a TinyTransformer checkpoint
    version                       the version that wrote it ("v1"); any version can resume it
    step                          optimizer steps completed; the next step to run is this number
    model_config, train_config    the run's settings, as plain dicts
    model                         the weights in the CANONICAL layout (version 1's names and shapes)
    optimizer                     the optimizer's per-parameter state (AdamW's moments), also canonical,
                                  and its scalar state (AdamW's step count)
    grad_scaler                   the float16 loss scaler's state, or None
    schedule                      the learning-rate schedule's settings (the schedule is a function of the step)
    rng                           the torch (CPU and every GPU), numpy and python random-number states
    history                       the training loss of every step so far and every validation loss
    corpus                        a fingerprint of the training tokens, to notice resuming on other data

Because weights and optimizer state are canonical, a checkpoint written by version 1 resumes in version 4 and
back. Writing is atomic (temporary file, fsync, rename): a kill during a write leaves the previous checkpoint
intact, and its temporary file is removed at once (Ctrl-C) or at the next start of a run that writes checkpoints
there (SIGKILL). Reading checks the zip archive's CRC-32s (a flipped bit in the weights is caught, not trained
on) and every field's type and shape. Only rank 0 writes under data parallel. One training run per checkpoint
directory, enforced by a lock file (lock.py).

    files.py      names, listing, the atomic write, rotation, leftovers of interrupted writes
    state.py      model, optimizer and random-number state <-> the plain values of the file; building one
    loading.py    reading with validation (a bad file is one clear line), choosing the checkpoint to resume
    manager.py    what a run does with checkpoints: resume at the start, save every N steps and when stopped
    lock.py       one run per checkpoint directory (host and pid in a lock file; stale locks taken over)
"""
from __future__ import annotations

from ...config import ConfigError

FORMAT = "tinytransformer-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message is one line. The CLI prints it and exits with code 2."""
