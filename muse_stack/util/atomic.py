"""Atomic file writes: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    """The process umask, read without changing it where Linux reports it (os.umask can only set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_temp_dir(target: str | os.PathLike[str]) -> Path:
    """A hidden staging directory beside ``target`` that will be renamed to it: created with the
    mode a plain ``mkdir`` gives (0777 less the umask: group-readable under a shared umask such as
    0002 or 0027), not mkdtemp's private 0700, which the rename would give the published folder."""
    target = Path(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    return staging


def follow_umask(root: str | os.PathLike[str]) -> None:
    """Give a folder written by libraries (safetensors writes its files 0600; mkdtemp makes 0700)
    the modes a plain ``open`` and ``mkdir`` would have given: 0666 / 0777 less the umask. Called
    on a checkpoint or an export before it is published."""
    mask = _umask()
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        try:
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        except PermissionError:  # another user's file (a rank running as another uid): its own mode stands
            pass


def write_bytes(path: str | os.PathLike[str], data: bytes, *, field: str = "output",
                private: bool = False) -> Path:
    """Write ``path`` whole or not at all. The file gets the mode a plain ``open`` would give it
    (0666 less the umask: 0644 by default), not mkstemp's private 0600, so a team on a shared
    filesystem can read each other's runs; ``private`` keeps it 0600 whatever the umask (a file
    that holds a secret). A parent that is a file or not writable is an InputError naming ``field``."""
    from muse_stack.util.errors import InputError

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except (NotADirectoryError, FileExistsError) as exc:
        raise InputError("a parent of the path is a file, not a directory", field=field, value=str(path),
                         fix="choose a path under a directory") from exc
    except OSError as exc:
        raise InputError(f"cannot write here: {exc.strerror or exc}", field=field, value=str(path),
                         fix="choose a path under a directory you can write to") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600 if private else 0o666 & ~_umask())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except IsADirectoryError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError("the path is a directory", field=field, value=str(path), fix="give a file path") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike[str], text: str, *, field: str = "output", private: bool = False) -> Path:
    """Write text whole; the credentials of any URL in it are redacted on the way (a URL is never
    written with its user:password)."""
    from muse_stack.util.safeio import redact_urls

    return write_bytes(path, redact_urls(text).encode("utf-8"), field=field, private=private)


def write_json(path: str | os.PathLike[str], obj: Any, *, field: str = "output") -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", field=field)


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one complete line and fsync it (used for metrics.jsonl)."""
    from muse_stack.util.safeio import redact_urls

    with open(path, "a", encoding="utf-8") as fh:
        fh.write(redact_urls(line.rstrip("\n")) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def disk_full(exc: BaseException) -> bool:
    """Whether a failed write failed because its file system is full or over quota (an OSError
    with ENOSPC / EDQUOT, or a writer library's error that wraps one), anywhere in its causes."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(cur)
        if f"os error {errno.ENOSPC})" in text or os.strerror(errno.ENOSPC) in text:
            return True
        cur = cur.__cause__ or cur.__context__
    return False
