"""Checkpoints: atomic save, validated load, and everything an exact resume needs.

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
on) and every field's type and shape. Only rank 0 writes under data parallel. Run ONE training run per
checkpoint directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import random
import re
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, ModelConfig, TrainConfig
from .outputs import write_atomically
from .weights import check_canonical

FORMAT = "tinytransformer-checkpoint"
FORMAT_VERSION = 1
FILE_PATTERN = re.compile(r"^ckpt_step(\d+)\.pt$")

# Settings that shape the trajectory of the weights: resuming with a different value is allowed (it may be
# what you want), but the run then no longer reproduces the uninterrupted one, so we say so.
TRAJECTORY_SETTINGS = ("seed", "batch_size", "seq_len", "data", "learning_rate", "lr_schedule",
                       "lr_warmup_steps", "weight_decay", "use_amp", "amp_dtype")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message is one line. The CLI prints it and exits with code 2."""


# ----------------------------------------------------------------------------------------------------------
# Files: names, atomic writing, rotation
# ----------------------------------------------------------------------------------------------------------
def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt_step{step:08d}.pt"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in `directory`, oldest first; temporary files are not listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = FILE_PATTERN.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


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


# ----------------------------------------------------------------------------------------------------------
# State: model, optimizer, random-number generators
# ----------------------------------------------------------------------------------------------------------
def _to_model_layout(model, canonical_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-parameter tensors in the canonical layout -> the same tensors laid out like the model's parameters.

    The model's own `load_canonical` is the one conversion every version is tested on, so we use it: load the
    tensors as if they were weights, read the parameters back, then put the real weights back. The optimizer's
    moments then sit in exactly the positions of the weights they belong to, in every version.
    """
    weights = model.canonical_state_dict()
    model.load_canonical(canonical_tensors)
    converted = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    model.load_canonical(weights)
    return converted


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state in the canonical layout: {"per_parameter": {key: {name: tensor}}, "scalars": {...}}.

    A state entry with the parameter's shape (AdamW's exp_avg, exp_avg_sq) is converted like the weights. A
    scalar entry (AdamW's step) is the same for every parameter, since they all step together; it is stored once.
    """
    name_of = {parameter: name for name, parameter in model.named_parameters()}
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict = {}
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == parameter.shape and value.dim() > 0:
                per_key.setdefault(key, {})[name_of[parameter]] = value.detach()
            else:
                plain = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                if key in scalars and not _same_value(scalars[key], plain):
                    raise CheckpointError(f"optimizer state '{key}' differs between parameters; it cannot be "
                                          f"stored in the canonical layout")
                scalars[key] = plain
    expected = set(name_of.values())
    canonical = {}
    for key, tensors in per_key.items():
        if set(tensors) != expected:
            raise CheckpointError(f"optimizer state '{key}' exists for some parameters only")
        canonical[key] = {name: t.cpu().clone() for name, t in model.to_canonical(tensors).items()}
    return {"class": type(optimizer).__name__, "per_parameter": canonical, "scalars": scalars}


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def load_optimizer_state(model, optimizer, saved: dict) -> None:
    """Put a canonical optimizer state (see optimizer_state) into this model's optimizer."""
    if not saved["per_parameter"] and not saved["scalars"]:
        return
    in_model_layout = {key: _to_model_layout(model, tensors) for key, tensors in saved["per_parameter"].items()}
    name_of = {parameter: name for name, parameter in model.named_parameters()}
    state, index = {}, 0
    # optimizer.state_dict() numbers the parameters 0, 1, ... in param_group order; we follow that order.
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            entry = {key: (value.clone() if isinstance(value, torch.Tensor) else value)   # one copy each: the
                     for key, value in saved["scalars"].items()}                         # step is per parameter
            entry.update({key: tensors[name_of[parameter]] for key, tensors in in_model_layout.items()})
            state[index] = entry
            index += 1
    full = optimizer.state_dict()
    full["state"] = state
    optimizer.load_state_dict(full)   # casts each entry to its parameter's device and dtype


def rng_state() -> dict:
    """Every random-number generator a run could draw from."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "python": {"version": int(py_version), "internal": [int(v) for v in py_internal], "gauss_next": py_gauss},
    }
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))


def corpus_fingerprint(tokens: torch.Tensor) -> str:
    """A short hash of the training tokens: the same for the same data on any device."""
    return hashlib.sha256(tokens.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
# Building and applying a checkpoint
# ----------------------------------------------------------------------------------------------------------
def build_checkpoint(*, version: str, step: int, model, optimizer, scaler, model_config: ModelConfig,
                     train_config: TrainConfig, losses: list[float], evals: list[list], corpus: str,
                     world_size: int = 1) -> dict:
    """Everything a resume needs, as tensors (on the CPU) and plain Python values."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": version,
        "step": step,
        "model_config": dataclasses.asdict(model_config),
        "train_config": {k: v for k, v in dataclasses.asdict(train_config).items() if k != "extra"},
        "model": {name: t.detach().cpu().clone() for name, t in model.canonical_state_dict().items()},
        "optimizer": optimizer_state(model, optimizer),
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
        "schedule": {"kind": train_config.lr_schedule, "peak_lr": train_config.learning_rate,
                     "warmup_steps": train_config.lr_warmup_steps, "total_steps": train_config.num_steps},
        "rng": rng_state(),
        "history": {"train_loss": [float(v) for v in losses], "eval": [[int(s), float(v)] for s, v in evals]},
        "corpus": corpus,
        "world_size": world_size,
        "written_by": {"python": platform.python_version(), "torch": str(torch.__version__)},
    }


