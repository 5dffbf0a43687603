"""Reading fingerprint documents back, with errors that name the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from muse_stack.errors import InputError

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


def load_fingerprint(path: str | Path) -> dict[str, Any]:
    file = resolve(path)
    if not file.exists():
        where = f"run directory {path} has no fingerprint.json" if Path(path).is_dir() else f"{file} does not exist"
        raise InputError(where, field="fingerprint", value=str(file), fix=FIX)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{file} is unreadable: {exc}", field="fingerprint", value=str(file), fix=FIX) from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{file} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            field="fingerprint",
            value=str(file),
            fix=f"the file is corrupt or truncated; capture it again: {FIX}",
        ) from exc
    validate(doc, file)
    return doc


def validate(doc: Any, file: str | Path) -> None:
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
