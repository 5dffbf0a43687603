"""Shared objects the process has actually mapped, read from /proc/self/maps.

Package metadata can name one version while the process loaded another (an LD_PRELOAD,
a second copy on LD_LIBRARY_PATH, a library bundled in a wheel); the maps file is the
ground truth of what runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from muse_stack.fingerprint.hashing import is_shared_object

MAPS = "/proc/self/maps"


def parse_maps(text: str) -> list[str]:
    """Unique file paths of shared objects in a maps listing, in first-seen order.

    Each line is ``address perms offset dev inode [pathname]``; the pathname may contain
    spaces and may end in `` (deleted)`` when the file was replaced after loading.
    """
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if not path.startswith("/"):
            continue  # [heap], [stack], [vdso], anonymous mappings
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if is_shared_object(path):
            seen.setdefault(path, None)
    return list(seen)


def loaded_shared_objects(maps_path: str = MAPS) -> list[str]:
    try:
        text = Path(maps_path).read_text(errors="replace")
    except OSError:
        return []
    return parse_maps(text)


def find_loaded(paths: list[str], pattern: str) -> list[str]:
    """Loaded paths whose file name matches the regular expression ``pattern``."""
    rx = re.compile(pattern)
    return [p for p in paths if rx.search(os.path.basename(p))]


def loaded_under(paths: list[str], directory: str | os.PathLike[str]) -> list[str]:
    base = os.path.realpath(directory).rstrip("/") + "/"
    return [p for p in paths if os.path.realpath(p).startswith(base)]
