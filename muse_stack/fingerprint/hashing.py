"""sha256 of shared objects, bounded and cached by (path, size, mtime) within the process.

Only libraries the process loaded or a framework compiled are hashed; files are read in
parallel threads (hashlib releases the GIL), and a file larger than ``MAX_HASH_BYTES`` is
recorded with its size and an absent hash rather than stalling the capture.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from muse_stack.fingerprint.absent import absent

MAX_HASH_BYTES = int(os.environ.get("MUSE_STACK_FINGERPRINT_MAX_HASH_BYTES", str(8 << 30)))

_cache: dict[tuple[str, int, int], str] = {}
_pending: dict[tuple[str, int, int], Future[str]] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _digest(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def file_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """{"path", "size", "sha256"} of one file; unreadable parts become absent markers."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        return {"path": str(path), "size": absent(f"stat failed: {exc.strerror}"), "sha256": absent("file not readable")}
    record: dict[str, Any] = {"path": str(path), "size": st.st_size}
    if real != str(path):
        record["resolved"] = real
    if st.st_size > MAX_HASH_BYTES:
        record["sha256"] = absent(
            f"not hashed: {st.st_size} bytes exceeds MUSE_STACK_FINGERPRINT_MAX_HASH_BYTES={MAX_HASH_BYTES}"
        )
        return record
    key = (real, st.st_size, st.st_mtime_ns)
    with _lock:
        cached = _cache.get(key)
        pending = _pending.get(key)
    try:
        if cached is None and pending is not None:
            cached = pending.result()
        if cached is None:
            cached = _digest(real)
    except OSError as exc:
        record["sha256"] = absent(f"read failed: {exc.strerror}")
        return record
    with _lock:
        _cache[key] = cached
    record["sha256"] = cached
    return record


def prefetch(paths: list[str]) -> None:
    """Start hashing files in the background (e.g. while torch imports); file_record waits
    for a pending hash instead of reading the file twice."""
    global _pool
    for path in dict.fromkeys(paths):
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            continue
        if st.st_size > MAX_HASH_BYTES:
            continue
        key = (real, st.st_size, st.st_mtime_ns)
        with _lock:
            if key in _cache or key in _pending:
                continue
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                           thread_name_prefix="muse-prefetch")
            _pending[key] = _pool.submit(_digest, real)


def file_records(paths: list[str]) -> dict[str, dict[str, Any]]:
    """Hash many files in parallel; returns {path: record} in the order given."""
    unique = list(dict.fromkeys(str(p) for p in paths))
    if not unique:
        return {}
    workers = max(1, min(8, len(unique), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="muse-hash") as pool:
        results = list(pool.map(file_record, unique))
    return dict(zip(unique, results))


def combined_sha256(records: dict[str, dict[str, Any]]) -> str:
    """One hash over "name sha256" lines, sorted: equal exactly when every member is equal."""
    lines = []
    for name in sorted(records):
        digest = records[name].get("sha256")
        lines.append(f"{name} {digest if isinstance(digest, str) else 'absent'}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _pending.clear()


def is_shared_object(path: str | Path) -> bool:
    name = Path(path).name
    return name.endswith(".so") or ".so." in name
