"""torch.distributed for the run pipeline: one process per GPU (or CPU worker), launched by
torchrun or by Slurm's srun (one task per GPU, no torchrun). Every helper is a no-op in a single
process.

Under srun the rank, the world and the rendezvous come from the step's environment: rank
``SLURM_PROCID``, world ``SLURM_STEP_NUM_TASKS``, local rank ``SLURM_LOCALID``; the rendezvous
host is ``MASTER_ADDR`` when set, else the first host of the step's node list (where srun's block
and cyclic distributions both place task 0), and the port ``MASTER_PORT`` when set, else
:func:`slurm_port` of the job and step ids, which every task computes alike. Only an srun step
counts: a batch script's own shell also carries ``SLURM_NTASKS`` and ``SLURM_PROCID=0``, but no
``SLURM_STEP_ID``, and a ``muse-stack run`` started there is one process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from muse_stack.util.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single"
    #: the rendezvous (srun only; torchrun sets MASTER_ADDR and MASTER_PORT itself)
    master_addr: str | None = None
    master_port: int | None = None


def _int(*names: str, environ: Mapping[str, str] | None = None) -> int | None:
    environ = os.environ if environ is None else environ
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise UsageError("not a whole number", field=name, value=value,
                                 fix=f"unset {name}, or set it to a whole number") from None
    return None


def from_environment(environ: Mapping[str, str] | None = None) -> DistEnv:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a multi-task srun step without torchrun sets
    SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID (see the module's notes)."""
    environ = os.environ if environ is None else environ
    if _int("WORLD_SIZE", environ=environ) is not None:
        return DistEnv(_int("RANK", environ=environ) or 0, _int("WORLD_SIZE", environ=environ) or 1,
                       _int("LOCAL_RANK", environ=environ) or 0, "torchrun")
    return from_slurm(environ) or DistEnv()


#: the ports :func:`slurm_port` derives: below Linux's ephemeral range (32768 up), so that no
#: outgoing connection of the node holds one
PORT_BASE, PORT_SPAN = 20000, 12768
#: 31 is prime and divides no factor of PORT_SPAN (2^5 * 3 * 7 * 19): consecutive job ids get
#: PORT_SPAN distinct ports, and within one job steps 0 to 30 get distinct ports
_JOB_STRIDE = 31


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of an srun step: a function of the job and step ids alone, so every task
    of the step computes the same port, and two steps or jobs side by side on one node get
    different ones."""
    return PORT_BASE + (job_id * _JOB_STRIDE + step_id) % PORT_SPAN


def from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    """Rank, world and rendezvous of a task of a multi-task srun step; None outside one (no step id,
    or a step of one task)."""
    step = _int("SLURM_STEP_ID", "SLURM_STEPID", environ=environ)
    world = _int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", environ=environ)
    if step is None or world is None or world <= 1:
        return None
    rank = _int("SLURM_PROCID", environ=environ)
    if rank is None or not 0 <= rank < world:
        raise UsageError("an srun task without its rank", field="SLURM_PROCID", value=environ.get("SLURM_PROCID"),
                         rule=f"0 to {world - 1} in a step of {world} tasks",
                         fix="start the run with srun (one task per GPU), or with torchrun")
    addr = environ.get("MASTER_ADDR") or head_node(environ)
    port = _int("MASTER_PORT", environ=environ)
    if port is None:
        job = _int("SLURM_JOB_ID", "SLURM_JOBID", environ=environ)
        if job is None:
            raise UsageError("an srun step without a job id: no rendezvous port to derive", field="SLURM_JOB_ID",
                             value=None, fix="set MASTER_PORT to a free port, the same for every task")
        port = slurm_port(job, step)
    return DistEnv(rank, world, _int("SLURM_LOCALID", environ=environ) or 0, "slurm", addr, port)


def head_node(environ: Mapping[str, str]) -> str:
    """The first host of the step's node list (else the job's): where task 0 runs."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        nodelist = (environ.get(name) or "").strip()
        if not nodelist:
            continue
        first = _scontrol_first(nodelist, environ)
        if first is not None:
            return first
        try:
            return next(hostnames(nodelist))
        except (ValueError, StopIteration) as exc:
            raise UsageError(f"cannot read the first host of the node list ({exc})", field=name, value=nodelist,
                             fix="set MASTER_ADDR to the host of task 0 for every task") from None
    raise UsageError("an srun step without a node list: no host to meet on", field="SLURM_STEP_NODELIST",
                     value=None, fix="set MASTER_ADDR to the host of task 0 for every task")


def _scontrol_first(nodelist: str, environ: Mapping[str, str]) -> str | None:
    """``scontrol show hostnames``'s first host, or None where scontrol is missing or says no (it
    prints "Invalid hostlist" and exits 0 on a list it cannot read)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30, env=dict(environ) if environ is not os.environ else None)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.split()
    if proc.returncode != 0 or not lines or "Invalid hostlist" in proc.stdout + proc.stderr:
        return None
    return lines[0]


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _bracket(text: str) -> list[tuple[int, int, int]]:
    """``01-03,7`` -> [(1, 3, 2), (7, 7, 1)]: (low, high, width of the low bound's digits)."""
    out = []
    for item in text.split(","):
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"[{text}]: {item!r} is not a number or a range like 01-03")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise ValueError(f"[{text}]: the range {item} runs backwards")
        out.append((lo, hi, len(m.group(1))))
    return out


def _expand(parts: list[str | list[tuple[int, int, int]]]) -> Iterator[str]:
    if not parts:
        yield ""
        return
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        for tail in _expand(rest):
            yield head + tail
        return
    for lo, hi, width in head:
        for n in range(lo, hi + 1):
            for tail in _expand(rest):
                yield f"{n:0{width}d}{tail}"


def hostnames(nodelist: str) -> Iterator[str]:
    """Slurm's compact host list, expanded in order, lazily: ``node[01-03,7],gpu5`` -> node01,
    node02, node03, node7, gpu5. Several brackets in one name multiply (``r[1-2]n[1-2]`` -> r1n1,
    r1n2, r2n1, r2n2); a range keeps its low bound's zero padding (``[07-100]`` -> 07 ... 99, 100).
    A malformed list raises ValueError."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{nodelist!r}: a bracket inside a bracket")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{nodelist!r}: ']' without '['")
        elif ch == "," and depth == 0:
            entries.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{nodelist!r}: '[' without ']'")
    entries.append(nodelist[start:])
    parsed = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        parts: list[str | list[tuple[int, int, int]]] = []
        for piece in re.split(r"(\[[^\]]*\])", entry):
            if piece.startswith("["):
                parts.append(_bracket(piece[1:-1]))
            elif piece:
                parts.append(piece)
        parsed.append(parts)  # the whole list is checked before the first host is given
    for parts in parsed:
        yield from _expand(parts)


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
    if env.master_addr is not None:  # srun: the rendezvous every task derived alike
        os.environ["MASTER_ADDR"] = env.master_addr
        os.environ["MASTER_PORT"] = str(env.master_port)
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
