"""The megatron-core adapters' sharding and name mapping, on the CPU against the reference
adapters: TP column / row / duplicated splits, per-expert adapters under EP, PP stage offsets.

The GPU parity run (megatron-core + TE against the reference engine on an H200) has not been
made; these tests emulate the collectives with sums and concatenations over the shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from muse_stack.engines.mcore.peft import (MCORE_MODULES, attach_adapters, load_reference_adapters,
                                           mcore_to_reference, parallel_mode, reference_to_mcore,
                                           replicated_over_tp, shard_factor)
from muse_stack.models.muse_spark import MuseSparkForCausalLM
from muse_stack.models.muse_spark.peft import adapter_modules, adapter_state_dict, apply_peft
from muse_stack.models.muse_spark.peft_config import ATTENTION_TARGETS, EXPERT_TARGETS, TARGETS, PeftSettings
from tiny_model import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = PeftSettings("lora", 4, 8.0, 0.0, TARGETS, True)
DORA = PeftSettings("dora", 4, 8.0, 0.0, ATTENTION_TARGETS, False)
GEN = torch.Generator().manual_seed(11)


def reference(settings: PeftSettings) -> MuseSparkForCausalLM:
    model = MuseSparkForCausalLM(tiny_config(), seed=0).double()
    apply_peft(model, settings, seed=1)
    with torch.no_grad():
        for module in adapter_modules(model).values():
            module.lora_B.copy_(0.1 * torch.randn(module.lora_B.shape, generator=GEN, dtype=torch.float64))
            if hasattr(module, "lora_magnitude"):
                module.lora_magnitude.mul_(1.1)
    return model


# float64 throughout: the shards sum the same products in another order, error ~ n u |terms|
# with n <= 64 and u = 2^-53: below 1e-13 for these O(1) values
TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("target", [t for t in TARGETS if t not in EXPERT_TARGETS] + list(EXPERT_TARGETS))
def test_tp_shards_recombine_to_the_reference_update(target, tp):
    model = reference(LORA)
    layer = model.model.language_model.layers[1]
    if target in EXPERT_TARGETS:
        ad = layer.mlp.experts.adapters[target.rsplit(".", 1)[1]]
        a, b, scaling = ad.lora_A[2].detach(), ad.lora_B[2].detach(), ad.scaling  # expert 2
    else:
        ad = layer.get_submodule(target).adapter
        a, b, scaling = ad.lora_A.detach(), ad.lora_B.detach(), ad.scaling
    x = torch.randn(7, a.shape[1], generator=GEN, dtype=torch.float64)
    want = scaling * x @ a.T @ b.T
    mode = parallel_mode(target)
    shards = [(shard_factor(a, target, "lora_A", r, tp), shard_factor(b, target, "lora_B", r, tp)) for r in range(tp)]
    if mode == "column":  # whole input on every rank, each rank its output rows
        outs = [scaling * x @ ar.T @ br.T for ar, br in shards]
        if target == "mlp.experts.gate_up_proj":  # each rank holds [gate_r; up_r]
            halves = [o.chunk(2, dim=1) for o in outs]
            got = torch.cat([torch.cat([h[0] for h in halves], 1), torch.cat([h[1] for h in halves], 1)], 1)
        else:
            got = torch.cat(outs, dim=1)
        assert replicated_over_tp(target, "lora_A") and not replicated_over_tp(target, "lora_B")
    elif mode == "row":  # each rank its input columns; A x summed over the ranks (the reduce-scatter)
        xs = x.chunk(tp, dim=1)
        h = sum(xr @ ar.T for xr, (ar, _) in zip(xs, shards))
        got = scaling * h @ shards[0][1].T
        assert all(torch.equal(br, b) for _, br in shards)
        assert replicated_over_tp(target, "lora_B") and not replicated_over_tp(target, "lora_A")
    else:  # duplicated: the latent projections are whole on every rank
        assert all(torch.equal(ar, a) and torch.equal(br, b) for ar, br in shards)
        got = scaling * x @ shards[0][0].T @ shards[0][1].T
        assert replicated_over_tp(target, "lora_A") and replicated_over_tp(target, "lora_B")
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_replicated_factor_gets_the_whole_gradient_once_summed_over_tp(tp):
    """Why the replicated factor carries ``sequence_parallel``: each rank's gradient is a part,
    their all-reduced sum is the reference gradient."""
    model = reference(LORA)
    for target in ("self_attn.q_proj", "self_attn.o_proj"):
        ad = model.model.language_model.layers[0].get_submodule(target).adapter
        a, b, s = ad.lora_A.detach(), ad.lora_B.detach(), ad.scaling
        x = torch.randn(8, a.shape[1], generator=GEN, dtype=torch.float64)
        g = torch.randn(8, b.shape[0], generator=GEN, dtype=torch.float64)
        full = {"lora_A": s * (g @ b).T @ x, "lora_B": s * g.T @ (x @ a.T)}
        factor = "lora_A" if parallel_mode(target) == "column" else "lora_B"
        parts = []
        for r in range(tp):
            ar = shard_factor(a, target, "lora_A", r, tp).clone().requires_grad_(True)
            br = shard_factor(b, target, "lora_B", r, tp).clone().requires_grad_(True)
            if factor == "lora_A":  # column: all tokens, this rank's output rows
                out = s * x @ ar.T @ br.T
                (out * g.chunk(tp, dim=1)[r]).sum().backward()
                parts.append(ar.grad)
            else:  # row under sequence parallelism: B sees this rank's tokens only
                tokens = slice(r * 8 // tp, (r + 1) * 8 // tp)
                h = (x @ a.T)[tokens]
                (s * h @ br.T * g[tokens]).sum().backward()
                parts.append(br.grad)
        torch.testing.assert_close(sum(parts), full[factor], **TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_dora_row_norms_of_split_weights(tp):
    model = reference(DORA)
    for target in ("self_attn.q_proj", "self_attn.o_proj"):
        proj = model.model.language_model.layers[0].get_submodule(target)
        ad = proj.adapter
        w = proj.weight.detach()
        v = w + ad.scaling * ad.lora_B.detach() @ ad.lora_A.detach()
        want = v.norm(dim=1)
        mag = [shard_factor(ad.lora_magnitude.detach(), target, "lora_magnitude", r, tp) for r in range(tp)]
        if parallel_mode(target) == "column":  # local rows: local norms, magnitude split alike
            rows = v.chunk(tp, dim=0)
            torch.testing.assert_close(torch.cat([rr.norm(dim=1) for rr in rows]), want, **TOL)
            torch.testing.assert_close(torch.cat(mag), ad.lora_magnitude.detach(), rtol=0, atol=0)
        else:  # row parts: squared sums all-reduced over TP
            cols = w.chunk(tp, dim=1)
            squares = sum(((c + ad.scaling * ad.lora_B.detach() @ shard_factor(ad.lora_A.detach(), target,
                                                                               "lora_A", r, tp)) ** 2).sum(1)
                          for r, c in enumerate(cols))
            torch.testing.assert_close(squares.sqrt(), want, **TOL)
            assert all(torch.equal(m, ad.lora_magnitude.detach()) for m in mag)


def test_names_round_trip_over_pipeline_stages_and_expert_ranks():
    model = reference(LORA)
    cfg = model.config
    state = adapter_state_dict(model)
    for pp_offsets, ep in (((0,), 1), ((0, 2), 2), ((0, 1, 2, 3), 4)):
        local = cfg.num_local_experts // ep
        for key in state:
            layer = int(key.split(".layers.")[1].split(".")[0])
            offset = max(o for o in pp_offsets if o <= layer)
            for ep_rank in range(ep):
                names = reference_to_mcore(key, num_experts=cfg.num_local_experts, layer_offset=offset,
                                           expert_offset=ep_rank * local, local_experts=local)
                for i, name in enumerate(names):
                    back = mcore_to_reference(name, layer_offset=offset, expert_offset=ep_rank * local)
                    assert back.hf_name == key
                    if ".experts." in key:
                        assert back.expert == ep_rank * local + i and name.endswith(f"{back.factor}{i}")
                    else:
                        assert back.expert is None and len(names) == 1
    with pytest.raises(KeyError):
        mcore_to_reference("decoder.layers.0.mlp.router.adapter.lora_A")


# ---- the transform on stand-ins for the TE linears (TP 1; no megatron-core needed) ----------
class _Linear(nn.Module):
    """Stands in for a TE linear: returns (x W^T, bias None)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x):
        return F.linear(x, self.weight), None


