"""One run per checkpoint directory, enforced with a lock file.

Two runs writing checkpoints into one directory would rotate away each other's files, and `--resume auto` would
pick up the other run's state. So rank 0 of a run that writes checkpoints creates DIR/.run.lock (host name and
process id) before it builds anything, and removes it when the run ends, however it ends. At the next start:

  - a lock of a live process on this host: the directory is in use; one line, exit 2;
  - a lock of a process on this host that no longer exists (a killed run): stale; taken over, with a note;
  - a lock written on another host: this host cannot tell whether that run still lives (a shared file system);
    one line saying so, never taken over silently: the user deletes the lock file once sure.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from ...outputs import write_atomically
from . import CheckpointError

LOCK_NAME = ".run.lock"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, under another user
        return True
    except (OSError, OverflowError):
        return False
    return True


class DirectoryLock:
    def __init__(self, directory: str | Path, log):
        self.path = Path(directory) / LOCK_NAME
        self.log = log
        self.held = False
        self.created_directory = False
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> None:
        if self.path.exists() and not self.path.is_file():   # a directory of that name cannot be replaced
            raise CheckpointError(f"the lock file {self.path} exists and is not a file (a directory?); remove it "
                                  f"(one run per checkpoint directory relies on it)")
        self.created_directory = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.mine) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self._take_over_if_stale(text)
        except OSError as error:
            raise CheckpointError(f"cannot create the lock file {self.path}: {error.strerror or error}") from None
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
        self.held = True

    def _take_over_if_stale(self, text: str) -> None:
        try:
            owner = json.loads(self.path.read_text(encoding="utf-8"))
            host, pid, since = str(owner["host"]), int(owner["pid"]), str(owner.get("since", "?"))
        except (OSError, ValueError, KeyError, TypeError):
            host, pid, since = None, None, "?"
        directory = self.path.parent
        if host is not None and host != self.mine["host"]:
            raise CheckpointError(f"--checkpoint-dir {directory} is locked by a run on host {host} (pid {pid}, since "
                                  f"{since}); one run per checkpoint directory. If that run has ended, delete "
                                  f"{self.path}")
        if pid == os.getpid():   # this process's own (an earlier run in it that was built but never run)
            self._write(text)
            return
        if pid is not None and _process_alive(pid):
            raise CheckpointError(f"--checkpoint-dir {directory} is in use by another run (pid {pid} on this host, "
                                  f"since {since}); one run per checkpoint directory: choose another one or stop "
                                  f"that run")
        what = f"pid {pid}, no longer running" if pid is not None else "unreadable"
        self.log(f"note: taking over the stale lock of {directory}/ ({what})")
        self._write(text)

    def _write(self, text: str) -> None:
        try:
            write_atomically(self.path, lambda file: file.write(text))
        except OSError as error:
            raise CheckpointError(f"cannot replace the lock file {self.path}: {error.strerror or error}") from None

    def release(self) -> None:
        """Remove the lock if it is still this process's (never another run's)."""
        if not self.held:
            return
        self.held = False
        try:
            owner = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if owner.get("pid") == self.mine["pid"] and owner.get("host") == self.mine["host"]:
            self.path.unlink(missing_ok=True)
            if self.created_directory:   # a run that wrote no checkpoint leaves no empty directory behind
                try:
                    self.path.parent.rmdir()
                except OSError:
                    pass
