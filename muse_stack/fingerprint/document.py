"""Reading fingerprint documents back, with errors that name the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from muse_stack.util.errors import InputError

SCHEMA_VERSION = 1
KIND = "muse-stack-fingerprint"
FIX = (
    "pass a fingerprint written by `muse-stack fingerprint -o FILE`, or a run directory "
    "whose fingerprint.json was written by `muse-stack run`"
)


def resolve(path: str | Path) -> Path:
    """A fingerprint file, or ``fingerprint.json`` inside a run directory."""
    p = Path(path)
    if p.is_dir():
        return p / "fingerprint.json"
    return p


#: the sections every captured fingerprint holds, each a JSON object
SECTIONS = ("capture", "process", "identity", "host", "gpu", "cuda_libraries", "frameworks", "network", "python",
            "environment", "run_inputs")
#: further sections some fingerprints hold (run extras, the rank agreement of multi-process runs)
OPTIONAL_SECTIONS = ("extra", "ranks")


def load_fingerprint(path: str | Path, *, complete: bool = False) -> dict[str, Any]:
    """Read and check a fingerprint. ``complete`` (what ``diff`` needs) also requires every
    section a capture writes: a document missing one is corrupt, not a stack that differs."""
    from muse_stack.util.safeio import read_text

    file = resolve(path)
    if not file.exists():
        where = f"run directory {path} has no fingerprint.json" if Path(path).is_dir() else f"{file} does not exist"
        raise InputError(where, field="fingerprint", value=str(file), fix=FIX)
    text = read_text(file, field="fingerprint", what="fingerprint JSON file", fix=FIX)
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InputError(
            f"{file} is not valid JSON ({exc})",
            field="fingerprint",
            value=str(file),
            fix=f"the file is corrupt or truncated; capture it again: {FIX}",
        ) from exc
    validate(doc, file, complete=complete)
    return doc


def validate(doc: Any, file: str | Path, *, complete: bool = False) -> None:
    if not isinstance(doc, dict):
        raise InputError(
            f"{file} holds a JSON {type(doc).__name__}, not a fingerprint object", field="fingerprint", value=str(file), fix=FIX
        )
    version = doc.get("schema_version")
    if "schema_version" not in doc:
        raise InputError(f"{file} has no schema_version: not a muse-stack fingerprint", field="schema_version",
                         value=None, fix=FIX)
    if not isinstance(version, int) or isinstance(version, bool):
        raise InputError(f"{file}: schema_version must be an integer", field="schema_version", value=version, fix=FIX)
    if version > SCHEMA_VERSION:
        raise InputError(
            f"{file} uses fingerprint schema {version}; this muse-stack reads up to {SCHEMA_VERSION}",
            field="schema_version",
            value=version,
            fix="upgrade muse-stack to compare this fingerprint",
        )
    if version < 1:
        raise InputError(f"{file}: schema_version {version} is not a valid version", field="schema_version",
                         value=version, fix=FIX)
    if complete and doc.get("kind") != KIND:
        raise InputError(f"{file}: kind is not {KIND!r}: not a muse-stack fingerprint", field="kind",
                         value=doc.get("kind"), fix=FIX)
    for name in SECTIONS + OPTIONAL_SECTIONS:
        if name not in doc:
            if complete and name in SECTIONS:
                raise InputError(f"{file} has no {name} section: the document is truncated or not a capture",
                                 field=name, value=None, fix=f"the file is corrupt; capture it again: {FIX}")
            continue
        if not isinstance(doc[name], dict):
            raise InputError(f"{file}: the {name} section must be a JSON object, not a {type(doc[name]).__name__}",
                             field=name, value=doc[name], fix=f"the file is corrupt; capture it again: {FIX}")
