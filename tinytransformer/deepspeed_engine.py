"""DeepSpeed as the training engine (--deepspeed): its configuration, the engine, and the step it runs.

DeepSpeed is optional. Everything about it that can fail (not installed, a config file that is unreadable or
disagrees with the flags) is checked by prepare_deepspeed before any process waits for another, so a bad input
is one line on every rank. The process group itself is distributed.py's: DeepSpeed joins the same job that
torchrun (or the deepspeed launcher) started.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

from .checks import read_settings_text
from .config import ConfigError, TrainConfig, check_zero_stage
from .distributed import DistributedContext, is_main_process, launched_by_torchrun, launcher_int

DEEPSPEED_MISSING = "DeepSpeed is not installed: pip install deepspeed"


def choose_deepspeed_accelerator(device: torch.device, env=os.environ) -> None:
    """DeepSpeed picks its "accelerator" once, when it is first imported. Left to guess on a machine without a
    GPU, it warns ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it."), and on a GPU machine it would take the GPU even for a --device cpu run. The harness knows the device:
    a CPU run says so before any part of it imports DeepSpeed (--deepspeed, --validate-setup's check of the
    installed libraries, the FLOPS profiles). A DS_ACCELERATOR the user set is kept."""
    if device.type == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")


def import_deepspeed(device: torch.device):
    """The deepspeed module, or ConfigError with the one line that says how to install it."""
    choose_deepspeed_accelerator(device)
    try:
        with _quiet_unless_main():
            import deepspeed
    except ImportError:
        raise ConfigError(DEEPSPEED_MISSING) from None
    return deepspeed


@contextlib.contextmanager
def _quiet_unless_main():
    """DeepSpeed prints set-up messages from every rank; keep only rank 0's."""
    if is_main_process():
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def read_deepspeed_config(path: str | None) -> dict:
    """The user's DeepSpeed JSON file (or {}), checked to be a JSON object."""
    if path is None:
        return {}
    text = read_settings_text(path, "--deepspeed-config")
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--deepspeed-config {path} is not valid JSON: {error}") from None
    except RecursionError:   # the decoder recurses once per level of nesting
        raise ConfigError(f"--deepspeed-config {path} is nested too deeply to be a DeepSpeed config") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"--deepspeed-config {path} must hold a JSON object, got {type(settings).__name__}")
    return settings


def build_deepspeed_config(train: TrainConfig, world_size: int, file_settings: dict | None = None) -> dict:
    """The DeepSpeed configuration of this run: the user's file (if any) with the harness's settings on top.

    The harness owns the batch (--batch-size per rank, no gradient accumulation), the optimizer (torch's AdamW,
    passed to deepspeed.initialize so no DeepSpeed op needs compiling), the learning-rate schedule (a function
    of the step, set before each step) and the precision (--use-amp/--amp-dtype -> DeepSpeed's bf16/fp16
    sections). A file that sets any of these differently is an error rather than a silent override.
    """
    config = dict(file_settings or {})
    for owned in ("optimizer", "scheduler"):
        if owned in config:
            raise ConfigError(f"the DeepSpeed config sets '{owned}': remove it; the harness passes torch's AdamW "
                              f"and sets the learning rate of every step itself (--learning-rate, --lr-schedule)")
    batch = {"train_micro_batch_size_per_gpu": train.batch_size, "gradient_accumulation_steps": 1,
             "train_batch_size": train.batch_size * world_size}
    for key, value in batch.items():
        if config.get(key, "auto") not in ("auto", value):
            raise ConfigError(f"the DeepSpeed config sets {key}={config[key]!r}, but this run needs {value} "
                              f"(--batch-size {train.batch_size} per rank x {world_size} rank(s)); remove it")
        config[key] = value
    zero = dict(_section(config, "zero_optimization"))
    if train.zero_stage is not None:
        zero["stage"] = train.zero_stage
    zero.setdefault("stage", 0)
    check_zero_stage(zero["stage"])
    config["zero_optimization"] = zero
    wanted = train.amp_dtype if train.use_amp else None
    for section, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        enabled_in_file = _switch(_section(config, section), section, "enabled")
        if enabled_in_file and wanted != dtype:
            raise ConfigError(f"the DeepSpeed config enables '{section}'; request it with --use-amp --amp-dtype "
                              f"{dtype} instead (the run's precision comes from the flags)")
        config[section] = {**_section(config, section), "enabled": wanted == dtype}
    config.setdefault("steps_per_print", 2**31 - 1)   # the harness prints its own step lines
    return config


def _section(config: dict, name: str) -> dict:
    """A section of the DeepSpeed config that this file reads: absent, null or a JSON object; anything else
    (`"zero_optimization": 5`) is one line, not a crash further down."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"the DeepSpeed config's '{name}' must be a JSON object, got {value!r}")
    return value


def _switch(section: dict, section_name: str, key: str) -> bool:
    """A true/false entry of a section: a JSON boolean, not the string "false" (which bool() would call true)."""
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"the DeepSpeed config's '{section_name}.{key}' must be true or false, got {value!r}")
    return value


def prepare_deepspeed(train: TrainConfig, device: torch.device, env=os.environ) -> dict:
    """Everything about --deepspeed that can fail, checked before any process waits for another: DeepSpeed is
    importable, the config file is readable and agrees with the flags. Returns the DeepSpeed config."""
    world_size = launcher_int(env, "WORLD_SIZE") if launched_by_torchrun(env) else 1
    config = build_deepspeed_config(train, world_size, read_deepspeed_config(train.deepspeed_config))
    import_deepspeed(device)
    return config


def initialize_deepspeed(model, optimizer, config: dict, context: DistributedContext):
    """deepspeed.initialize around the (unwrapped, loaded, on-device) model and torch's AdamW; returns the engine.

    Stage 0 is plain data parallelism; stage 1 partitions the optimizer state (AdamW's two moments) over the
    ranks, stage 2 the gradients too: each rank then keeps 1/N of them, which saves memory, not time.
    With bf16 (--use-amp --amp-dtype bfloat16) DeepSpeed keeps the weights in bfloat16 and a float32 master copy
    in the optimizer, instead of autocasting float32 weights.
    """
    deepspeed = import_deepspeed(context.device)
    import logging
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)   # its INFO lines would bury the harness's output
    with _quiet_unless_main():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class DeepSpeedStep:
    """The training step under DeepSpeed: the engine runs forward, backward (with its gradient reduction and,
    under float16, its loss scaling) and the optimizer step (which also zeroes the gradients)."""

    supports_breakdown = False

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, inputs, targets):
        _, loss = self.engine(inputs, targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach().float()

