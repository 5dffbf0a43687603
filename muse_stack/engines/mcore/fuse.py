"""Elementwise fusion for the GPU layers: ``torch.compile`` over the norm / gate / residual /
softcap chains, switched by the recipe's ``engine_options.compile_elementwise`` (and compiled with
TorchInductor's multi-kernel under ``engine_options.compile_multi_kernel``).

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
    #: TorchInductor options of the compiled chains (``torch.compile``'s ``options``; none: its defaults)
    inductor_options: dict[str, Any] = {}
    generation = 0  # bumped on every change so compiled chains are rebuilt


_settings = _Settings()

#: TorchInductor's multi-kernel: each row reduction compiled both persistent and looped, the faster one
#: chosen at the first call (``torch._inductor.config.triton.multi_kernel``)
MULTI_KERNEL = {"triton.multi_kernel": 1}


def configure(enabled: bool, *, backend: Any = "inductor", inductor_options: dict[str, Any] | None = None) -> None:
    """Turn compilation of the elementwise chains on or off (for this process); ``backend`` is
    any ``torch.compile`` backend, ``inductor_options`` TorchInductor's options for them (the
    inductor backend only; None: as they are)."""
    chosen = dict(_settings.inductor_options if inductor_options is None else inductor_options)
    if (enabled, backend, chosen) != (_settings.enabled, _settings.backend, _settings.inductor_options):
        _settings.enabled, _settings.backend, _settings.inductor_options = bool(enabled), backend, chosen
        _settings.generation += 1


def enabled() -> bool:
    return _settings.enabled


def install_compile_elementwise(model: Any, on: bool) -> str | None:
    """``engine_options.compile_elementwise``: the chains compiled by TorchInductor (or eager) for this process."""
    configure(on)
    return None


def install_compile_multi_kernel(model: Any, on: bool) -> str | None:
    """``engine_options.compile_multi_kernel``: the compiled chains with TorchInductor's multi-kernel (or its
    default), on the backend :func:`install_compile_elementwise` chose."""
    configure(_settings.enabled, backend=_settings.backend, inductor_options=MULTI_KERNEL if on else {})
    return None


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
            extra = {"options": dict(_settings.inductor_options)} if _settings.inductor_options else {}
            cache["compiled"] = torch.compile(fn, dynamic=None, backend=_settings.backend, **extra)
            cache["generation"] = _settings.generation
        return cache["compiled"](*args)

    return wrapper  # type: ignore[return-value]
