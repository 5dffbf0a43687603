"""The Python interpreter and the installed distributions (importlib.metadata)."""

from __future__ import annotations

import hashlib
import platform
import re
import sys
from importlib import metadata
from typing import Any


def normalize(name: str) -> str:
    """PEP 503 name normalisation: runs of -, _ and . become -, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_index() -> dict[str, metadata.Distribution]:
    """Installed distributions by normalised name; the first on sys.path wins, as for imports."""
    index: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if not name:
            continue
        index.setdefault(normalize(name), dist)
    return index


def distributions_sha256(versions: dict[str, str]) -> str:
    listing = "".join(f"{name}=={version}\n" for name, version in sorted(versions.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


def collect(index: dict[str, metadata.Distribution]) -> dict[str, Any]:
    versions = {name: index[name].version for name in sorted(index)}
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "distribution_count": len(versions),
        "distributions_sha256": distributions_sha256(versions),
        "distributions": versions,
    }
