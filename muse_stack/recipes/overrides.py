"""Dotted ``key.path=value`` overrides, as Megatron-Bridge takes them on its command line."""

from __future__ import annotations

import copy
import re
from typing import Any

from muse_stack.util.errors import RecipeError

_KEY_PART = re.compile(r"[A-Za-z0-9_-]{1,100}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``key.path=value`` as (path, value). A literal secret is refused here, before its value is
    parsed, so that no error (not even a YAML error on a malformed value) can show it: a value under
    a secret-named key that is not a reference (``${env:NAME}``), or a credential-shaped key or value
    (:mod:`muse_stack.util.credentials`)."""
    from muse_stack.util.credentials import ENV_REFERENCE, SHELL_REFERENCE, is_secret_key, shape
    from muse_stack.util.safeio import refuse_secrets

    if "=" not in text:
        refuse_secrets(text, field="override")
        raise RecipeError(
            "an override needs the form key.path=value",
            field="override", value=text, fix="write e.g. layout.ep=4 or batch.gbs=64",
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError("the override has no key", field="override", value=text, fix="write e.g. layout.ep=4")
    refuse_secrets(key, field="override", what="the key")
    path = key.split(".")
    bad = next((part for part in path if not _KEY_PART.fullmatch(part)), None)
    if bad is not None:
        raise RecipeError("each part of an override's key is a name: letters, digits, '_' or '-', none empty",
                          field="override", value=key, rule="key.path=value with non-empty names between the dots",
                          fix=f"write e.g. layout.tp=2 (check {'an empty part' if not bad else repr(bad[:40])})")
    if shape(raw):  # name the element that holds it where the value parses; never show the value
        from muse_stack.util.safeio import load_yaml

        try:
            parsed = load_yaml(raw, source="the value", field=key)
        except Exception:
            parsed = raw
        refuse_secrets(parsed, field=key)
        refuse_secrets(raw, field=key)
    reference = ENV_REFERENCE.fullmatch(raw.strip()) or SHELL_REFERENCE.fullmatch(raw.strip())
    if raw.strip() and not reference and any(is_secret_key(part) for part in path) and _text_or_malformed(raw, key):
        from muse_stack.util.credentials import FIX, REDACTED

        raise RecipeError("a secret-named key is given a literal value; recipes, run directories and launch "
                          "files are shared, so secrets never go in them", field=key, value=REDACTED,
                          rule="secrets come only by reference, ${env:NAME}, resolved when the job runs", fix=FIX)
    if raw.strip():
        from muse_stack.util.safeio import load_yaml

        value = load_yaml(raw, source=f"the value of override {key}", field=key)
    else:
        value = None
    return path, value


def _text_or_malformed(raw: str, key: str) -> bool:
    """Whether a value under a secret-named key is a literal (text or a number) or cannot be
    parsed (its parse error must not be shown); a flag, null or a section (checked inside by the
    recipe's own rule) is not."""
    from muse_stack.util.safeio import load_yaml

    try:
        value = load_yaml(raw, source="the value", field=key)
    except Exception:
        return True
    return not isinstance(value, (dict, list, bool, type(None)))


def apply_overrides(data: dict[str, Any], overrides: list[str], known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key.path=value`` applied.

    A Megatron-Bridge key (``train.global_batch_size=64``) is applied to its recipe field
    (:data:`muse_stack.recipes.bridge.BRIDGE_KEYS`). Intermediate mappings are created when missing (``model.overrides.hidden_size=64``); a
    path that walks into a non-mapping is an error naming the path.
    """
    from muse_stack.recipes.bridge import translate

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        path = translate(path)  # Megatron-Bridge ConfigContainer keys name their recipe field
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
