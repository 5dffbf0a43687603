"""The perception towers' memory traffic outside their GEMMs and attention, counted by running their code
(muse_stack/models/muse_spark/traffic.py), and the data file the planner reads it from
(muse_stack/plan/tower_traffic.json)."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from muse_stack.models.muse_spark import traffic, vision
from muse_stack.models.muse_spark.perception import media_features
from muse_stack.models.muse_spark.tower_config import TowersConfig
from muse_stack.plan.towers import TRAFFIC_FILE, TrafficFile, count_traffic, tower_plan
from muse_stack.recipes.catalogue import load_recipe, recipe_names
from muse_stack.resolve.recipe import finalize
from muse_stack.util.datafile import load

RELEASED = TowersConfig()
TEXT = 8192  # the text width of the recipes that carry the released towers


def _tiny():
    recipe = load_recipe("tiny-cpu-mm")
    return recipe.towers_config_resolved(), recipe.model_config_resolved().hidden_size


def _collinear(values, patches) -> bool:
    """Whether three (patches, bytes) points lie on one line; in integers (the bytes are whole), so exactly."""
    (v0, v1, v2), (n0, n1, n2) = values, patches
    return (v1 - v0) * (n2 - n0) == (v2 - v0) * (n1 - n0)


def test_the_count_is_linear_in_the_patches(one_thread):
    """The released towers' bytes at three frames of the same rows, growing by whole windows in width (each
    with the same four window sizes): the third's lie on the line through the first two's, exactly, for every
    quantity and part. A frame grown in both directions too, for the layers: their bytes grow with the
    patches alone, the gathers and scatters of every attention group included. (Outside the layers a few
    hundred bytes grow with a frame's rows and columns rather than its patches: the coordinates' and the
    position table's sample points.)"""
    frames = traffic.counting_frames(RELEASED)
    t, rows, cols = frames[1]
    window = RELEASED.vision_config.window_patches
    frames.append((t, rows + window, cols))  # grown in height from the second
    got = [traffic.count_frames(RELEASED, TEXT, torch.bfloat16, [f]) for f in frames]
    n = [t * h * w for t, h, w in frames]
    assert n[0] < n[1] < n[2] and n[1] < n[3]
    for quantity, parts in got[0].items():
        for part in parts if isinstance(parts, dict) else [None]:
            v = [g[quantity][part] if part else g[quantity] for g in got]
            assert v[0] > 0 and _collinear(v[:3], n[:3]), (quantity, part, v)
            if part in ("window_attention", "full_attention"):
                assert _collinear([v[0], v[1], v[3]], [n[0], n[1], n[3]]), (quantity, part, v)


def test_an_extra_fp32_copy_in_the_layer_adds_its_bytes(one_thread, monkeypatch):
    """A mutation: every encoder layer copies its fp32 input once more. The forward of each layer moves that
    copy's bytes (read and written: 2 x 4 bytes x D per patch) more; its backward nothing more (a copy's
    gradient passes through); the backward with the blocks recomputed moves it again (the recomputed forward)."""
    towers, text = _tiny()
    before = traffic.count(towers, text, torch.bfloat16)
    layer = vision.MuseSparkVisionEncoderLayer.forward
    monkeypatch.setattr(vision.MuseSparkVisionEncoderLayer, "forward",
                        lambda self, x, **kw: layer(self, x.clone(), **kw))
    after = traffic.count(towers, text, torch.bfloat16)
    copy = 2 * 4 * towers.vision_config.hidden_size
    for kind in ("window_attention", "full_attention"):
        assert after.forward[kind] - before.forward[kind] == copy
        assert after.backward[kind] == before.backward[kind]
        assert after.backward_recomputed[kind] - before.backward_recomputed[kind] == copy
    assert after.forward["outside_layers"] == before.forward["outside_layers"]


def test_a_frozen_projector_changes_only_its_weight_gradient_gemms(one_thread):
    """The planner prices a trained vision tower's backward the same whether the projector trains or not: what
    differs is the projector's weight-gradient GEMMs, priced apart (no bytes here)."""
    towers, text = _tiny()
    frames = [traffic.counting_frames(towers)[0]]
    kw = dict(layer_types=["window_attention", "full_attention"], vision_trains=True)
    trained = traffic.run_image_path(towers, text, torch.bfloat16, frames, projector_trains=True, **kw)
    frozen = traffic.run_image_path(towers, text, torch.bfloat16, frames, projector_trains=False, **kw)
    assert trained == frozen and trained["backward"] > 0


def test_the_recorder_changes_nothing_but_the_index_backward_it_corrects(one_thread):
    """Under a dispatch mode autograd takes tensor subclasses' paths where it has them (ATen's
    isTensorSubclassLike). torch.profiler, which needs no mode, records the aten ops of the tiny towers' forward
    and backward (blocks recomputed) with and without one; with it, each op the mode sees is recorded twice (on
    the way in, and run from the mode), so ``with - without - seen`` is what the mode changed. Only two things:
    index_backward's out-of-place index_put (a clone, then the in-place scatter) for the in-place
    _index_put_impl_, which the recorder counts as the in-place scatter; and gradient accumulation out of place
    (add for add_, the same bytes read and written). Any other change would be a path the count does not see."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    towers, text = _tiny()
    seen: Counter[str] = Counter()

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[f"aten::{func.overloadpacket.__name__}"] += 1
            return func(*args, **(kwargs or {}))

    def ops(mode: bool) -> Counter[str]:
        torch.manual_seed(0)
        host = traffic._host(towers, text, torch.bfloat16, ["window_attention", "full_attention"])
        with torch.no_grad():
            for p in host.parameters():
                p.normal_(0.0, 0.02)
        host.vision_tower.recompute = True
        host.audio_tower.requires_grad_(False)
        grid = torch.tensor([traffic.counting_frames(towers)[0]])
        pixels = torch.randn(int(grid.prod()), towers.vision_config.patch_dim)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with Seen() if mode else contextlib.nullcontext():
                features = media_features(host, towers, pixel_values=pixels, image_grid_thw=grid)
                features.backward(torch.ones_like(features))
        return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))

    without = ops(False)
    with_mode = ops(True)
    changed = Counter(with_mode)
    changed.subtract(without)
    changed.subtract(seen)
    changed = {k: v for k, v in changed.items() if v}
    scatters = changed.get("aten::index_put", 0)
    assert scatters > 0  # the towers' gathers have a backward, and the mode changes it
    # each out-of-place index_put: its clone (empty_strided + copy_) and in-place index_put_
    expected = {"aten::index_put": scatters, "aten::clone": scatters, "aten::empty_strided": scatters,
                "aten::copy_": scatters, "aten::index_put_": scatters}
    accumulated = changed.get("aten::add", 0)
    if accumulated:
        expected.update({"aten::add": accumulated, "aten::add_": -accumulated})
    metadata = {k: v for k, v in changed.items() if k in ("aten::view", "aten::_reshape_alias")}
    assert sum(metadata.values()) == 0  # a reshape's view recorded under another name: no data either way
    assert {k: v for k, v in changed.items() if k not in metadata} == expected


def test_the_file_holds_the_count_of_every_shipped_shape(one_thread):
    """Every shipped recipe that holds the towers finds its shape in tower_traffic.json (its plan reads the
    file rather than counting), and each entry is what counting it again gives, exactly."""
    file = load(TRAFFIC_FILE, TrafficFile)
    holding = [name for name in recipe_names() if tower_plan(finalize(load_recipe(name))) is not None]
    assert "slice-1gpu-mm" in holding
    for name in holding:
        assert tower_plan(finalize(load_recipe(name))).traffic()[1], name
    for entry in file.counts:
        assert count_traffic(entry.shape) == entry
