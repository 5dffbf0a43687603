"""Write the values the lab measures into the product's data files, never into its source.

The product reads its measured and tuned values from two files of the package:

* ``muse_stack/plan/calibration.json`` (:mod:`muse_stack.plan.calibration`): the planner's step-time
  calibration, written by ``plan/fit_time.py --sweep DIR --write`` and by the choosers' ``launch --write``
  (each kernel's bandwidth share); its memory calibration, written by ``plan/fit.py --write`` and
  ``plan/fit_used.py --write``; and the engine's shipped kernels, written by ``embedgrad_choose.py --ship``;
* ``muse_stack/engines/mcore/launch.json`` (:mod:`muse_stack.engines.mcore.launch`): the Triton kernels'
  launches, written by ``adam_choose.py launch --write`` and ``normbwd_choose.py launch --write``.

(``muse_stack/plan/tower_traffic.json``, the towers' memory traffic counted by running their code, not measured,
is written by ``plan/tower_traffic.py --write`` through :func:`validated` and :func:`write`.)

Each entry carries its value, the benchmark result folder it came from and the command that wrote it
(paths relative to the repository root). A writer replaces its own entries and keeps the others; the
file is validated by the product's own model before it is written, written whole or not at all, as
JSON with two-space indents in the model's order. Fitted numbers are rounded (the step-time calibration
to ``DIGITS`` significant digits; each writer states its rounding): a refit from the same committed
results writes the same bytes, and a refit that moves a value by less than its rounding leaves the file
as it is.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "muse_stack" / "plan" / "calibration.json"
LAUNCH = ROOT / "muse_stack" / "engines" / "mcore" / "launch.json"
#: significant digits of the step-time calibration's numbers (a relative rounding of at most 5e-4)
DIGITS = 4


def significant(value: float, digits: int = DIGITS) -> float:
    """``value`` rounded to ``digits`` significant digits (0 stays 0)."""
    return float(f"{value:.{digits}g}")


def rel(path: str | Path) -> str:
    """``path`` relative to the repository root where it lies under it (the form the files record)."""
    p = Path(path).resolve()
    try:
        return p.relative_to(ROOT).as_posix()
    except ValueError:
        return p.as_posix()


def command(script: str | Path, *args: str | Path) -> str:
    """The command line that runs ``script`` with ``args``, from the repository root (paths made relative)."""
    return " ".join(["python", rel(script), *(rel(a) if isinstance(a, Path) else a for a in args)])


def entry(value: Any, source: str | Path, cmd: str) -> dict[str, Any]:
    """One entry: the value, the result folder it came from, the command that writes it."""
    return {"value": value, "source": rel(source), "command": cmd}


def read(path: Path) -> dict[str, Any]:
    """The data file as it stands (an empty one where there is none yet)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not readable JSON ({e}); restore it from the repository first") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: not a JSON object; restore it from the repository first")
    return data


def dumps(model: BaseModel) -> str:
    """The file's text: the model's JSON, two-space indents, in the model's order."""
    return json.dumps(model.model_dump(mode="json"), indent=2) + "\n"


def validated(path: Path, model: type[BaseModel], data: dict[str, Any]) -> str:
    """``data`` as the file's text, validated as the product reads it (``model``)."""
    from pydantic import ValidationError

    try:
        return dumps(model.model_validate(data))
    except ValidationError as e:
        raise SystemExit(f"{path}: not written, the product would refuse it:\n{e}") from None


def write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    from muse_stack.util import atomic

    atomic.write_text(path, text, field=str(path))


def _section_models() -> dict[str, type[BaseModel]]:
    """calibration.json's sections of numbers -> the calibration whose fields they hold."""
    from muse_stack.plan.cost import TimeCalibration
    from muse_stack.plan.memory import Calibration
    from muse_stack.plan.save import SaveCalibration
    from muse_stack.plan.scale import ScaleCalibration
    from muse_stack.plan.used import UsedCalibration

    return {"time": TimeCalibration, "memory": Calibration, "used": UsedCalibration, "checkpoint": SaveCalibration,
            "scale": ScaleCalibration}


def calibration_text(entries: dict[str, dict[str, dict]], path: Path = CALIBRATION) -> str:
    """calibration.json with ``entries`` ({section: {name: entry}}) replaced and the others kept; a section of
    numbers in its calibration's field order."""
    from muse_stack.plan.calibration import CalibrationFile

    data = read(path)
    for section, new in entries.items():
        data[section] = {**data.get(section, {}), **new}
    for section, model in _section_models().items():
        merged = data.get(section, {})
        unknown = sorted(set(merged) - set(model.model_fields))
        if unknown:
            raise SystemExit(f"{path}: {section}.{unknown[0]} is no field of {model.__name__}")
        data[section] = {f: merged[f] for f in model.model_fields if f in merged}
    return validated(path, CalibrationFile, data)


def launch_text(name: str, launch: dict, path: Path = LAUNCH) -> str:
    """launch.json with kernel ``name``'s launch (an entry) replaced and the other kernels' kept."""
    from muse_stack.engines.mcore.launch import Launches

    data = read(path)
    data[name] = launch
    return validated(path, Launches, data)


def write_calibration(entries: dict[str, dict[str, dict]], path: Path = CALIBRATION) -> str:
    """Replace these entries of calibration.json (:func:`calibration_text`); the text written."""
    text = calibration_text(entries, path)
    write(path, text)
    return text


def hbm_gbps(kernels: dict, path: Path) -> float:
    """The datasheet HBM bandwidth (GB/s) of the GPU a ``kernels.py`` result was timed on."""
    from muse_stack.machine.hardware import GPUS

    device = kernels.get("device")
    gpu = next((g for g in GPUS if isinstance(device, str) and g in device.split()), None)
    if gpu is None or GPUS[gpu].hbm_gbps is None:
        raise SystemExit(f"{path}: device {device!r} is no GPU of muse_stack/machine/hardware.py with an HBM "
                         "bandwidth; a bandwidth share needs one")
    return GPUS[gpu].hbm_gbps



def fit_cli(argv: list[str] | None, what: str, compute: Callable[[], dict], show: Callable[[dict], None],
            write: Callable[[dict], Any]) -> int:
    """A fit script's command line: ``compute()`` from the committed results, ``show`` it, and with ``--write``
    ``write`` it into the planner's calibration (``what``: the help's name for it)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true",
                    help=f"write {what} into the planner's calibration (muse_stack/plan/calibration.json)")
    args = ap.parse_args(argv)
    out = compute()
    show(out)
    if args.write:
        write(out)
        print(f"written to {rel(CALIBRATION)}")
    return 0
