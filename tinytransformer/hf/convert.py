"""A checkpoint of any version -> a Hugging Face model directory, and a Hugging Face Llama -> a checkpoint.

export: `config.json` (a LlamaConfig of our architecture) and `model.safetensors` (our canonical weights under
Hugging Face's names), so that `LlamaForCausalLM.from_pretrained(DIR)` loads the model and `generate()` works.
import: the reverse, into a checkpoint at step 0 with no optimizer state, which every version can resume from
(`--checkpoint-dir DIR --resume auto`) and sample.py can read. Nothing is downloaded: only local directories.

Both write into a temporary directory beside the destination and rename it at the end, so a failure or Ctrl-C
half-way leaves nothing behind, and neither overwrites a directory that already holds files.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig, TrainConfig
from ..paths import prove_output_dir
from ..training.checkpoint.files import checkpoint_path, list_checkpoints, save_atomically
from ..training.checkpoint.loading import read_checkpoint
from ..training.checkpoint.state import build_checkpoint
from ..weights import check_canonical
from .model import INSTALL_HINT, hf_config, model_config_of, require_transformers, to_canonical_names, to_hf_names

WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def require_safetensors():
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"safetensors is not installed ({INSTALL_HINT})")
    import safetensors.torch
    return safetensors.torch


def newest_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """A checkpoint file, or the newest readable one in a directory (the way --resume auto picks one)."""
    path = Path(path)
    if path.is_file():
        return path, read_checkpoint(path)
    if not path.is_dir():
        raise ConfigError(f"--checkpoint {path}: no such file or directory")
    found = list_checkpoints(path)
    if not found:
        raise ConfigError(f"--checkpoint {path}: no checkpoint (ckpt_step*.pt) in this directory")
    return found[-1][1], read_checkpoint(found[-1][1])


def prove_fresh_output(out: Path) -> None:
    """`out` may be created (never overwritten) and its parent written: checked before any work (paths.py)."""
    if out.is_file():
        raise ConfigError(f"--out {out} is a file, not a directory; choose a new path")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: already exists and is not an empty directory; choose a new path")
    prove_output_dir(out.parent, "--out")


def fresh_output_directory(out: Path) -> Path:
    """The temporary directory to write into, after checking that `out` may be created (never overwritten)."""
    prove_fresh_output(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot create it ({error.strerror or error})") from None
    return staging


def publish(staging: Path, out: Path) -> Path:
    """Move the finished directory into place (replacing an empty directory of that name)."""
    if out.is_dir():
        out.rmdir()
    os.replace(staging, out)
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> tuple[Path, Path]:
    """Write the checkpoint's weights as a Hugging Face model directory. Returns (checkpoint used, directory)."""
    require_transformers()
    safetensors_torch = require_safetensors()
    prove_fresh_output(Path(out))   # before reading a large checkpoint
    source, payload = newest_checkpoint(checkpoint)
    config = ModelConfig(**payload["model_config"])
    out = Path(out)
    staging = fresh_output_directory(out)
    try:
        hf_config(config).save_pretrained(staging)
        weights = {name: tensor.detach().to(torch.float32).contiguous()
                   for name, tensor in to_hf_names(payload["model"], config.num_layers).items()}
        safetensors_torch.save_file(weights, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        return source, publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a local Hugging Face model directory (one safetensors file, or shards with an index)."""
    safetensors_torch = require_safetensors()
    if (directory / WEIGHTS_FILE).is_file():
        files = [directory / WEIGHTS_FILE]
    elif (directory / SHARD_INDEX).is_file():
        index = json.loads((directory / SHARD_INDEX).read_text())
        files = [directory / name for name in sorted(set(index["weight_map"].values()))]
    else:
        raise ConfigError(f"--model {directory}: no {WEIGHTS_FILE} (or {SHARD_INDEX}) in this directory")
    tensors = {}
    for file in files:
        tensors.update(safetensors_torch.load_file(str(file)))
    return tensors


def import_model(model_dir: str | Path, out: str | Path) -> tuple[Path, ModelConfig]:
    """A local Hugging Face Llama of our architecture -> a step-0 checkpoint in the directory `out`."""
    transformers = require_transformers()
    model_dir = Path(model_dir)
    prove_fresh_output(Path(out))   # before reading the weights
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {model_dir}: no config.json (a Hugging Face model directory is expected)")
    config = model_config_of(transformers.LlamaConfig.from_pretrained(model_dir, local_files_only=True))
    weights = {name: tensor.to(torch.float32).contiguous()
               for name, tensor in to_canonical_names(read_hf_weights(model_dir), config.num_layers).items()}
    try:
        check_canonical(weights, config)
    except ValueError as error:
        raise ConfigError(f"--model {model_dir}: {error}") from None
    bad = next((name for name, tensor in weights.items() if not bool(torch.isfinite(tensor).all())), None)
    if bad:
        raise ConfigError(f"--model {model_dir}: tensor '{bad}' holds NaN or infinite values")
    out = Path(out)
    staging = fresh_output_directory(out)
    try:
        save_atomically(step_zero_checkpoint(config, weights), checkpoint_path(staging, 0))
        return publish(staging, out), config
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class _ImportedWeights:
    """What build_checkpoint reads of a model, for weights that are not in a model yet."""

    def __init__(self, weights: dict):
        self.weights = weights

    def canonical_state_dict(self) -> dict:
        return self.weights

    def named_parameters(self):
        return iter(())


def step_zero_checkpoint(config: ModelConfig, weights: dict) -> dict:
    """A checkpoint that holds only weights: a fresh AdamW (no state yet), no training history, default settings;
    written as "hf" (which version wrote a checkpoint is informational: any version resumes any checkpoint)."""
    fresh_optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return build_checkpoint(version="hf", step=0, model=_ImportedWeights(weights), optimizer=fresh_optimizer,
                            scaler=None, model_config=config, train_config=TrainConfig(), losses=[], evals=[],
                            corpus=None)
