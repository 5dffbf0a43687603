"""Named points in a run where the fault-injection tests stop a process.

``MUSE_STACK_FAULT_AT=POINT@STEP`` (or ``POINT`` for the first pass) makes the run write
``MUSE_STACK_FAULT_MARK`` (a file path) when it reaches that point and then wait there, so a
test can SIGKILL it at exactly that moment. Unset (every real run), each point is one
dictionary lookup. ``MUSE_STACK_FAULT_SLOW_SAVE_S=SECONDS`` makes every checkpoint save sleep that long before it
completes its folder (:func:`slow_save`), a save slower than the launcher's grace for the preemption tests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV_AT = "MUSE_STACK_FAULT_AT"
ENV_MARK = "MUSE_STACK_FAULT_MARK"
ENV_SLOW_SAVE = "MUSE_STACK_FAULT_SLOW_SAVE_S"

#: every point the pipeline passes, in order (the tests kill at each)
POINTS = (
    "setup",  # the run directory exists, nothing else yet
    "after-data",  # the rows are built, the engine is not
    "after-step",  # a step's metrics row is on disk
    "save-engine",  # inside a save: the engine's files are written, the folder is not yet complete
    "save-renamed",  # the step folder is complete, the latest pointer still names the previous one
    "save-pointed",  # the latest pointer names the new folder, old folders not yet pruned
)


def point(name: str, step: int | None = None) -> None:
    wanted = os.environ.get(ENV_AT)
    if not wanted:
        return
    where, _, at = wanted.partition("@")
    if where != name or (at and step is not None and int(at) != step) or (at and step is None):
        return
    mark = os.environ.get(ENV_MARK)
    if mark:
        Path(mark).write_text(f"{name}@{step}\n")
    while True:  # wait to be killed
        time.sleep(3600)


def slow_save() -> None:
    """Inside a save, before its folder is complete: sleep ``MUSE_STACK_FAULT_SLOW_SAVE_S`` seconds when set."""
    seconds = os.environ.get(ENV_SLOW_SAVE)
    if seconds:
        time.sleep(float(seconds))
