"""Tolerant version parsing for comparing recorded (free-text) versions with loaded ones.

A version is a numeric release (``2.17.0``), an optional pre/post/dev tag (``rc1``,
``.post1``, ``.dev0``) and an optional build label (``+cu130``, ``-aws``, ``amzn1.0``).
Two versions match when their releases agree on every component both state (a recorded
``1.49`` matches a loaded ``1.49.0``; a recorded ``9.22.0.52`` matches a loaded ``9.22.0``
that cannot show the build number), their tags are equal, and build labels are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(
    r"""v?(?P<release>\d+(?:\.\d+)*)
        (?P<tag>(?:[-_.]?(?:alpha|beta|preview|pre|post|dev|rc|a|b)[-_.]?\d*(?![A-Za-z]))*)
        (?P<local>(?:[+\-~][\w.\-]+|[A-Za-z][\w.]*)?)""",
    re.X | re.I,
)
VERSION_IN_TEXT = re.compile(
    r"(?<![\w.])v?\d+(?:\.\d+)+(?:(?:[-_.]?(?:a|b|rc|post|dev)\d*)+)?(?:\+[\w.]+)?(?![\w])", re.I
)


@dataclass(frozen=True)
class Version:
    text: str
    release: tuple[int, ...]
    tag: str
    local: str

    def __str__(self) -> str:
        return self.text


def parse_version(text: str) -> Version | None:
    """The version at the start of ``text`` (surrounding spaces allowed), or None."""
    m = _VERSION.match(text.strip())
    if not m:
        return None
    release = tuple(int(x) for x in m.group("release").split("."))
    tag = re.sub(r"[-_.]", "", m.group("tag") or "").lower()
    tag = tag.replace("alpha", "a").replace("beta", "b").replace("preview", "rc").replace("pre", "rc")
    return Version(text=m.group(0), release=release, tag=tag, local=(m.group("local") or "").lstrip("+-~"))


def first_version(text: str) -> str | None:
    """The first version-looking token in free text ("2.17.0 (PyTorch extension ...)" -> "2.17.0")."""
    m = VERSION_IN_TEXT.search(text)
    return m.group(0).lstrip("vV") if m else None


def versions_match(recorded: str, loaded: str) -> bool:
    a, b = parse_version(recorded), parse_version(loaded)
    if a is None or b is None:
        return recorded.strip() == loaded.strip()
    n = min(len(a.release), len(b.release))
    return a.release[:n] == b.release[:n] and a.tag == b.tag


def precision_note(recorded: str, loaded: str) -> str | None:
    """Say when a match could only compare part of the release."""
    a, b = parse_version(recorded), parse_version(loaded)
    if a is None or b is None:
        return None
    if len(a.release) > len(b.release):
        return f"the loaded version shows {len(b.release)} components; {recorded} compared on those"
    return None
