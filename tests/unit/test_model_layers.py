"""Each architectural detail of the decoder, checked in isolation on a tiny fp32 model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_stack.models.muse_spark import MuseSparkForCausalLM, init_weights
from muse_stack.models.muse_spark.norms import rms_norm
from muse_stack.models.muse_spark.residual import GatedResidual, initial_gate_value, residual_gate_coefficients
from muse_stack.models.muse_spark.router import select_top_k
from tiny_model import attention_output_bound, fp32_sum_bound, tiny_config



pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def model() -> MuseSparkForCausalLM:
    return MuseSparkForCausalLM(tiny_config(), seed=0)


def lm(model):
    return model.model.language_model


#: the full-attention (and NoPE) layer of the 4-layer tiny model: transformers' default pattern
#: counts every 4th layer back from the last
FULL = 3


def attend(model, layer: int, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Output of one layer's attention on hidden input x [B, T, H]."""
    text = lm(model)
    ids = torch.zeros(x.shape[:2], dtype=torch.long)
    layout = text.layout(ids, position_ids=position_ids)
    attn = text.layers[layer].self_attn
    mask = layout.full_mask if attn.window is None else layout.sliding_mask
    return attn(x, cos=layout.cos, sin=layout.sin, mask=mask)


# ---- attention -----------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 8), seq_len=st.integers(2, 14), data=st.data())
def test_sliding_window_admits_exactly_w_keys(window, seq_len, data):
    model = MuseSparkForCausalLM(tiny_config(sliding_window=window), seed=window)
    query = data.draw(st.integers(0, seq_len - 1))
    x = torch.randn(1, seq_len, 32, generator=torch.Generator().manual_seed(seq_len))
    base = attend(model, 0, x)[0, query]
    for key in range(seq_len):
        bumped = x.clone()
        bumped[0, key] += 3.0
        changed = not torch.allclose(attend(model, 0, bumped)[0, query], base, atol=1e-6)
        visible = query - window < key <= query
        assert changed == visible, (key, query, window)


def test_full_attention_sees_every_earlier_key(model):
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(0))
    base = attend(model, FULL, x)[0, 9]
    for key in range(10):
        bumped = x.clone()
        bumped[0, key] += 3.0
        assert not torch.allclose(attend(model, FULL, bumped)[0, 9], base, atol=1e-6)


def test_nope_on_full_layers_rope_on_sliding_layers(model):
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, 8)
    scrambled = torch.tensor([[0, 3, 4, 9, 10, 20, 21, 40]]).expand(2, 8)
    # the full-attention layer: positions do not matter at all
    torch.testing.assert_close(attend(model, FULL, x, positions), attend(model, FULL, x, scrambled), rtol=0, atol=0)
    # sliding layer 0: non-uniform positions change the output ...
    assert not torch.allclose(attend(model, 0, x, positions), attend(model, 0, x, scrambled), atol=1e-4)
    # ... while a uniform shift does not (RoPE depends only on relative position). The angles p x f
    # are float32: at p <= 1007, f <= 1 each carries up to 1007 u of error, on q and on k, which
    # adds 2 x 1007 roundings to the layer's chain (tiny_model.attention_output_bound); seen 2.5e-7
    tol = attention_output_bound(lm(model).layers[0].self_attn, model.config, 8, extra_roundings=2 * 1007)
    torch.testing.assert_close(attend(model, 0, x, positions), attend(model, 0, x, positions + 1000),
                               rtol=0, atol=tol)
    assert tol < 0.01  # far below the ~0.17 the scrambled positions move the output


