"""`muse-stack plan` of image-text recipes counts the perception towers: their parameters on the
first pipeline stage (the frozen audio tower without gradients or optimizer state), their
activations, their step time and their FLOPs in the MFU."""

from __future__ import annotations

import pytest
import torch

from muse_stack.models.muse_spark.flops import tower_flops_per_sequence, training_flops_per_token, vision_forward_flops_per_patch
from muse_stack.machine.hardware import gpu_spec
from muse_stack.models.muse_spark.vision import MuseSparkVisionModel
from muse_stack.plan.cost import tower_elementwise_time
from muse_stack.plan.memory import GIB
from muse_stack.plan.planner import make_plan
from muse_stack.plan.towers import tower_plan
from muse_stack.resolve.recipe import finalize
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.models.muse_spark.tower_config import TowersConfig, VisionConfig

BATCH = ["batch.mbs=1", "batch.gbs=384", "batch.seq_length=4096"]
VISION = 1_852_639_744
AUDIO = 117_840_384
PROJECTOR = 75_497_472  # with the text hidden size 8192


def _stage0(name: str, overrides: list[str]):
    plan, _ = make_plan(load_recipe(name, overrides), strict=False)
    return plan, plan.memory[0]


def test_released_tower_sizes():
    towers = TowersConfig()
    assert towers.vision_config.parameter_count == VISION and towers.audio_config.parameter_count == AUDIO
    assert towers.projector_parameter_count(8192) == PROJECTOR
    assert towers.parameter_count(8192) == VISION + AUDIO + PROJECTOR == 2_045_977_600


def test_sft_192_mm_holds_the_towers_on_stage_0_with_the_audio_tower_frozen():
    mm, m = _stage0("sft-192-mm", BATCH)
    text, t = _stage0("sft-192-mm", [*BATCH, "data.kind=sft"])  # the same layout without the towers
    assert m.holds == ["embedding", "perception towers"] and "perception towers" not in t.holds
    towers = VISION + AUDIO + PROJECTOR
    trainable = VISION + PROJECTOR  # frozen: [audio_tower]
    assert m.params - t.params == towers and m.trainable_params - t.trainable_params == trainable
    assert m.weights_gib - t.weights_gib == pytest.approx(2 * towers / GIB, rel=1e-12)  # bf16
    assert m.grads_gib - t.grads_gib == pytest.approx(4 * trainable / GIB, rel=1e-12)  # fp32 gradient buffers
    # Adam's 12 bytes per trainable parameter, sharded over DP x CP = 32 by the distributed optimizer
    assert m.optimizer_gib - t.optimizer_gib == pytest.approx(12 * trainable / 32 / GIB, rel=1e-9)
    # the other stages hold no towers
    assert [a.params for a in mm.memory[1:]] == [b.params for b in text.memory[1:]]
    # activations: full recompute keeps each vision layer's input, fp32 (the tower's activations between its
    # bf16 GEMMs), for the 4096 x 4 patches of the one image of each sequence, for the 6 micro-batches stage 0
    # keeps in flight; bf16 under engine_options.towers_bf16_activations
    for overrides, act_bytes in (([], 4), (["engine_options.towers_bf16_activations=true"], 2)):
        _, mb = _stage0("sft-192-mm", [*BATCH, *overrides])
        stored = act_bytes * (1536 * 50 * 4096 * 4 + (6144 + 2 * 4096 + 8192) * 4096)
        assert (mb.activations_gib - t.activations_gib) * GIB == pytest.approx(6 * stored, rel=1e-9)
    assert any("perception towers: 2,045,977,600 parameters" in a for a in mm.assumptions)
    assert any("frozen audio tower" in a for a in _stage0("sft-192-mm", [])[0].assumptions)  # also unbatched


def test_freezing_the_audio_tower_is_what_saves_its_state():
    _, frozen = _stage0("sft-192-mm", BATCH)
    _, trained = _stage0("sft-192-mm", [*BATCH, "frozen=[]"])
    assert trained.trainable_params - frozen.trainable_params == AUDIO
    assert (trained.grads_gib - frozen.grads_gib) * GIB == pytest.approx(4 * AUDIO, rel=1e-9)


