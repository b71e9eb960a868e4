"""Result files: the metrics JSON of a run, the JSON of a benchmark, checkpoints, output directories and plots.

Every result file is written atomically: into a temporary file in the same directory, then renamed over its
name. A rename within one file system is atomic, so a reader (another script, a resumed benchmark, a crash or a
Ctrl-C half-way) finds the previous file or the new one, never half of one. The temporary file is named
.NAME.tmp-PID, so a directory listing that looks for NAME never mistakes it for a result.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, IO


def temporary_path(path: Path) -> Path:
    """Where `path` is written before the rename: beside it (same file system), hidden, this process's own."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomically(path: str | Path, write: Callable[[IO], None], binary: bool = False,
                     durable: bool = False) -> Path:
    """Create the parent directories, call `write(file)` on the temporary file, then rename it over `path`.

    durable: also fsync the file and its directory, so the new file survives a power cut (checkpoints).
    Any failure, KeyboardInterrupt included, removes the temporary file and leaves `path` as it was.
    """
    path = Path(path)
    temporary = temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as file:
            write(file)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable; not every platform can open a directory (Windows), which is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str | Path, data) -> Path:
    """`data` as indented JSON (a value JSON cannot hold, such as a path, written as its string)."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    return write_atomically(path, lambda file: file.write(text))


def load_pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed (it is optional)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt
    return plt
