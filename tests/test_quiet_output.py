"""No third-party noise in a run's output: DeepSpeed's accelerator warning, torch's FutureWarning about the
memory-timeline exporter."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tinytransformer.profiling.session import PyTorchProfilerSession

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
        "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]


def test_validate_setup_prints_no_deepspeed_accelerator_warning(tmp_path):
    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    result = subprocess.run([sys.executable, str(REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py"),
                             *TINY, "--num-steps", "2", "--validate-setup"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[ok  ] deepspeed" in result.stdout or "[skip] deepspeed" in result.stdout
    assert "Setting accelerator" not in result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr


def test_memory_timeline_export_raises_no_future_warning(tmp_path):
    session = PyTorchProfilerSession(str(tmp_path), "v1", 1, torch.device("cpu"), profile_memory=True)

    class DeprecatedExporter:   # what torch 2.9+ does: a FutureWarning, then the export
        def export_memory_timeline(self, path, device=None):
            warnings.warn("`export_memory_timeline` is deprecated and will be removed in a future version.",
                          FutureWarning, stacklevel=2)
            Path(path).write_text("<html></html>")

    session.profiler = DeprecatedExporter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = session.export_memory_timeline()
    assert path is not None and path.exists()
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]


def test_memory_timeline_without_the_exporter_is_one_note(tmp_path, capsys):
    session = PyTorchProfilerSession(str(tmp_path), "v1", 1, torch.device("cpu"), profile_memory=True)
    session.profiler = object()   # a future torch without profile.export_memory_timeline
    assert session.export_memory_timeline() is None
    assert capsys.readouterr().out.count("\n") == 1
