"""The planned time of a checkpoint save and the periodic interval chosen from it.

A save writes each rank's share of the training state: its bf16 weights and, where the optimizer's state is on
the GPU, the fp32 main weights and both Adam moments of its shard (the memory model's ``weights_gib`` and
``optimizer_gib`` of the rank's stage; gradients are not saved). The planned time is the largest stage's bytes
divided by the write rate measured on a synchronous save (``checkpoint.write_gb_per_s`` of calibration.json:
benchmarks/results/ckpt-save, the slice's full training state through the runner's own checkpoint manager on one
H200's local disk, one writer). Every rank writes at once, so a shared filesystem slower per writer than that
disk lengthens the save: the launcher's margin (:data:`SIGNAL_MARGIN`) covers it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from muse_stack.plan.calibration import calibrated

GB = 1e9
#: the launcher's warning signal comes this many planned saves ahead of the limit, plus one step (the stop
#: waits for the step under way): a save may take twice its plan before the limit cuts it off
SIGNAL_MARGIN = 2.0
#: the warning is never shorter than this (seconds): setup and a short save still finish
MIN_SIGNAL_S = 120
#: the fill policy of the periodic interval: the synchronous save takes at most this share of the training time
INTERVAL_POLICY = "save-share-5pct"
SAVE_SHARE = 0.05


class SaveCalibration(BaseModel):
    model_config = ConfigDict(frozen=True)

    #: GB/s one rank writes a synchronous dist-checkpoint save at (measured: benchmarks/results/ckpt-save)
    write_gb_per_s: float = calibrated("checkpoint", "write_gb_per_s")


class SaveTime(BaseModel):
    bytes_per_rank: int  #: the largest stage's weights and optimizer state per rank
    stage: int  #: the stage that holds them
    write_gb_per_s: float
    seconds: float  #: planned synchronous save time

    def describe(self) -> str:
        return (f"{self.bytes_per_rank / GB:.1f} GB per rank (stage {self.stage}: weights + fp32 main + Adam "
                f"moments) at {self.write_gb_per_s:g} GB/s measured (benchmarks/results/ckpt-save) = "
                f"{self.seconds:.0f} s")


def save_time(memory, cal: SaveCalibration | None = None) -> SaveTime | None:
    """The planned save of the stage with the most checkpoint bytes (``memory``: the planner's StageMemory list)."""
    if not memory:
        return None
    cal = cal or SaveCalibration()
    from muse_stack.plan.memory import GIB

    stage = max(memory, key=lambda m: m.weights_gib + m.optimizer_gib)
    nbytes = int((stage.weights_gib + stage.optimizer_gib) * GIB)
    return SaveTime(bytes_per_rank=nbytes, stage=stage.stage, write_gb_per_s=cal.write_gb_per_s,
                    seconds=nbytes / (cal.write_gb_per_s * GB))


def signal_seconds(save_s: float | None, step_s: float | None, floor: int = MIN_SIGNAL_S) -> int:
    """Seconds ahead of the time limit the warning signal comes: one step to finish plus ``SIGNAL_MARGIN``
    planned saves, at least ``floor``. It is also the grace torchrun gives its workers (``--shutdown-timeout``)."""
    if save_s is None:
        return floor
    return max(floor, math.ceil((step_s or 0.0) + SIGNAL_MARGIN * save_s))


def default_interval(save_s: float, step_s: float) -> int:
    """Steps between periodic saves so the save takes at most ``SAVE_SHARE`` of the time:
    ``save / (interval x step + save) <= SAVE_SHARE``."""
    return max(1, math.ceil(save_s * (1 - SAVE_SHARE) / (SAVE_SHARE * step_s)))


def fill_interval(recipe, plan) -> None:
    """On several nodes, a recipe that states no ``training.checkpoint_interval`` (and keeps its fill policy) gets
    the interval of :data:`INTERVAL_POLICY` from ``plan``'s planned save and step time, recorded under
    ``filled`` with its source like the other filled values. A stated value is left as it is."""
    from muse_stack.recipes.fill import POLICY
    from muse_stack.recipes.schema import FilledValue

    if (recipe.training.checkpoint_interval is not None or recipe.fill_policy != POLICY or plan.nodes <= 1
            or plan.save is None or plan.time is None):
        return
    step = plan.time.step_s
    value = default_interval(plan.save.seconds, step)
    recipe.training.checkpoint_interval = value
    recipe.filled["training.checkpoint_interval"] = FilledValue(
        value=value, source=f"fill policy {INTERVAL_POLICY}: the planned save ({plan.save.seconds:.0f} s per rank) "
                            f"at most {SAVE_SHARE:.0%} of the time of {value} steps of {step:.3f} s "
                            "(muse_stack/plan/save.py)")