def restore_training_state(checkpoint: dict, model, optimizer) -> None:
    """Weights and optimizer state, in place (parameters keep their identity: captured graphs stay valid).
    The optimizer state goes first because its conversion borrows the model's parameters for a moment."""
    load_optimizer_state(model, optimizer, checkpoint["optimizer"])
    model.load_canonical(checkpoint["model"])


def restore_scaler(checkpoint: dict, scaler) -> None:
    if scaler is not None and checkpoint["grad_scaler"]:
        scaler.load_state_dict(checkpoint["grad_scaler"])


def setting_differences(checkpoint: dict, train: TrainConfig, world_size: int = 1) -> list[str]:
    """One line for each setting that makes this resumed run differ from the run that wrote the checkpoint."""
    saved = checkpoint["train_config"]
    names = list(TRAJECTORY_SETTINGS) + (["num_steps"] if train.lr_schedule == "cosine" else [])
    notes = []
    for name in names:
        if name in saved and saved[name] != getattr(train, name):
            notes.append(f"{name} is {getattr(train, name)!r} here but {saved[name]!r} in the checkpoint")
    if checkpoint.get("world_size", 1) != world_size:
        notes.append(f"{world_size} rank(s) here but {checkpoint['world_size']} when written (the global batch "
                     f"changes)")
    return notes


# ----------------------------------------------------------------------------------------------------------
# Loading, with validation: a bad file is one clear line, never a traceback
# ----------------------------------------------------------------------------------------------------------
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
    _require_canonical(payload["model"], config, "model", require)
    optimizer = payload["optimizer"]
    require(isinstance(optimizer.get("per_parameter"), dict) and isinstance(optimizer.get("scalars"), dict),
            "optimizer state lacks 'per_parameter' / 'scalars'")
    for key, tensors in optimizer["per_parameter"].items():
        require(isinstance(tensors, dict), f"optimizer state '{key}' is not a mapping")
        _require_canonical(tensors, config, f"optimizer state '{key}'", require)
    losses = payload["history"].get("train_loss")
    require(isinstance(losses, list) and len(losses) == payload["step"]
            and all(isinstance(v, float) for v in losses),
            "the loss history does not have one value per completed step")
    evals = payload["history"].get("eval")
    require(isinstance(evals, list) and all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], int)
                                            and isinstance(e[1], float) for e in evals),
            "the validation history is missing or malformed")
    require(payload.get("grad_scaler") is None or isinstance(payload["grad_scaler"], dict),
            "the loss-scaler state is not a mapping")
    _require_rng_states(payload["rng"], require)


def _require_rng_states(rng: dict, require) -> None:
    numpy_state, python_state = rng.get("numpy"), rng.get("python")
    require(isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8
            and isinstance(rng.get("cuda"), list) and isinstance(numpy_state, dict)
            and isinstance(python_state, dict), "random-number states are missing")
    require(isinstance(numpy_state.get("keys"), torch.Tensor) and numpy_state["keys"].shape == (624,)
            and isinstance(numpy_state.get("pos"), int) and isinstance(numpy_state.get("kind"), str),
            "the numpy random-number state is malformed")
    require(isinstance(python_state.get("internal"), list) and len(python_state["internal"]) == 625
            and isinstance(python_state.get("version"), int), "the python random-number state is malformed")


def _require_canonical(tensors: dict, config: ModelConfig, what: str, require) -> None:
    require(all(isinstance(t, torch.Tensor) for t in tensors.values()), f"{what} holds non-tensor values")
    try:
        check_canonical(tensors, config)
    except ValueError as error:
        require(False, f"{what}: {error}")
    require(all(t.is_floating_point() for t in tensors.values()), f"{what} holds non-float tensors")


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
