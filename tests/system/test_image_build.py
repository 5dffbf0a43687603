"""Build the cpu image with podman from a debootstrap base and run it (containers/image-test.sh).

Takes minutes on a cold cache, so it runs when selected: `pytest -m image` or
MUSE_STACK_IMAGE_TEST=1, as `make test` sets it (`make image-test gpu=cpu` runs the script
directly). It skips with the script's reason when podman, buildah or debootstrap cannot be
installed or run (e.g. not root).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from debian_packages import LOCK as APT_LOCK

ROOT = Path(__file__).resolve().parents[2]
SKIP = 77

pytestmark = pytest.mark.image


def _selected(config) -> bool:
    markexpr = (config.getoption("-m") or "").strip()
    return markexpr == "image" or os.environ.get("MUSE_STACK_IMAGE_TEST") == "1"


def test_cpu_image_builds_runs_and_carries_its_lock(request, tmp_path):
    if not _selected(request.config):
        pytest.skip("builds a container image (minutes); select with `pytest -m image` or MUSE_STACK_IMAGE_TEST=1")
    env = {**os.environ, "PY": sys.executable, "MUSE_STACK_APT_LOCK": str(APT_LOCK)}
    r = subprocess.run(["bash", "containers/image-test.sh", "cpu"], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=1800)
    if r.returncode == SKIP:
        pytest.skip(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "image tools unavailable")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "identity ok: lock cpu sha256 " in r.stdout
    assert "image-test passed" in r.stderr
