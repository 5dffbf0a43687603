"""The rate one rank writes a synchronous checkpoint save at, from the measured save (CPU only).

    python benchmarks/scripts/plan/fit_save.py [--write]

benchmarks/results/ckpt-save/ckpt-save.json holds a synchronous dist-checkpoint save of slice-1gpu through the
runner's own checkpoint manager on one H200 (one process, the machine's local disk): the bytes written
(``sync.bytes``) and the time the training loop was blocked (``sync.blocking_s``). Their ratio, in GB/s, is the
write rate the planner divides a rank's checkpoint bytes by (:mod:`muse_stack.plan.save`). ``--write`` writes
it, to ``DIGITS`` significant digits, into the planner's calibration (``checkpoint.write_gb_per_s`` in
``muse_stack/plan/calibration.json``) with benchmarks/results/ckpt-save and this command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datafiles  # noqa: E402

RESULT = Path(__file__).resolve().parents[2] / "results" / "ckpt-save"
#: significant digits the rate keeps in the calibration (a rounding of at most 0.5%)
DIGITS = 3


def measure(folder: Path = RESULT) -> dict:
    sync = json.loads((folder / "ckpt-save.json").read_text())["sync"]
    return {"bytes": sync["bytes"], "seconds": sync["blocking_s"],
            "write_gb_per_s": sync["bytes"] / sync["blocking_s"] / 1e9}


def write_calibration(out: dict, path: Path = datafiles.CALIBRATION) -> str:
    cmd = datafiles.command(__file__, "--write")
    entry = datafiles.entry(datafiles.significant(out["write_gb_per_s"], DIGITS), RESULT, cmd)
    return datafiles.write_calibration({"checkpoint": {"write_gb_per_s": entry}}, path)


def show(out: dict) -> None:
    print(f"{out['bytes'] / 1e9:.1f} GB in {out['seconds']:.1f} s: {out['write_gb_per_s']:.4f} GB/s")


def main(argv: list[str] | None = None) -> int:
    return datafiles.fit_cli(argv, "the rate", measure, show, write_calibration)


if __name__ == "__main__":
    raise SystemExit(main())
