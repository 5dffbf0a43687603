"""Keep megatron-core's distributed optimizer's parameter bookkeeping right when a parameter
group mixes fp32 and bf16 model parameters.

The Muse Spark layer spec keeps its norm gains, residual gates and router weight in fp32 while
the matmul weights are bf16. megatron-core 0.19's ``DistributedOptimizer`` puts each group's
optimizer parameters in the order ``[fp32 shards..., fp32 copies of the bf16 shards...]`` but
records each model parameter's position (``model_param_group_index_map``) in the order the
parameters appear in the gradient buffers, bf16 and fp32 interleaved. Training does not read
that map (it copies through the aligned ``model_*_groups`` / ``shard_*_groups`` lists); the
optimizer's ``state_dict``, ``load_state_dict`` and ``sharded_state_dict`` do, so a checkpoint
would pair a parameter with another parameter's Adam state. :func:`align_group_orders`
rewrites the map to the positions the optimizer actually uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _distributed_optimizers(optimizer: Any) -> Iterable[Any]:
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(opt, "model_param_group_index_map"):
            yield opt


def align_group_orders(optimizer: Any) -> int:
    """Point every model parameter at its own shard in the inner optimizer's param groups.

    ``optimizer`` is what ``get_megatron_optimizer`` returns (a ChainedOptimizer or a single
    optimizer); only distributed optimizers are touched. Returns how many entries changed.
    """
    changed = 0
    for opt in _distributed_optimizers(optimizer):
        precision_aware = bool(getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
        half_shards = opt.shard_float16_groups if precision_aware else opt.shard_fp32_from_float16_groups
        shard_of: dict[int, Any] = {}
        for models, shards in ((opt.model_fp32_groups, opt.shard_fp32_groups),
                               (opt.model_float16_groups, half_shards)):
            for group_models, group_shards in zip(models, shards):
                for model_param, shard in zip(group_models, group_shards):
                    shard_of[id(model_param)] = shard
        positions = [{id(p): i for i, p in enumerate(group["params"])} for group in opt.optimizer.param_groups]
        for model_param, (group, order) in list(opt.model_param_group_index_map.items()):
            shard = shard_of.get(id(model_param))
            if shard is None:
                continue
            actual = positions[group][id(shard)]
            if actual != order:
                opt.model_param_group_index_map[model_param] = (group, actual)
                changed += 1
    return changed
