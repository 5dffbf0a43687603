"""Walking fingerprint documents: leaf paths and structural differences."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from muse_stack.fingerprint.absent import is_absent


class _Missing:
    """A key present on one side only."""

    def __repr__(self) -> str:
        return "<missing>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Missing)

    def __hash__(self) -> int:
        return 0


MISSING = _Missing()
Path = tuple[str, ...]


def dotted(path: Path) -> str:
    return ".".join(path)


def matches(path: Path, patterns: tuple[str, ...] | list[str]) -> bool:
    text = dotted(path)
    return any(fnmatchcase(text, p) for p in patterns)


def is_branch(value: Any) -> bool:
    """A mapping to descend into (absent markers and empty mappings are leaves)."""
    return isinstance(value, dict) and bool(value) and not is_absent(value)


def leaves(doc: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    if is_branch(doc):
        for key, value in doc.items():
            yield from leaves(value, prefix + (str(key),))
    else:
        yield prefix, doc


@dataclass(frozen=True)
class Change:
    path: Path
    a: Any
    b: Any

    @property
    def kind(self) -> str:
        if self.a is MISSING:
            return "added"
        if self.b is MISSING:
            return "removed"
        if is_absent(self.a) and not is_absent(self.b):
            return "now readable"
        if is_absent(self.b) and not is_absent(self.a):
            return "now absent"
        return "changed"


def changes(a: Any, b: Any, prefix: Path = (), skip: tuple[str, ...] = ()) -> list[Change]:
    """Every place where ``a`` and ``b`` differ; mappings are compared key by key, other
    values (lists, absent markers, scalars) as wholes. Paths matching ``skip`` are ignored."""
    out: list[Change] = []
    _walk(a, b, prefix, skip, out)
    return out


def _walk(a: Any, b: Any, path: Path, skip: tuple[str, ...], out: list[Change]) -> None:
    if skip and path and matches(path, skip):
        return
    if a == b and type(a) is type(b):
        return
    if is_branch(a) and is_branch(b):
        for key in list(a) + [k for k in b if k not in a]:
            _walk(a.get(key, MISSING), b.get(key, MISSING), path + (str(key),), skip, out)
        return
    out.append(Change(path, a, b))


def summarize(value: Any, limit: int = 120) -> str:
    """Short human text for one side of a change."""
    if value is MISSING:
        return "—"
    if is_absent(value):
        text = f"absent: {value['absent']}"
    elif isinstance(value, dict):
        text = f"{{{len(value)} fields}}" if value else "{}"
    elif isinstance(value, list):
        text = ", ".join(str(v) for v in value) if len(value) <= 8 else f"[{len(value)} items]"
        text = text or "[]"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
