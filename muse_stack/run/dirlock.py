"""An advisory lock on a run directory: one writer at a time.

``flock`` on ``RUN_DIR/.lock``, held from creation (or resume) to the last write. The
kernel drops it when the process dies, however it dies, so a killed run never leaves a
stale lock; a second writer is refused with the holder's pid.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from muse_stack.util.errors import InputError

LOCK = ".lock"


class RunLock:
    def __init__(self, directory: Path, field: str = "--resume") -> None:
        self.path = Path(directory) / LOCK
        self.field = field  #: the option that named the directory, for the errors
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only file system or folder, a lock path that is a folder, ...
            raise InputError(f"cannot open the run directory's lock file {self.path} for writing: "
                             f"{exc.strerror or exc}; a run writes into its directory", field=self.field,
                             value=str(self.path.parent),
                             fix="make the run directory writable (a read-only mount: mount it read-write, or copy "
                                 "the run directory to a writable place and resume the copy)") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InputError(f"the run directory is being written by another process (pid {holder})",
                             field=self.field, value=str(self.path.parent),
                             fix="wait for that process to finish (or stop it) before resuming this run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
