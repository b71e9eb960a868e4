"""The state a checkpoint holds, converted to plain values and back: the model and optimizer in the canonical
layout, every random-number generator, and the whole payload of a checkpoint file (build_checkpoint).

Because weights and optimizer state are canonical (version 1's names and shapes), a checkpoint written by one
version resumes in any other.
"""
from __future__ import annotations

import dataclasses
import hashlib
import platform
import random

import numpy as np
import torch

from ...config import ModelConfig, TrainConfig
from . import FORMAT, FORMAT_VERSION, CheckpointError

# Settings that shape the trajectory of the weights: resuming with a different value is allowed (it may be
# what you want), but the run then no longer reproduces the uninterrupted one, so we say so.
TRAJECTORY_SETTINGS = ("seed", "batch_size", "seq_len", "data", "learning_rate", "lr_schedule",
                       "lr_warmup_steps", "weight_decay", "use_amp", "amp_dtype")


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
