"""The planner's measured and fitted constants: ``calibration.json`` beside this module.

Each entry is a value with the benchmark result folder it came from and the command that writes it
again (:class:`muse_stack.util.datafile.Entry`); nothing here or in the planner's source restates a value.
A calibration's field takes its default from the file through :func:`calibrated`; the file's sections:

``time``: :class:`muse_stack.plan.cost.TimeCalibration`, the step-time model:

* the GPU terms (the matmul efficiency, the compiled passes, the dispatchers' and the optimizer layouts'
  passes): ``benchmarks/scripts/plan/fit_time.py --sweep``'s fit to one machine's sweep of slice-1gpu
  and its neighbours, which writes them with ``--write``;
* the host times and the eager passes, which that sweep does not separate: the same command writes the
  values it held them at, the fit to the older runs of benchmarks/ (``fit_time.py`` without ``--sweep``,
  benchmarks/results/plan/fit_time.json);
* the share of the HBM bandwidth each of the engine's kernels reached alone: ``adam_choose.py launch
  --write`` and ``normbwd_choose.py launch --write``, from the timings the kernel's launch was chosen by.

``memory``: :class:`muse_stack.plan.memory.Calibration`, the activation factors and the runtime buffers fitted
to the runs' peak allocated memory (``benchmarks/scripts/plan/fit.py --write``).

``used``: :class:`muse_stack.plan.used.UsedCalibration`, the allocator's reserve and the memory outside the
allocator measured on the runs that recorded device memory (``benchmarks/scripts/plan/fit_used.py --write``).

``scale``: :class:`muse_stack.plan.scale.ScaleCalibration`, the at-scale terms' Blackwell kernel efficiency and the
host gap per MoE layer's token-count sync, fitted to the published runs' fit rows only
(``benchmarks/scripts/plan/validate_bridge.py --fit --write``; muse_stack/plan/published/bridge-moe.yaml).

``checkpoint``: :class:`muse_stack.plan.save.SaveCalibration`, the rate one rank writes a synchronous checkpoint
save at, from the measured save of benchmarks/results/ckpt-save (``benchmarks/scripts/plan/fit_save.py --write``).

Which of its own kernels the engine runs is no calibration: each is an engine option of the recipe
(muse_stack/recipes/options.py), on where it applies unless the recipe says otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from muse_stack.util.datafile import Entry, load
from muse_stack.util.errors import InputError

FILE = Path(__file__).with_name("calibration.json")
#: the sections of numbers, and the calibration whose defaults each holds
SECTIONS = {"time": "TimeCalibration (plan/cost.py)", "memory": "Calibration (plan/memory.py)",
            "used": "UsedCalibration (plan/used.py)", "checkpoint": "SaveCalibration (plan/save.py)",
            "scale": "ScaleCalibration (plan/scale.py)"}
#: section -> the fields that take their default from it (each registered by :func:`calibrated`)
_FIELDS: dict[str, set[str]] = {s: set() for s in SECTIONS}


def _finite_non_negative(v: float) -> float:
    if not math.isfinite(v) or v < 0:
        raise ValueError("must be a finite number >= 0 (an efficiency, a factor, a count of passes, seconds, GiB "
                         "or a share)")
    return v


Number = Entry[Annotated[float, AfterValidator(_finite_non_negative)]]


class CalibrationFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    time: dict[str, Number]
    memory: dict[str, Number]
    used: dict[str, Number]
    checkpoint: dict[str, Number]
    scale: dict[str, Number]

    @field_validator("time")
    @classmethod
    def _shares(cls, time: dict[str, Entry]) -> dict[str, Entry]:
        """An efficiency or a bandwidth share is a share of a datasheet peak: above 0 (the model divides by it)
        and at most 1."""
        for name, entry in time.items():
            if ("efficiency" in name or "bandwidth" in name) and not 0 < entry.value <= 1:
                raise ValueError(f"time.{name}.value is {entry.value}: a share of a datasheet peak, above 0 and at "
                                 "most 1")
        return time


def calibration() -> CalibrationFile:
    """calibration.json, validated (read once per process)."""
    return load(FILE, CalibrationFile)


def value(section: str, name: str) -> float:
    """``section.name``'s value. An entry no calibration field takes is refused, as a missing one is."""
    entries = getattr(calibration(), section)
    unknown = sorted(set(entries) - _FIELDS[section])
    if unknown:
        raise InputError(f"{FILE}: {section}.{unknown[0]} is no field of {SECTIONS[section]}",
                         field=f"{section}.{unknown[0]}", value=entries[unknown[0]].value,
                         fix="remove the entry, or rerun the command of the other entries to rewrite the file")
    if name not in entries:
        raise InputError(f"{FILE}: {section}.{name} is missing", field=f"{section}.{name}", value=None,
                         fix=f"restore {FILE.name} from the repository, or rerun the fit or chooser that writes "
                             f"{name} (docs/planning.md, 'Where the calibration lives')")
    return entries[name].value


def calibrated(section: str, name: str) -> Any:
    """A pydantic field whose default is ``section.name`` of calibration.json, read when first needed."""
    _FIELDS[section].add(name)
    return Field(default_factory=lambda: value(section, name))
