"""Muse Spark as transformers 5.24.0 defines it (``transformers.models.muse_spark``): the reference
model computes the same function, config fields mean the same, an export loads in transformers with
nothing missing and generates, and a checkpoint transformers writes loads here and starts a run.

Float64 parity: transformers casts to float32 inside its norms (``hidden_states.float()``) and its
router (``.type(torch.float32)``); :func:`float64_throughout` lifts those casts for float64 tensors
so that both models run the same formulas in float64 and any difference is rounding (or a formula
error, which the negative controls show the bound catches). The bound is Higham's for a float64
chain as long as the longest path from the embedding to a logit (``logits_rounding_chain``), at
the largest logit, which the softcap bounds: n u / (1 - n u) x softcap with u = 2^-53.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration, MuseSparkTextConfig  # noqa: E402

from muse_stack.engines.mcore.chains import hold_padding_row  # noqa: E402
from muse_stack.engines.mcore.weights import dist_key_to_hf, hf_to_mcore, mcore_to_hf  # noqa: E402
from muse_stack.util.errors import RecipeError  # noqa: E402
from muse_stack.models.muse_spark.hf_config import full_config  # noqa: E402
from muse_stack.models.muse_spark.config import TEXT_FIELDS  # noqa: E402
from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint  # noqa: E402
from muse_stack.models.muse_spark.config import ModelConfig  # noqa: E402
from muse_stack.run.pipeline import run  # noqa: E402
from tiny_model import float64_throughout, logits_rounding_chain  # noqa: E402

FP64_U = 2.0**-53
ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            moe_hidden_size=16, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=None, first_padding_token_id=None)


def config(layers: int, **extra) -> ModelConfig:
    return ModelConfig().with_overrides(**{**TINY, "num_hidden_layers": layers, **extra})


def hf_model(cfg: ModelConfig, dtype=torch.float64) -> MuseSparkForConditionalGeneration:
    hf_config = MuseSparkConfig(**full_config(cfg))
    for sub in (hf_config, hf_config.text_config):
        sub._experts_implementation = "eager"  # the grouped-mm kernel takes no float64
    return MuseSparkForConditionalGeneration(hf_config).to(dtype).eval()


def perturbed_pair(cfg: ModelConfig, seed: int = 0, lm_scale: float = 1.0):
    """Our model with every weight perturbed (no gain at 0 or 1, no zero bias) and transformers'
    holding the same values, both in float64."""
    ours = MuseSparkForCausalLM(cfg, seed=seed).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        ours.lm_head.weight.mul_(lm_scale)
        for layer in ours.language_model.layers:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.05 * torch.randn(bias.shape, generator=g))
    theirs = hf_model(cfg)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected
    assert all(not m.startswith(("model.language_model.", "lm_head.")) for m in missing)
    return ours.eval(), theirs


def bound(cfg: ModelConfig, tokens: int, scale: float = 1.0) -> float:
    """``scale``: how much the LM head was scaled up; the pre-cap logit, and its rounding, grow with it
    (the cap's slope is at most 1, so the error after the cap is no larger)."""
    n = logits_rounding_chain(cfg, tokens)
    return n * FP64_U / (1 - n * FP64_U) * cfg.final_logit_softcapping * scale


CASES = {
    # 8 layers: transformers' default pattern (counted back from the last) differs from the front-counted one
    "default-pattern-8": (config(8), {}),
    "default-pattern-6": (config(6), {}),
    # explicit layer types with NoPE decided by layer_rope_theta, not by the type
    "nope-apart-from-type": (config(4, layer_types=["full_attention", "sliding_attention", "full_attention",
                                                    "sliding_attention"],
                                    layer_rope_theta=[500000.0, 0, 0, 500000.0]), {}),
    "saturated-softcap": (config(4), {"lm_scale": 400.0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_model_equals_transformers_in_float64(case):
    cfg, kw = CASES[case]
    ours, theirs = perturbed_pair(cfg, lm_scale=kw.get("lm_scale", 1.0))
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), float64_throughout():
        a, b = ours(ids).logits, theirs(input_ids=ids).logits
    assert a.dtype == b.dtype == torch.float64
    if case == "saturated-softcap":
        assert b.abs().max() > 0.99 * cfg.final_logit_softcapping  # the tanh is saturated somewhere
    assert (a - b).abs().max().item() <= bound(cfg, 13, kw.get("lm_scale", 1.0))


def test_packed_rows_equal_transformers_position_id_packing():
    """Two sequences packed in one row: ours by cu_seqlens, transformers' by positions that restart."""
    cfg = config(4)
    ours, theirs = perturbed_pair(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad(), float64_throughout():
        a = ours(ids, cu_seqlens=torch.tensor([0, 5, 12])).logits
        # no cache: transformers reads packing from restarting positions only without one
        b = theirs(input_ids=ids, position_ids=positions, use_cache=False).logits
        whole = theirs(input_ids=ids, use_cache=False).logits
    assert (a - b).abs().max().item() <= bound(cfg, 12)
    assert (whole - b).abs().max().item() > 1e3 * bound(cfg, 12)  # the packing is seen, not ignored


def test_router_picks_the_same_experts():
    cfg = config(4)
    ours, theirs = perturbed_pair(cfg)
    x = torch.randn(20, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), float64_throughout():
        routing = ours.language_model.layers[0].mlp.gate(x)
        _, their_weights, their_idx = theirs.model.language_model.layers[0].mlp.gate(x)
    # transformers' top-k is unsorted: compare the sets of experts per token, and their weights
    mine, order = routing.indices.sort(-1)
    theirs_sorted, their_order = their_idx.sort(-1)
    assert torch.equal(mine, theirs_sorted)
    torch.testing.assert_close(routing.weights.gather(-1, order).double(),
                               their_weights.gather(-1, their_order).double(), rtol=0, atol=0)


# ---- negative controls: each changes one meaning, and the bound catches it ---------------------
def _front_counted(cfg: ModelConfig) -> ModelConfig:
    types = ["full_attention" if i % 4 == 1 else "sliding_attention" for i in range(cfg.num_hidden_layers)]
    return cfg.with_overrides(layer_types=types,
                              layer_rope_theta=[0 if t == "full_attention" else cfg.rope_theta for t in types])


def _nope_by_type(cfg: ModelConfig) -> ModelConfig:
    return cfg.with_overrides(layer_rope_theta=[0 if t == "full_attention" else cfg.rope_theta
                                                for t in cfg.resolved_layer_types])


CONTROLS = {
    "layer pattern counted from the front": (CASES["default-pattern-8"][0], _front_counted),
    "NoPE decided by layer type": (CASES["nope-apart-from-type"][0], _nope_by_type),
    "residual temperature 0.31": (config(4), lambda c: c.with_overrides(residual_gate_temperature=0.31)),
    "window one key wider": (config(4), lambda c: c.with_overrides(sliding_window=5)),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_negative_controls_exceed_the_bound(control):
    cfg, change = CONTROLS[control]
    ours, theirs = perturbed_pair(cfg)
    wrong = MuseSparkForCausalLM(change(cfg), seed=None).double().eval()
    wrong.load_state_dict(ours.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), float64_throughout():
        diff = (wrong(ids).logits - theirs(input_ids=ids).logits).abs().max().item()
    assert diff > 1e3 * bound(cfg, 13), f"{control} is not caught: {diff}"


# ---- config meanings ---------------------------------------------------------------------------
def test_every_transformers_text_field_has_a_stated_meaning():
    fields = {f.name for f in dataclasses.fields(MuseSparkTextConfig)}
    assert fields - set(TEXT_FIELDS) == set(), "a transformers field muse-stack does not know how to read"
    ours = set(ModelConfig.model_fields)
    assert {k for k, v in TEXT_FIELDS.items() if v == "field"} <= ours


def test_defaults_read_as_transformers_defaults():
    theirs = MuseSparkTextConfig(num_hidden_layers=8)
    ours = ModelConfig(num_hidden_layers=8)
    assert ours.resolved_layer_types == theirs.layer_types
    assert [float(t) for t in ours.resolved_layer_rope_theta] == [float(t) for t in theirs.layer_rope_theta]
    for key in ("pad_token_id", "eos_token_id", "bos_token_id", "max_position_embeddings", "initializer_range",
                "sliding_window", "qk_scale_factor", "output_multiplier", "post_norm_eps", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(theirs, key), key


@pytest.mark.parametrize("key,value,match", [
    ("layer_rope_theta", [10000.0, 0, 500000.0, 500000.0], "layer_rope_theta"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 2.0}, "rope_type"),
    ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"], "mlp_layer_types"),
    ("attention_dropout", 0.1, "attention_dropout"),
    ("sliding_window", None, "sliding_window"),
])
def test_a_value_read_differently_is_refused_by_name(key, value, match):
    text = MuseSparkTextConfig(**{k: v for k, v in TINY.items() if k != "first_padding_token_id"},
                               num_hidden_layers=4).to_dict()
    text[key] = value
    with pytest.raises(RecipeError, match=match):
        ModelConfig.from_hf_config({"model_type": "muse_spark", "text_config": text})


ROPE_KEYS = {
    "legacy rope_theta alone (ignored: the model's default RoPE)": {"rope_theta": 1234.0},
    "legacy rope_theta beside a full rope_parameters (ignored)": {
        "rope_theta": 1234.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "legacy rope_theta fills a rope_parameters without one": {
        "rope_theta": 1234.0, "rope_parameters": {"rope_type": "default"}},
    "rope_parameters without a theta (the generic 10000)": {"rope_parameters": {"rope_type": "default"}},
    "rope_scaling replaces rope_parameters": {
        "rope_scaling": {"rope_type": "default", "rope_theta": 30000.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "rope_scaling without a theta takes the legacy key": {
        "rope_scaling": {"type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_theta": 99.0},
    "an empty rope_scaling leaves rope_parameters": {
        "rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}},
}


def _text_config(**extra) -> dict:
    text = MuseSparkTextConfig(**{k: v for k, v in TINY.items() if k != "first_padding_token_id"},
                               num_hidden_layers=4).to_dict()
    for key in ("rope_parameters", "layer_rope_theta"):
        del text[key]  # filled by transformers from the keys under test
    return {**text, **extra}


@pytest.mark.parametrize("case", sorted(ROPE_KEYS))
def test_rope_keys_are_read_as_transformers_reads_them(case):
    """The decoder's RoPE (its base, and which layers have none) from every way a config can state
    it, against transformers' own rotary embedding: fp32 both, the same formula, so equal bitwise."""
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTextRotaryEmbedding

    from muse_stack.models.muse_spark.rope import rope_cos_sin

    text = _text_config(**ROPE_KEYS[case])
    ours = ModelConfig.from_hf_config({"model_type": "muse_spark", "text_config": json.loads(json.dumps(text))})
    theirs = MuseSparkConfig(text_config=json.loads(json.dumps(text)),
                             audio_config={"out_hidden_size": text["hidden_size"]}).text_config
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert [float(t) for t in ours.resolved_layer_rope_theta] == [float(t) for t in theirs.layer_rope_theta]
    positions = torch.arange(0, 4096, 37)[None]
    cos, sin = MuseSparkTextRotaryEmbedding(theirs)(torch.zeros(1, dtype=torch.float32), positions)
    our_cos, our_sin = rope_cos_sin(positions, ours.head_dim, ours.rope_theta)
    assert torch.equal(our_cos, cos) and torch.equal(our_sin, sin)


def test_a_rope_scaling_transformers_applies_is_refused_naming_it():
    """transformers applies a non-empty rope_scaling over a plain rope_parameters (linear x2 here);
    muse-stack implements plain RoPE only, so the config is refused by that key."""
    text = _text_config(rope_scaling={"rope_type": "linear", "factor": 2.0},
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    theirs = MuseSparkConfig(text_config=json.loads(json.dumps(text)),
                             audio_config={"out_hidden_size": text["hidden_size"]}).text_config
    assert theirs.rope_parameters["rope_type"] == "linear"  # what the refusal is about
    with pytest.raises(RecipeError) as err:
        ModelConfig.from_hf_config({"model_type": "muse_spark", "text_config": text})
    assert err.value.field == "config.json text_config.rope_scaling.rope_type" and "linear" in str(err.value)


def test_tie_word_embeddings_true_is_read_as_transformers_reads_it(tmp_path):
    """transformers accepts ``tie_word_embeddings: true`` for muse_spark and ties nothing (the model
    declares no tied weights): a checkpoint saying so loads here with two separate tensors, and its
    logits equal transformers'."""
    cfg = config(4)
    hf_config = MuseSparkConfig(**full_config(cfg))
    hf_config.text_config.tie_word_embeddings = True
    for sub in (hf_config, hf_config.text_config):
        sub._experts_implementation = "eager"  # the grouped-mm kernel takes no float64
    theirs = MuseSparkForConditionalGeneration(hf_config).eval()
    assert theirs.config.text_config.tie_word_embeddings is True
    assert not torch.equal(theirs.lm_head.weight, theirs.model.language_model.embed_tokens.weight)
    theirs.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["tie_word_embeddings"] is True
    ours = load_checkpoint(tmp_path)
    assert ours.config.tie_word_embeddings is False
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), float64_throughout():
        a = ours.double()(ids).logits
        b = theirs.double()(input_ids=ids).logits
    assert (a - b).abs().max().item() <= bound(cfg, 7)


# ---- checkpoints in both directions ------------------------------------------------------------
def test_transformers_checkpoint_loads_here_sharded_with_its_defaults(tmp_path):
    cfg = config(4)
    theirs = hf_model(cfg, dtype=torch.float32)
    theirs.config.text_config.pad_token_id = None
    theirs.save_pretrained(tmp_path, max_shard_size="100KB")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["text_config"]["pad_token_id"] is None and (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_checkpoint(tmp_path)
    assert ours.load_report.ignored > 0  # the towers, which the text model does not hold
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), float64_throughout():
        a = ours.double()(ids).logits
        b = theirs.double()(input_ids=ids).logits
    assert (a - b).abs().max().item() <= bound(cfg, 9)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "run"
    outcome = run("tiny-cpu", out=out, steps=2, progress=False,
                  overrides=["training.measure_warmup_steps=1", "batch.gbs=2"])
    assert outcome.status == "completed"
    return out


def test_export_loads_in_transformers_generates_and_gives_our_logits(trained, tmp_path, cli):
    out = tmp_path / "export"
    rc, _, err = cli("export", trained, "--hf", out)
    assert rc == 0, err
    model, info = MuseSparkForConditionalGeneration.from_pretrained(out, output_loading_info=True,
                                                                    experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=4)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4 or tokenizer.eos_token_id in generated[0]
    ours = load_checkpoint(out)
    with torch.no_grad(), float64_throughout():
        a = ours.double()(prompt["input_ids"]).logits
        b = model.double()(input_ids=prompt["input_ids"]).logits
    assert (a - b).abs().max().item() <= bound(ours.config, prompt["input_ids"].shape[1])
    card = (out / "README.md").read_text()
    for needle in ("tiny-cpu", trained.name, "steps | 2", "MuseSparkForConditionalGeneration.from_pretrained"):
        assert needle in card
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"]


def test_docs_snippet_loads_an_export(trained, tmp_path, cli):
    """The snippet docs/running.md gives for loading an export runs as written."""
    out = tmp_path / "export"
    assert cli("export", trained, "--hf", out)[0] == 0
    text = (ROOT / "docs" / "running.md").read_text()
    block = re.search(r"<!-- load-export -->\s*```python\n(.*?)```", text, re.S)
    assert block, "docs/running.md has no load-export snippet"
    exec(compile(block.group(1).replace("OUT", str(out)), "docs/running.md", "exec"), {})


def test_transformers_checkpoint_starts_a_run(tmp_path):
    from muse_stack.recipes.catalogue import load_recipe

    cfg = load_recipe("tiny-cpu").model_config_resolved()
    theirs = hf_model(cfg, dtype=torch.float32)
    theirs.save_pretrained(tmp_path / "base")
    outcome = run("tiny-cpu", out=tmp_path / "run", steps=1, progress=False,
                  pretrained_checkpoint=str(tmp_path / "base"),
                  overrides=["training.measure_warmup_steps=0", "batch.gbs=2"])
    assert outcome.status == "completed"


# ---- the megatron engine's names through transformers' layout ----------------------------------
def test_megatron_names_round_trip_through_transformers_layout():
    cfg = config(4)
    names = [n for n in hf_model(cfg, dtype=torch.float32).state_dict()
             if n.startswith(("model.language_model.", "lm_head."))]
    assert names
    for name in names:
        mcore = hf_to_mcore(name, cfg.num_local_experts)
        assert {mcore_to_hf(m).hf_name for m in mcore} == {name}
        dist = mcore[0] if len(mcore) == 1 else re.sub(r"(linear_fc[12]\.weight)\d+$", r"\1", mcore[0])
        dist = dist.replace("mlp.experts.linear_fc", "mlp.experts.experts.linear_fc")
        assert dist_key_to_hf(dist) == name


# ---- pad_token_id is the embedding's padding_idx -----------------------------------------------
def test_the_padding_row_gets_no_gradient_in_both_engines():
    cfg = config(4, pad_token_id=3)
    model = MuseSparkForCausalLM(cfg, seed=0)
    ids = torch.tensor([[3, 5, 3, 7, 8]])
    model(ids).logits.sum().backward()
    grad = model.language_model.embed_tokens.weight.grad
    assert grad[3].abs().sum() == 0 and grad[5].abs().sum() > 0
    weight = torch.nn.Parameter(torch.ones(4, 2))
    assert hold_padding_row(weight, 6, vocab_start=4, vocab_end=8)  # row 2 of this rank's part
    (weight * torch.arange(8.0).view(4, 2)).sum().backward()
    assert weight.grad[2].abs().sum() == 0 and weight.grad[1].abs().sum() > 0
    assert not hold_padding_row(torch.nn.Parameter(torch.ones(4, 2)), 1, vocab_start=4, vocab_end=8)
