"""The two results formats the benchmarks write and read back: compare_versions.py's (also merge_presets.py's)
and scaling.py's. Each check returns the document unchanged once every field a reader uses has the right type and
range, or raises ONE ConfigError line naming the file and the field (tinytransformer/profiling/result_fields.py).
Readers (make_readme_table.py, merge_presets.py, compare_versions.py --resume) call them as they load a file, so
a hand-edited or cut-short file is refused before it can become a traceback or a wrong table.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared harness

from tinytransformer.profiling.result_fields import Fields, read_json_file  # noqa: E402

COMPARISON = "compare_versions.py results"
SCALING = "benchmarks/scaling.py results"


def _check_measured(row: Fields) -> None:
    """The figures of a run that finished (a failed row has an `error` line instead)."""
    row.number("samples_per_s", positive=True)
    for key in ("tokens_per_s", "median_step_ms"):
        row.number(key, positive=True, optional=True)
    for key in ("mfu", "kernels_per_step", "speedup", "efficiency"):
        row.number(key, minimum=0.0, optional=True)
    row.number("final_loss", optional=True, finite=False)
    row.integer("parameters", 1, optional=True)
    row.list("repeats_samples_per_s", optional=True)   # a failed repeat is null there


def _check_error(row: Fields) -> bool:
    """Whether the row is a failed run (then its `error` is its one line of explanation)."""
    if "error" not in row.data:
        return False
    row.text("error")
    return True


def check_comparison_row(row: Fields, preset_required: bool = False) -> None:
    row.text("variant")
    row.text("preset", optional=not preset_required)
    row.integer("batch_size", 1)
    row.integer("seq_len", 1)
    row.integer("repeat", 0, optional=True)
    if _check_error(row):
        return
    _check_measured(row)
    for key in ("peak_memory_mib", "speedup_vs_v1"):
        row.number(key, minimum=0.0, optional=True)
    row.number("first_loss", optional=True, finite=False)


def check_comparison(data, file: str | Path, need_rows: bool = True, preset_required: bool = False) -> dict:
    """compare_versions.py results (one run, or presets joined by merge_presets.py). need_rows: a file to show or
    join, whose rows and environment must be there (a file --resume continues may have neither yet: the resumed
    run writes its own environment); preset_required: every row names its preset."""
    results = Fields(data, file, what=f"{COMPARISON} (a JSON object)")
    results.text("command")
    environment = results.section("environment", optional=not need_rows)
    if environment is not None:
        environment.text("torch")
        for key in ("gpu", "backend", "triton"):
            environment.text(key, optional=True)
    results.text("dtype")
    results.integer("num_steps", 1)
    results.integer("warmup_steps", 0)
    results.integer("repeats", 1, optional=True)
    results.flag("profile", optional=True)
    for key in ("preset", "note"):
        results.text(key, optional=True)
    for key in ("resumed_by", "loss_agreement_problems"):
        results.texts(key, optional=True)
    for row in results.items("rows", allow_empty=not need_rows):
        check_comparison_row(row, preset_required)
    for run in results.items("runs", optional=True) or []:
        check_comparison_row(run, preset_required)
    for part in results.items("parts", optional=True) or []:
        part.texts("presets")
        part.text("command")
        part.text("note", optional=True)
        for key in ("resumed_by", "loss_agreement_problems"):
            part.texts(key, optional=True)
    return data


def read_comparison(path: str | Path, need_rows: bool = True, preset_required: bool = False) -> dict:
    return check_comparison(read_json_file(path, COMPARISON), path, need_rows, preset_required)


def check_scaling(data, file: str | Path) -> dict:
    """benchmarks/scaling.py results: one row per (version, preset, process count)."""
    results = Fields(data, file, what=f"{SCALING} (a JSON object)")
    results.text("engine")
    results.integer("zero_stage", 0, optional=True)
    results.texts("extra_flags", optional=True)
    environment = results.section("environment")
    environment.text("gpu", optional=True)
    environment.integer("gpus_visible", 0, optional=True)
    for row in results.items("rows"):
        row.text("version")
        row.text("preset")
        row.integer("gpus", 1)
        row.text("launcher", optional=True)
        row.text("gradients_averaged_by", optional=True)
        if _check_error(row):
            continue
        _check_measured(row)
        row.integer("global_batch_size", 1)
        row.number("median_step_ms", positive=True)
        row.number("peak_memory_mib_per_gpu", minimum=0.0, optional=True)
    return data


def read_scaling(path: str | Path) -> dict:
    return check_scaling(read_json_file(path, SCALING), path)
