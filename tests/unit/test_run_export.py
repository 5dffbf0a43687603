"""`muse-stack export RUN_DIR --hf OUT`: a run's checkpoint as a Hugging Face checkpoint that
the reference model loads to the same logits, from both engines' checkpoint formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from muse_stack.models.muse_spark.tower_config import TowersConfig

from muse_stack.engines.mcore.weights import EXPERT_NAMES, LAYER_NAMES, LM, TOP_NAMES
from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint, save_checkpoint
from muse_stack.recipes.catalogue import load_recipe, recipe_yaml
from muse_stack.run import checkpoints
from muse_stack.engines.mcore.weights import dist_key_to_hf
from muse_stack.publish.hf import export_run
from muse_stack.run.pipeline import run
from muse_stack.models.muse_spark.hf_config import full_config

IDS = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 400, 3, 3, 17, 250]])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "run"
    outcome = run("tiny-cpu", out=out, steps=3, progress=False,
                  overrides=["training.measure_warmup_steps=1", "batch.gbs=2"])
    assert outcome.status == "completed"
    return out


def test_export_a_reference_run_round_trips_bitwise(reference_run, tmp_path, cli):
    out = tmp_path / "hf"
    # shards of at most 0.2 MB: the 1 MB of tiny-cpu weights spread over several files and an index
    rc, text, err = cli("export", reference_run, "--hf", out, "--max-shard-mb", "0.2")
    assert rc == 0, err
    assert "exported step 3" in text
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = load_checkpoint(out)
    own = load_checkpoint(checkpoints.latest(reference_run).path)  # the run's own weights
    assert exported.state_dict().keys() == own.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(exported(IDS).logits, own(IDS).logits)
    assert json.loads((out / "config.json").read_text()) == full_config(own.config)


def test_export_refuses_an_existing_directory_and_a_run_without_checkpoint(reference_run, tmp_path, cli):
    out = tmp_path / "taken"
    out.mkdir()
    rc, _, err = cli("export", reference_run, "--hf", out)
    assert rc == 3 and "already exists" in err and not any(out.iterdir())
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(InputError, match="no complete checkpoint"):
        export_run(bare, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ---- megatron-core dist-checkpoints --------------------------------------------------------
def _dist_key(hf_name: str) -> str:
    """megatron-core 0.19's global key of an HF tensor (TransformerBlock / TEGroupedMLP
    ``sharded_state_dict``: global layer numbers, grouped experts under ``experts.experts.``)."""
    for mc, hf in TOP_NAMES.items():
        if hf == hf_name:
            return mc
    if not hf_name.startswith(LM):  # a tower: MegatronModule's default sharded state of a plain child module
        return "perception." + hf_name[len("model."):]
    layer, rest = hf_name[len(f"{LM}layers."):].split(".", 1)
    for table in (LAYER_NAMES, EXPERT_NAMES):
        for mc, hf in table.items():
            if hf == rest:
                return f"decoder.layers.{layer}." + mc.replace("mlp.experts.", "mlp.experts.experts.")
    raise KeyError(hf_name)


def _megatron_run(tmp_path: Path, model: MuseSparkForCausalLM, step: int, recipe_name: str = "tiny-cpu") -> Path:
    """A run directory whose latest checkpoint is a torch_dist checkpoint of ``model``'s weights
    under megatron-core's global keys, next to the optimizer state and TE extra state it also holds."""
    import torch.distributed.checkpoint as dcp

    run_dir = tmp_path / "mrun"
    folder = run_dir / "checkpoints" / checkpoints.folder_name(step)
    state = {}
    for name, tensor in model.state_dict().items():
        key = _dist_key(name)
        state[key] = tensor.clone()
        state[f"optimizer.state.exp_avg.{key}"] = torch.zeros_like(tensor)
    state["decoder.layers.0.self_attention.linear_q._extra_state"] = torch.zeros(4, dtype=torch.uint8)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    recipe = load_recipe(recipe_name).model_dump(mode="json")
    recipe["engine"] = "megatron"
    from muse_stack.recipes.catalogue import parse_recipe

    (folder / "recipe.yaml").write_text(recipe_yaml(parse_recipe(recipe, "megatron tiny")))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "latest").write_text(json.dumps({"step": step, "folder": folder.name}))
    return run_dir


def test_every_hf_tensor_has_one_dist_checkpoint_key():
    model_cfg = load_recipe("tiny-cpu").model_config_resolved()
    with torch.device("meta"):
        names = list(MuseSparkForCausalLM(model_cfg, seed=None).state_dict())
    keys = [_dist_key(n) for n in names]
    assert len(set(keys)) == len(keys)
    assert [dist_key_to_hf(k) for k in keys] == names
    assert dist_key_to_hf("optimizer.state.exp_avg.decoder.layers.0.mlp.router.weight") is None


def test_export_a_megatron_dist_checkpoint_round_trips_bitwise(tmp_path):
    cfg = load_recipe("tiny-cpu").model_config_resolved()
    model = MuseSparkForCausalLM(cfg, seed=7)
    run_dir = _megatron_run(tmp_path, model, step=5)
    out, step, count = export_run(run_dir, tmp_path / "hf")
    assert step == 5 and count == len(model.state_dict())
    exported = load_checkpoint(out)
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in model.state_dict().items())
    # the same weights through the same loader: on the same weights and config, a model built by
    # load_checkpoint and a freshly initialised one already differ in the last bit of some
    # logits (measured: 6e-8), so the reference is the model's own checkpoint, loaded alike
    save_checkpoint(model, tmp_path / "own")
    own = load_checkpoint(tmp_path / "own")
    with torch.no_grad():
        assert torch.equal(exported(IDS).logits, own(IDS).logits)


