"""`muse-stack stack pins TARGET [--write]` (make pins gpu=TARGET): read a lock's registry pins
from their sources on a networked builder and compare them with the lock, or write the ones the
lock leaves null.

- base.digest: the tag's index (manifest list) digest, the sha256 of the registry's raw
  manifest bytes: ``skopeo inspect --raw docker://IMAGE:TAG | sha256sum``, else
  ``crane digest IMAGE:TAG``, else ``docker buildx imagetools inspect IMAGE:TAG``.
- components.efa.installer_sha256: ``curl -fsSL URL | sha256sum`` of the installer tarball.

A pinned value that differs from what the source says now is an error (a moved tag, a replaced
tarball); it is never overwritten. A null value is written only with --write, together with the
source it was read from.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import shutil
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from muse_stack.stack.lock import Efa, LoadedLock, LockError, Null, load


class PinError(LockError):
    pass


@dataclass(frozen=True)
class Pin:
    field: str
    locked: str | None
    found: str | None
    how: str
    # for an index digest: the platforms its manifests are for, when the tool shows them
    platforms: tuple[str, ...] | None = None

    @property
    def ok(self) -> bool:
        return self.found is not None and self.locked == self.found


def _run(cmd: list[str], timeout: int = 120) -> tuple[int, bytes, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, b"", str(exc)
    return p.returncode, p.stdout, p.stderr.decode(errors="replace")


def _platforms(index: object) -> tuple[str, ...] | None:
    """os/architecture of each manifest an image index lists (None when it is not an index)."""
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        return None
    out = []
    for m in index["manifests"]:
        p = m.get("platform") or {}
        if p.get("os") and p.get("architecture") and p.get("os") != "unknown":
            out.append(f"{p['os']}/{p['architecture']}")
    return tuple(out)


def index_digest(image: str, tag: str) -> tuple[str | None, str, tuple[str, ...] | None]:
    """The registry's digest of IMAGE:TAG (the index for a multi-platform tag), how it was read,
    and the platforms the index lists (None where the tool does not show them)."""
    ref = f"{image}:{tag}"
    tried = []
    if shutil.which("skopeo"):
        rc, out, err = _run(["skopeo", "inspect", "--raw", f"docker://{ref}"])
        if rc == 0 and out:
            try:
                plats = _platforms(json.loads(out))
            except ValueError:
                plats = None
            return ("sha256:" + hashlib.sha256(out).hexdigest(), f"skopeo inspect --raw docker://{ref} | sha256sum",
                    plats)
        tried.append(f"skopeo: {err.strip()[:200]}")
    if shutil.which("crane"):
        rc, out, err = _run(["crane", "digest", ref])
        text = out.decode().strip()
        if rc == 0 and re.fullmatch(r"sha256:[0-9a-f]{64}", text):
            return text, f"crane digest {ref}", None
        tried.append(f"crane: {err.strip()[:200]}")
    if shutil.which("docker"):
        rc, out, err = _run(["docker", "buildx", "imagetools", "inspect", ref, "--format", "{{json .Manifest}}"])
        if rc == 0:
            try:
                manifest = json.loads(out)
                return manifest["digest"], f"docker buildx imagetools inspect {ref}", _platforms(manifest)
            except (ValueError, KeyError, TypeError):
                pass
        tried.append(f"docker buildx imagetools: {err.strip()[:200]}")
    return None, "; ".join(tried) or "none of skopeo, crane or docker (buildx) is installed", None


def url_sha256(url: str) -> tuple[str | None, str]:
    """sha256 of the bytes at URL (streamed), and how it was read."""
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - https URL from the lock
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        return None, f"download of {url} failed: {exc}"
    return h.hexdigest(), f"curl -fsSL {url} | sha256sum"


def read(loaded: LoadedLock) -> list[Pin]:
    lock = loaded.lock
    out: list[Pin] = []
    if lock.base.source == "registry":
        locked = None if isinstance(lock.base.digest, Null) else lock.base.digest
        found, how, plats = index_digest(lock.base.image, lock.base.tag)
        out.append(Pin("base.digest", locked, found, how, plats))
    efa = lock.components.efa
    if isinstance(efa, Efa):
        locked = None if isinstance(efa.installer_sha256, Null) else efa.installer_sha256
        found, how = url_sha256(efa.installer_url)
        out.append(Pin("components.efa.installer_sha256", locked, found, how))
    return out


_LINES = {
    "base.digest": ("base", "digest", "digest_sources"),
    "components.efa.installer_sha256": ("components.efa", "installer_sha256", "installer_sha256_sources"),
}


def write_pin(path: Path, pin: Pin) -> None:
    """Replace the field's `{ null = "..." }` line in its table with the value and its source."""
    table, key, sources_key = _LINES[pin.field]
    text = path.read_text()
    start = text.index(f"[{table}]")
    nxt = text.find("\n[", start + 1)
    end = len(text) if nxt < 0 else nxt
    body = text[start:end]
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    source = f"{pin.how} on {socket.gethostname()} at {when} (make pins)"
    new, n = re.subn(
        rf"^{key} = \{{ null = .*\}}$",
        lambda _m: f"{key} = {json.dumps(pin.found)}\n{sources_key} = [{json.dumps(source)}]",
        body, count=1, flags=re.M,
    )
    if n != 1:
        raise PinError(f"{path}: no `{key} = {{ null = ... }}` line in [{table}]", field=pin.field, exit_code=1)
    path.write_text(text[:start] + new + text[end:])


def run(target: str, *, write: bool) -> list[Pin]:
    loaded = load(target)
    pins = read(loaded)
    problems = []
    for p in pins:
        if p.found is None:
            problems.append(f"{p.field}: could not be read ({p.how})")
        elif p.locked is not None and p.locked != p.found:
            problems.append(f"{p.field}: the lock pins {p.locked}, the source says {p.found} now ({p.how})")
        if p.platforms is not None and loaded.lock.platform not in p.platforms:
            problems.append(f"{p.field}: the index lists no {loaded.lock.platform} manifest "
                            f"(it lists {', '.join(p.platforms) or 'none'})")
    if problems:
        raise PinError(
            f"{loaded.path}: " + "; ".join(problems),
            field=pins[0].field if pins else "lock",
            value=loaded.name,
            rule="a pin is what its source says; a moved tag or a replaced file is never written over",
            fix="install skopeo (or crane, or docker with buildx) and reach the registry; for a value that "
                "changed, find out why before pinning the new one by hand",
            exit_code=1,
        )
    if write:
        for p in pins:
            if p.locked is None:
                write_pin(loaded.path, p)
        load(loaded.path)  # what was written still validates
    return pins
