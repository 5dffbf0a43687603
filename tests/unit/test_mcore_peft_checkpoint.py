"""The megatron engine's adapter checkpoints on the CPU: where each adapter shard sits in the
dist-checkpoint, the base identity and its refusals, the resolve step for peft on megatron, and
`muse-stack export --adapters-only / --merge` of adapter checkpoints (a torch_dist checkpoint
written here with the engine's keys, and a reference-engine adapter run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from muse_stack.engines.mcore.peft_checkpoint import (ADAPTER_BASE, FORMAT, adapter_keys, base_identity, check_resume,
                                                      placement, safetensors_headers_sha256, same_base)
from muse_stack.util.errors import InputError, RecipeError
from muse_stack.recipes.catalogue import load_recipe, parse_recipe
from muse_stack.run import checkpoints

PEFT = {"scheme": "lora", "rank": 4, "alpha": 8, "per_expert": True,
        "targets": ["self_attn.q_proj", "self_attn.o_proj", "mlp.pre_expert_proj", "mlp.experts.gate_up_proj",
                    "mlp.experts.down_proj"]}


def _kw(**over):
    kw = dict(layer_offset=0, expert_offset=0, num_experts=8, per_expert=True, tp_rank=0, tp_size=1, ep_rank=0,
              dp_rank=0, expert_dp_rank=0)
    kw.update(over)
    return kw


# ---- placements ---------------------------------------------------------------------------------
def test_tp_split_factors_are_placed_on_their_split_axis_and_whole_ones_replicated():
    q = "decoder.layers.1.self_attention.linear_q.adapter."
    o = "decoder.layers.1.self_attention.linear_proj.adapter."
    # column-parallel q: B [out/TP, r] by rows; A whole on every TP rank, one copy (TP rank 0) writes
    b = placement(q + "lora_B", **_kw(tp_rank=1, tp_size=2, layer_offset=4, dp_rank=3))
    assert b.key == "model.language_model.layers.5.self_attn.q_proj.adapter.lora_B"
    assert b.rank_offsets == ((0, 1, 2),) and b.prepend_axis_num == 0 and b.replica_id == (0, 0, 3)
    a = placement(q + "lora_A", **_kw(tp_rank=1, tp_size=2))
    assert a.rank_offsets == () and a.replica_id == (0, 1, 0)
    # row-parallel o: A [r, in/TP] by columns; B whole
    assert placement(o + "lora_A", **_kw(tp_rank=1, tp_size=4)).rank_offsets == ((1, 1, 4),)
    assert placement(o + "lora_B", **_kw(tp_rank=2, tp_size=4)).replica_id == (0, 2, 0)
    # duplicated latent projection: whole everywhere
    lat = placement("decoder.layers.0.mlp.fc1_latent_proj.adapter.lora_B", **_kw(tp_rank=1, tp_size=2))
    assert lat.rank_offsets == () and lat.replica_id == (0, 1, 0)
    # TP 1: nothing split, nothing replicated over TP
    assert placement(q + "lora_B", **_kw()).rank_offsets == ()


def test_expert_factors_sit_at_their_global_expert_of_the_stacked_tensor():
    name = "decoder.layers.0.mlp.experts.linear_fc2.adapter.lora_A3"
    p = placement(name, **_kw(expert_offset=4, ep_rank=1, expert_dp_rank=2))
    assert p.key == "model.language_model.layers.0.mlp.experts.adapters.down_proj.lora_A"
    assert p.rank_offsets == ((0, 7, 8),) and p.prepend_axis_num == 1 and p.replica_id == (0, 0, 2)
    shared = placement("decoder.layers.0.mlp.experts.linear_fc1.adapter.lora_B0",
                       **_kw(per_expert=False, expert_offset=4, ep_rank=1))
    assert shared.rank_offsets == ((0, 0, 1),) and shared.replica_id == (1, 0, 0)  # EP rank 0 writes


def test_every_tp_and_ep_placement_tiles_the_global_tensor_once():
    """The written (replica 0) placements of all ranks cover each global index exactly once:
    4 ranks as TP 2 x DP 2 for the dense layers, EP 2 x expert-DP 2 for the experts (ETP 1)."""
    tp, ep, experts = 2, 2, 8
    cover: dict[str, list] = {}
    for rank in range(4):
        tp_rank, dp_rank = rank % tp, rank // tp
        ep_rank, edp_rank = rank % ep, rank // ep
        names = ["decoder.layers.0.self_attention.linear_q.adapter.lora_A",
                 "decoder.layers.0.self_attention.linear_q.adapter.lora_B"]
        names += [f"decoder.layers.0.mlp.experts.linear_fc1.adapter.lora_B{e}" for e in range(experts // ep)]
        for name in names:
            p = placement(name, **_kw(tp_rank=tp_rank, tp_size=tp, dp_rank=dp_rank, ep_rank=ep_rank,
                                      expert_dp_rank=edp_rank, expert_offset=ep_rank * experts // ep))
            if not any(p.replica_id):
                cover.setdefault(p.key, []).append(p.rank_offsets)
    assert sorted(cover["model.language_model.layers.0.self_attn.q_proj.adapter.lora_B"]) == [((0, 0, 2),), ((0, 1, 2),)]
    assert cover["model.language_model.layers.0.self_attn.q_proj.adapter.lora_A"] == [()]
    assert sorted(o[0][1] for o in cover["model.language_model.layers.0.mlp.experts.adapters.gate_up_proj.lora_B"]) \
        == list(range(experts))


def test_adapter_keys_pick_the_adapters_from_a_dist_checkpoint():
    keys = ["model.language_model.layers.0.self_attn.q_proj.adapter.lora_A",
            "model.language_model.layers.0.mlp.experts.adapters.down_proj.lora_B",
            "optimizer.distributed.dp_group_idx_0.param_state", "decoder.layers.0.self_attention.linear_q.weight"]
    assert adapter_keys(keys) == keys[:2][::-1]


# ---- base identity --------------------------------------------------------------------------------
def _ident(**over):
    kw = dict(pretrained_checkpoint=None, revision="r1", hf_id="org/m", hf_config={"hidden_size": 64}, init_seed=7,
              layout={"tp": 1, "pp": 1, "ep": 1, "etp": 1})
    kw.update(over)
    return base_identity(**kw)


def test_identity_of_a_seeded_base_is_its_seed_layout_and_config():
    a = _ident()
    assert a["init_seed"] == 7 and a["headers_sha256"] is None and same_base(a, _ident())
    assert not same_base(a, _ident(init_seed=8))
    assert not same_base(a, _ident(layout={"tp": 2, "pp": 1, "ep": 1, "etp": 1}))
    assert not same_base(a, _ident(hf_config={"hidden_size": 128}))


def test_identity_of_a_checkpoint_base_is_its_headers_hash(tmp_path):
    from safetensors.torch import save_file

    one, two = tmp_path / "one", tmp_path / "two"
    for d, shape in ((one, (2, 3)), (two, (3, 3))):
        d.mkdir()
        save_file({"w": torch.zeros(shape)}, str(d / "model.safetensors"))
    a, b = _ident(pretrained_checkpoint=str(one)), _ident(pretrained_checkpoint=str(two))
    assert a["init_seed"] is None and a["headers_sha256"] == safetensors_headers_sha256(one)
    assert same_base(a, {**a, "path": "/moved/elsewhere"})  # the hash names the base, not where it lies
    assert not same_base(a, b) and not same_base(a, _ident())
    with pytest.raises(InputError, match="no .safetensors") as err:
        safetensors_headers_sha256(tmp_path)
    assert err.value.field == "model.pretrained_checkpoint"


def test_resume_refuses_another_base_naming_both(tmp_path):
    settings = {"scheme": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["self_attn.q_proj"],
                "per_expert": False, "filled": []}
    meta = {"format": FORMAT, "peft": settings, "base": _ident()}
    check_resume(tmp_path, meta, settings={**settings, "filled": ["peft.dropout = 0.0"]}, ours=_ident())
    with pytest.raises(InputError) as err:
        check_resume(tmp_path, meta, settings=settings, ours=_ident(init_seed=9))
    text = str(err.value)
    assert err.value.field == "adapters.base" and "seed 7" in text and "seed 9" in text
    with pytest.raises(InputError, match="other settings") as err:
        check_resume(tmp_path, meta, settings={**settings, "rank": 8}, ours=_ident())
    assert err.value.field == "peft.rank" and "peft.rank=4" in err.value.fix
    with pytest.raises(InputError, match="holds a full model"):
        check_resume(tmp_path, None, settings=settings, ours=_ident())
    with pytest.raises(InputError, match="no peft block"):
        check_resume(tmp_path, meta, settings=None, ours=None)
    check_resume(tmp_path, None, settings=None, ours=None)  # full model, full run


# ---- the resolve step -------------------------------------------------------------------------------
def _megatron_recipe(**over):
    raw = load_recipe("slice-1gpu").model_dump(mode="json")
    raw.update(peft=dict(PEFT), frozen=["base"])
    raw["optimizer"].update(precision_aware=None, param_remainders=None)  # not run with adapters: refused
    for key, value in over.items():
        section, field = key.split(".")
        raw[section][field] = value
    return parse_recipe(raw, "slice-1gpu + peft")


def test_peft_on_the_megatron_engine_passes_the_resolve_step():
    from muse_stack.resolve.recipe import resolve

    resolve(_megatron_recipe())
    resolve(_megatron_recipe(**{"training.async_checkpoint": True}))  # the adapter state saves async too


def test_expert_adapters_under_etp_are_refused_naming_the_field():
    from muse_stack.resolve.recipe import resolve

    with pytest.raises(RecipeError) as err:
        resolve(_megatron_recipe(**{"layout.etp": 2, "layout.tp": 2}))
    assert err.value.field == "layout.etp" and "layout.etp=1" in err.value.fix
    raw = load_recipe("slice-1gpu").model_dump(mode="json")
    raw.update(peft={**PEFT, "scheme": "dora", "targets": ["mlp.experts.down_proj"]}, frozen=["base"])
    with pytest.raises(RecipeError) as err:
        resolve(parse_recipe(raw, "dora experts"))
    assert err.value.field.startswith("peft")


# ---- export -------------------------------------------------------------------------------------------
def _tiny():
    return load_recipe("tiny-cpu")


def _settings():
    from muse_stack.models.muse_spark.peft_config import resolve

    recipe = _tiny()
    raw = recipe.model_dump(mode="json")
    raw.update(peft=dict(PEFT), frozen=["base"])
    return resolve(parse_recipe(raw, "tiny peft").peft, recipe.model_config_resolved()), raw


def _trained_adapters(seed: int = 3):
    """A reference model with adapters whose B factors are non-zero (as after training)."""
    from muse_stack.models.muse_spark import MuseSparkForCausalLM
    from muse_stack.models.muse_spark.peft import adapter_state_dict, apply_peft

    settings, raw = _settings()
    model = MuseSparkForCausalLM(_tiny().model_config_resolved(), seed=11)
    apply_peft(model, settings, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, t in adapter_state_dict(model).items():
            if "lora_B" in k:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    return model, settings, raw


def _megatron_adapter_run(tmp_path: Path, model, settings, raw, base: dict) -> Path:
    """A run whose latest checkpoint is a torch_dist checkpoint as the megatron engine writes it
    with peft: the adapters under their reference names and global shapes, optimizer state, and
    adapter_base.json."""
    import torch.distributed.checkpoint as dcp

    from muse_stack.models.muse_spark.peft import adapter_state_dict
    from muse_stack.recipes.catalogue import recipe_yaml

    run_dir = tmp_path / "mrun"
    folder = run_dir / "checkpoints" / checkpoints.folder_name(3)
    state = {k: v.detach().clone() for k, v in adapter_state_dict(model).items()}
    state.update({f"optimizer.state.exp_avg.{k}": torch.zeros_like(v) for k, v in list(state.items())})
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    raw = dict(raw, engine="megatron")
    (folder / "recipe.yaml").write_text(recipe_yaml(parse_recipe(raw, "megatron tiny peft")))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 3}))
    (folder / ADAPTER_BASE).write_text(json.dumps({"format": FORMAT, "peft": settings.as_dict(), "base": base}))
    (run_dir / "checkpoints" / "latest").write_text(json.dumps({"step": 3, "folder": folder.name}))
    return run_dir


def _logits(model):
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        return model(ids).logits


def test_export_adapters_only_from_a_megatron_adapter_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from muse_stack.models.muse_spark.peft import adapter_state_dict
    from muse_stack.publish.hf import export_run

    model, settings, raw = _trained_adapters()
    run_dir = _megatron_adapter_run(tmp_path, model, settings, raw, _ident())
    out, step, count = export_run(run_dir, tmp_path / "peft", adapters_only=True)
    assert step == 3 and count == len(adapter_state_dict(model))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == "org/m"
    written = load_file(str(out / "adapter_model.safetensors"))
    ref = tmp_path / "ref"
    from muse_stack.models.muse_spark.peft_io import export_adapters_hf_peft

    export_adapters_hf_peft(model, ref, settings, base_model_name_or_path="org/m", revision="r1")
    expected = load_file(str(ref / "adapter_model.safetensors"))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_export_merge_of_a_seeded_megatron_base_is_refused_naming_the_fix(tmp_path):
    from muse_stack.publish.hf import export_run

    model, settings, raw = _trained_adapters()
    run_dir = _megatron_adapter_run(tmp_path, model, settings, raw, _ident())
    with pytest.raises(InputError) as err:
        export_run(run_dir, tmp_path / "merged", merge=True)
    assert err.value.field == "--merge" and "--adapters-only" in err.value.fix and "seed 7" in str(err.value)
    assert not (tmp_path / "merged").exists()


def test_export_merge_of_a_megatron_run_on_a_pretrained_base(tmp_path):
    """--merge rebuilds the base from the checkpoint the identity names and folds the adapters in:
    the merged export's logits equal the adapted model's within float32 summation order (the merged
    weight W + s B A is rounded once to float32, so logits of O(1) differ by a few float32 ulps of
    the sums, ~1e-5 here at hidden size 64 and 2 layers; measured 1e-6; bound 1e-4)."""
    from muse_stack.models.muse_spark import load_checkpoint, save_checkpoint
    from muse_stack.publish.hf import export_run

    model, settings, raw = _trained_adapters()
    base_dir = tmp_path / "base"
    from muse_stack.models.muse_spark import MuseSparkForCausalLM

    save_checkpoint(MuseSparkForCausalLM(_tiny().model_config_resolved(), seed=11), base_dir)
    run_dir = _megatron_adapter_run(tmp_path, model, settings, raw, _ident(pretrained_checkpoint=str(base_dir)))
    out, _, _ = export_run(run_dir, tmp_path / "merged", merge=True)
    merged = load_checkpoint(out)
    assert torch.allclose(_logits(merged), _logits(model), atol=1e-4, rtol=0)
    # a checkpoint at the saved path whose headers differ from the saved hash is refused
    ident = _ident(pretrained_checkpoint=str(base_dir))
    ident["headers_sha256"] = "0" * 64
    run2 = _megatron_adapter_run(tmp_path / "b", model, settings, raw, ident)
    with pytest.raises(InputError, match="not the one the adapters were trained on"):
        export_run(run2, tmp_path / "merged2", merge=True)
    assert not (tmp_path / "merged2").exists()


def test_export_flags_are_checked(tmp_path, cli):
    from muse_stack.publish.hf import export_run

    model, settings, raw = _trained_adapters()
    run_dir = _megatron_adapter_run(tmp_path, model, settings, raw, _ident())
    with pytest.raises(InputError, match="exclude each other"):
        export_run(run_dir, tmp_path / "x", merge=True, adapters_only=True)
    rc, _, err = cli("export", run_dir, "--hf", tmp_path / "x")
    assert rc != 0 and "--adapters-only" in err and not (tmp_path / "x").exists()
