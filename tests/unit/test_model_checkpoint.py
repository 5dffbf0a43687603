"""Hugging Face-style checkpoints: round trips, shards, real-checkpoint layouts, and errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint, load_weights_into, save_checkpoint
from tiny_model import tiny_config



pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))


def tiny_model(seed: int = 0, **overrides) -> MuseSparkForCausalLM:
    model = MuseSparkForCausalLM(tiny_config(**overrides), seed=seed)
    with torch.no_grad():  # non-zero gains and bias, so a lost tensor would show
        for name, tensor in model.state_dict(keep_vars=True).items():
            if tensor.dim() == 1:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def test_round_trip_single_file(tmp_path):
    model = tiny_model()
    written = save_checkpoint(model, tmp_path / "ckpt")
    assert sorted(p.name for p in written) == ["config.json", "model.safetensors"]
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == model.config
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=0)
    assert loaded.load_report.loaded == len(model.state_dict()) and loaded.load_report.ignored == 0
    assert all(p.requires_grad for p in loaded.parameters())
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert set(stored) == set(model.state_dict())


def test_round_trip_sharded(tmp_path):
    model = tiny_model()
    written = save_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=20_000)
    names = sorted(p.name for p in written)
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in names and "model.safetensors" not in names
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    loaded = load_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=0)
    # saving again unsharded over it leaves no stale shard behind and keeps foreign files
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    save_checkpoint(model, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors",
                                                                       "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_weights_into_existing_model(tmp_path):
    source = tiny_model(seed=1)
    save_checkpoint(source, tmp_path / "ckpt")
    target = tiny_model(seed=2)
    report = load_weights_into(target, tmp_path / "ckpt")
    assert report.loaded == len(source.state_dict())
    torch.testing.assert_close(target(IDS).logits, source(IDS).logits, rtol=0, atol=0)
    other = tiny_model(qk_scale_factor=1.0)
    with pytest.raises(InputError, match="qk_scale_factor"):
        load_weights_into(other, tmp_path / "ckpt")


def test_bf16_load_keeps_router_fp32(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert sd["model.language_model.layers.0.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.language_model.layers.0.mlp.experts.down_proj"].dtype == torch.bfloat16
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    assert torch.isfinite(model(IDS).logits).all()


def test_real_layout_nested_config_and_towers_ignored(tmp_path):
    model = tiny_model()
    directory = tmp_path / "release"
    directory.mkdir()
    text_config = model.config.to_hf_text_config()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "muse_spark", "architectures": ["MuseSparkForConditionalGeneration"],
        "text_config": text_config, "vision_config": {"hidden_size": 8}}))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    towers = {"model.vision_tower.patch_embed.weight": torch.zeros(8, 3),
              "model.vision_tower.blocks.0.attn.qkv.weight": torch.zeros(24, 8),
              "model.audio_tower.conv.weight": torch.zeros(4, 4),
              "model.multi_modal_projector.linear.weight": torch.zeros(32, 8)}
    names = list(tensors)
    first = {**{k: tensors[k] for k in names[: len(names) // 2]}, **dict(list(towers.items())[:2])}
    second = {**{k: tensors[k] for k in names[len(names) // 2:]}, **dict(list(towers.items())[2:])}
    save_file(first, directory / "model-00001-of-00002.safetensors")
    save_file(second, directory / "model-00002-of-00002.safetensors")
    weight_map = {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(second, "model-00002-of-00002.safetensors")}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_checkpoint(directory)
    assert loaded.load_report.ignored == 4
    assert loaded.load_report.ignored_prefixes == ["model.audio_tower", "model.multi_modal_projector",
                                                   "model.vision_tower"]
    assert "ignored 4 non-text tensors" in loaded.load_report.summary()
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, rtol=0, atol=0)


def _saved(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_directory_or_config(tmp_path):
    with pytest.raises(InputError, match="not found") as err:
        load_checkpoint(tmp_path / "nowhere")
    assert err.value.exit_code == 3
    path = _saved(tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(InputError, match="config.json"):
        load_checkpoint(path)
    with pytest.raises(InputError, match="config.json"):
        load_weights_into(tiny_model(), path)


def test_missing_tensor_is_named(tmp_path):
    path = _saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.language_model.layers.2.mlp.experts.post_expert_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(InputError) as err:
        load_checkpoint(path)
    assert "layers.2.mlp.experts.post_expert_norm.weight" in str(err.value) and err.value.fix


def test_mis_shaped_tensor_is_named(tmp_path):
    path = _saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.language_model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(InputError, match=r"k_proj.weight: checkpoint \[8, 32\], model \[16, 32\]"):
        load_checkpoint(path)


def test_unexpected_text_tensor_is_named(tmp_path):
    path = _saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.language_model.layers.4.input_layernorm.weight"] = torch.zeros(32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(InputError, match="layers.4.input_layernorm"):
        load_checkpoint(path)


def test_corrupt_or_absent_weights(tmp_path):
    path = _saved(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(InputError, match="corrupt"):
        load_checkpoint(path)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InputError, match="corrupt"):
        load_checkpoint(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no weights"):
        load_checkpoint(path)


def test_missing_shard(tmp_path):
    model = tiny_model()
    save_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=20_000)
    next((tmp_path / "ckpt").glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(InputError, match="shard model-00002-of-"):
        load_checkpoint(tmp_path / "ckpt")


def test_a_loaded_model_owns_its_weights(tmp_path):
    """The loaded weights are the model's own allocations (the allocator's alignment, not the
    file's offsets), and saving another model over the checkpoint leaves the loaded one computing
    what it did."""
    save_checkpoint(tiny_model(seed=0), tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    before = loaded(IDS).logits.detach().clone()
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())  # the allocator's alignment
    save_checkpoint(tiny_model(seed=1), tmp_path / "ckpt")
    torch.testing.assert_close(loaded(IDS).logits, before, rtol=0, atol=0)
