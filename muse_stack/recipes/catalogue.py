"""The recipe catalogue: every YAML file under the recipes directory, by name and alias."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from muse_stack.util.errors import RecipeError
from muse_stack.recipes.overrides import apply_overrides
from muse_stack.recipes.schema import Recipe

RECIPES_ENV = "MUSE_STACK_RECIPES"


def recipes_dir() -> Path:
    """``$MUSE_STACK_RECIPES``, else the ``recipes/`` folder of the source tree."""
    env = os.environ.get(RECIPES_ENV)
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "recipes")
    for cand in candidates:
        if cand.is_dir():
            return cand
    raise RecipeError(
        "no recipes directory found",
        field=RECIPES_ENV, value=env, fix=f"set {RECIPES_ENV} to the folder holding the recipe YAML files",
    )


def format_validation_error(exc: ValidationError, source: str) -> RecipeError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(recipe)"
    value = first.get("input")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    fix = "remove the key (see the recipe format in docs/recipes.md)" if first["type"] == "extra_forbidden" \
        else "correct the value (see the recipe format in docs/recipes.md)"
    return RecipeError(f"{source}: {first['msg'].removeprefix('Value error, ')}{more}", field=loc,
                       value=value if not isinstance(value, dict) else "{...}", fix=fix)


def parse_recipe(data: Any, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping", field="(recipe)", value=type(data).__name__,
                          fix="start the file with name:, task:, hardware: ...")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc, source) from exc


def read_yaml(path: Path) -> Any:
    """A recipe file: a missing file is a RecipeError (exit 2); a directory, unreadable, binary or
    non-UTF-8 file an InputError (exit 3); bad YAML, duplicate keys or runaway aliases a RecipeError."""
    from muse_stack.util.safeio import load_yaml, read_text

    text = read_text(path, field="recipe", what="recipe YAML file", missing=RecipeError,
                     fix="give an existing UTF-8 recipe file or a catalogue name (muse-stack list)")
    return load_yaml(text, source=str(path), field="recipe")


@lru_cache(maxsize=8)
def _load_catalogue(directory: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    index: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        data = read_yaml(path)
        recipe = parse_recipe(data, str(path))
        for name in recipe.all_names:
            if name in index:
                raise RecipeError(f"two recipes are named {name!r}: {index[name][0]} and {path}", field="name",
                                  value=name, fix="rename one of them")
            index[name] = (path, data)
    return index


def catalogue() -> dict[str, tuple[Path, dict[str, Any]]]:
    return _load_catalogue(str(recipes_dir()))


def recipe_names() -> list[str]:
    """Primary names, in file order."""
    seen: list[str] = []
    for _, (path, data) in catalogue().items():
        if data["name"] not in seen:
            seen.append(data["name"])
    return seen


def raw_recipe(name: str) -> tuple[Path, dict[str, Any]]:
    path = Path(name)
    if name.endswith((".yaml", ".yml")) or path.is_file() or path.is_dir():
        return path, read_yaml(path)
    entries = catalogue()
    if name not in entries:
        import difflib

        close = difflib.get_close_matches(name, list(entries), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise RecipeError("no such recipe", field="recipe", value=name,
                          fix=f"{hint}run `muse-stack list` for the catalogue, or pass a path to a recipe YAML file")
    return entries[name]


def load_recipe(name: str, overrides: list[str] | None = None) -> Recipe:
    """A catalogue recipe (by name or alias) or a YAML file, with dotted overrides applied, then
    the optimizer values it still leaves unstated filled by its fill policy (recorded under
    ``filled``; :mod:`muse_stack.recipes.fill`)."""
    from muse_stack.recipes import fill

    path, data = raw_recipe(name)
    if overrides:
        data = apply_overrides(data, overrides)
    return parse_recipe(fill.apply(data), str(path))


def recipe_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, width=100, allow_unicode=True)


def recipe_sha256(recipe: Recipe) -> str:
    """sha256 of the resolved recipe as YAML (stable: key order is the schema's)."""
    return hashlib.sha256(recipe_yaml(recipe).encode("utf-8")).hexdigest()