def test_qk_norm_is_weightless_per_head(model):
    names = [n for n, _ in model.named_parameters() if "self_attn" in n and "layers.0." in n]
    assert sorted(n.split("self_attn.")[1] for n in names) == sorted(
        f"{p}_proj.weight" for p in ("q", "k", "v", "gate", "o"))
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(2))
    attn = lm(model).layers[0].self_attn
    saved_q, saved_k = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    with torch.no_grad():  # large q/k so that eps (1e-5) is negligible against mean(q^2)
        attn.q_proj.weight.mul_(100.0)
        attn.k_proj.weight.mul_(100.0)
    try:
        base = attend(model, 0, x)
        with torch.no_grad():
            attn.q_proj.weight[8:16] *= 7.0  # one query head scaled: its rms removes the factor
            attn.k_proj.weight[:8] *= 0.2  # one kv head scaled
        # the per-head norms remove the factors up to rounding (eps is 1e-5 against mean(q^2) ~ 1e2,
        # a 1e-7 relative effect, below one rounding): the layer's float32 bound
        torch.testing.assert_close(attend(model, 0, x), base, rtol=0,
                                   atol=attention_output_bound(attn, model.config, 6, extra_roundings=2))
        with torch.no_grad():
            attn.q_proj.weight[8] *= 5.0  # one lane only: not a per-head scale, output changes
        assert not torch.allclose(attend(model, 0, x), base, atol=1e-4)
    finally:
        with torch.no_grad():
            attn.q_proj.weight.copy_(saved_q)
            attn.k_proj.weight.copy_(saved_k)


