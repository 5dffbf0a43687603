"""Shell completion of recipe and lock names (``muse-stack --install-completion``).

Each TAB runs the command line once, so completion reads only what names need: the recipe files'
``name`` and ``aliases`` keys (YAML, no validation) and the lock files' names. The command
modules import nothing heavy at load (torch, the models) for the same reason."""

from __future__ import annotations

from pathlib import Path


def _yaml_names(path: Path) -> list[str]:
    import yaml

    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []  # a broken file is reported when it is used, not while completing
    if not isinstance(data, dict):
        return []
    names = [data.get("name")] + list(data.get("aliases") or [])
    return [n for n in names if isinstance(n, str)]


def recipe_names(incomplete: str) -> list[str]:
    """Catalogue recipe names and aliases that start with ``incomplete``."""
    from muse_stack.recipes.catalogue import recipes_dir
    from muse_stack.util.errors import MuseStackError

    try:
        folder = recipes_dir()
    except MuseStackError:
        return []
    names = [n for path in sorted(folder.glob("*.yaml")) for n in _yaml_names(path)]
    return [n for n in names if n.startswith(incomplete)]


def lock_names(incomplete: str) -> list[str]:
    """Stack lock targets (containers/locks/<name>.toml) that start with ``incomplete``."""
    from muse_stack.stack.lock import locks_dir

    folder = locks_dir()
    names = sorted(p.stem for p in folder.glob("*.toml") if not p.stem.startswith("pylock.")) if folder.is_dir() else []
    return [n for n in names if n.startswith(incomplete)]
