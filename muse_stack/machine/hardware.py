"""GPU facts the planner and the MFU figures use, each with its source: the GPU machines of the
machine table (:mod:`muse_stack.machine.table`, ``muse_stack/machine/machines.yaml``)."""

from __future__ import annotations

from typing import Any

from muse_stack.machine.table import GpuSpec, table

__all__ = ["GPUS", "GpuSpec", "gpu_spec", "gpus"]


def gpus() -> dict[str, GpuSpec]:
    """The GPU machines of the table in use, in table order."""
    return table().gpus


def gpu_spec(gpu: str) -> GpuSpec | None:
    """The GPU's facts, or None for ``cpu`` (its peak is measured at run time)."""
    return gpus().get(gpu)


def __getattr__(name: str) -> Any:
    # ``GPUS``: the table in use when it is read, never a copy taken at import
    if name == "GPUS":
        return gpus()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
