"""Who built this stack: image labels, the image digest given at run time, the source revision."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import muse_stack
from muse_stack.fingerprint.absent import absent, is_absent

IMAGE_INFO_DEFAULT = "/etc/muse-stack/image.json"
IMAGE_FIELDS = (
    "lock_name",
    "lock_sha256",
    "base_image",
    "base_digest",
    "source_revision",
    "muse_stack_version",
    "platform",
    "built_by",
)


def image_info() -> dict[str, Any]:
    path = Path(os.environ.get("MUSE_STACK_IMAGE_INFO", IMAGE_INFO_DEFAULT))
    if not path.exists():
        return absent(f"no image identity file at {path} (not a muse-stack image; MUSE_STACK_IMAGE_INFO overrides the path)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return absent(f"image identity file {path} unreadable: {exc}")
    if not isinstance(data, dict):
        return absent(f"image identity file {path} is not a JSON object")
    info: dict[str, Any] = {"file": str(path)}
    for key in IMAGE_FIELDS:
        info[key] = data[key] if key in data else absent(f"{path} has no {key!r}")
    return info


def image_digest() -> Any:
    digest = os.environ.get("MUSE_STACK_IMAGE_DIGEST")
    if not digest:
        return absent("MUSE_STACK_IMAGE_DIGEST not set (an image cannot see its own digest; the launcher passes it)")
    return digest


def image_reference() -> Any:
    """The image reference the launcher ran the job from (MUSE_STACK_IMAGE: a registry reference
    without credentials, or a squashfs path)."""
    ref = os.environ.get("MUSE_STACK_IMAGE")
    if not ref:
        return absent("MUSE_STACK_IMAGE not set (not started by muse-stack launch)")
    return ref


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=5)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        fatal = [line for line in lines if line.startswith(("fatal:", "error:"))]
        raise RuntimeError((fatal or lines or [f"exit {out.returncode}"])[0])
    return out.stdout.strip()


def git_checkout(directory: Path) -> dict[str, Any] | None:
    """Commit and local-change state of the git checkout rooted at ``directory``; None if not one."""
    if not (directory / ".git").exists():
        return None
    try:
        commit = _git(directory, "rev-parse", "HEAD")
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        return absent(f"git in {directory} failed: {exc}")
    return {"commit": commit, "dirty": bool(status)}


def source_revision() -> Any:
    """The muse-stack source revision: git of the source tree, else MUSE_STACK_SOURCE_REVISION, else the
    revision the image recorded when it was built (image.json's ``source_revision``: an image's source
    tree has no .git)."""
    root = Path(muse_stack.__file__).resolve().parent.parent
    checkout = git_checkout(root)
    if checkout is not None and "commit" in checkout:
        return {"revision": checkout["commit"], "dirty": checkout["dirty"], "from": "git"}
    env = os.environ.get("MUSE_STACK_SOURCE_REVISION")
    if env:
        return {"revision": env, "from": "MUSE_STACK_SOURCE_REVISION"}
    why = checkout["absent"] if checkout is not None else f"{root} is not a git checkout"
    info = image_info()
    recorded = None if is_absent(info) else info.get("source_revision")
    if isinstance(recorded, str) and recorded:
        return {"revision": recorded, "from": info["file"]}
    image = "not in a muse-stack image" if is_absent(info) else f"the image ({info['file']}) records no source revision"
    return absent(f"{why}, MUSE_STACK_SOURCE_REVISION is not set, and {image}")


def collect() -> dict[str, Any]:
    return {
        "muse_stack_version": muse_stack.__version__,
        "source_revision": source_revision(),
        "image": image_info(),
        "image_digest": image_digest(),
        "image_reference": image_reference(),
    }
