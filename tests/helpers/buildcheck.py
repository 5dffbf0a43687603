"""What the build checks (test_build_kernels.py) compile with, fetched from the registry with every
file's sha256 checked and kept in a cache so that a second run downloads nothing:

- the lock's torch wheel (its headers, its cpp_extension.py, its TorchConfig.cmake) and the CUDA
  library wheels its headers include (cuDNN, NCCL, cuBLAS, cuSPARSE, cuSOLVER, NVRTC, NVTX), all
  from the lock's wheel set (containers/locks/pylock.<target>.toml): the URL and sha256 there;
- the flash-attn and transformer-engine-torch sdists, from the same set;
- CUDA 13.0's nvcc, cudart and CCCL headers (and cuobjdump), from the registry, installed by pip
  with hashes required from tests/fixtures/build/cuda-nvcc.txt.

The cache is $MUSE_STACK_CACHE/build-check, else ~/.cache/muse-stack/build-check. Downloaded files
keep their registry names under files/ and are re-hashed on every use; unpacked trees are keyed
by the sha256 of what they came from and marked complete only once fully written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from muse_stack.stack import pylock

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "containers" / "locks"
NVCC_REQUIREMENTS = ROOT / "tests" / "fixtures" / "build" / "cuda-nvcc.txt"
# the CUDA library wheels whose headers torch's ATen/cuda headers and TE's csrc include
HEADER_WHEELS = (
    "nvidia-cublas",
    "nvidia-cudnn-cu13",
    "nvidia-nccl-cu13",
    "nvidia-cusparse",
    "nvidia-cusolver",
    "nvidia-cuda-nvrtc",
    "nvidia-nvtx",
)
COMPLETE = ".complete"


def cache_dir() -> Path:
    env = os.environ.get("MUSE_STACK_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "muse-stack"
    return root / "build-check"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(artifact: pylock.Artifact) -> Path:
    """The file at artifact.url, downloaded once and checked against artifact.sha256."""
    dest = cache_dir() / "files" / artifact.filename
    if dest.is_file():
        if sha256(dest) == artifact.sha256:
            return dest
        dest.unlink()  # a damaged or different file: fetch it again
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{artifact.filename}.")
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(artifact.url, timeout=180) as resp:
            while block := resp.read(1 << 20):
                h.update(block)
                out.write(block)
        if h.hexdigest() != artifact.sha256:
            raise RuntimeError(
                f"{artifact.url}: sha256 {h.hexdigest()} is not the wheel set's {artifact.sha256}; "
                "the registry serves different bytes than the set was resolved from"
            )
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def _fresh(target: Path) -> Path:
    """A temporary sibling of target to write into; moved over target once complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))


def _finish(tmp: Path, target: Path) -> Path:
    if (target / COMPLETE).is_file():  # another run finished it meanwhile: keep that one
        shutil.rmtree(tmp)
        return target
    (tmp / COMPLETE).write_text("")
    if target.exists():  # an unfinished tree left by an interrupted run
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def wheel_set(target: str) -> dict[str, pylock.Package]:
    return pylock.load(LOCKS / f"pylock.{target}.toml")[1]


def _one_wheel(pkg: pylock.Package) -> pylock.Artifact:
    linux = [w for w in pkg.wheels if "x86_64" in w.filename or w.filename.endswith("-any.whl")]
    if len(linux) != 1:
        raise RuntimeError(f"{pkg.name} {pkg.version}: expected one x86_64 wheel in the set, found {len(linux)}")
    return linux[0]


def torch_tree(target: str) -> Path:
    """The lock's torch package directory, as much of it as a compile reads: include/,
    utils/cpp_extension.py and share/cmake/, unpacked from the set's wheel."""
    art = _one_wheel(wheel_set(target)["torch"])
    out = cache_dir() / f"torch-{art.sha256[:16]}"
    if (out / COMPLETE).is_file():
        return out / "torch"
    wheel = fetch(art)
    tmp = _fresh(out)
    with zipfile.ZipFile(wheel) as zf:
        members = [
            n
            for n in zf.namelist()
            if n.startswith(("torch/include/", "torch/share/cmake/")) or n == "torch/utils/cpp_extension.py"
        ]
        zf.extractall(tmp, members)
    return _finish(tmp, out) / "torch"


def library_headers(target: str) -> list[Path]:
    """Include directories of the set's CUDA library wheels (HEADER_WHEELS), in one tree."""
    pkgs = wheel_set(target)
    arts = [_one_wheel(pkgs[n]) for n in HEADER_WHEELS]
    key = hashlib.sha256("".join(a.sha256 for a in arts).encode()).hexdigest()[:16]
    out = cache_dir() / f"cuda-headers-{key}"
    if not (out / COMPLETE).is_file():
        tmp = _fresh(out)
        for art in arts:
            with zipfile.ZipFile(fetch(art)) as zf:
                zf.extractall(tmp, [n for n in zf.namelist() if n.startswith("nvidia/") and "/include/" in n])
        _finish(tmp, out)
    return sorted(p for p in (out / "nvidia").glob("*/include") if p.is_dir())


def sdist(target: str, name: str, into: Path) -> Path:
    """The set's sdist of `name`, unpacked into `into`; returns the sdist's top directory."""
    pkg = wheel_set(target)[pylock.canonical(name)]
    if pkg.sdist is None:
        raise RuntimeError(f"{name} {pkg.version}: the wheel set holds no sdist")
    with tarfile.open(fetch(pkg.sdist)) as tf:
        tops = {m.name.split("/", 1)[0] for m in tf.getmembers()}
        if len(tops) != 1:
            raise RuntimeError(f"{pkg.sdist.filename}: expected one top directory, found {sorted(tops)}")
        tf.extractall(into, filter="data")
    return into / tops.pop()


def nvcc_toolkit() -> Path:
    """CUDA_HOME of the registry's CUDA 13.0 nvcc (bin/nvcc, include/), installed by pip from
    NVCC_REQUIREMENTS with hashes required."""
    key = sha256(NVCC_REQUIREMENTS)[:16]
    out = cache_dir() / f"nvcc-{key}"
    if not (out / COMPLETE).is_file():
        tmp = _fresh(out)
        cmd = [
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-deps", "--require-hashes", "--only-binary=:all:", "--target", str(tmp),
            "-r", str(NVCC_REQUIREMENTS),
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"pip could not install {NVCC_REQUIREMENTS}:\n{res.stderr[-4000:]}")
        _finish(tmp, out)
    home = out / "nvidia" / "cu13"
    if not (home / "bin" / "nvcc").is_file():
        raise RuntimeError(f"{home}/bin/nvcc is missing: the nvcc wheels' layout changed")
    return home