class _Grouped(nn.Module):
    """Stands in for TE's grouped linear: ``weight{e}`` per local expert, tokens grouped by m_splits."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        for e, w in enumerate(weights):
            self.register_parameter(f"weight{e}", nn.Parameter(w.clone()))

    def forward(self, x, m_splits):
        parts = torch.split(x, list(m_splits), dim=0)
        return torch.cat([F.linear(p, getattr(self, f"weight{e}")) for e, p in enumerate(parts)]), None


def _stage(ref: MuseSparkForCausalLM, layers: range, ep_rank: int, ep: int) -> nn.Module:
    local = ref.config.num_local_experts // ep
    stage = nn.Module()
    stage.decoder = nn.Module()
    stage.decoder.layers = nn.ModuleList()
    for index in layers:
        src = ref.model.language_model.layers[index]
        layer = nn.Module()
        for target, path in MCORE_MODULES.items():
            parent = layer
            for part in path.split(".")[:-1]:
                if not hasattr(parent, part):
                    setattr(parent, part, nn.Module())
                parent = getattr(parent, part)
            if target in EXPERT_TARGETS:
                w = getattr(src.mlp.experts, target.rsplit(".", 1)[1]).detach()[ep_rank * local:(ep_rank + 1) * local]
                setattr(parent, path.rsplit(".", 1)[1], _Grouped(w))
            else:
                setattr(parent, path.rsplit(".", 1)[1], _Linear(src.get_submodule(target).weight.detach()))
        stage.decoder.layers.append(layer)
    return stage


@pytest.mark.parametrize("settings", [LORA, DORA], ids=["lora", "dora"])
@pytest.mark.parametrize("pp, ep", [(1, 1), (2, 2), (2, 4)])
def test_attached_adapters_compute_the_reference_on_every_stage_and_expert_rank(settings, pp, ep):
    ref = reference(settings)
    cfg = ref.config
    state = adapter_state_dict(ref)
    per_stage = cfg.num_hidden_layers // pp
    local = cfg.num_local_experts // ep
    for stage_index in range(pp):
        layers = range(stage_index * per_stage, (stage_index + 1) * per_stage)
        for ep_rank in range(ep):
            stage = _stage(ref, layers, ep_rank, ep)
            names = attach_adapters(stage, settings, cfg, tp_size=1, tp_group=None, sequence_parallel=False,
                                    ep_size=ep, etp_size=1)
            # only adapters train: these names are what the optimizer and DDP's buffers get
            assert names and all(".adapter." in n for n in names)
            assert {n for n, p in stage.named_parameters() if p.requires_grad} == set(names)
            copied = load_reference_adapters(stage, state, layer_offset=layers[0], expert_offset=ep_rank * local,
                                             tp_rank=0, tp_size=1)
            assert copied == len(names)
            for i, index in enumerate(layers):
                src, dst = ref.model.language_model.layers[index], stage.decoder.layers[i]
                for target in settings.targets:
                    module = dst.get_submodule(MCORE_MODULES[target])
                    if target in EXPERT_TARGETS:
                        attr = target.rsplit(".", 1)[1]
                        fan_in = getattr(src.mlp.experts, attr).shape[2]
                        splits = [3] * local
                        x = torch.randn(sum(splits), fan_in, generator=GEN, dtype=torch.float64)
                        got, _ = module(x, splits)
                        want = torch.cat([src.mlp.experts.project(attr, ep_rank * local + e, chunk)
                                          for e, chunk in enumerate(torch.split(x, splits))])
                    else:
                        proj = src.get_submodule(target)
                        x = torch.randn(5, proj.in_features, generator=GEN, dtype=torch.float64)
                        got, _ = module(x)
                        want = proj(x)
                    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("settings", [LORA, PeftSettings("lora", 4, 8.0, 0.0, TARGETS, False), DORA],
                         ids=["lora-per-expert", "lora-shared", "dora"])
def test_the_engine_starts_from_the_reference_engines_initial_adapters(settings):
    """The megatron engine's initial adapters are the reference's, value for value (A drawn on
    the CPU from the seed and the tensor's name, B zero): both engines start from one state."""
    from muse_stack.engines.mcore.peft import initial_adapters

    cfg = tiny_config()
    model = MuseSparkForCausalLM(cfg, seed=0)
    apply_peft(model, settings, seed=5)
    expected = {k: v for k, v in adapter_state_dict(model).items() if not k.endswith("lora_magnitude")}
    got = initial_adapters(settings, cfg, 5, range(cfg.num_hidden_layers))
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key].to(value.dtype), value), key
    # one pipeline stage's layers only
    stage = initial_adapters(settings, cfg, 5, range(1, 2))
    assert stage and all(".layers.1." in k for k in stage)
    assert all(torch.equal(stage[k], got[k]) for k in stage)


