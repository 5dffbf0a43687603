"""Shared test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MUSE_STACK_SHARED", ROOT.parent / "shared"))
SEEDS = SHARED / "seeds"


@pytest.fixture
def seeds() -> Path:
    if not SEEDS.is_dir():
        pytest.skip(f"the seed documents are not at {SEEDS} (set MUSE_STACK_SHARED)")
    return SEEDS


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process: returns (exit code, stdout, stderr)."""
    from muse_stack.cli import main

    def run(*args: str):
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP
    threads waiting on each other slow each op down a hundredfold."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
