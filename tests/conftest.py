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


#: what a run's rendezvous reads (torchrun's variables, which a multi-task run exports for torch.distributed)
DIST_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _rendezvous_variables_restored():
    """Many tests run in one process (an xdist worker): a test that leaves WORLD_SIZE or RANK set makes every
    later in-process run take itself for one rank of several and wait for the others. Each test starts with
    the variables as the process had them."""
    before = {k: os.environ.get(k) for k in DIST_VARIABLES}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


#: tests/<kind>/: each test is marked with its folder's kind (-m unit, -m system, -m lab, -m gpu)
KINDS = ("unit", "system", "gpu", "lab")


def _cost(item) -> int:
    """Which modules start first: the image build, the build checks, the system tests, the other
    slow ones, then the rest. With workers (make test) a module stays on one worker and the long
    ones go out first, so that none is left running alone at the end."""
    names = {mark.name for mark in item.iter_markers()}
    for rank, mark in enumerate(("image", "build", "system", "slow")):
        if mark in names:
            return rank
    return 4


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(here) and path.relative_to(here).parts[0] in KINDS:
            item.add_marker(path.relative_to(here).parts[0])
    # each module's tests stay together and in their order; modules by their costliest test
    first: dict[Path, int] = {}
    for item in items:
        first[item.path] = min(first.get(item.path, 4), _cost(item))
    items.sort(key=lambda item: first[item.path])


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        # a worker of `pytest -n N` takes its share of the cores: torch's intra-op threads default to
        # all of them, and OpenMP threads of several workers waiting on each other on shared cores
        # slow small operations down many times (see one_thread)
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