def test_a_megatron_run_with_towers_exports_its_own_towers_from_the_dist_checkpoint(tmp_path):
    """The megatron engine keeps the towers under ``perception.`` in its dist-checkpoint and writes
    no config.json beside them: the export takes the towers' tensors from the checkpoint and their
    config from the run's recipe, and transformers loads it with nothing missing."""
    from transformers import MuseSparkForConditionalGeneration

    recipe = load_recipe("tiny-cpu-mm")
    cfg, towers = recipe.model_config_resolved(), recipe.towers_config_resolved()
    model = MuseSparkForCausalLM(cfg, seed=7, towers=towers)
    run_dir = _megatron_run(tmp_path, model, step=3, recipe_name="tiny-cpu-mm")
    out, step, _ = export_run(run_dir, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert TowersConfig.from_hf(config) == towers  # the run's towers, not placeholders
    exported = load_checkpoint(out, towers=True)
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in model.state_dict().items())
    assert "this run's step 3 checkpoint" in (out / "README.md").read_text()
    _, info = MuseSparkForConditionalGeneration.from_pretrained(out, output_loading_info=True,
                                                                experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_a_dist_checkpoint_missing_a_tensor_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = load_recipe("tiny-cpu").model_config_resolved()
    model = MuseSparkForCausalLM(cfg, seed=7)
    run_dir = _megatron_run(tmp_path, model, step=2)
    folder = run_dir / "checkpoints" / checkpoints.folder_name(2)
    state = {_dist_key(n): t for n, t in model.state_dict().items() if not n.endswith("mlp.experts.down_proj")}
    for f in folder.iterdir():
        if f.name not in ("recipe.yaml", "trainer_state.json"):
            f.unlink()
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(InputError, match="missing from the checkpoint"):
        export_run(run_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("tp, pp, ep, etp", [(2, 1, 1, 1), (1, 2, 2, 1), (1, 1, 2, 2), (2, 2, 4, 2)])
def test_any_layout_writes_the_global_tensors_export_reads(tp, pp, ep, etp):
    """Through the weight mapping: every rank of a TP/PP/EP/ETP layout holds ``shard()`` of its
    tensors (what the engine loads and trains); megatron-core's dist-checkpoint places each at
    its global offset (TP/ETP shards along their axis, the GLU's gate and up halves each split
    (``apply_swiglu_sharded_factory``), an expert at its global index, a layer under its global
    number). Those placements must tile the HF tensor exactly once, for export to read it whole."""
    from muse_stack.engines.mcore.weights import hf_to_mcore, mcore_to_hf, shard

    cfg = load_recipe("tiny-cpu").model_config_resolved()
    full = MuseSparkForCausalLM(cfg, seed=3).state_dict()
    rebuilt = {n: torch.full_like(t, float("nan")) for n, t in full.items()}
    writes = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in full.items()}
    layers_per_stage, experts_per_rank = cfg.num_hidden_layers // pp, cfg.num_local_experts // ep
    for hf_name, tensor in full.items():
        for global_name in hf_to_mcore(hf_name, cfg.num_local_experts):
            target = mcore_to_hf(global_name)
            layer = int(global_name.split(".")[2]) if global_name.startswith("decoder.layers.") else None
            for stage in range(pp):
                if layer is not None and not stage * layers_per_stage <= layer < (stage + 1) * layers_per_stage:
                    continue
                for ep_rank in range(ep):
                    if target.expert is not None and target.expert // experts_per_rank != ep_rank:
                        continue
                    # dense tensors split over the TP group, expert tensors over the ETP group
                    groups = [(r, 0) for r in range(tp)] if target.etp_axis is None else [(0, r) for r in range(etp)]
                    for tp_rank, etp_rank in groups:
                        src = tensor[target.expert] if target.expert is not None else tensor
                        part = shard(src, target, tp_rank, tp, etp_rank, etp)
                        dst = rebuilt[hf_name][target.expert] if target.expert is not None else rebuilt[hf_name]
                        cnt = writes[hf_name][target.expert] if target.expert is not None else writes[hf_name]
                        axis, rank, size = ((target.tp_axis, tp_rank, tp) if target.etp_axis is None
                                            else (target.etp_axis, etp_rank, etp))
                        if axis is None or size == 1:
                            dst.copy_(part)
                            cnt += 1
                        elif target.glu:
                            half = src.shape[axis] // 2
                            step = half // size
                            gate, up = part.chunk(2, dim=axis)
                            for offset, piece in ((rank * step, gate), (half + rank * step, up)):
                                dst.narrow(axis, offset, step).copy_(piece)
                                cnt.narrow(axis, offset, step).add_(1)
                        else:
                            step = src.shape[axis] // size
                            dst.narrow(axis, rank * step, step).copy_(part)
                            cnt.narrow(axis, rank * step, step).add_(1)
    # every element written as often as every other (replicas write whole copies): the shards
    # tile each tensor with no gap and no overlap, and what they hold is the HF tensor
    for name, tensor in full.items():
        assert writes[name].min() == writes[name].max() > 0, name
        assert torch.equal(rebuilt[name], tensor), name
