"""Training engines behind `muse-stack run`: the PyTorch reference engine and megatron-core."""

from __future__ import annotations

from muse_stack.engines.base import Engine, StepStats, TrainContext


def get_engine(name: str):
    """The engine class for a recipe's ``engine`` field."""
    from muse_stack.engines.spec import engine_spec

    return engine_spec(name).load()


__all__ = ["Engine", "StepStats", "TrainContext", "get_engine"]
