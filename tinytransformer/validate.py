"""--validate-setup: check the environment before a workshop run, and the run's outputs after it."""
from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

import torch

from .device import describe
from .weights import init_canonical_weights


def _check(label: str, ok: bool, detail: str, required: bool = True) -> bool:
    mark = "ok  " if ok else ("FAIL" if required else "skip")
    print(f"  [{mark}] {label}: {detail}")
    return ok or not required


def _optional_module(name: str) -> tuple[bool, str]:
    try:
        module = importlib.import_module(name)
    except Exception as error:
        return False, f"not available ({type(error).__name__}); pip install {name}"
    return True, f"version {getattr(module, '__version__', '?')}"


def validate_setup(trainer) -> bool:
    """Print a checklist; return False when something required is missing or broken."""
    print("=== Setup check ===")
    info = describe(trainer.device)
    good = _check("torch", True, torch.__version__)
    good &= _check("device", True, f"{info.name} ({info.backend})")
    if trainer.device.type == "cuda":
        good &= _check("GPU memory", True,
                       f"{torch.cuda.get_device_properties(trainer.device).total_memory / 2**30:.1f} GiB")
    for name in ("triton", "deepspeed", "tensorboard"):
        ok, detail = _optional_module(name)
        _check(name, ok, detail, required=False)
    train = trainer.train
    if train.enable_pytorch_profiler:
        directory = Path(train.profile_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            writable = os.access(directory, os.W_OK)
        except OSError:
            writable = False
        good &= _check("profile dir", writable, f"{directory} {'writable' if writable else 'NOT writable'}")
    good &= _check("forward/backward", *_tiny_step(trainer))
    print("setup check " + ("passed" if good else "FAILED"))
    return good


def _tiny_step(trainer) -> tuple[bool, str]:
    """One forward and backward of the configured model on a 2 x 8 batch: finite loss and gradients."""
    model = trainer.spec.build_model(trainer.model_config, trainer.args)
    model.load_canonical(init_canonical_weights(trainer.model_config, 0))
    model.to(trainer.device)
    seq = min(8, trainer.model_config.max_seq_len)
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, seq + 1), device=trainer.device)
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads_finite = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    ok = math.isfinite(loss.item()) and grads_finite
    return ok, f"loss {loss.item():.3f}, gradients {'finite' if grads_finite else 'MISSING or non-finite'}"


def check_outputs(trainer) -> bool:
    """After the run: the files the run was asked to write exist."""
    print("=== Output check ===")
    good = True
    train = trainer.train
    if train.enable_pytorch_profiler:
        trace = Path(train.profile_dir) / f"trace_{trainer.spec.name}.json"
        good &= _check("profiler trace", trace.exists(), str(trace))
    if train.output_json:
        good &= _check("metrics JSON", Path(train.output_json).exists(), train.output_json)
    print("outputs " + ("complete" if good else "MISSING"))
    return good
