"""What `make image` checks before it pulls or installs anything: the lock's pins are resolved, its
wheel set belongs to it, the build tool is there, and the builder can produce the lock's
platform. Every problem is listed in one refusal, with its fix."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

from muse_stack.stack import wheelset
from muse_stack.stack.lock import LoadedLock, LockError, pin_fix, unresolved

ENGINES = ("docker", "podman")
_MACHINE = {"x86_64": "linux/amd64", "amd64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}
_QEMU = {"linux/amd64": "qemu-x86_64", "linux/arm64": "qemu-aarch64"}


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def builder_platforms(engine: str, binfmt_dir: Path = Path("/proc/sys/fs/binfmt_misc")) -> tuple[set[str], str]:
    """Platforms the engine can build here, and how that was learnt."""
    if engine == "docker":
        rc, out = _run(["docker", "buildx", "inspect"])
        if rc != 0:
            return set(), f"`docker buildx inspect` failed: {out.strip()[:200]}"
        plats: set[str] = set()
        for line in out.splitlines():
            if line.strip().lower().startswith("platforms:"):
                plats |= {p.strip().rstrip("*") for p in line.split(":", 1)[1].split(",") if p.strip()}
        return plats, "docker buildx inspect"
    native = _MACHINE.get(platform.machine().lower())
    plats = {native} if native else set()
    for plat, qemu in _QEMU.items():
        if (binfmt_dir / qemu).exists():
            plats.add(plat)
    return plats, f"this machine ({platform.machine()}) and binfmt_misc emulators"


def problems(loaded: LoadedLock, engine: str) -> list[tuple[str, str]]:
    """(problem, fix) pairs; empty when the build may start."""
    out: list[tuple[str, str]] = []
    if engine not in ENGINES:
        return [(f"ENGINE={engine} is not a supported build tool", "use ENGINE=docker (buildx) or ENGINE=podman")]
    for field, reason in unresolved(loaded.lock):
        if field == "base.digest" and os.environ.get("BASE_DIGEST"):
            continue  # a locally made base (the cpu image test): its digest is passed in
        out.append((f"{loaded.name}: {field} is not pinned ({reason})", pin_fix(loaded.name, [field])))
    res = wheelset.check(loaded)
    for p in res.problems:
        out.append((f"{loaded.name} wheel set: {p}", f"muse-stack stack resolve {loaded.name} (or make wheelsets)"))
    if shutil.which(engine) is None:
        install = "Docker with the buildx plugin" if engine == "docker" else "podman (apt-get install podman buildah)"
        out.append((f"`{engine}` is not on PATH", f"install {install}, or choose the other with ENGINE=docker|podman"))
        return out
    if engine == "docker":
        rc, text = _run(["docker", "buildx", "version"])
        if rc != 0:
            out.append(("docker has no buildx plugin", "install docker-buildx (the image uses BuildKit mounts and secrets)"))
            return out
    plats, how = builder_platforms(engine)
    if loaded.lock.platform not in plats:
        have = ", ".join(sorted(plats)) or "none"
        out.append((
            f"the builder cannot produce {loaded.lock.platform} (can: {have}; from {how})",
            "build on a machine of that architecture, or register an emulator "
            "(docker run --privileged tonistiigi/binfmt --install all) and use a buildx builder that lists it",
        ))
    return out


def check(loaded: LoadedLock, engine: str | None = None) -> None:
    engine = engine or os.environ.get("ENGINE", "docker")
    found = problems(loaded, engine)
    if found:
        lines = "\n".join(f"  - {p}\n    fix: {f}" for p, f in found)
        raise LockError(
            f"make image gpu={loaded.name} refused before any download ({len(found)} problem(s)):\n{lines}",
            field="image",
            value=loaded.name,
            rule="an image is built only from a fully pinned lock, by a builder that can produce its platform",
            fix="fix each problem above, then run make image again",
            exit_code=2,
        )
