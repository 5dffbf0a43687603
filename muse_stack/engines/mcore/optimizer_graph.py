"""The optimizer step captured in a CUDA graph (``engine_options.optimizer_cuda_graph``).

megatron-core builds TE's capturable FusedAdam for it (``OptimizerConfig.optimizer_cuda_graph``: the
learning rate and the step count as GPU tensors, which the engine sets in place), and its own training loop
wraps the optimizer's step in ``OptimizerCudaGraphWrapper`` (``megatron/training/training.py``):
``cuda_graph_warmup_steps`` eager steps, then the norm, the clip, Adam and the parameter copy captured once
and replayed. :func:`install_optimizer_cuda_graph` wraps the engine's step the same way.
"""

from __future__ import annotations

from typing import Any


def install_optimizer_cuda_graph(engine: Any, on: bool) -> str | None:
    """``engine_options.optimizer_cuda_graph``: ``engine.optimizer.step`` wrapped in megatron-core's
    ``OptimizerCudaGraphWrapper`` (on; the optimizer config asked for TE's capturable step), or left as it is
    (off)."""
    if not on:
        return None
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper

    # its iteration count and graph are class attributes (one per process): a new engine starts over
    OptimizerCudaGraphWrapper.cuda_graph, OptimizerCudaGraphWrapper.result = None, None
    OptimizerCudaGraphWrapper.curr_iteration = 0
    engine.optimizer.step = OptimizerCudaGraphWrapper(
        engine.optimizer.step, cuda_graph_warmup_steps=engine.config.cuda_graph_warmup_steps,
        use_single_mempool=engine.config.cuda_graph_use_single_mempool)
    return None
