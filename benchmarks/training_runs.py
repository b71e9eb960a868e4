"""A training script run the way the benchmarks run it: in a fresh process, its --output-json read back, a failure
turned into one line for the results table. Shared by compare_versions.py and scaling.py.

Why fresh processes: each run starts exactly as a workshop attendee starts it, and nothing leaks between runs
(version 4's TF32 switch, torch.compile caches, the CUDA caching allocator's pools, a process group).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "v1": "version1_pytorch_baseline/tiny_llama_v1.py",
    "v2": "version2_pytorch_fused/tiny_llama_v2.py",
    "v3": "version3_triton/tiny_llama_v3.py",
    "v4": "version4_triton_ultra/tiny_llama_v4.py",
    "hf": "benchmarks/hf_llama.py",   # the Hugging Face peer (benchmarks/variants.py)
}


@dataclass
class RunOutcome:
    metrics: dict | None        # the run's metrics JSON, or None when it failed
    error: str | None           # one line saying why it failed, or None
    wall_s: float | None        # seconds the process ran (None when it was stopped at the timeout)


def run_training(command: list[str], json_path: Path, timeout: float, **popen) -> RunOutcome:
    """Run `command` (a training script given --output-json json_path) and read the metrics it wrote."""
    started = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen)
    except subprocess.TimeoutExpired:
        return RunOutcome(None, f"timed out after {timeout} s", None)
    wall_s = time.perf_counter() - started
    if result.returncode != 0 or not json_path.exists():
        return RunOutcome(None, first_error_line(result.stdout + result.stderr, result.returncode), wall_s)
    return RunOutcome(json.loads(json_path.read_text()), None, wall_s)


# A traceback's exception line: "ValueError: ...", "torch._dynamo.exc.TorchRuntimeError: ...".
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*:")
MAX_ERROR_CHARS = 300


def first_error_line(output: str, code: int) -> str:
    """The script's own one-line error if it printed one, else the last exception line of a traceback (libraries
    such as torch.compile print hints after it: "Set TORCHDYNAMO_VERBOSE=1 ..."), else the last line; under
    torchrun, the launcher adds its report after the script's line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if ": error: " in line:
            return line
    exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
    chosen = exceptions[-1] if exceptions else (lines[-1] if lines else f"exit code {code}")
    return chosen if len(chosen) <= MAX_ERROR_CHARS else chosen[:MAX_ERROR_CHARS - 3] + "..."


def triton_shape_problem(runs: list[tuple[str, str, list[str]]]) -> str | None:
    """The first run a Triton version would refuse, found before any run starts instead of as a failed row after
    the other versions have run. `runs`: (where, version, the script's flags) for every planned run; only
    versions 3 and 4 have shape rules (tiny_llama_v3/v4.shape_problem_of_flags). Returns "where: problem"."""
    sys.path.insert(0, str(REPO_ROOT))
    from tinytransformer.config import ConfigError
    from tinytransformer.equivalence import load_version
    for where, version, flags in runs:
        if version not in ("v3", "v4"):
            continue
        try:
            problem = load_version(version).shape_problem_of_flags(flags)
        except ConfigError as error:
            problem = f"{version}: {error}"
        if problem:
            return f"{where}: {problem}"
    return None


def checked_preset(name: str):
    """configs/NAME.yaml as (ModelConfig, TrainConfig), each value checked by the rules the training scripts
    apply to it: a bad value (batch_size 0, a list) is one line now, not a failed run per row later."""
    from tinytransformer.config import ConfigError, ModelConfig, TrainConfig, preset_settings
    model_settings, train_settings = preset_settings(name)
    try:
        model, train = ModelConfig(**model_settings), TrainConfig(**train_settings)
        model.validate()
        train.validate_values()   # not validate(): the benchmark sets its own step counts
    except (TypeError, ConfigError) as error:
        raise ConfigError(f"preset {name} (configs/{name}.yaml): {error}") from None
    return model, train
