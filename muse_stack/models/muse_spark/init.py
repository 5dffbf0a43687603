"""Deterministic initialisation of a Muse Spark model.

Every tensor draws from its own generator seeded by ``(seed, crc32(parameter name))``, so a
tensor's initial value depends only on the seed, its name and its device type (CPU and CUDA
generators differ), not on the order modules are built or on the model's depth.

* projections, stacked experts, router, embedding, lm_head: normal(0, 0.02)
* centred norm gains (pre-norms, pre/post-expert and post-FFN norms): 0 -> effective gain 1
* ``model.norm`` (used as stored): 1
* residual gates: :func:`muse_stack.models.muse_spark.residual.initial_gate_value` (beta = 1/sqrt(2L))
* ``e_score_correction_bias``: 0
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

#: standard deviation of every matmul weight and the embedding
INIT_STD = 0.02


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = INIT_STD) -> None:
    """(Re)initialise ``model`` (a MuseSparkForCausalLM) in place from ``seed``."""
    from muse_stack.models.muse_spark.linear import Projection
    from muse_stack.models.muse_spark.moe import MuseSparkExperts
    from muse_stack.models.muse_spark.norms import CenteredRMSNorm, GainFirstRMSNorm, StoredGainRMSNorm
    from muse_stack.models.muse_spark.residual import GatedResidual, initial_gate_value
    from muse_stack.models.muse_spark.router import MuseSparkRouter

    num_layers = model.config.num_hidden_layers

    def normal(name: str, tensor: torch.Tensor) -> None:
        if tensor.is_meta:
            return
        values = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
        values.normal_(0.0, std, generator=_generator(seed, name, tensor.device))
        tensor.copy_(values)

    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, (Projection, nn.Embedding)):
            normal(prefix + "weight", module.weight)
        elif isinstance(module, MuseSparkRouter):
            normal(prefix + "weight", module.weight)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, MuseSparkExperts):
            normal(prefix + "gate_up_proj", module.gate_up_proj)
            normal(prefix + "down_proj", module.down_proj)
        elif isinstance(module, (CenteredRMSNorm, GainFirstRMSNorm)):
            module.weight.zero_()
        elif isinstance(module, StoredGainRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, GatedResidual):
            module.gate.fill_(initial_gate_value(num_layers, module.temperature))
