"""Checks of the checkpoint fields a resume restores besides the weights: the random-number states, the
optimizer's scalar state, the loss scaler and the histories.

Each field is checked by type and range before anything is restored, so that a damaged file is one line naming
the field, never a crash inside numpy, `random` or torch half-way through the set-up, and never a value those
libraries would take silently (numpy accepts any position in its key array). Every check calls
`require(condition, problem)`, which raises the CheckpointError naming the file (loading.validate_structure).
"""
from __future__ import annotations

import math
import random

import numpy as np
import torch

MT_WORDS = 624                 # a Mersenne Twister state: 624 32-bit words (numpy's MT19937, Python's random)
WORD_LIMIT = 2**32
PYTHON_RANDOM_VERSION = 3      # the format of random.getstate() since Python 3.2
CUDA_RNG_STATE_BYTES = 16      # torch.cuda.get_rng_state(): the Philox seed and offset, 8 bytes each
# What AdamW (torch's, and version 4's own) keeps: a step count shared by every parameter, and per parameter the
# two moments (plus the running maximum of the second under amsgrad).
OPTIMIZER_SCALARS = ("step",)
OPTIMIZER_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
NON_NEGATIVE_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")   # square roots are taken of these
SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


def _finite_float(value) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _trial_restore(restore, field: str, require) -> None:
    """Restore into a throwaway generator: what the library itself refuses (torch checks its state's content)
    is refused here too, before the run's own generators are touched."""
    try:
        restore()
    except (ValueError, TypeError, RuntimeError, OverflowError) as error:
        require(False, f"{field} is not a valid state ({str(error).strip().splitlines()[0][:80]})")


# -- random-number states ------------------------------------------------------------------------------------
def require_rng_states(rng: dict, require) -> None:
    require(isinstance(rng.get("torch"), torch.Tensor) and isinstance(rng.get("cuda"), list)
            and isinstance(rng.get("numpy"), dict) and isinstance(rng.get("python"), dict),
            "random-number states are missing")
    _require_torch_state(rng["torch"], require)
    for index, state in enumerate(rng["cuda"]):
        require(_is_byte_vector(state, CUDA_RNG_STATE_BYTES),
                f"rng.cuda[{index}] must be a uint8 tensor of {CUDA_RNG_STATE_BYTES} bytes")
    _require_numpy_state(rng["numpy"], require)
    _require_python_state(rng["python"], require)


def _is_byte_vector(value, size: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and tuple(value.shape) == (size,)


def _require_torch_state(state, require) -> None:
    size = torch.get_rng_state().numel()
    require(_is_byte_vector(state, size), f"rng.torch must be a uint8 tensor of {size} bytes")
    _trial_restore(lambda: torch.Generator().set_state(state), "rng.torch", require)


def _require_numpy_state(state: dict, require) -> None:
    require(state.get("kind") == "MT19937", f"rng.numpy.kind must be 'MT19937', got {state.get('kind')!r}")
    keys = state.get("keys")
    require(isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and tuple(keys.shape) == (MT_WORDS,)
            and bool(((keys >= 0) & (keys < WORD_LIMIT)).all()),
            f"rng.numpy.keys must be {MT_WORDS} 32-bit words (an int64 tensor)")
    require(_int_in(state.get("pos"), 0, MT_WORDS),
            f"rng.numpy.pos must be an integer in [0, {MT_WORDS}], got {state.get('pos')!r}")
    require(_int_in(state.get("has_gauss"), 0, 1), f"rng.numpy.has_gauss must be 0 or 1, got "
                                                   f"{state.get('has_gauss')!r}")
    require(_finite_float(state.get("cached_gaussian")),
            f"rng.numpy.cached_gaussian must be a finite float, got {state.get('cached_gaussian')!r}")
    as_tuple = (state["kind"], keys.numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                state["cached_gaussian"])
    _trial_restore(lambda: np.random.RandomState().set_state(as_tuple), "rng.numpy", require)


def _require_python_state(state: dict, require) -> None:
    require(state.get("version") == PYTHON_RANDOM_VERSION and _is_int(state.get("version")),
            f"rng.python.version must be {PYTHON_RANDOM_VERSION}, got {state.get('version')!r}")
    internal = state.get("internal")
    # The 624 words of the state, then the position in them.
    require(isinstance(internal, list) and len(internal) == MT_WORDS + 1
            and all(_int_in(word, 0, WORD_LIMIT - 1) for word in internal[:-1])
            and _int_in(internal[-1], 0, MT_WORDS),
            f"rng.python.internal must be {MT_WORDS} 32-bit words and a position in [0, {MT_WORDS}]")
    gauss = state.get("gauss_next")
    require(gauss is None or _finite_float(gauss), f"rng.python.gauss_next must be empty or a finite float, got "
                                                   f"{gauss!r}")
    as_tuple = (state["version"], tuple(internal), gauss)
    _trial_restore(lambda: random.Random().setstate(as_tuple), "rng.python", require)


# -- optimizer, loss scaler ----------------------------------------------------------------------------------
def require_optimizer_scalars(scalars: dict, step: int, require) -> None:
    """AdamW's step count: a whole number of optimizer steps, at most the checkpoint's step (a float16 loss
    scaler skips steps, so it may be fewer)."""
    for key, value in scalars.items():
        require(key in OPTIMIZER_SCALARS, f"optimizer.scalars holds an unknown entry {key!r}")
        if isinstance(value, torch.Tensor):
            require(value.dim() == 0 and not value.is_complex(), f"optimizer.scalars.{key} must be a scalar")
            value = value.item()
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and float(value).is_integer() and 0 <= value <= step,
                f"optimizer.scalars.{key} must be a whole number of steps in [0, {step}], got {value!r}")


