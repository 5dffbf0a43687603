"""The vision tower with its activations in bf16 (``engine_options.towers_bf16_activations``): it rounds where
transformers' own bf16 tower rounds, forward and backward, and the option is refused where it cannot apply.

Bound. transformers runs its vision tower in the model's dtype: in bf16 the residual stream, the norms' and the
GELU's outputs and every GEMM's input and output are bf16, with RoPE in fp32 (``apply_rotary_pos_emb_vision``).
The option takes the same policy. Two bf16 evaluations of one function that round at the same points make rounding
errors of the same size; where they compute a value alike they round it alike, elsewhere (another order of a
reduction, another kernel) their roundings are independent. So their distance is at most sqrt(2) times the
distance of either from the exact result: sqrt(2) for independent errors of equal size, less where they round alike.
"Exact" is our tower in float64 on the same bf16-rounded weights and inputs, so only the activations' rounding is
measured. Everything runs on one thread: the CPU's bf16 reductions (a norm's weight gradient summed over the
patches) round by the thread count. Measured on the development machine: ours is 1.12 times transformers'
distance from the exact result away from transformers (forward) and 0.53 times it (gradients); the default fp32
activations are 0.66 (forward) and 0.33 (gradients) of the bf16 tower's distance from it. The negative control, a
LayerNorm that computes its statistics in bf16 (one more rounding in every normalised value, the mistake a bf16
path written by hand makes), is 1.60 times it: outside.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import towers_bf16_checks as checks
from towers_bf16_checks import BOUND, GRID, VISION, distance, ours, run

from muse_stack.engines.mcore import towers
from muse_stack.models.muse_spark import vision as vision_mod
from muse_stack.models.muse_spark.tower_config import VisionConfig
from muse_stack.models.muse_spark.vision import EAGER_CHAINS, MuseSparkVisionModel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def reference(one_thread):
    """transformers' bf16 tower, the inputs, its output and gradients and the exact ones (on one thread, as every
    run of these tests: the CPU's bf16 reductions round by the thread count)."""
    return checks.reference()


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_bf16_activations_round_where_transformers_bf16_tower_rounds(reference, recompute):
    checks.check_rounds_where_transformers_rounds(reference, recompute)


def test_a_norm_with_bf16_statistics_falls_outside_the_bound(reference):
    """The negative control (see the module docstring)."""
    hf, px, (hf_out, _), (exact_out, _) = reference

    def bf16_statistics(norm, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).square().mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight.to(x.dtype) + norm.bias.to(x.dtype)

    with mock.patch.object(vision_mod, "layer_norm", bf16_statistics), torch.no_grad():
        out = ours(hf, torch.bfloat16, bf16_activations=True)(px, GRID)
    assert out.dtype == torch.bfloat16
    assert distance(out, hf_out) > BOUND * distance(hf_out, exact_out)


def test_every_block_carries_bf16_and_the_chains_give_the_written_blocks_bit_for_bit(reference):
    """With bf16 activations each block's input and output are bf16, and the chained forward in plain PyTorch
    (what engine_options.compile_towers compiles) computes the written one's values: output and gradients equal."""
    hf, px, _, _ = reference
    written = ours(hf, torch.bfloat16, bf16_activations=True)
    seen = []
    for block in written.layers:
        block.register_forward_hook(lambda m, args, kwargs, out: seen.append((args[0].dtype, out.dtype)),
                                    with_kwargs=True)
    out_w, grad_w = run(written, px)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * VISION["num_hidden_layers"]
    chained = ours(hf, torch.bfloat16, bf16_activations=True)
    towers.set_chains(chained, EAGER_CHAINS)
    out_c, grad_c = run(chained, px)
    assert torch.equal(out_w, out_c) and torch.equal(grad_w, grad_c)


def test_install_sets_every_tower_and_off_restores_fp32():
    model = torch.nn.ModuleList([MuseSparkVisionModel(VisionConfig(**VISION)).to(torch.bfloat16)])
    assert towers.describe_activations(model) == "float32, the GEMMs in bfloat16"
    assert towers.install_towers_bf16_activations(model, True) is None
    assert model[0].activations_dtype == torch.bfloat16
    assert towers.describe_activations(model) == \
        "bfloat16 (the weights' dtype: engine_options.towers_bf16_activations)"
    assert towers.install_towers_bf16_activations(model, False) is None
    assert model[0].activations_dtype is None
    assert towers.describe_activations(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize(("recipe", "overrides", "reason"), [
    ("slice-1gpu", [], "no perception towers"),
    ("slice-1gpu-mm", ["precision=fp32"], "precision: fp32"),
], ids=["text", "fp32"])
def test_the_option_is_refused_where_it_cannot_apply_naming_the_field(recipe, overrides, reason):
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.recipes.options import check
    from muse_stack.util.errors import RecipeError

    check(load_recipe("slice-1gpu-mm", ["engine_options.towers_bf16_activations=true"]))
    with pytest.raises(RecipeError, match=reason) as err:
        check(load_recipe(recipe, ["engine_options.towers_bf16_activations=true", *overrides]))
    assert err.value.field == "engine_options.towers_bf16_activations"
