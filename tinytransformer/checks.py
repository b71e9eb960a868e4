"""Typed checks of single values: the one place that decides what an integer, a number, a switch or a choice is.

A value reaches a run from a flag, a YAML file or a checkpoint. All three go through these functions (the flags
through the argparse types of cli.py, the other two through ModelConfig / TrainConfig.validate), so a value that
a flag refuses is refused in a config file too, with the same words. Each raises ConfigError with one line.

The rules are strict on purpose: YAML turns `1e-3` into a string and `yes` into a boolean, and a loose check
would train with a value the user did not mean.
"""
from __future__ import annotations

import math
import os
import stat
from pathlib import Path


class ConfigError(ValueError):
    """An invalid input; its message is one line meant for the user (the CLI prints it and exits with 2).
    Defined here, beside the checks that raise it; config.py re-exports it."""

# Sizes, counts and steps. Far above anything that fits a machine (the memory estimate refuses those), low enough
# that products of a few of them stay inside int64 tensor arithmetic and numpy's index types.
INT_LIMIT = 2**31 - 1
SEED_LIMIT = 2**63 - 1   # seeds feed numpy's uint64 hashing and torch.manual_seed
# A settings file (a YAML config, a DeepSpeed JSON) is a few hundred bytes; one this large is not one.
SETTINGS_FILE_LIMIT = 4 * 2**20


def describe_value(value) -> str:
    """How a wrong value is described: "'12' (a string)", "True (a boolean)"."""
    names = {bool: "a boolean", str: "a string", float: "a float", type(None): "empty",
             list: "a list", dict: "a mapping"}
    return f"{value!r} ({names.get(type(value), type(value).__name__)})"


def check_int(name: str, value, minimum: int | None = None, maximum: int = INT_LIMIT) -> int:
    """An int (not a bool, not a string of digits, not a whole float) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = ""
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            hint = f" (write {int(value)})"
        elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            hint = " (remove the quotes)"
        raise ConfigError(f"{name} must be an integer, got {describe_value(value)}{hint}")
    if minimum is not None and value < minimum:
        bound = {0: "an integer >= 0", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ConfigError(f"{name} must be {bound}, got {value}")
    if value > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {value}")
    return value


def check_number(name: str, value, positive: bool = False, minimum: float | None = None) -> float:
    """A finite int or float (not a bool, not a string); positive (> 0) or >= minimum when asked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = (" (YAML reads a quoted value, or an exponent without a dot such as 1e-3, as text: "
                        "write 0.001 or 1.0e-3)")
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {describe_value(value)}{hint}")
    if isinstance(value, int):
        if abs(value) > 2**53:   # beyond this an int is no longer exact as a float
            raise ConfigError(f"{name} is too large, got {value}")
        value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if positive and not value > 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {describe_value(value)}")
    return value


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {describe_value(value)}")
    return value


def check_text(name: str, value, optional: bool = False) -> str | None:
    """A non-empty string (a path, a data source); None too when `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {describe_value(value)}")
    if not value:
        raise ConfigError(f"{name} must not be empty")
    if "\0" in value:
        raise ConfigError(f"{name} must not contain a NUL character")
    return value


# -- the same rules as argparse types: a flag's text is converted, then checked like any other value -----------
def parse_int(text: str, name: str, minimum: int | None, maximum: int = INT_LIMIT) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None
    return check_int(name, value, minimum, maximum)


def parse_number(text: str, name: str, positive: bool = False, minimum: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {text!r}") from None
    return check_number(name, value, positive=positive, minimum=minimum)


# -- files a command reads -------------------------------------------------------------------------------------
def check_input_file(path, what: str, max_bytes: int | None = None) -> Path:
    """A file a command reads (`what`: "config", "--data text:"): it must exist and be a regular file. A directory
    cannot be read, a device such as /dev/zero never ends (reading it fills the memory) and a pipe can block
    forever; `max_bytes` bounds files that have no business being large. Returns the path."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file (a device, a pipe or a socket cannot be read as one)")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ConfigError(f"{what} {path} is {info.st_size:,} bytes; a {what} file holds at most {max_bytes:,}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"cannot read {what} {path}: permission denied")
    return path


def read_settings_text(path, what: str) -> str:
    """The text of a small settings file (a YAML config, a DeepSpeed JSON), checked by check_input_file first."""
    path = check_input_file(path, what, SETTINGS_FILE_LIMIT)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not a text (UTF-8) file") from None
