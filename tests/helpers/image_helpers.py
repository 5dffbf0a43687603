"""What the image and Nix tests share: the Dockerfile's RUN instructions as one line each, and
``nix-instantiate`` (installed from Debian's nix-bin where the tests run as root)."""

from __future__ import annotations

import os
import shutil

import pytest
from debian_packages import apt_get


def dockerfile_runs(text: str) -> list[str]:
    """RUN instructions with continuations joined and comment lines dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        cur += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if cur.strip().startswith("RUN"):
                out.append(" ".join(cur.split()))
            cur = ""
    return out


def nix_instantiate() -> str:
    """The nix-instantiate executable, installed when missing; the test skips, saying why, where it cannot be."""
    exe = shutil.which("nix-instantiate")
    if exe:
        return exe
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("nix-instantiate missing and nix-bin cannot be installed (needs root and apt-get)")
    r = apt_get("install", "-y", "-qq", "nix-bin")
    exe = shutil.which("nix-instantiate")
    if r.returncode != 0 or not exe:
        pytest.skip(f"apt-get install nix-bin failed: {r.stderr.strip()[-300:]}")
    return exe
