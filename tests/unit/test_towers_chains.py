"""The vision tower's chained forward (engine_options.compile_towers): the chains as plain PyTorch give the block's
written forward bit for bit, and compiled they stay within one bf16 rounding of it (CPU, TorchInductor)."""

from __future__ import annotations

import pytest
import torch

from towers_chain_bounds import check_chains

from muse_stack.engines.mcore import towers
from muse_stack.models.muse_spark import vision as vision_mod
from muse_stack.models.muse_spark.tower_config import VisionConfig
from muse_stack.models.muse_spark.vision import EAGER_CHAINS, MuseSparkVisionModel

#: a small tower with window and full-attention blocks (windows of 6 x 6 patches)
CONFIG = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=48, pos_emb_height=6,
              pos_emb_width=6, layer_types=["window_attention", "full_attention", "window_attention"])
#: two images, one of them with partial windows, so each block runs several attention groups of several sizes
GRID = torch.tensor([[1, 8, 12], [1, 6, 6]])


def tower(dtype: torch.dtype, recompute: bool) -> MuseSparkVisionModel:
    torch.manual_seed(0)
    model = MuseSparkVisionModel(VisionConfig(**CONFIG))
    for p in model.parameters():  # away from the initial ones and zeros, so every weight and bias matters
        p.data.normal_(0.0, 0.2)
    model.recompute = recompute
    return model.to(dtype)


def step(model: MuseSparkVisionModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The tower's output on fixed patches and the gradients of a fixed loss of it."""
    torch.manual_seed(1)
    pixels = torch.randn(int(GRID.prod(dim=1).sum()), model.config.patch_dim)
    out = model(pixels, GRID)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-weights", "fp32-weights"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_the_chains_in_plain_pytorch_give_the_written_blocks_bit_for_bit(dtype, recompute):
    """The chained forward computes the written one's values: the norm's output cast once per projection as
    written (so q's, k's and v's input gradients are summed in fp32, as written), v and the GEMM outputs kept in the
    GEMM dtype (bf16 -> fp32 -> bf16 is exact, forward and backward), the same fp32 RoPE, GELU and residual adds. So
    the output and every gradient are equal, not close."""
    written = tower(dtype, recompute)
    chained = tower(dtype, recompute)
    assert towers.set_chains(chained, EAGER_CHAINS) == CONFIG["num_hidden_layers"]
    out_w, grads_w = step(written)
    out_c, grads_c = step(chained)
    assert torch.equal(out_w, out_c)
    assert all(torch.equal(a, b) for a, b in zip(grads_w, grads_c, strict=True))


def test_chains_are_off_by_default_and_under_autocast():
    """A block runs as written unless an engine sets its chains; under autocast (the reference engine's GPU mode)
    it runs as written even with chains set, since the autocast dtype, not the weights', rules its GEMMs."""
    model = tower(torch.float32, False)
    assert all(block.chains is None for block in model.layers)
    calls = []

    def spy(fn):
        def wrapped(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return wrapped

    towers.set_chains(model, vision_mod.VisionChains(*(spy(fn) for fn in EAGER_CHAINS)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(model)
    assert calls == []
    step(model)
    assert set(calls) == {"chain_normed", "chain_rope", "chain_gelu", "chain_residual"}


def test_install_sets_every_block_and_off_restores_the_written_forward():
    model = tower(torch.bfloat16, False)
    assert towers.install_compile_towers(model, True) is None
    compiled = {id(block.chains) for block in model.layers}
    assert len(compiled) == 1 and model.layers[0].chains is not EAGER_CHAINS  # one compiled set for every block
    assert towers.describe_chains(model) == \
        "chained, each chain compiled by torch.compile (engine_options.compile_towers)"
    assert towers.install_compile_towers(model, False) is None
    assert all(block.chains is None for block in model.layers)
    assert towers.describe_chains(model) == "as written, op by op"
    assert towers.describe_chains(torch.nn.Linear(2, 2)) is None


@pytest.fixture
def inductor():
    torch._dynamo.reset()
    yield towers.compiled_chains("inductor")
    torch._dynamo.reset()


def test_compiled_chains_stay_within_one_bf16_rounding_of_plain_pytorch(inductor):
    """Each chain compiled by TorchInductor (CPU here; Triton on a GPU: tests/gpu/test_towers_chains_gpu.py)
    against the same chain in plain PyTorch (tests/helpers/towers_chain_bounds.py). Compiled code computes the same
    fp32 operations but may reorder LayerNorm's reductions (a relative change of at most about D x 2^-24 = 2e-6 for
    D = 32 here) or contract a multiply and an add (an fp32 ulp). An fp32 result that moves by that little rounds
    to the same bf16 number or to its neighbour, so a chain whose output is bf16 is within one bf16 spacing of plain
    PyTorch at every element. The GELU's erf is another polynomial: each fp32 evaluation is within 2^-20 |h| of the
    exact GELU (checked against float64), so the two differ by up to twice that besides the bf16 spacing. The
    residual add, one exactly rounded fp32 operation either way, is equal."""
    check_chains(inductor, rows=97, width=32, inner=48, heads=2, device="cpu")


def test_compiled_chains_compile_once_more_when_the_patch_count_changes():
    """Images of another size give another patch count: automatic dynamic shapes compile each chain a second time
    with that dimension symbolic, and not again for a third count."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    chains = towers.compiled_chains(counting)
    for n in (40, 56, 72):
        chains.gelu(torch.randn(n, 48).to(torch.bfloat16), torch.float32, torch.bfloat16)
    torch._dynamo.reset()
    assert len(graphs) == 2


def test_a_text_recipe_refuses_the_option_naming_the_field():
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.recipes.options import check
    from muse_stack.util.errors import RecipeError

    check(load_recipe("slice-1gpu-mm", ["engine_options.compile_towers=true"]))
    with pytest.raises(RecipeError, match="no perception towers") as err:
        check(load_recipe("slice-1gpu", ["engine_options.compile_towers=true"]))
    assert err.value.field == "engine_options.compile_towers"
