"""Proving that two versions compute the same model: same canonical weights in, same logits, loss, gradients out.

Every version can load version 1's (canonical) weights and report its gradients in the canonical layout, so
one function call per version gives three comparable things:

    logits    [B, S, V]   of a forward pass without targets
    loss      scalar      of a forward pass with targets
    gradients {canonical parameter name: tensor} after loss.backward()

They are compared by relative error ||candidate - reference|| / ||reference||, computed in float64.
Used by the tests (tests/test_versions.py, tests/test_v2_equivalence.py) and by
benchmarks/validate_numerical_accuracy.py.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch

from .weights import init_canonical_weights

# Version name -> the module that defines its TinyLlama and SPEC.
VERSION_MODULES = {
    "v1": "version1_pytorch_baseline.tiny_llama_v1",
    "v2": "version2_pytorch_fused.tiny_llama_v2",
    "v3": "version3_triton.tiny_llama_v3",
    "v4": "version4_triton_ultra.tiny_llama_v4",
}


def version_name(text: str) -> str:
    """'v3', 'V3', '3' or a path ending in tiny_llama_v3.py -> 'v3'. ValueError for anything else."""
    stem = Path(text).name.lower()
    match = re.fullmatch(r"(?:tiny_llama_)?v?([1-4])(?:\.py)?", stem)
    if not match:
        raise ValueError(f"{text!r} is not a version: use v1, v2, v3, v4 or a path to tiny_llama_vK.py")
    return f"v{match.group(1)}"


def load_version(name: str):
    """The module of a version (it has TinyLlama and SPEC). Importing a Triton version picks the interpreter
    when there is no GPU, as the training scripts do."""
    return importlib.import_module(VERSION_MODULES[version_name(name)])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; infinity when out holds a NaN or an infinity (NaN never passes).
    Compared on the CPU: a GPU result may be checked against a CPU (float64) reference."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def forward_backward(model, weights, input_ids, targets, autocast_dtype=None):
    """Logits (inference call), loss and canonical-layout gradients (training call) of one model."""
    model.load_canonical(weights)
    model.zero_grad(set_to_none=True)
    device_type = input_ids.device.type
    context = (torch.autocast(device_type=device_type, dtype=autocast_dtype) if autocast_dtype
               else torch.autocast(device_type=device_type, enabled=False))
    with context:
        with torch.no_grad():
            logits, _ = model(input_ids)
        _, loss = model(input_ids, targets)
    loss.backward()
    grads = model.to_canonical({name: p.grad for name, p in model.named_parameters()})
    return logits.float(), loss.detach().float(), grads


def relative_errors(reference, candidate) -> dict[str, float | None]:
    """{"logits": e, "loss": e, <parameter name>: e, ...}: the relative error of each quantity, in that order.

    A gradient the candidate lacks (None, or no entry) maps to None.
    """
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = reference, candidate
    errors: dict[str, float | None] = {"logits": rel_err(logits, ref_logits), "loss": rel_err(loss, ref_loss)}
    for name, ref_grad in ref_grads.items():
        grad = grads.get(name)
        errors[name] = None if grad is None else rel_err(grad, ref_grad)
    return errors


def compare(reference, candidate, tolerance: float) -> list[str]:
    """Names (logits, loss, parameter names) whose relative error exceeds the tolerance, with the error."""
    failures = []
    for name, error in relative_errors(reference, candidate).items():
        if error is None:
            failures.append(f"{name} (no gradient)")
        elif error > tolerance:
            failures.append(f"{name} ({error:.2e})")
    return failures


def random_batch(config, batch, seq, device, seed=0):
    """(input_ids, targets) [batch, seq] of uniform random tokens, the same on every machine for a seed."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def canonical(config, seed=0):
    """Fresh canonical weights (version 1's layout) for `config`."""
    return init_canonical_weights(config, seed)
