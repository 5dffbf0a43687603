"""torch.distributed for the run pipeline: one process per GPU (or CPU worker), launched by
torchrun or by Slurm's srun. Every helper is a no-op in a single process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single"


def _int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def from_environment() -> DistEnv:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; srun without torchrun sets SLURM_PROCID/NTASKS/LOCALID."""
    if _int("WORLD_SIZE") is not None:
        return DistEnv(_int("RANK") or 0, _int("WORLD_SIZE") or 1, _int("LOCAL_RANK") or 0, "torchrun")
    if _int("SLURM_NTASKS") is not None and (_int("SLURM_NTASKS") or 1) > 1 and os.environ.get("MASTER_ADDR"):
        return DistEnv(_int("SLURM_PROCID") or 0, _int("SLURM_NTASKS") or 1, _int("SLURM_LOCALID") or 0, "slurm")
    return DistEnv()


def _dist():
    import torch.distributed as dist

    return dist


def active() -> bool:
    d = _dist()
    return d.is_available() and d.is_initialized()


def init(env: DistEnv, cuda: bool) -> None:
    if env.world_size <= 1 or active():
        return
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("MASTER_PORT", "29500")
    if cuda:
        import torch

        torch.cuda.set_device(env.local_rank)  # before NCCL starts: one GPU per process
    _dist().init_process_group(backend="nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size)


def shutdown() -> None:
    if active():
        _dist().destroy_process_group()


def barrier() -> None:
    if active():
        _dist().barrier()


def broadcast(obj: Any) -> Any:
    if not active():
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    d = _dist()
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def any_flag(flag: bool) -> bool:
    """True on every rank when any rank raised the flag (all ranks stop at the same step)."""
    if not active():
        return flag
    return any(gather(bool(flag)))
