"""Checkpoint import reads each rank's part once: expert slices and TP/ETP shards through
``safe_open(...).get_slice``, in the megatron engine's loader; every tensor once, one at a
time, in the reference engine's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lab.engine import StateDictSlices
from muse_stack.engines.mcore.load import CheckpointSlices, read_part, read_rank_weights
from muse_stack.engines.mcore.weights import hf_to_mcore, mcore_to_hf, rank_names, shard
from muse_stack.models.muse_spark.hf_config import full_config

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("import_slices", ROOT / "benchmarks" / "scripts" / "import_slices.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tp, etp", [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_a_sliced_read_equals_the_shard_of_the_whole_tensor(tmp_path, tp, etp):
    from muse_stack.models.muse_spark import MuseSparkForCausalLM
    from muse_stack.recipes.catalogue import load_recipe

    cfg = load_recipe("tiny-cpu").model_config_resolved()
    state = MuseSparkForCausalLM(cfg, seed=5).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    source = CheckpointSlices(tmp_path)
    for hf_name, tensor in state.items():
        for name in hf_to_mcore(hf_name, cfg.num_local_experts):
            target = mcore_to_hf(name)
            whole = tensor[target.expert] if target.expert is not None else tensor
            for tp_rank in range(tp):
                for etp_rank in range(etp):
                    before = source.bytes_read
                    part = read_part(source, target, tp_rank, tp, etp_rank, etp)
                    assert torch.equal(part, shard(whole, target, tp_rank, tp, etp_rank, etp)), name
                    assert source.bytes_read - before == part.numel() * part.element_size()  # only the part


def test_each_expert_parallel_rank_reads_only_its_part_at_the_real_width(tmp_path):
    """One decoder layer of the real width with 16 experts (2.2 GB, a sparse file: the data is
    a hole), loaded as the 8 ranks of EP 8 one after another: each reads the layer's dense
    tensors and its own 2 experts, once; never the stacked expert tensors whole."""
    bench = _bench()
    specs = bench.layer_specs(16)
    bench.write_checkpoint(tmp_path, specs, sparse=True)
    sizes = {name: torch.Size(shape).numel() * (2 if dtype == "torch.bfloat16" else 4) for name, shape, dtype in specs}
    stacked = [n for n in sizes if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert len(stacked) == 2
    dense = sum(v for n, v in sizes.items() if n not in stacked)
    per_rank_experts = sum(sizes[n] for n in stacked) * 2 // 16  # 2 of 16 experts of each stacked tensor
    names = [n for n, _, _ in specs]
    for rank in range(8):
        source = CheckpointSlices(tmp_path)
        local = rank_names(names, 16, ep_rank=rank, ep_size=8, layers=range(0, 1))
        for _ in read_rank_weights(source, local, layer_offset=0, expert_offset=rank * 2, tp_rank=0, tp_size=1,
                                   etp_rank=0, etp_size=1):
            pass
        assert source.reads == len(local)  # one read per parameter
        assert source.bytes_read == dense + per_rank_experts, rank
    # the loader before slices read the stacked tensor whole for each local expert parameter:
    # 2 experts x (gate_up + down) of all 16 = 3.8 GB per rank with the dense tensors, now 0.77 GB
    whole = dense + 2 * sum(sizes[n] for n in stacked)
    assert (dense + per_rank_experts) * 4 < whole


def test_the_reference_loader_reads_every_tensor_once_and_skips_towers(tmp_path):
    from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_weights_into
    from muse_stack.recipes.catalogue import load_recipe

    cfg = load_recipe("tiny-cpu").model_config_resolved()
    state = MuseSparkForCausalLM(cfg, seed=5).state_dict()
    tower = {"model.vision_tower.patch.weight": torch.zeros(64, 64)}
    save_file({**{k: v.contiguous() for k, v in state.items()}, **tower}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(__import__("json").dumps(full_config(cfg)))
    model = MuseSparkForCausalLM(cfg, seed=9)
    report = load_weights_into(model, tmp_path)
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in state.values())
    assert report.ignored == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_state_dict_source_reads_parts_too():
    t = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    source = StateDictSlices({"model.language_model.layers.0.mlp.experts.gate_up_proj": t})
    target = mcore_to_hf("decoder.layers.0.mlp.experts.linear_fc1.weight1")
    part = read_part(source, target, 0, 1, 1, 2)
    assert torch.equal(part, torch.cat([t[1, 2:4], t[1, 6:8]]))
    assert source.bytes_read == part.numel() * 4
