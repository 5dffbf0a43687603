"""The vision tower's attention as one variable-length call a layer (``engine_options.towers_varlen_attention``):
the blocks run on the patches in window order, each frame and window a contiguous run of rows, and attend over
their cumulative lengths. On a CPU the call's stand-in attends per segment (PyTorch's ``varlen_attn`` is a CUDA
kernel; tests/gpu/test_towers_varlen_gpu.py checks the kernel against the grouped calls). The forward against
transformers in float64 is in tests/unit/test_model_towers.py, for both ways."""

from __future__ import annotations

import pytest
import torch

from muse_stack.engines.mcore import towers
from muse_stack.models.muse_spark import vision as vision_mod
from muse_stack.models.muse_spark.tower_config import VisionConfig
from muse_stack.models.muse_spark.vision import EAGER_CHAINS, MuseSparkVisionModel

pytestmark = pytest.mark.usefixtures("one_thread")

#: a small tower with window and full-attention blocks (windows of 6 x 6 patches)
CONFIG = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=48, pos_emb_height=6,
              pos_emb_width=6, layer_types=["window_attention", "full_attention", "window_attention"])
#: an image of 8 x 12 patches (windows of 6 x 6, 2 x 6, 6 x 6, 2 x 6), one of 6 x 6, and a two-frame video of 4 x 8
GRID = torch.tensor([[1, 8, 12], [1, 6, 6], [2, 4, 8]])
#: the sizes of its windows in window order (each frame's windows in raster order), and of its frames
WINDOW_SIZES = [36, 36, 12, 12, 36, 24, 8, 24, 8]
FRAME_SIZES = [96, 36, 32, 32]


def tower(dtype: torch.dtype, attention: str, recompute: bool = False) -> MuseSparkVisionModel:
    torch.manual_seed(0)
    model = MuseSparkVisionModel(VisionConfig(**CONFIG))
    for p in model.parameters():  # away from the initial ones and zeros, so every weight and bias matters
        p.data.normal_(0.0, 0.2)
    model.recompute = recompute
    model.attention = attention
    return model.to(dtype)


def step(model: MuseSparkVisionModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's output on fixed patches and the gradients of a fixed loss of it, in one vector."""
    torch.manual_seed(1)
    dtype = model.patch_embedder.patch_embedding.weight.dtype
    pixels = torch.randn(int(GRID.prod(dim=1).sum()), model.config.patch_dim, dtype=torch.float64).to(dtype)
    out = model(pixels, GRID)
    (out.double() * torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)).square().sum().backward()
    return out.detach(), torch.cat([p.grad.double().flatten() for p in model.parameters()])


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_the_varlen_tower_computes_the_grouped_towers_function_forward_and_backward(recompute):
    """In float64 the two differ by rounding alone: the patches' order changes the order in which each weight
    gradient sums over the rows, and each window attends alone instead of in a batch of its size. Each such sum
    is exact to n u of the sum of its terms' magnitudes (n <= the 196 rows here, u = 2^-53: 2e-14 relative);
    1e-12 of the output's and the gradient's largest magnitude leaves 50 times that for the three blocks' growth."""
    grouped_out, grouped_grad = step(tower(torch.float64, "grouped", recompute))
    varlen_out, varlen_grad = step(tower(torch.float64, "varlen", recompute))
    assert (varlen_out - grouped_out).abs().max() <= 1e-12 * grouped_out.abs().max()
    assert (varlen_grad - grouped_grad).abs().max() <= 1e-12 * grouped_grad.abs().max()


def test_each_layer_attends_once_over_its_windows_or_frames_in_window_order(monkeypatch):
    """The call a GPU makes (varlen_attn's arguments) gets each window's rows, or each frame's, as one segment: the
    window layers the windows of every frame in raster order, the full layer the frames."""
    calls = []
    real = vision_mod.attend_per_segment

    def spy(q, k, v, cu_q, cu_k, max_q, max_k):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, q.shape[0]))
        return real(q, k, v, cu_q, cu_k, max_q, max_k)

    monkeypatch.setattr(vision_mod, "attend_per_segment", spy)
    with torch.no_grad():
        tower(torch.float32, "varlen")(torch.randn(int(GRID.prod(dim=1).sum()), VisionConfig(**CONFIG).patch_dim),
                                       GRID)

    def cumulative(sizes):
        return [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    windows = (cumulative(WINDOW_SIZES), cumulative(WINDOW_SIZES), 36, 36, 196)
    frames = (cumulative(FRAME_SIZES), cumulative(FRAME_SIZES), 96, 96, 196)
    assert calls == [windows, frames, windows]


def test_the_chains_and_bf16_activations_run_with_it_bit_for_bit():
    """The chained forward computes the written one's values in window order too, with either activations."""
    for bf16 in (False, True):
        written, chained = tower(torch.bfloat16, "varlen"), tower(torch.bfloat16, "varlen")
        for model in (written, chained):
            towers.install_towers_bf16_activations(model, bf16)
        towers.set_chains(chained, EAGER_CHAINS)
        assert all(torch.equal(a, b) for a, b in zip(step(written), step(chained), strict=True))


def test_install_sets_every_tower_says_why_off_and_describes(monkeypatch):
    model = torch.nn.ModuleList([tower(torch.bfloat16, "grouped")])
    assert towers.install_towers_varlen_attention(model, True) is None  # this torch has varlen_attn
    assert model[0].attention == "varlen"
    assert "one variable-length call a layer" in towers.describe_attention(model)
    assert towers.install_towers_varlen_attention(model, False) is None and model[0].attention == "grouped"
    assert "one attention call per group size" in towers.describe_attention(model)
    monkeypatch.setattr(towers, "varlen_kernel", lambda: None)
    why = towers.install_towers_varlen_attention(model, True)
    assert "has no torch.nn.attention.varlen.varlen_attn" in why and model[0].attention == "grouped"
    assert towers.describe_attention(torch.nn.Linear(2, 2)) is None


def test_a_text_recipe_refuses_the_option_naming_the_field():
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.recipes.options import check
    from muse_stack.util.errors import RecipeError

    check(load_recipe("slice-1gpu-mm", ["engine_options.towers_varlen_attention=true"]))
    with pytest.raises(RecipeError, match="no perception towers") as err:
        check(load_recipe("slice-1gpu", ["engine_options.towers_varlen_attention=true"]))
    assert err.value.field == "engine_options.towers_varlen_attention"
