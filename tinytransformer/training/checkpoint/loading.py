"""Reading a checkpoint, with validation: every way a file can be wrong is one clear line, never a traceback; and
choosing the checkpoint a run resumes from (--resume PATH or --resume auto)."""
from __future__ import annotations

import dataclasses
import warnings
import zipfile
from pathlib import Path

import torch

from ...config import TRAIN_FIELDS, ConfigError, ModelConfig, TrainConfig
from ...weights import check_canonical
from . import FORMAT, FORMAT_VERSION, CheckpointError
from .files import list_checkpoints
from .restored_fields import (require_histories, require_optimizer_scalars, require_optimizer_tensor_kinds,
                              require_rng_states, require_scaler_state)

ZIP_MAGIC = b"PK\x03\x04"   # torch.save writes a zip archive; every file it writes starts with these bytes


def _describe_load_error(error: BaseException) -> str:
    message = str(error)
    if "Weights only load failed" in message or "weights_only" in message:
        return "it holds objects other than tensors and plain values (refused by weights_only loading)"
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    if len(first_line) > 100:
        first_line = first_line[:97] + "..."
    return f"damaged ({type(error).__name__}{': ' + first_line if first_line else ''})"


def _first_damaged_entry(path: Path) -> str | None:
    """torch.save records a CRC-32 for every entry but torch.load does not check it: flipped bits in the
    weights would load silently. zipfile's testzip re-reads the archive and checks every CRC."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as error:
        return f"? ({type(error).__name__})"


def read_checkpoint(path: str | Path) -> dict:
    """torch.load(weights_only=True) after integrity checks, then a structural check; raises CheckpointError
    with one line for every way a file can be wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory; give a checkpoint file, or --resume auto "
                              f"with --checkpoint-dir {path}")
    if not path.is_file():   # a device or a pipe: reading it could never end, or block
        raise CheckpointError(f"checkpoint {path} is not a regular file")
    try:
        with open(path, "rb") as file:
            magic = file.read(len(ZIP_MAGIC))
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {error.strerror or error}") from None
    if magic != ZIP_MAGIC:
        raise CheckpointError(f"{path} is not a checkpoint: not the zip archive torch.save writes (empty, text, "
                              f"random bytes or another format)")
    if not zipfile.is_zipfile(path):   # the archive's directory sits at its end: the first thing a cut loses
        raise CheckpointError(f"{path} is not a readable checkpoint: truncated (its zip archive is incomplete)")
    damaged_entry = _first_damaged_entry(path)
    if damaged_entry:
        raise CheckpointError(f"{path} is not a readable checkpoint: damaged (entry {damaged_entry} fails its "
                              f"CRC-32 check)")
    try:
        with warnings.catch_warnings():   # torch warns about odd pickles; the error below says it all
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:   # a damaged file can fail anywhere inside the zip reader or the unpickler
        raise CheckpointError(f"{path} is not a readable checkpoint: {_describe_load_error(error)}") from None
    validate_structure(payload, path)
    return payload


