"""Debian packages a test installs when they are missing (as root, with apt-get), one apt-get at a
time: apt-get fails at once, instead of waiting, while another holds its lock, and the workers of
`make test` may each reach an install. Every installer takes LOCK first; containers/image-test.sh
takes it too when MUSE_STACK_APT_LOCK names it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "muse-stack-apt.lock"


def apt_get(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`apt-get ARGS` once no other installer of the suite is running."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=timeout)
