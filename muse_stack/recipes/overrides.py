"""Dotted ``key.path=value`` overrides, as Megatron-Bridge takes them on its command line."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from muse_stack.errors import RecipeError


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(
            "an override needs the form key.path=value",
            field="override", value=text, fix="write e.g. layout.ep=4 or batch.gbs=64",
        )
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise RecipeError("the override has no key", field="override", value=text, fix="write e.g. layout.ep=4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"cannot parse the value: {exc}", field=key, value=raw,
                          fix="quote strings and write lists as [a, b]") from exc
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str], known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key.path=value`` applied.

    Intermediate mappings are created when missing (``model.overrides.hidden_size=64``); a
    path that walks into a non-mapping is an error naming the path.
    """
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = {}
                node[part] = nxt
            if not isinstance(nxt, dict):
                raise RecipeError(
                    f"{'.'.join(path[: i + 1])} is a value, not a section",
                    field=".".join(path), value=value, fix=f"override {'.'.join(path[: i + 1])} itself",
                )
            node = nxt
        node[path[-1]] = value
    return out
