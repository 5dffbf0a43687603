"""Measured and tuned values the product reads from data files of the package.

A value that a measurement decides (a kernel's launch, a fitted or measured constant of the planner)
lives in a JSON file beside the code that reads it, never in its source. Each value is an
:class:`Entry`: the value, the benchmark result folder it came from and the command that writes it
again from that folder. The lab's choosers and fits write these files; the product only reads them,
once per process, through :func:`load`, which validates the whole file with its pydantic model and
turns any fault into an InputError naming the file and the field.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from muse_stack.util.errors import InputError

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class Entry(BaseModel, Generic[T]):
    """One value of a data file and where it came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    value: T
    #: the benchmark result folder the value was computed from (relative to the repository root)
    source: str
    #: the command, run from the repository root, that computes the value from ``source`` and writes it here
    command: str


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(the whole file)"


@cache
def load(path: Path, model: type[M]) -> M:
    """``path`` validated as ``model``, read once per process (the files are part of the package)."""
    fix = f"restore {path.name} from the repository, or rerun the command its entries name"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} is missing", field=str(path), value=None, fix=fix) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not readable JSON ({e})", field=str(path), value=None, fix=fix) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = _field(err["loc"])
        raise InputError(f"{path}: {field}: {err['msg']}", field=field, value=err.get("input"), fix=fix) from None