def test_lora_16_mm_holds_the_towers_frozen_with_the_base():
    _, m = _stage0("lora-16-mm", ["layout.cp=1", *BATCH])
    _, t = _stage0("lora-16-mm", ["layout.cp=1", *BATCH, "data.kind=sft"])
    assert m.params - t.params == VISION + AUDIO + PROJECTOR  # whole on every TP rank
    assert m.trainable_params == t.trainable_params and m.grads_gib == t.grads_gib  # the adapters only
    assert m.activations_gib == t.activations_gib  # a frozen tower keeps nothing for a backward


def test_vision_matmul_flops_are_twice_the_linear_weights_a_patch_passes():
    """An independent count: the weights of every nn.Linear in the reference vision tower."""
    cfg = VisionConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=3, intermediate_size=48,
                       pos_emb_height=4, pos_emb_width=4)
    tower = MuseSparkVisionModel(cfg)
    weights = sum(m.weight.numel() for m in tower.modules() if isinstance(m, torch.nn.Linear))
    towers = TowersConfig(vision_config=cfg, out_hidden_size=128)
    assert vision_forward_flops_per_patch(towers, 64)["matmul"] == 2 * weights
    # attention: 4 D keys per patch and layer; layers 3 and the last are full (64 keys), the others a 4x4 window
    assert cfg.layer_types == ["window_attention", "window_attention", "full_attention"]
    assert vision_forward_flops_per_patch(towers, 64)["attention"] == 4 * 32 * (16 + 16 + 64)


def test_a_frozen_tower_counts_its_forward_once():
    towers = TowersConfig()
    train = tower_flops_per_sequence(towers, 8192, 1000, vision_trains=True, projector_trains=True)
    frozen = tower_flops_per_sequence(towers, 8192, 1000, vision_trains=False, projector_trains=False)
    forward = train["vision_forward"] + train["projector_forward"]
    assert train["training"] == pytest.approx(3 * forward) and frozen["training"] == pytest.approx(forward)


def test_the_step_time_and_the_mfu_count_the_towers():
    recipe = load_recipe("sft-192-mm", BATCH)
    plan, _ = make_plan(recipe, strict=False)
    text, _ = make_plan(load_recipe("sft-192-mm", [*BATCH, "data.kind=sft"]), strict=False)
    assert plan.time.terms_s["towers"] > 0 and text.time.terms_s["towers"] == 0
    assert plan.time.stage_s[0] > text.time.stage_s[0] and plan.time.stage_s[1:] == text.time.stage_s[1:]
    towers = tower_plan(finalize(recipe))
    assert towers.image_tokens_per_sequence == 4096  # not stated: the processor's cap, within the 4096 sequence
    per_token = training_flops_per_token(recipe.model_config_resolved(), [4096])["training"] \
        + towers.flops_per_sequence()["training"] / 4096
    peak = gpu_spec("GB200").peak_bf16_tflops * 1e12
    assert plan.time.mfu == pytest.approx(per_token * plan.time.tokens_per_s_per_gpu / peak, rel=1e-12)
    # a stated image size is used as stated
    stated = tower_plan(finalize(load_recipe("sft-192-mm", [*BATCH, "data.details.image_tokens_per_sequence=1200"])))
    assert stated.image_tokens_per_sequence == 1200
    from muse_stack.util.errors import RecipeError

    with pytest.raises(RecipeError) as exc:
        tower_plan(finalize(load_recipe("sft-192-mm", [*BATCH, "data.details.image_tokens_per_sequence=0"])))
    assert exc.value.field == "data.details.image_tokens_per_sequence"


def test_the_counts_are_the_reference_models_own():
    """tiny-cpu-mm's towers as the reference engine builds and freezes them: the plan counts the
    parameters the model holds and, of them, the ones that train."""
    from muse_stack.models.muse_spark import MuseSparkForCausalLM, freeze

    recipe = load_recipe("tiny-cpu-mm")
    plan = tower_plan(finalize(recipe))
    model = MuseSparkForCausalLM(recipe.model_config_resolved(), seed=None, towers=recipe.towers_config_resolved())
    freeze(model, [f"model.{name}" for name in recipe.frozen])
    towers = [p for n, p in model.named_parameters() if not n.startswith(("model.language_model.", "lm_head."))]
    assert plan.params == sum(p.numel() for p in towers) > 0
    assert plan.trainable_params == sum(p.numel() for p in towers if p.requires_grad) < plan.params


