"""Output paths proven before any work: every file or directory a command will write is checked first.

A run that trains for an hour and then cannot write its metrics JSON has lost the hour. So each command calls
`prove_output_file` / `prove_output_dir` for every output before it starts: the path must be of the right kind
(a file where a file goes, a directory where a directory goes), and a probe file is created and removed where the
output will go. The probe catches what no permission bit shows: read-only mounts, names too long for the file
system, pseudo file systems such as /proc. Directories created for the probe are removed again, so a command that
fails later for another reason leaves nothing behind. Each problem is a ConfigError: one line, exit 2.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .checks import ConfigError
from .outputs import temporary_path


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _kind(path: Path, flag: str, target: Path) -> str | None:
    """"dir", "file", "other" (a device, a socket, ...) or None (absent). A name the file system cannot even look
    up (too long, a loop of links, no permission to search) is one line."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise ConfigError(f"{flag} {target}: cannot use this path ({_reason(error)})") from None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _check_ancestors(path: Path, flag: str) -> None:
    """Every existing ancestor of `path` must be a directory (a file there makes the path impossible)."""
    for ancestor in reversed(path.parents):
        if _kind(ancestor, flag, path) not in (None, "dir"):
            raise ConfigError(f"{flag} {path}: {ancestor} is a file, not a directory")


def _create_missing(directory: Path, flag: str, target: Path) -> list[Path]:
    """Create `directory` and its missing parents; return those created (outermost first)."""
    missing = []
    for candidate in [directory, *directory.parents]:
        if _kind(candidate, flag, target) is not None:
            break
        missing.append(candidate)
    created = []
    try:
        for candidate in reversed(missing):
            candidate.mkdir()
            created.append(candidate)
    except OSError as error:
        _remove_created(created)
        raise ConfigError(f"{flag} {target}: cannot create the directory {candidate} ({_reason(error)})") from None
    return created


def _remove_created(created: list[Path]) -> None:
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:   # something else wrote there meanwhile: leave it
            pass


def _probe(probe: Path, flag: str, target: Path) -> None:
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:   # a leftover of this very process id; still proves nothing about writing
        probe.unlink(missing_ok=True)
        return _probe(probe, flag, target)
    except OSError as error:
        raise ConfigError(f"{flag} {target}: cannot write there ({_reason(error)})") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def prove_output_file(path: str | Path, flag: str) -> Path:
    """A file the command will write (atomically: outputs.write_atomically), proven writable now."""
    path = Path(path)
    if str(path) in ("", ".") or path.name in ("", ".", ".."):
        raise ConfigError(f"{flag} {str(path)!r}: give a file name")
    _check_ancestors(path, flag)
    kind = _kind(path, flag, path)
    if kind == "dir":
        raise ConfigError(f"{flag} {path} is a directory; give a file name (e.g. {path / 'results.json'})")
    if kind == "other":
        raise ConfigError(f"{flag} {path} exists and is not a regular file")
    created = _create_missing(path.parent, flag, path)
    try:
        _probe(temporary_path(path), flag, path)   # the very name the atomic write will create
    finally:
        _remove_created(created)
    return path


def prove_output_dir(path: str | Path, flag: str, keep: bool = False) -> Path:
    """A directory the command will write into, proven writable now; `keep`: leave it created (the command
    writes there at once anyway)."""
    path = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag} must not be empty")
    _check_ancestors(path, flag)
    if _kind(path, flag, path) not in (None, "dir"):
        raise ConfigError(f"{flag} {path} is a file, not a directory")
    created = _create_missing(path, flag, path)
    try:
        # As long as the longest name the harness writes there (checkpoints' temporary files, trace files).
        _probe(path / f".write-probe-{'x' * 24}.tmp-{os.getpid()}", flag, path)
    except ConfigError:
        _remove_created(created)
        raise
    if not keep:
        _remove_created(created)
    return path


def ensure_directory(path: str | Path, flag: str) -> Path:
    """The output directory a command-line `flag` names, proven writable and created (the command writes there
    at once)."""
    return prove_output_dir(path, flag, keep=True)


def prove_outputs(*outputs: tuple[str, str | Path | None, str]) -> None:
    """Each (flag, path, "file" or "dir") given (path not None), proven, and no two files the same; the first
    problem raises ConfigError."""
    refuse_shared_outputs([(flag, path) for flag, path, kind in outputs if kind == "file"])
    for flag, path, kind in outputs:
        if path is None:
            continue
        (prove_output_dir if kind == "dir" else prove_output_file)(path, flag)


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same inode where both exist (links, `..`, a second spelling), else
    the same absolute path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def refuse_shared_outputs(outputs) -> None:
    """Two outputs of one command naming one file ((flag, path or None) each) would leave only the one written
    last: one line (ConfigError) before any work."""
    named = [(flag, path) for flag, path in outputs if path is not None]
    for index, (flag, path) in enumerate(named):
        for earlier_flag, earlier_path in named[:index]:
            if same_file(Path(path), Path(earlier_path)):
                raise ConfigError(f"{flag} {path} is also the file {earlier_flag} writes; give each output its "
                                  f"own file")


def refuse_output_over_input(outputs, inputs) -> None:
    """No output may replace a file the command reads: each of `outputs` and `inputs` is (flag, path or None), and
    an output naming the same file as an input is one line (ConfigError) before any work, not an overwritten
    input after it."""
    for out_flag, out_path in outputs:
        if out_path is None:
            continue
        for in_flag, in_path in inputs:
            if in_path is not None and same_file(Path(out_path), Path(in_path)):
                raise ConfigError(f"{out_flag} {out_path} is the file {in_flag} reads; write the output elsewhere")