def require_optimizer_tensor_kinds(per_parameter: dict, require) -> None:
    for key, tensors in per_parameter.items():
        require(key in OPTIMIZER_TENSORS, f"optimizer.per_parameter holds an unknown state {key!r}")
        if key in NON_NEGATIVE_MOMENTS:
            require(all(bool((t >= 0).all()) for t in tensors.values()),
                    f"optimizer.per_parameter.{key} holds negative values (a second moment is never negative)")


def require_scaler_state(state, require) -> None:
    """The float16 loss scaler's state: None, {} (a disabled scaler) or GradScaler.state_dict()'s five entries."""
    if state is None or state == {}:
        return
    require(isinstance(state, dict) and sorted(state) == sorted(SCALER_KEYS),
            f"grad_scaler must hold {', '.join(SCALER_KEYS)}")
    require(_finite_float(state["scale"]) and state["scale"] > 0, "grad_scaler.scale must be a positive float")
    require(_finite_float(state["growth_factor"]) and state["growth_factor"] > 1,
            "grad_scaler.growth_factor must be a float above 1")
    require(_finite_float(state["backoff_factor"]) and 0 < state["backoff_factor"] < 1,
            "grad_scaler.backoff_factor must be a float between 0 and 1")
    require(_int_in(state["growth_interval"], 1, 2**31 - 1), "grad_scaler.growth_interval must be a positive "
                                                             "integer")
    require(_int_in(state["_growth_tracker"], 0, 2**31 - 1), "grad_scaler._growth_tracker must be an integer >= 0")


# -- histories -----------------------------------------------------------------------------------------------
def require_histories(history: dict, step: int, trained_on_nan: bool, require) -> None:
    """One training loss per completed step and [step, loss] validation pairs of completed steps. The losses are
    finite unless the run that wrote the file trained on with --no-stop-on-nan: otherwise a non-finite value
    cannot have been written (a run stops before checkpointing a diverged loss), so the file is damaged."""
    losses = history.get("train_loss")
    require(isinstance(losses, list) and len(losses) == step and all(isinstance(v, float) for v in losses),
            "the loss history does not have one value per completed step")
    evals = history.get("eval")
    require(isinstance(evals, list) and all(isinstance(e, list) and len(e) == 2 and _int_in(e[0], 1, step)
                                            and isinstance(e[1], float) for e in evals),
            "the validation history is missing or malformed")
    if trained_on_nan:
        return
    for name, values in (("history.train_loss", losses), ("history.eval", [value for _, value in evals])):
        bad = next((value for value in values if not math.isfinite(value)), None)
        require(bad is None, f"{name} holds a non-finite loss ({bad}) although the run that wrote it stops on one")
