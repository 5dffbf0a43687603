"""benchmarks/scripts/stage-gpu.sh moves a folder in sha256-checked chunks: packed here, received chunk by chunk and
unpacked there, byte for byte; a missing or torn chunk is named before anything is extracted. CPU only (the
te-download and te-install steps need a registry and a GPU; they are the same pack and unpack around pip)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scripts" / "stage-gpu.sh"


def _stage(tmp_path: Path, *args: str, chunk: str = "64k") -> subprocess.CompletedProcess:
    env = {**os.environ, "CHUNK": chunk, "STAGE_CHUNKS": str(tmp_path / "chunks")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _pack(tmp_path: Path) -> tuple[Path, int]:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(200_000))
    (src / "sub" / "b.txt").write_text("wheel\n")
    done = _stage(tmp_path, "pack", "src", "stage")  # tmp_path is no git checkout: nothing to ignore it in
    assert done.returncode == 0, done.stderr
    chunks = sorted(p.name for p in (tmp_path / "stage").iterdir() if p.name.startswith("c"))
    assert len(chunks) >= 3 and (tmp_path / "stage" / "manifest").read_text().count("part.") == len(chunks)
    assert f"receive {len(chunks) - 1} stage" in done.stdout  # it prints every device call
    return src, len(chunks)


def test_a_folder_travels_byte_for_byte(tmp_path):
    src, n = _pack(tmp_path)
    for k in range(n):
        done = _stage(tmp_path, "receive", str(k), "stage")
        assert done.returncode == 0 and f"have {k + 1} of {n} chunk(s)" in done.stdout, done.stdout + done.stderr
    done = _stage(tmp_path, "unpack", "dest", "stage")
    assert done.returncode == 0, done.stderr
    assert _tree(tmp_path / "dest") == _tree(src)


def test_a_missing_or_torn_chunk_is_named_and_nothing_is_extracted(tmp_path):
    _, n = _pack(tmp_path)
    for k in range(n - 1):  # the last chunk never arrives
        assert _stage(tmp_path, "receive", str(k), "stage").returncode == 0
    done = _stage(tmp_path, "unpack", "dest", "stage")
    assert done.returncode == 1 and "chunks missing or torn" in done.stderr and f"part.{n - 1:03d}" in done.stderr
    assert not (tmp_path / "dest").exists()
    assert _stage(tmp_path, "receive", str(n - 1), "stage").returncode == 0
    torn = sorted((tmp_path / "chunks" / "stage").iterdir())[0]
    torn.write_bytes(torn.read_bytes()[:-1])
    done = _stage(tmp_path, "unpack", "dest", "stage")
    assert done.returncode == 1 and "chunks missing or torn" in done.stderr and not (tmp_path / "dest").exists()


def test_it_refuses_a_staging_folder_git_would_carry(tmp_path):
    """Inside a checkout the chunks must go to an ignored folder, or every device call would carry them all."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x").write_text("x")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/.stage/\n")
    done = _stage(tmp_path, "pack", "src", "visible")
    assert done.returncode == 1 and "not git-ignored" in done.stderr
    assert _stage(tmp_path, "pack", "src", ".stage/src").returncode == 0


def test_an_unknown_step_prints_the_usage_and_fails(tmp_path):
    done = _stage(tmp_path, "bogus")
    assert done.returncode == 2 and "te-install" in done.stdout