def validate_structure(payload, path) -> None:
    """Check every field a resume will read, so that a wrong file fails here and not half-way into a run."""
    def require(condition: bool, problem: str) -> None:
        if not condition:
            raise CheckpointError(f"{path} is not a valid checkpoint: {problem}")

    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        raise CheckpointError(f"{path} is not a TinyTransformer checkpoint (it is a torch file, but without "
                              f"the '{FORMAT}' marker)")
    require(payload.get("format_version") == FORMAT_VERSION,
            f"format version {payload.get('format_version')!r}; this code reads version {FORMAT_VERSION}")
    kinds = {"version": str, "step": int, "model_config": dict, "train_config": dict, "model": dict,
             "optimizer": dict, "rng": dict, "history": dict, "schedule": dict}
    for key, kind in kinds.items():
        require(isinstance(payload.get(key), kind) and not isinstance(payload.get(key), bool),
                f"'{key}' is missing or not a {kind.__name__}")
    require(payload["step"] >= 0, f"negative step {payload['step']}")
    try:
        config = ModelConfig(**payload["model_config"])
        config.validate()
    except (TypeError, ConfigError) as error:
        require(False, f"model_config is unusable ({error})")
    try:   # the saved training settings pass the same typed checks as a flag or a YAML value
        saved = {k: v for k, v in payload["train_config"].items() if k in TRAIN_FIELDS}
        TrainConfig(**saved).validate_values()
    except (TypeError, ConfigError) as error:
        require(False, f"train_config is unusable ({error})")
    _require_canonical(payload["model"], config, "model", require)
    optimizer = payload["optimizer"]
    require(isinstance(optimizer.get("per_parameter"), dict) and isinstance(optimizer.get("scalars"), dict),
            "optimizer state lacks 'per_parameter' / 'scalars'")
    for key, tensors in optimizer["per_parameter"].items():
        require(isinstance(tensors, dict), f"optimizer state '{key}' is not a mapping")
        _require_canonical(tensors, config, f"optimizer state '{key}'", require)
    require_optimizer_scalars(optimizer["scalars"], payload["step"], require)
    require_optimizer_tensor_kinds(optimizer["per_parameter"], require)
    trained_on_nan = payload["train_config"].get("stop_on_nan") is False
    require_histories(payload["history"], payload["step"], trained_on_nan, require)
    require_scaler_state(payload.get("grad_scaler"), require)
    require_rng_states(payload["rng"], require)
    world_size = payload.get("world_size", 1)
    require(isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1,
            f"world_size must be a positive integer, got {world_size!r}")
    require(payload.get("corpus") is None or isinstance(payload["corpus"], str), "corpus must be text")


def _require_canonical(tensors: dict, config: ModelConfig, what: str, require) -> None:
    require(all(isinstance(t, torch.Tensor) for t in tensors.values()), f"{what} holds non-tensor values")
    try:
        check_canonical(tensors, config)
    except ValueError as error:
        require(False, f"{what}: {error}")
    require(all(t.is_floating_point() for t in tensors.values()), f"{what} holds non-float tensors")
    for name, tensor in tensors.items():   # weights of a diverged run: training on them gives NaN at once
        if not bool(torch.isfinite(tensor).all()):
            kind = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
            require(False, f"{what} tensor '{name}' holds {kind} values (written by a run that had diverged?)")


def check_model_config(payload: dict, expected: ModelConfig, path) -> None:
    """The checkpoint must hold the model this run builds; name the first difference and the flag to fix it."""
    saved = payload["model_config"]
    for name, value in dataclasses.asdict(expected).items():
        if saved.get(name) != value:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(f"{path} holds a different model: {name} is {saved.get(name)!r} in the "
                                  f"checkpoint but {value!r} in this run (set {flag} {saved.get(name)})")


def find_checkpoint_to_resume(resume: str, directory: str, expected: ModelConfig,
                              log=print) -> tuple[Path, dict] | None:
    """--resume PATH: that file, validated. --resume auto: the newest valid checkpoint in `directory`, skipping
    damaged ones (a note each); None when there is none yet (a first launch). Raises CheckpointError."""
    if resume != "auto":
        payload = read_checkpoint(resume)
        check_model_config(payload, expected, resume)
        return Path(resume), payload
    found = list_checkpoints(directory)
    if not found:
        log(f"note: --resume auto: no checkpoint in {directory}/ yet; starting from step 0")
        return None
    first_problem = None
    for _, path in reversed(found):
        try:
            payload = read_checkpoint(path)
        except CheckpointError as error:
            log(f"note: --resume auto skips {path}: {error}")
            first_problem = first_problem or str(error)
            continue
        check_model_config(payload, expected, path)
        return path, payload
    raise CheckpointError(f"--resume auto: none of the {len(found)} checkpoint(s) in {directory}/ is usable; "
                          f"newest: {first_problem}")
