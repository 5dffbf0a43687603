"""Capture the stack fingerprint of the running process."""

from __future__ import annotations

import datetime as _dt
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from muse_stack.fingerprint import cudalibs, environment, frameworks, gpu, hashing, host, identity, network, pyenv
from muse_stack.fingerprint.absent import absent, guarded
from muse_stack.fingerprint.document import KIND, SCHEMA_VERSION


def _import_torch() -> tuple[Any, str | None]:
    try:
        import torch
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return torch, None


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.lstrip("-").isdigit():
            return int(value)
    return None


def _process(torch: Any) -> dict[str, Any]:
    rank = _env_int("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if torch is not None:
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "rank": rank if rank is not None else 0,
        "world_size": world if world is not None else 1,
        "local_rank": _env_int("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
        "node_rank": _env_int("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"),
    }


def capture(
    recipe_sha256: str | None = None,
    rows_sha256: str | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    """The fingerprint of this process's stack as a JSON-ready dict (schema_version 1).

    Call it inside the training process (after choosing the CUDA device): the CUDA and
    framework sections describe what *this* process loaded. Every field that cannot be read
    here is ``{"absent": "<reason>"}``.
    """
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        value = guarded(f"capturing {name}", fn)
        timings[name] = round(time.perf_counter() - t, 4)
        return value

    index = timed("distributions", pyenv.distribution_index)
    # hash the frameworks' compiled libraries in the background while torch imports
    hashing.prefetch(frameworks.installed_shared_objects(index))
    torch, torch_error = timed("import_torch", _import_torch)
    cuda_ok = bool(torch is not None and torch.version.cuda and torch.cuda.is_available())

    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "capture": {},
        "process": timed("process", lambda: _process(torch)),
        "identity": timed("identity", identity.collect),
        "host": timed("host", host.collect),
        "gpu": timed("gpu", gpu.collect),
        # CUDA libraries before frameworks: initialising CUDA maps the lazily loaded libraries
        "cuda_libraries": timed("cuda_libraries", lambda: cudalibs.collect(torch))
        if torch is not None
        else absent(f"torch not importable ({torch_error}); CUDA libraries are read from the torch process"),
        "frameworks": timed("frameworks", lambda: frameworks.collect(index, torch, cuda_ok)),
        "network": timed("network", network.collect),
        "python": timed("python", lambda: pyenv.collect(index)),
        "environment": timed("environment", environment.collect),
        "run_inputs": {
            "recipe_sha256": recipe_sha256 or absent("no resolved recipe given to the capture"),
            "rows_sha256": rows_sha256 or absent("data rows hash not known at capture"),
        },
    }
    secrets = environment.secret_values()
    if extra:
        doc["extra"] = environment.redact(extra, secrets, secret_keys=True)
    doc["capture"] = {
        "captured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 3),
        "section_seconds": timings,
    }
    return environment.redact(doc, secrets)
