"""The launches of the engine's own Triton kernels: ``launch.json`` beside this module.

Each kernel's launch (programs per streaming multiprocessor, warps per program and its tile) is the
fastest of a grid that ``benchmarks/scripts/kernels.py`` timed at the slice's shape on an H200; the
kernel's chooser writes it here with the result folder it came from and its own command
(:class:`muse_stack.util.datafile.Entry`):

* ``adam_step`` (:mod:`.adam_step`): ``benchmarks/scripts/adam_choose.py launch KERNELS.json --write``;
* ``norm_backward`` (:mod:`.norm_backward`): ``benchmarks/scripts/normbwd_choose.py launch KERNELS.json --write``.

The kernels read their launch once, when their module is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, PositiveInt

from muse_stack.util.datafile import Entry, load

FILE = Path(__file__).with_name("launch.json")


def _power_of_two(v: int) -> int:
    if v & (v - 1):
        raise ValueError("must be a power of two (a Triton tile or warp count)")
    return v


PowerOfTwo = Annotated[PositiveInt, AfterValidator(_power_of_two)]


class AdamLaunch(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    programs_per_sm: PositiveInt
    num_warps: PowerOfTwo
    #: elements a program updates per iteration (a work item, adam_step.CHUNK elements, is a multiple of it)
    block: PowerOfTwo


class NormBackwardLaunch(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    programs_per_sm: PositiveInt
    #: null: from the row's width, 4 to 16
    num_warps: PowerOfTwo | None
    rows_per_iteration: PowerOfTwo


class Launches(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    adam_step: Entry[AdamLaunch]
    norm_backward: Entry[NormBackwardLaunch]


def launches() -> Launches:
    """launch.json, validated (read once per process)."""
    return load(FILE, Launches)
