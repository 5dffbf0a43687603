"""The flake's pure part (containers/nix/lock.nix, no nixpkgs) derives exactly the build
arguments, tag, system and CUDA capabilities of the Python side, for every lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from muse_stack.stack import load
from muse_stack.stack.buildargs import summary

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["gb200", "b200", "h200", "cpu"]


def _nix_instantiate() -> str:
    exe = shutil.which("nix-instantiate")
    if exe:
        return exe
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("nix-instantiate missing and nix-bin cannot be installed (needs root and apt-get)")
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "nix-bin"], capture_output=True, text=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    exe = shutil.which("nix-instantiate")
    if r.returncode != 0 or not exe:
        pytest.skip(f"apt-get install nix-bin failed: {r.stderr.strip()[-300:]}")
    return exe


@pytest.fixture(scope="module")
def nix() -> str:
    return _nix_instantiate()


def _eval(nix: str, expr: str):
    r = subprocess.run([nix, "--eval", "--strict", "--json", "-E", expr], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def nix_locks(nix):
    expr = "{ " + " ".join(
        f'"{t}" = let l = import ./containers/nix/lock.nix {{ lockFile = ./containers/locks/{t}.toml; }}; in '
        "{ inherit (l) buildArgs tag system cudaCapabilities sha256 name kind; };"
        for t in TARGETS
    ) + " }"
    return _eval(nix, expr)


@pytest.mark.parametrize("target", TARGETS)
def test_nix_and_python_derive_identical_build_args(nix_locks, target):
    lk = load(target)
    py = summary(lk)
    nx = nix_locks[target]
    assert nx["buildArgs"] == py["build_args"]
    assert nx["tag"] == py["tag"]
    assert nx["system"] == py["system"]
    assert nx["cudaCapabilities"] == py["cuda_capabilities"]
    assert nx["sha256"] == lk.sha256 and nx["name"] == target and nx["kind"] == lk.lock.kind


def test_gb200_is_an_aarch64_sm100_system_for_nix(nix_locks):
    assert nix_locks["gb200"]["system"] == "aarch64-linux"
    assert nix_locks["gb200"]["cudaCapabilities"] == ["10.0"]
    assert nix_locks["b200"]["cudaCapabilities"] == ["9.0", "10.0", "10.3"]


def test_nix_sees_an_edited_lock(nix, tmp_path):
    # the agreement is not vacuous: the Nix side reads the file it is given
    text = (ROOT / "containers/locks/h200.toml").read_text().replace('cuda_archs = ["9.0"]', 'cuda_archs = ["9.0", "8.0"]')
    p = tmp_path / "h200.toml"
    p.write_text(text)
    nx = _eval(nix, f"(import {ROOT}/containers/nix/lock.nix {{ lockFile = {p}; }}).buildArgs")
    py = summary(load(p))["build_args"]
    assert nx == py and nx["NVTE_CUDA_ARCHS"] == "90;80"
    caps = _eval(nix, f"(import {ROOT}/containers/nix/lock.nix {{ lockFile = {p}; }}).cudaCapabilities")
    assert caps == summary(load(p))["cuda_capabilities"] == ["8.0", "9.0"]


def test_flake_parses(nix):
    r = subprocess.run([nix, "--parse", str(ROOT / "flake.nix")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
