"""Values read from another run's files (metrics JSON, benchmark results, reports), checked where they are read.

A results file may be cut short, edited by hand, or written by another edition of a script. Used unchecked, such
a file ends in a traceback far from its cause, or worse in a wrong verdict (a negative samples/s reported as a
slow-down). So each reader checks every field it uses for presence, type and range, and a problem is ONE line
(ConfigError) that names the file and the field:

    run.json: throughput.samples_per_s must be a number, got 'fast' (a string)

`read_json_file` reads a file; `Fields` wraps one JSON object of it, and each accessor checks one field with the
same rules as a flag or a YAML value (checks.py). `check_metrics` is the check of the most read format, the metrics
JSON a training script writes with --output-json.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..checks import ConfigError, check_bool, check_int, check_number, check_text, describe_value


def read_json_file(path: str | Path, what: str):
    """The JSON document in `path`; `what` says what the file should be, for the error line."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{path}: cannot read it (no such file)")
    if not file.is_file():
        raise ConfigError(f"{path}: not a file (expected {what})")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text (UTF-8) file (expected {what})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{path}: not JSON ({reason}); expected {what}") from None


class Fields:
    """One JSON object of a file. Each accessor returns one field, checked; a missing field, or a field of the
    wrong type or out of range, raises ConfigError naming `file` and the field's path (e.g. rows[2].variant).
    `optional`: a field that is absent or null is None instead of an error."""

    def __init__(self, data, file: str | Path, where: str = "", what: str = "a JSON object"):
        self.file, self.where = str(file), where
        if not isinstance(data, dict) and not where:
            raise ConfigError(f"{self.file}: not {what} (it holds {_short_kind(data)})")
        if not isinstance(data, dict):
            raise ConfigError(f"{self.file}: {where} must be {what}, got {_short_kind(data)}")
        self.data = data

    def name(self, key: str) -> str:
        """How a field is named in an error: "file: where.key"."""
        return f"{self.file}: {self.where}{'.' if self.where else ''}{key}"

    def _value(self, key: str, optional: bool):
        """(present, value): absent (or null when optional) is (False, None); absent and required is an error."""
        if key not in self.data or (optional and self.data[key] is None):
            if optional:
                return False, None
            raise ConfigError(f"{self.name(key)} is missing")
        return True, self.data[key]

    def section(self, key: str, optional: bool = False) -> Fields | None:
        present, value = self._value(key, optional)
        return Fields(value, self.file, self.name(key).split(": ", 1)[1], "a JSON object") if present else None

    def items(self, key: str, optional: bool = False, allow_empty: bool = True) -> list[Fields] | None:
        """A list of JSON objects (the rows of a table), each as Fields."""
        values = self.list(key, optional, allow_empty)
        if values is None:
            return None
        where = self.name(key).split(": ", 1)[1]
        return [Fields(item, self.file, f"{where}[{index}]") for index, item in enumerate(values)]

    def list(self, key: str, optional: bool = False, allow_empty: bool = True) -> list | None:
        present, value = self._value(key, optional)
        if not present:
            return None
        if not isinstance(value, list):
            raise ConfigError(f"{self.name(key)} must be a list, got {_short_kind(value)}")
        if not value and not allow_empty:
            raise ConfigError(f"{self.name(key)} is empty")
        return value

    def integer(self, key: str, minimum: int | None = None, optional: bool = False) -> int | None:
        present, value = self._value(key, optional)
        return check_int(self.name(key), value, minimum) if present else None

    def number(self, key: str, positive: bool = False, minimum: float | None = None, optional: bool = False,
               finite: bool = True) -> float | None:
        """finite=False: also NaN and infinity (a loss that diverged is still a loss)."""
        present, value = self._value(key, optional)
        if not present:
            return None
        if not finite and isinstance(value, float) and not math.isfinite(value):
            return value
        return check_number(self.name(key), value, positive=positive, minimum=minimum)

    def text(self, key: str, optional: bool = False) -> str | None:
        present, value = self._value(key, optional)
        return check_text(self.name(key), value) if present else None

    def flag(self, key: str, optional: bool = False) -> bool | None:
        present, value = self._value(key, optional)
        return check_bool(self.name(key), value) if present else None

    def texts(self, key: str, optional: bool = False) -> list[str] | None:
        """A list of strings (commands, notes, problems)."""
        values = self.list(key, optional)
        for index, value in enumerate(values or []):
            check_text(f"{self.name(key)}[{index}]", value)
        return values

    def numbers(self, key: str, positive: bool = False, optional: bool = False) -> list[float] | None:
        values = self.list(key, optional)
        for index, value in enumerate(values or []):
            check_number(f"{self.name(key)}[{index}]", value, positive=positive)
        return values

    def scalars(self, key: str, optional: bool = False) -> dict | None:
        """A JSON object whose values are printed as they are: each a string, a number, a boolean or null."""
        section = self.section(key, optional)
        if section is None:
            return None
        for name, value in section.data.items():
            if value is not None and not isinstance(value, (str, int, float, bool)):
                raise ConfigError(f"{section.name(name)} must be a single value, got {_short_kind(value)}")
        return section.data


def _short_kind(value) -> str:
    """A wrong value described without printing all of it (a list of a thousand rows stays one short line)."""
    text = describe_value(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(value).__name__})"


# -- the metrics JSON of a training run (--output-json) ------------------------------------------------------
METRICS = "a metrics JSON written by --output-json of a tiny_llama_vK.py run"


def check_metrics(data, file: str | Path) -> dict:
    """`data` (the metrics JSON in `file`) unchanged, once every field the comparison scripts read is checked."""
    run = Fields(data, file, what=METRICS)
    run.section("throughput").number("samples_per_s", positive=True)
    train = run.section("train_config")
    train.integer("batch_size", 1)
    train.integer("seq_len", 1)
    train.flag("use_amp", optional=True)
    for key in ("amp_dtype", "data"):
        train.text(key, optional=True)
    run.scalars("model_config", optional=True)
    run.section("timing").number("median_ms", positive=True, optional=True)
    run.section("memory").number("peak_allocated_mib", minimum=0.0, optional=True)
    loss = run.section("loss", optional=True)
    if loss is not None:
        loss.number("final", optional=True, finite=False)
    run.scalars("variant", optional=True)
    run.scalars("device", optional=True)
    for key in ("version", "title", "precision"):
        run.text(key, optional=True)
    profile = run.section("profile", optional=True)
    if profile is not None:
        profile.number("kernels_per_step", minimum=0.0, optional=True)
    return data