def test_te_dtype_check_sees_only_the_linears_own_parameters():
    """TE refuses a forward whose input dtype differs from any parameter under the module; DoRA's
    float32 magnitude beside bf16 weights must not trip it, and the adapter stays attached."""
    from muse_stack.engines.mcore.peft import _AdaptedLinear

    class TEish(nn.Module):  # TE's check, as TransformerEngineBaseModule.set_activation_dtype does it
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))

        def set_activation_dtype(self, inp):
            for name, p in self.named_parameters():
                if p.dtype != inp.dtype:
                    raise TypeError(f"{name}: {p.dtype} vs {inp.dtype}")

    plain = TEish()
    plain.adapter = nn.Module()
    plain.adapter.lora_magnitude = nn.Parameter(torch.ones(4))
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="lora_magnitude"):
        plain.set_activation_dtype(x)  # the check this guards against
    adapted = TEish()
    adapted.adapter = plain.adapter
    adapted.__class__ = type("AdaptedTEish", (_AdaptedLinear, TEish), {})
    adapted.set_activation_dtype(x)
    assert adapted.adapter is plain.adapter
    with pytest.raises(TypeError, match="weight"):  # TE's own parameters are still checked
        adapted.set_activation_dtype(x.float())
    assert "adapter.lora_magnitude" in dict(adapted.named_parameters())
