"""Where the megatron engine's process group meets (muse_stack.engines.megatron.rendezvous): a single process
takes a free port of its own, so a second single-GPU run on the host, or a process the first one starts, never
finds the port taken; under torchrun the environment's address and port. The rendezvous is torch's TCPStore for
any backend, so gloo on a CPU exercises the same path NCCL takes."""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed as tdist

from muse_stack.engines.megatron import rendezvous

CHILD = """
import torch.distributed as tdist
from muse_stack.engines.megatron import rendezvous
tdist.init_process_group("gloo", rank=0, world_size=1, **rendezvous(1))
tdist.barrier(); tdist.destroy_process_group(); print("joined")
"""


def test_a_single_process_takes_its_own_port_and_leaves_the_environment(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    first = rendezvous(1)["init_method"]
    assert first.startswith("tcp://127.0.0.1:") and int(first.rsplit(":", 1)[1]) > 0
    tdist.init_process_group("gloo", rank=0, world_size=1, init_method=first)
    try:
        # a process started while this one holds its store: it inherits this environment, and still joins
        env_after = dict(os.environ)
        assert "MASTER_PORT" not in env_after
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env_after)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "joined"
    finally:
        tdist.destroy_process_group()


def test_torchrun_environment_is_used(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert rendezvous(1) == {"init_method": "env://"}
    monkeypatch.delenv("MASTER_PORT")
    assert rendezvous(2) == {"init_method": "env://"}
    assert os.environ["MASTER_PORT"] == "29517" and os.environ["MASTER_ADDR"] == "127.0.0.1"
