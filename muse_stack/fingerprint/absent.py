"""Fields that could not be read are recorded as ``{"absent": "<reason>"}``, never guessed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ABSENT = "absent"


def absent(reason: str) -> dict[str, str]:
    """A field this machine could not provide, with the reason."""
    return {ABSENT: reason}


def is_absent(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and ABSENT in value and isinstance(value[ABSENT], str)


def guarded(what: str, fn: Callable[[], Any]) -> Any:
    """Run one probe; an exception becomes an absent marker naming the probe and the error."""
    try:
        return fn()
    except Exception as exc:  # a probe must never break the capture
        return absent(f"{what} failed: {type(exc).__name__}: {exc}")
