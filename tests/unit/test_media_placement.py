"""The megatron engine's media placement (``media_index`` + ``place_media``) against the reference
model's ``scatter_media``: the same rows in the same places for the whole batch, for any part of
the sequence (sequence- and context-parallel chunks, packed streams), and the same gradients.

Everything here is exact: placement only copies rows (no arithmetic), so the tolerances are 0."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.perception import (MEDIA_ORDER, MuseSparkPerception, feature_rows, media_features, media_index,
                                         media_token_ids, place_media, scatter_media)
from muse_stack.recipes.catalogue import load_recipe

TOWERS = load_recipe("tiny-cpu-mm").towers_config_resolved()
IDS = media_token_ids(TOWERS)
H = 8


def batch(rows: int, width: int, counts: dict[str, int], seed: int) -> torch.Tensor:
    """[rows, width] ids with ``counts[kind]`` placeholders of each medium at random places."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (rows, width), generator=gen)
    free = torch.randperm(rows * width, generator=gen)
    at = 0
    for kind in MEDIA_ORDER:
        n = counts[kind]
        ids.view(-1)[free[at:at + n]] = IDS[kind]
        at += n
    return ids


media_counts = st.fixed_dictionaries({k: st.integers(0, 6) for k in MEDIA_ORDER})


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), width=st.integers(6, 24), counts=media_counts, seed=st.integers(0, 2**16))
def test_placement_equals_scatter_for_the_batch_and_any_sequence_chunk(rows, width, counts, seed):
    if sum(counts.values()) > rows * width:
        return
    ids = batch(rows, width, counts, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    embeds = torch.randn(rows, width, H, generator=gen, dtype=torch.float64)
    feats = {k: torch.randn(counts[k], H, generator=gen, dtype=torch.float64) for k in MEDIA_ORDER}
    expected = scatter_media(ids, embeds, TOWERS, **{k: v for k, v in feats.items()})
    index = media_index(ids, TOWERS, counts)
    table = torch.cat([feats[k] for k in MEDIA_ORDER])
    assert torch.equal(place_media(embeds, table, index), expected)
    # the engine's layout: sequence first ([s, b, H]), cut into chunks along the sequence
    stream, idx = embeds.transpose(0, 1), index.transpose(0, 1)
    for parts in (2, 3):
        bounds = torch.linspace(0, width, parts + 1).round().long().tolist()
        for a, b in zip(bounds, bounds[1:]):
            got = place_media(stream[a:b], table, idx[a:b])
            assert torch.equal(got, expected.transpose(0, 1)[a:b])
    # a packed stream: the rows flattened into one [1, rows * width] row
    flat = place_media(embeds.reshape(1, -1, H), table, index.reshape(1, -1))
    assert torch.equal(flat, expected.reshape(1, -1, H))


def test_context_parallel_zigzag_chunks_place_their_own_rows():
    """CP gives each rank chunks i and 2CP-1-i of 2CP along the sequence; the index travels with
    them, so each rank's part equals the matching part of the whole placement."""
    counts = {"image": 5, "video": 2, "audio": 3}
    ids = batch(2, 16, counts, seed=3)
    embeds = torch.randn(2, 16, H, dtype=torch.float64)
    feats = [torch.randn(counts[k], H, dtype=torch.float64) for k in MEDIA_ORDER]
    whole = place_media(embeds, torch.cat(feats), media_index(ids, TOWERS, counts))
    index = media_index(ids, TOWERS, counts)
    cp = 2
    chunks = 2 * cp
    size = 16 // chunks
    for rank in range(cp):
        keep = torch.cat([torch.arange(c * size, (c + 1) * size) for c in (rank, chunks - 1 - rank)])
        got = place_media(embeds[:, keep], torch.cat(feats), index[:, keep])
        assert torch.equal(got, whole[:, keep])


def test_gradients_reach_the_features_and_the_text_as_through_scatter():
    counts = {"image": 4, "video": 0, "audio": 2}
    ids = batch(2, 10, counts, seed=5)
    gen = torch.Generator().manual_seed(9)
    upstream = torch.randn(2, 10, H, generator=gen, dtype=torch.float64)
    grads = []
    for use_index in (False, True):
        embeds = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                             requires_grad=True)
        image = torch.randn(4, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64, requires_grad=True)
        audio = torch.randn(2, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
        if use_index:
            out = place_media(embeds, torch.cat([image, audio]), media_index(ids, TOWERS, counts))
        else:
            out = scatter_media(ids, embeds, TOWERS, image=image, audio=audio)
        (out * upstream).sum().backward()
        grads.append((embeds.grad, image.grad, audio.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    # negative control: a placeholder that took no row would leave its text gradient non-zero
    assert bool((grads[1][0][ids == IDS["image"]] == 0).all())
    assert bool((grads[1][0][~torch.isin(ids, torch.tensor(list(IDS.values())))] != 0).all())


def test_placeholders_and_feature_rows_that_disagree_are_refused_naming_the_medium():
    counts = {"image": 3, "video": 0, "audio": 0}
    ids = batch(1, 8, counts, seed=0)
    with pytest.raises(InputError) as exc:
        media_index(ids, TOWERS, {"image": 4, "video": 0, "audio": 0})
    assert exc.value.field == "input_ids" and "image" in exc.value.message and exc.value.fix


def test_feature_rows_read_off_the_inputs_equal_what_the_towers_make():
    """The engine numbers the rows before any tower runs: the count it reads off the grids and
    the audio mask must be the towers' own."""
    torch.manual_seed(0)
    host = MuseSparkPerception(TOWERS, text_hidden_size=64, text_rms_norm_eps=1e-6).double()
    vc, ac = TOWERS.vision_config, TOWERS.audio_config
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    pixels = torch.randn(int(grid.prod(1).sum()), vc.patch_dim, dtype=torch.float64)
    step = ac.samples_per_token
    audio = torch.randn(2, 5 * step, dtype=torch.float64)
    mask = torch.ones(2, 5 * step, dtype=torch.long)
    mask[1, 3 * step + 1:] = 0  # 3 whole tokens and one sample: 4 tokens
    media = dict(pixel_values=pixels, image_grid_thw=grid, input_values=audio, input_values_mask=mask)
    rows = feature_rows(TOWERS, **media)
    table = media_features(host, TOWERS, **media)
    assert rows == {"image": (24 + 4) // 4, "video": 0, "audio": 5 + 4}
    assert table.shape[0] == sum(rows.values())
    # the image rows come first, then the audio rows: the order media_index numbers them in
    image = host.image_features(pixels, grid)
    assert torch.equal(table[:rows["image"]], image)
    assert torch.equal(table[rows["image"]:], host.audio_features(audio, mask))


def test_vision_recompute_gives_the_same_features_and_gradients():
    """Recomputing each block in the backward re-runs the same forward: bit-equal in float64."""
    torch.manual_seed(0)
    host = MuseSparkPerception(TOWERS, text_hidden_size=64, text_rms_norm_eps=1e-6).double()
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, TOWERS.vision_config.patch_dim, dtype=torch.float64)
    results = []
    for recompute in (False, True):
        host.zero_grad(set_to_none=True)
        host.vision_tower.recompute = recompute
        out = host.image_features(pixels, grid)
        out.pow(2).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in host.vision_tower.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_recipes_say_when_the_towers_recompute():
    assert load_recipe("sft-192-mm").recompute_towers()  # granularity full
    assert not load_recipe("tiny-cpu-mm").recompute_towers()
    assert load_recipe("tiny-cpu-mm", ["recompute.towers=true"]).recompute_towers()
    assert not load_recipe("sft-192-mm", ["recompute.towers=false"]).recompute_towers()


def test_the_towers_map_one_to_one_onto_transformers_names():
    """Every tower tensor the megatron engine holds under ``perception.`` is transformers'
    ``model.`` tensor of the same name, both ways, and in the engine's dist-checkpoint."""
    from muse_stack.engines.mcore.weights import dist_key_to_hf, hf_to_mcore, mcore_to_hf

    host = MuseSparkPerception(TOWERS, text_hidden_size=64, text_rms_norm_eps=1e-6)
    names = [f"perception.{n}" for n in host.state_dict()]
    assert names and len({mcore_to_hf(n).hf_name for n in names}) == len(names)
    for name in names:
        target = mcore_to_hf(name)
        assert target.hf_name == "model." + name[len("perception."):] and target.tp_axis is None
        assert hf_to_mcore(target.hf_name, num_experts=8) == [name]
        assert dist_key_to_hf(name) == target.hf_name
    with pytest.raises(KeyError):  # a name under perception. that is no tower stays unknown
        mcore_to_hf("perception.unknown.weight")


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 6), min_size=1, max_size=60))
def test_attention_groups_cover_every_patch_once_bucketed_by_size(ids):
    """Each row of a bucket is one group's patches in order; every patch is in exactly one row."""
    from muse_stack.models.muse_spark.vision import attention_groups

    group = torch.tensor(ids)
    buckets = attention_groups(group)
    seen = torch.cat([b.reshape(-1) for b in buckets])
    assert sorted(seen.tolist()) == list(range(len(ids)))
    assert len({b.shape[1] for b in buckets}) == len(buckets)  # one bucket per size
    for bucket in buckets:
        for row in bucket:
            members = group[row]
            assert bool((members == members[0]).all())  # one group per row
            assert row.tolist() == sorted(row.tolist())  # in the patches' order
            assert int((group == members[0]).sum()) == row.numel()  # the whole group
