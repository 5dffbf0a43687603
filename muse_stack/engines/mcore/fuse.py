"""Elementwise fusion for the GPU layers: ``torch.compile`` over the norm / gate / residual /
softcap chains, switched by the recipe's ``fusions.compile_elementwise``.

Each chain is a handful of fp32 elementwise kernels between two matmuls; compiled, it is one
kernel that reads and writes the activation once. Compilation is lazy (first call) and uses
automatic dynamic shapes: a chain compiles for the first shape it sees and, if it later sees
another (the post-expert norm under EP > 1, where each rank receives a different number of
tokens every step), compiles once more with that dimension symbolic instead of once per
token count. A chain may call another (the post-attention residual calls the gated
residual): the inner one is then part of the caller's graph, and compiled on its own where it is
called directly.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


class _Settings:
    enabled = False
    backend: Any = "inductor"
    generation = 0  # bumped on every change so compiled chains are rebuilt


_settings = _Settings()


def configure(enabled: bool, *, backend: Any = "inductor") -> None:
    """Turn compilation of the elementwise chains on or off (for this process); ``backend`` is
    any ``torch.compile`` backend."""
    if (enabled, backend) != (_settings.enabled, _settings.backend):
        _settings.enabled, _settings.backend = bool(enabled), backend
        _settings.generation += 1


def enabled() -> bool:
    return _settings.enabled


def elementwise(fn: F) -> F:
    """Run ``fn`` eagerly, or compiled when :func:`configure` turned compilation on."""
    cache: dict[str, Any] = {"generation": -1, "compiled": None}

    @wraps(fn)
    def wrapper(*args: Any) -> Any:
        # Called from another chain while that one is being traced: run the plain function, so
        # that Dynamo inlines it into the caller's graph. Building the compiled object here
        # instead would be traced as a side effect, and Dynamo replays ``torch.compile`` inside
        # a traced region as the plain function: the cache would then hold the eager function
        # and every later direct call of this chain would run eagerly.
        if not _settings.enabled or torch.compiler.is_compiling():
            return fn(*args)
        if cache["generation"] != _settings.generation:
            cache["compiled"] = torch.compile(fn, dynamic=None, backend=_settings.backend)
            cache["generation"] = _settings.generation
        return cache["compiled"](*args)

    return wrapper  # type: ignore[return-value]
