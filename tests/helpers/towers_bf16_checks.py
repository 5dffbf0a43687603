"""The vision tower with bf16 activations against transformers' own bf16 tower, shared by
tests/unit/test_towers_bf16_activations.py (CPU, where the bound is derived) and
tests/gpu/test_towers_bf16_gpu.py (the same check on a GPU)."""

from __future__ import annotations

import math

import torch
from transformers import MuseSparkVisionConfig
from transformers.models.muse_spark import modeling_muse_spark as hf_modeling

from muse_stack.engines.mcore import towers
from muse_stack.models.muse_spark.tower_config import VisionConfig
from muse_stack.models.muse_spark.vision import MuseSparkVisionModel

#: 4 blocks (three window, one full attention), width 128, 4 heads, windows of 6 x 6 patches
VISION = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=256, pos_emb_height=6,
              pos_emb_width=6)
#: an image with partial windows, one without, and a two-frame video
GRID = torch.tensor([[1, 12, 8], [1, 6, 10], [2, 8, 8]])
#: the bound (tests/unit/test_towers_bf16_activations.py derives it)
BOUND = math.sqrt(2)


def transformers_tower(device: str = "cpu") -> hf_modeling.MuseSparkVisionModel:
    """transformers' vision tower in bf16, its weights perturbed away from the initial ones and zeros."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = hf_modeling.MuseSparkVisionModel(MuseSparkVisionConfig(**VISION, attn_implementation="sdpa"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.to(device=device, dtype=torch.bfloat16).eval()


def ours(reference: torch.nn.Module, dtype: torch.dtype, *, bf16_activations: bool,
         recompute: bool = False) -> MuseSparkVisionModel:
    device = next(reference.parameters()).device
    model = MuseSparkVisionModel(VisionConfig(**VISION)).eval()
    model.load_state_dict({k: v.cpu() for k, v in reference.state_dict().items()}, strict=True)
    model = model.to(device=device, dtype=dtype)
    model.recompute = recompute
    towers.install_towers_bf16_activations(model, bf16_activations)
    return model


def pixels(device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    n = int(GRID.prod(dim=1).sum())
    return torch.randn(n, VisionConfig(**VISION).patch_dim, generator=gen).to(device=device, dtype=torch.bfloat16)


def run(model, px: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's output and the gradient of a fixed loss of it, every parameter's in one float64 vector (in the
    order of transformers' state dict, whose names ours shares)."""
    model.zero_grad(set_to_none=True)
    grid = GRID.to(px.device)
    if isinstance(model, MuseSparkVisionModel):
        out = model(px.to(model.patch_embedder.patch_embedding.weight.dtype), grid)
    else:
        out = model(pixel_values=px, grid_thw=grid).last_hidden_state
    weights = torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64, device=out.device)
    (out.double() * weights).square().sum().backward()
    params = dict(model.named_parameters())
    return out.detach(), torch.cat([params[k].grad.double().flatten() for k in sorted(params)])


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).norm().item()


def reference(device: str = "cpu"):
    """transformers' bf16 tower, the inputs, its output and gradients, and the exact ones (ours in float64)."""
    hf = transformers_tower(device)
    px = pixels(device)
    return hf, px, run(hf, px), run(ours(hf, torch.float64, bf16_activations=False), px)


def check_rounds_where_transformers_rounds(ref, recompute: bool) -> None:
    """Ours with bf16 activations within :data:`BOUND` of transformers' distance from the exact result, forward and
    gradients; the default fp32 activations nearer the exact result than either bf16 tower."""
    hf, px, (hf_out, hf_grad), (exact_out, exact_grad) = ref
    out, grad = run(ours(hf, torch.bfloat16, bf16_activations=True, recompute=recompute), px)
    assert out.dtype == hf_out.dtype == torch.bfloat16
    assert distance(out, hf_out) <= BOUND * distance(hf_out, exact_out)
    assert distance(grad, hf_grad) <= BOUND * distance(hf_grad, exact_grad)
    default_out, default_grad = run(ours(hf, torch.bfloat16, bf16_activations=False, recompute=recompute), px)
    assert default_out.dtype == torch.float32
    assert distance(default_out, exact_out) < min(distance(out, exact_out), distance(hf_out, exact_out))
    assert distance(default_grad, exact_grad) < min(distance(grad, exact_grad), distance(hf_grad, exact_grad))
