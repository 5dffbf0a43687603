"""Training engines behind `muse-stack run`: the PyTorch reference engine and megatron-core."""

from __future__ import annotations

from muse_stack.engines.base import Engine, StepStats, TrainContext


def get_engine(name: str):
    """The engine class for a recipe's ``engine`` field."""
    if name == "reference":
        from muse_stack.engines.reference import ReferenceEngine

        return ReferenceEngine
    if name == "megatron":
        from muse_stack.engines.megatron_available import require_megatron

        require_megatron()
        from muse_stack.engines.megatron import MegatronEngine

        return MegatronEngine
    raise ValueError(f"unknown engine {name!r}")


__all__ = ["Engine", "StepStats", "TrainContext", "get_engine"]
