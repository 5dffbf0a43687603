"""Freezing named parts of a model for recipes (e.g. train only the experts).

Patterns match parameter names (the checkpoint names) either as a module prefix
(``model.language_model.embed_tokens`` freezes ``...embed_tokens.weight``) or as an
:mod:`fnmatch` glob (``*.self_attn.*``, ``model.language_model.layers.[0-3].*``).
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn

from muse_stack.util.errors import RecipeError


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.startswith(pattern.rstrip(".") + ".") or fnmatchcase(name, pattern)


def _set_trainable(model: nn.Module, patterns: Iterable[str], trainable: bool) -> list[str]:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    named = list(model.named_parameters())
    changed: list[str] = []
    for pattern in patterns:
        hits = [name for name, _ in named if _matches(name, pattern)]
        if not hits:
            raise RecipeError(
                "the pattern matches no parameter of the model",
                field="freeze", value=pattern,
                rule="a pattern is a module prefix or an fnmatch glob over parameter names",
                fix="use a checkpoint name such as 'model.language_model.embed_tokens' or '*.self_attn.*'",
            )
        changed.extend(hits)
    selected = set(changed)
    for name, param in named:
        if name in selected:
            param.requires_grad_(trainable)
    return sorted(selected)


def freeze(model: nn.Module, patterns: str | Iterable[str]) -> list[str]:
    """Stop gradients to every parameter matching ``patterns``; returns the frozen names."""
    return _set_trainable(model, patterns, False)


def unfreeze(model: nn.Module, patterns: str | Iterable[str]) -> list[str]:
    """Make parameters matching ``patterns`` trainable again; returns their names."""
    return _set_trainable(model, patterns, True)


def named_trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters an optimizer should update (``e_score_correction_bias`` is a buffer, never here)."""
    return [p for _, p in named_trainable_parameters(model)]
