"""The planner's measured and fitted constants: ``calibration.json`` beside this module.

Each entry is a value with the benchmark result folder it came from and the command that writes it
again (:class:`muse_stack.util.datafile.Entry`); nothing here or in the planner's source restates a value.

``time``: the defaults of the step-time model's :class:`muse_stack.plan.cost.TimeCalibration`, one entry a
field:

* the GPU terms (the matmul efficiency, the compiled passes, the dispatchers' and the optimizer layouts'
  passes): ``benchmarks/scripts/plan/fit_time.py --sweep``'s fit to one machine's sweep of slice-1gpu
  and its neighbours, which writes them with ``--write``;
* the host times and the eager passes, which that sweep does not separate: the same command writes the
  values it held them at, the fit to the older runs of benchmarks/ (``fit_time.py`` without ``--sweep``,
  benchmarks/results/plan/fit_time.json);
* the share of the HBM bandwidth each of the engine's kernels reached alone: ``adam_choose.py launch
  --write`` and ``normbwd_choose.py launch --write``, from the timings the kernel's launch was chosen by.

``engine_kernels``: which of its own kernels the megatron engine runs where no recipe field decides it
(``embedgrad_choose.py --ship``); the planner prices it (:func:`muse_stack.plan.cost.step_kernels`) and the
engine runs it (muse_stack/engines/mcore/layers.py), both from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

from muse_stack.util.datafile import Entry, load
from muse_stack.util.errors import InputError

FILE = Path(__file__).with_name("calibration.json")


def _finite_non_negative(v: float) -> float:
    if not math.isfinite(v) or v < 0:
        raise ValueError("must be a finite number >= 0 (an efficiency, a count of passes, seconds or a share)")
    return v


class EngineKernels(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the post-expert norm's backward: the compiled chain's, or the engine's one Triton pass (norm_backward.py)
    post_expert_norm_backward: Entry[Literal["compiled", "one_pass"]]


class CalibrationFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    #: TimeCalibration's field -> its default
    time: dict[str, Entry[Annotated[float, AfterValidator(_finite_non_negative)]]]
    engine_kernels: EngineKernels


def calibration() -> CalibrationFile:
    """calibration.json, validated (read once per process)."""
    return load(FILE, CalibrationFile)


def time_value(name: str, fields: Iterable[str]) -> float:
    """The default of TimeCalibration's ``name`` (``fields``: TimeCalibration's fields; an entry of the file
    that names none of them is refused, as a missing one is)."""
    entries = calibration().time
    unknown = sorted(set(entries) - set(fields))
    if unknown:
        raise InputError(f"{FILE}: time.{unknown[0]} is no field of the planner's TimeCalibration",
                         field=f"time.{unknown[0]}", value=entries[unknown[0]].value,
                         fix="remove the entry, or rerun the command of the other entries to rewrite the file")
    if name not in entries:
        raise InputError(f"{FILE}: time.{name} is missing", field=f"time.{name}", value=None,
                         fix=f"restore {FILE.name} from the repository, or rerun the fit or chooser that writes "
                             f"{name} (docs/planning.md, 'Calibration')")
    return entries[name].value


def one_pass_norm_backward() -> bool:
    """Whether the engine runs the post-expert norm's backward as its one Triton pass (where Triton is present)."""
    return calibration().engine_kernels.post_expert_norm_backward.value == "one_pass"
