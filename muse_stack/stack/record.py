"""Compare a lock with the stack recorded by its reference recipe (recipe field `stack`).

The recorded values are free text as the source states them ("2.17.0 (PyTorch extension
rebuilt ...)", "8 GPUs per node, EFA 1.49 (aws-ofi-nccl 1.20), ..."); a lock version matches
a recorded one when they are equal or the recorded one is a shorter prefix ("1.49" ~ "1.49.0").
A difference is accepted only where the lock lists a deviation for that field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from muse_stack.stack.lock import Lock, Null

_VERSION = r"\d+(?:\.\d+)+(?:\.?post\d+|[a-z]+\d*(?:\.\d+)*)?"


@dataclass(frozen=True)
class FieldCheck:
    field: str  # lock field
    recorded_key: str  # key of the recorded stack
    locked: str
    recorded: str | None  # the version found in the recorded text, None if none
    ok: bool
    deviation: bool


def _match(locked: str, recorded: str | None) -> bool:
    if recorded is None:
        return False
    base = locked.split("+")[0]
    return base == recorded or base.startswith(recorded + ".")


def _after(text: str, label: str) -> str | None:
    m = re.search(re.escape(label) + r"\s*(" + _VERSION + ")", text)
    return m.group(1) if m else None


def _first(text: str) -> str | None:
    m = re.search(_VERSION, text)
    return m.group(0) if m else None


def compare(lock: Lock, stack: dict[str, Any]) -> list[FieldCheck]:
    """Check each pinned component against the recorded stack dict (keys as in the recipe contract)."""
    c = lock.components
    pairs: list[tuple[str, str, str, str | None]] = []

    def add(field: str, key: str, locked: str, found: str | None) -> None:
        pairs.append((field, key, locked, found))

    rec = {k: str(v) for k, v in stack.items() if v is not None}
    if "python" in rec:
        add("python.version", "python", lock.python.version, _first(rec["python"]))
    if "pytorch" in rec:
        add("components.torch.version", "pytorch", c.torch.version, _first(rec["pytorch"]))
    if "cuda" in rec:
        add("cuda.version", "cuda", "" if isinstance(lock.cuda, Null) else lock.cuda.version, _first(rec["cuda"]))
    simple = {
        "transformer_engine": "transformer_engine",
        "nccl": "nccl",
        "cudnn": "cudnn",
        "flash_attn": "flash_attn",
    }
    for comp, key in simple.items():
        if key in rec:
            obj = getattr(c, comp)
            add(f"components.{comp}.version", key, "" if isinstance(obj, Null) else obj.version, _first(rec[key]))
    if "deepep" in rec:
        obj = c.deepep
        locked = "" if isinstance(obj, Null) else obj.version
        found = None if isinstance(obj, Null) else _after(rec["deepep"], obj.package)
        add("components.deepep.version", "deepep", locked, found)
    if "megatron_lm" in rec:
        obj = c.megatron_core
        locked = "" if isinstance(obj, Null) else obj.version
        add("components.megatron_core.version", "megatron_lm", locked, _after(rec["megatron_lm"], "megatron-core"))
    if "network" in rec and ("EFA" in rec["network"]):
        efa = c.efa
        add(
            "components.efa.installer_version",
            "network",
            "" if isinstance(efa, Null) else efa.installer_version,
            _after(rec["network"], "EFA"),
        )
        add(
            "components.efa.aws_ofi_nccl",
            "network",
            "" if isinstance(efa, Null) else efa.aws_ofi_nccl,
            _after(rec["network"], "aws-ofi-nccl"),
        )

    devs = [d.field for d in lock.deviations]
    return [
        FieldCheck(f, k, locked, found, _match(locked, found) if locked else False,
                   any(covers(d, f) for d in devs))
        for f, k, locked, found in pairs
    ]


def covers(deviation: str, field: str) -> bool:
    """Whether a declared deviation's field names this compared field."""
    d = deviation
    if field == d or field.startswith(d + ".") or d == "components":
        return True
    return "*" in d and re.fullmatch(d.replace(".", r"\.").replace("*", r"[^.]+"), field) is not None


def covering_deviations(lock: Lock, checks: list[FieldCheck]) -> list[str]:
    """The declared deviations that cover at least one compared pin that differs from the record
    (one count per deviation, however many pins it covers)."""
    differing = [x.field for x in checks if not x.ok]
    return [d.field for d in lock.deviations if any(covers(d.field, f) for f in differing)]


def problems(checks: list[FieldCheck]) -> list[str]:
    return [
        f"{x.field} = {x.locked or 'null'!r} but the record's {x.recorded_key} says {x.recorded!r} and no deviation names it"
        for x in checks
        if not x.ok and not x.deviation
    ]


def stack_of_lock(lock: Lock) -> dict[str, str]:
    """The stack a lock pins, in the recorded-stack keys of the recipe contract (what ``audit``
    reads): a run audited against it is checked against its image's pins. A component the lock
    writes as null (e.g. CUDA on the cpu target) is left out: there is nothing to check."""
    c = lock.components
    out = {"python": lock.python.version, "pytorch": c.torch.version}
    if not isinstance(lock.cuda, Null):
        out["cuda"] = lock.cuda.version
    for comp in ("transformer_engine", "nccl", "cudnn", "flash_attn"):
        obj = getattr(c, comp)
        if not isinstance(obj, Null):
            out[comp] = obj.version
    if not isinstance(c.deepep, Null):
        out["deepep"] = f"{c.deepep.package} {c.deepep.version}"
    if not isinstance(c.megatron_core, Null):
        out["megatron_lm"] = f"megatron-core {c.megatron_core.version}"
    if not isinstance(c.efa, Null):
        out["network"] = f"EFA {c.efa.installer_version} (aws-ofi-nccl {c.efa.aws_ofi_nccl}, libfabric {c.efa.libfabric})"
    return out