def test_the_towers_recompute_is_priced_as_the_engine_runs_it():
    """slice-1gpu-mm recomputes the vision blocks (``recompute.towers: true``) with no decoder recompute: the step
    prices one more vision forward, as the memory model keeps only the blocks' inputs. With the vision tower frozen
    (nothing to recompute) the setting changes nothing."""
    def towers_s(overrides):
        plan, _ = make_plan(load_recipe("slice-1gpu-mm", overrides), strict=False)
        return plan.time.terms_s["towers"]

    recipe = load_recipe("slice-1gpu-mm")
    assert recipe.recompute_towers() and recipe.recompute.granularity != "full"
    assert tower_plan(finalize(recipe)).vision_trains
    recomputed, kept = towers_s([]), towers_s(["recompute.towers=false"])
    # the GEMMs and attention: kept holds the vision forward and backward (3 x V) and the projector's; recomputed
    # adds V, at most a third of kept. The memory traffic (counted, not 3 x the forward: the backward moves about
    # 1.6 x the forward's bytes) adds the recomputed forward's bytes as counted
    plan = tower_plan(finalize(recipe))
    spec = gpu_spec(recipe.hardware.gpu)
    mbs, microbatches = recipe.batch.mbs, recipe.batch.gbs // recipe.batch.mbs
    ew_recomputed, ew_kept = (microbatches * tower_elementwise_time(plan, spec, sequences=mbs, recomputed=r)
                              for r in (True, False))
    assert kept < recomputed and kept - ew_kept < recomputed - ew_recomputed <= (kept - ew_kept) * 4 / 3
    count, _ = plan.traffic()
    types = plan.towers.vision_config.layer_types
    patches = microbatches * mbs * plan.image_tokens_per_sequence * plan.towers.vision_config.merge_size**2
    added = (count.backward_recomputed.per_patch(types) - count.backward.per_patch(types)) * patches
    assert ew_recomputed - ew_kept == pytest.approx(added / (spec.hbm_gbps * 1e9), rel=1e-12)


def test_the_towers_memory_traffic_is_priced(monkeypatch):
    """slice-1gpu-mm: the towers' memory traffic outside their GEMMs and attention (counted by running their code,
    muse_stack/plan/tower_traffic.json) is part of the towers' term, and the step grows by it: without it (no
    bytes) the one-stage pipeline of 4 micro-batches is 4 x its time shorter."""
    from muse_stack.plan.towers import TowerPlan

    recipe = load_recipe("slice-1gpu-mm")
    plan = tower_plan(finalize(recipe))
    spec = gpu_spec(recipe.hardware.gpu)
    ew = tower_elementwise_time(plan, spec, sequences=recipe.batch.mbs, recomputed=recipe.recompute_towers())
    patches = recipe.batch.mbs * 3072 * 4
    assert ew == pytest.approx(plan.traffic_bytes_per_patch(True) * patches / (spec.hbm_gbps * 1e9), rel=1e-12)
    assert plan.traffic()[1] and ew > 0
    priced, _ = make_plan(recipe, strict=False)
    assert any("MB per patch moved outside the GEMMs and attention" in a for a in priced.time.assumptions)
    monkeypatch.setattr(TowerPlan, "traffic_bytes_per_patch", lambda self, recomputed: 0.0)
    unpriced, _ = make_plan(recipe, strict=False)
    microbatches = recipe.batch.gbs // recipe.batch.mbs
    assert recipe.layout.pp == 1 and microbatches == 4
    assert priced.time.terms_s["towers"] - unpriced.time.terms_s["towers"] == pytest.approx(4 * ew, rel=1e-9)
    assert priced.time.step_s - unpriced.time.step_s == pytest.approx(4 * ew, rel=1e-9)