def test_softmax_scale_and_output_gate(model):
    """One query head against a direct formula: scale qk_scale_factor/sqrt(d), o = rms(o)*sigmoid(g)."""
    cfg = model.config
    attn = lm(model).layers[FULL].self_attn  # full attention, NoPE
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(3))
    q = rms_norm((x @ attn.q_proj.weight.T).view(1, 5, 4, 8), 1e-5)
    k = rms_norm((x @ attn.k_proj.weight.T).view(1, 5, 2, 8), 1e-5)
    v = (x @ attn.v_proj.weight.T).view(1, 5, 2, 8)
    g = (x @ attn.gate_proj.weight.T).view(1, 5, 4, 8)
    out = torch.zeros(1, 5, 4, 8)
    for t in range(5):
        for h in range(4):
            scores = torch.stack([q[0, t, h] @ k[0, u, h // 2] for u in range(t + 1)]) * cfg.qk_scale_factor / math.sqrt(8)
            out[0, t, h] = torch.softmax(scores, 0) @ v[0, : t + 1, h // 2]
    expected = (rms_norm(out, 1e-5) * torch.sigmoid(g)).reshape(1, 5, 32) @ attn.o_proj.weight.T
    # both sides are float32 with the same operations in other orders: each within the layer's
    # bound of the exact value, so within twice it of each other
    torch.testing.assert_close(attend(model, FULL, x), expected, rtol=0,
                               atol=2 * attention_output_bound(attn, cfg, 5))


# ---- norms, residual, embedding, output ------------------------------------------------------
def test_gated_residual_formula():
    res = GatedResidual(6, temperature=0.3)
    with torch.no_grad():
        res.gate.copy_(torch.tensor([-2.0, -0.3, 0.0, 0.3, 1.0, 5.0]))
    s, b = torch.randn(3, 6), torch.randn(3, 6)
    u = res.gate.detach() / 0.3
    beta = 1 / (1 + torch.exp(-u))
    alpha = torch.sqrt(torch.clamp((1 / (1 + torch.exp(u))) * (1 + beta), min=1e-3))
    torch.testing.assert_close(res(s, b), alpha * s + beta * b)
    # where the clamp is inactive alpha^2 + beta^2 = 1; the last channel (u = 16.7) hits the floor
    a, bt = residual_gate_coefficients(res.gate, 0.3)
    torch.testing.assert_close(a[:5] ** 2 + bt[:5] ** 2, torch.ones(5))
    assert a[5].item() == pytest.approx(math.sqrt(1e-3))


def test_residual_gate_initialisation(model):
    gate = lm(model).layers[2].post_feedforward_residual_gate.gate
    assert torch.all(gate == initial_gate_value(4, 0.3))
    alpha, beta = residual_gate_coefficients(gate, 0.3)
    torch.testing.assert_close(beta, torch.full((32,), 1 / math.sqrt(8)))
    torch.testing.assert_close(alpha**2 + beta**2, torch.ones(32))


def test_embedding_norm_is_parameter_free(model):
    text = lm(model)
    ids = torch.tensor([[3, 5, 7]])
    torch.testing.assert_close(text.embed(ids), rms_norm(text.embed_tokens.weight[ids], 1e-5))
    assert [n for n, _ in text.named_parameters() if not n.startswith("layers.")] == ["embed_tokens.weight",
                                                                                     "norm.weight"]
    saved = text.embed_tokens.weight[5].detach().clone()
    with torch.no_grad():
        text.embed_tokens.weight[5] = torch.randn(32)  # unit scale: eps negligible
    try:
        before = text.embed(ids)
        with torch.no_grad():
            text.embed_tokens.weight[5] *= 4.0
        # rms_norm(4e) / rms_norm(e) = sqrt((m + eps) / (m + eps / 16)), m = mean(e^2): a relative
        # change of at most eps / (2 m); plus the norm's own rounding, H + 2 roundings on each side
        m = (text.embed_tokens.weight[5] ** 2).mean().item() / 16
        rel = 1e-5 / (2 * m) + 2 * fp32_sum_bound(32 + 2, 1.0)
        torch.testing.assert_close(text.embed(ids), before, rtol=rel, atol=0)
    finally:
        with torch.no_grad():
            text.embed_tokens.weight[5] = saved


def test_pre_norm_gain_is_centred(model):
    norm = lm(model).layers[0].input_layernorm
    x = torch.randn(4, 32)
    assert torch.all(norm.weight == 0)
    torch.testing.assert_close(norm(x), rms_norm(x, 1e-5))


def test_final_norm_uses_stored_weight(model):
    text = lm(model)
    assert torch.all(text.norm.weight == 1)
    s = torch.randn(2, 32)
    with torch.no_grad():
        text.norm.weight.fill_(2.0)
    try:
        torch.testing.assert_close(text.norm(s), 2.0 * rms_norm(s, 1e-5))  # not 3x
    finally:
        with torch.no_grad():
            text.norm.weight.fill_(1.0)


def test_softcap_bounds_logits():
    model = MuseSparkForCausalLM(tiny_config(), seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)
    logits = model(torch.randint(0, 97, (2, 6))).logits
    assert logits.abs().max() < 20.0
    assert logits.abs().max() > 19.0  # near saturation, so the cap is what bounds them
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)
    assert model(torch.randint(0, 97, (2, 6))).logits.abs().max() <= 20.0
    hidden = lm(model)(torch.randint(0, 97, (1, 3)))
    raw = hidden @ model.lm_head.weight.T
    torch.testing.assert_close(model.logits_from_hidden(hidden), 20 * torch.tanh(raw * 2**-2.5 / 20))


# ---- router and experts ----------------------------------------------------------------------
def test_router_bias_selects_but_does_not_weigh(model):
    router = lm(model).layers[0].mlp.gate
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    plain = router(x)
    scores = torch.sigmoid((x @ router.weight.T) * 2**-2.5)
    torch.testing.assert_close(plain.scores, scores)
    with torch.no_grad():
        router.e_score_correction_bias[6] = 10.0
    try:
        biased = router(x)
    finally:
        with torch.no_grad():
            router.e_score_correction_bias.zero_()
    assert torch.all((biased.indices == 6).any(dim=-1))  # the bias forces expert 6 in
    assert not torch.equal(biased.indices, plain.indices)
    picked = scores.gather(-1, biased.indices)
    torch.testing.assert_close(biased.weights, picked / (picked.sum(-1, keepdim=True) + 1e-15))
    assert biased.weights.dtype == torch.float32


def test_router_ties_go_to_lowest_index(model):
    router = lm(model).layers[0].mlp.gate
    saved = router.weight.detach().clone()
    with torch.no_grad():
        router.weight.zero_()  # every score is sigmoid(0): all tied
    try:
        routing = router(torch.randn(5, 32))
        assert routing.indices.tolist() == [[0, 1]] * 5
        torch.testing.assert_close(routing.weights, torch.full((5, 2), 0.5))
        with torch.no_grad():
            router.e_score_correction_bias[[3, 5]] = 0.25
        assert router(torch.randn(2, 32)).indices.tolist() == [[3, 5]] * 2
    finally:
        with torch.no_grad():
            router.weight.copy_(saved)
            router.e_score_correction_bias.zero_()
    assert select_top_k(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 3).tolist() == [[1, 2, 4]]


def test_router_stays_fp32_in_bf16_model():
    model = MuseSparkForCausalLM(tiny_config(), seed=0).to(torch.bfloat16)
    mlp = lm(model).layers[0].mlp
    assert mlp.gate.weight.dtype == torch.float32
    assert mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert mlp.experts.gate_up_proj.dtype == torch.bfloat16
    logits = model(torch.randint(0, 97, (1, 5))).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_expert_swiglu_and_post_expert_norm_order(model):
    experts = lm(model).layers[0].mlp.experts
    with torch.no_grad():
        experts.post_expert_norm.weight.copy_(torch.linspace(-0.5, 0.5, 16))
    try:
        h = torch.randn(3, 16)
        gu = h @ experts.gate_up_proj[2].T
        y = (torch.nn.functional.silu(gu[:, :16]) * gu[:, 16:]) @ experts.down_proj[2].T
        gain = 1 + experts.post_expert_norm.weight
        torch.testing.assert_close(experts.expert(2, h), rms_norm(y * gain, 1e-8))  # gain, then rms
        assert not torch.allclose(experts.expert(2, h), rms_norm(y, 1e-8) * gain, atol=1e-3)
    finally:
        with torch.no_grad():
            experts.post_expert_norm.weight.zero_()


def test_moe_mixture_equals_per_token_sum(model):
    mlp = lm(model).layers[3].mlp
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(6))
    out = mlp(x)
    flat = x.reshape(-1, 32)
    routing = mlp.gate(flat)
    h = mlp.pre_expert_norm(flat @ mlp.pre_expert_proj.weight.T)
    rows = []
    for t in range(flat.shape[0]):
        m = sum(routing.weights[t, j] * mlp.experts.expert(int(routing.indices[t, j]), h[t:t + 1])[0] for j in range(2))
        rows.append(m @ mlp.post_expert_proj.weight.T)
    # the same float32 operations batched against one token at a time: each side within n u S of
    # the exact value, n = the MoE's rounding chain (router and latent projection over H, the expert
    # norms and projections over Hm and I, the top-k sum, the output projection over Hm), S the
    # output projection's sum of |terms|
    cfg = model.config
    n = 2 * cfg.hidden_size + 4 * cfg.moe_hidden_size + cfg.moe_intermediate_size + cfg.num_experts_per_tok
    w = mlp.post_expert_proj.weight.detach().abs()
    s = max((m.detach().abs() @ w.T).max().item() for m in
            [sum(routing.weights[t, j].abs() * mlp.experts.expert(int(routing.indices[t, j]), h[t:t + 1])[0].abs()
                 for j in range(2)) for t in range(flat.shape[0])])
    torch.testing.assert_close(out.reshape(-1, 32), torch.stack(rows), rtol=0, atol=2 * fp32_sum_bound(n, s))


# ---- initialisation --------------------------------------------------------------------------
def test_initialisation_is_deterministic():
    a = MuseSparkForCausalLM(tiny_config(), seed=11).state_dict()
    b = MuseSparkForCausalLM(tiny_config(), seed=11).state_dict()
    c = MuseSparkForCausalLM(tiny_config(), seed=12).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    std = a["model.language_model.layers.0.mlp.experts.gate_up_proj"].std().item()
    assert 0.015 < std < 0.025
    # a tensor's value depends on its name and the seed, not on the depth of the model
    deeper = MuseSparkForCausalLM(tiny_config(num_hidden_layers=6), seed=11).state_dict()
    key = "model.language_model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(a[key], deeper[key])
    model = MuseSparkForCausalLM(tiny_config(), seed=None)
    init_weights(model, 11)
    assert torch.equal(model.state_dict()[key], a[key])
