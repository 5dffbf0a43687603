"""``numerics.deterministic``: two runs of one recipe on the same stack and GPU type repeat
bit for bit (loss and grad norm at every step).

What it sets, before the engine builds anything (and what the fingerprint then records, under
``environment`` and ``frameworks.torch``):

* ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS keeps one fixed workspace per stream, so its
  GEMMs pick the same reduction order every call (cuBLAS's reproducibility requirement);
* ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``: Transformer Engine's attention and GEMMs use their
  deterministic backward algorithms (cuDNN fused attention without atomic dQ accumulation);
* ``torch.use_deterministic_algorithms(True)`` and ``torch.backends.cudnn.deterministic``:
  PyTorch's scatter/index-add kernels (the MoE token permutation) take their sorted,
  atomic-free paths, and an operation with no deterministic kernel fails loudly rather than
  varying quietly;
* megatron-core's ``deterministic_mode`` (its TransformerConfig), which selects the
  deterministic code paths inside megatron-core;
* TorchInductor's ``deterministic`` setting for the compiled elementwise chains (no
  benchmark-driven kernel choice that could differ between runs).

A variable the user already set to something else is an error, not silently overridden: the
run would not be what the switch promises.
"""

from __future__ import annotations

import os

from muse_stack.util.errors import RecipeError

#: environment the deterministic mode needs (name -> value)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def check(recipe) -> None:
    """Refuse, before any output, an environment that contradicts the recipe's numerics."""
    if not recipe.numerics.deterministic:
        return
    for name, value in DETERMINISTIC_ENV.items():
        current = os.environ.get(name)
        if current is not None and current != value:
            raise RecipeError(f"numerics.deterministic needs {name}={value}, but the environment sets {current!r}",
                              field="numerics.deterministic", value=True,
                              fix=f"unset {name} (or set it to {value}), or set numerics.deterministic=false")


def apply(recipe) -> dict[str, str]:
    """Set up this process for the recipe's numerics; returns what was set (for the fingerprint)."""
    check(recipe)
    if not recipe.numerics.deterministic:
        return {}
    import torch

    applied: dict[str, str] = {}
    for name, value in DETERMINISTIC_ENV.items():
        os.environ[name] = value
        applied[name] = value
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    applied["torch.use_deterministic_algorithms"] = "True"
    applied["torch.backends.cudnn.deterministic"] = "True"
    try:  # the compiled elementwise chains: no run-to-run autotuning of reduction kernels
        import torch._inductor.config as inductor

        if hasattr(inductor, "deterministic"):
            inductor.deterministic = True
            applied["torch._inductor.config.deterministic"] = "True"
    except ImportError:  # a torch without inductor compiles nothing
        pass
    return applied
