"""LoRA and DoRA on the reference model: identity at B = 0, frozen base, exact gradients, the
DoRA decomposition, adapter checkpoints, merge, and the Hugging Face peft layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from muse_stack.util.errors import InputError, RecipeError
from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint
from muse_stack.models.muse_spark.peft import DoRA, adapter_modules, adapter_state_dict, apply_peft, is_adapter_key, merge_adapters
from muse_stack.models.muse_spark.peft_io import (export_adapters_hf_peft, export_merged, load_adapters, save_adapters,
                                      base_identity)
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.models.muse_spark.peft_config import ATTENTION_TARGETS, TARGETS, PeftSettings, resolve
from tiny_model import logits_tolerance, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
LORA_ALL = PeftSettings("lora", 4, 8.0, 0.0, TARGETS, True)
LORA_SHARED = PeftSettings("lora", 4, 8.0, 0.0, TARGETS, False)
DORA = PeftSettings("dora", 4, 8.0, 0.0, ATTENTION_TARGETS, False)
SCHEMES = pytest.mark.parametrize("settings", [LORA_ALL, LORA_SHARED, DORA], ids=["lora", "lora-shared", "dora"])


def adapted(settings: PeftSettings, *, dtype=torch.float32, layers: int = 4, trained: bool = True):
    model = MuseSparkForCausalLM(tiny_config(num_hidden_layers=layers), seed=0).to(dtype)
    apply_peft(model, settings, seed=1)
    if trained:  # B != 0 and m != ||W||, as after training, so that every adapter tensor matters
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for module in adapter_modules(model).values():
                module.lora_B.copy_(0.05 * torch.randn(module.lora_B.shape, generator=gen))
                if isinstance(module, DoRA):
                    module.lora_magnitude.mul_(1 + 0.1 * torch.randn(module.lora_magnitude.shape, generator=gen))
    return model


@SCHEMES
def test_before_training_the_adapted_model_computes_the_base_exactly(settings):
    base = MuseSparkForCausalLM(tiny_config(), seed=0)
    expected = base(IDS).logits
    model = adapted(settings, trained=False)
    # B = 0 adds an exact zero, and DoRA's m / ||W + 0|| is exactly 1: bit for bit the base
    assert torch.equal(model(IDS).logits, expected)
    assert all(is_adapter_key(n) for n, p in model.named_parameters() if p.requires_grad)
    assert sum(p.requires_grad for p in model.parameters()) == len(adapter_state_dict(model))


@SCHEMES
def test_one_step_changes_only_adapter_parameters(settings):
    model = adapted(settings, trained=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    labels = torch.roll(IDS, -1, dims=1)
    model(IDS, labels=labels).loss.backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    opt.step()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_adapter_key(k) for k in changed)
    # B starts at zero, so A has no gradient on the first step; every B moves
    assert {k for k in after if k.endswith("lora_B")} <= changed


def _fd_check(loss, params: dict[str, torch.nn.Parameter], gen: torch.Generator) -> None:
    """Each parameter's autograd gradient against central finite differences of ``loss``, float64."""
    for p in params.values():
        p.grad = None
    loss().backward()
    h = 1e-6
    for name, p in params.items():
        flat = p.detach().view(-1)
        for idx in torch.randint(0, flat.numel(), (4,), generator=gen).tolist():
            orig = flat[idx].item()
            with torch.no_grad():
                flat[idx] = orig + h
                up = loss().item()
                flat[idx] = orig - h
                down = loss().item()
                flat[idx] = orig
            fd = (up - down) / (2 * h)
            analytic = p.grad.view(-1)[idx].item()
            # Central differences in float64: truncation h^2 / 6 x |third derivative| ~ 1e-12 x O(1);
            # rounding u |L| / h with u = 2^-53 and |L| <= sum |probe x out| ~ 1e2: 1.1e-16 x 1e2 / 1e-6
            # ~ 1e-8. 1e-7 absolute plus 1e-7 relative covers both; a wrong or missing term is O(1e-2).
            assert abs(fd - analytic) <= 1e-7 + 1e-7 * abs(fd), (name, idx, fd, analytic)


@SCHEMES
def test_adapter_gradients_match_finite_differences_in_float64(settings):
    """The tiny model's adapted projections and expert GEMMs, in float64. (The whole decoder keeps
    its residual stream, norms and router in float32 by design, which would drown a float64
    difference quotient; the end-to-end wiring is checked against the base-weight gradient below.)"""
    model = adapted(settings, layers=1).double()
    gen = torch.Generator().manual_seed(7)
    layer = model.model.language_model.layers[0]
    with torch.no_grad():  # A away from its init too, so that B's gradient is generic
        for module in adapter_modules(model).values():
            module.lora_A.mul_(3.0)
    for target in settings.targets:
        if target.startswith("mlp.experts."):
            continue
        proj = layer.get_submodule(target)
        x = torch.randn(6, proj.in_features, dtype=torch.float64, generator=gen)
        probe = torch.randn(6, proj.out_features, dtype=torch.float64, generator=gen)
        _fd_check(lambda: (proj(x) * probe).sum(), dict(proj.adapter.named_parameters()), gen)
    if settings.expert_targets:
        experts = layer.mlp.experts
        x = torch.randn(5, experts.gate_up_proj.shape[2], dtype=torch.float64, generator=gen)
        probe = torch.randn(5, experts.down_proj.shape[1], dtype=torch.float64, generator=gen)

        def swiglu_experts():
            total = 0
            for e in (0, 3):  # two experts: per-expert adapters must get only their own expert's gradient
                gate, up = experts.project("gate_up_proj", e, x).split(experts.intermediate_size, dim=-1)
                total = total + (experts.project("down_proj", e, torch.nn.functional.silu(gate) * up) * probe).sum()
            return total

        _fd_check(swiglu_experts, dict(experts.adapters.named_parameters()), gen)
        if settings.per_expert:  # experts 0 and 3 only: every other expert's adapter has zero gradient
            grad = experts.adapters["gate_up_proj"].lora_B.grad
            assert grad[[1, 2, 4, 5, 6, 7]].abs().max() == 0 and grad[[0, 3]].abs().amax(dim=(1, 2)).min() > 0


@pytest.mark.parametrize("settings", [LORA_ALL, LORA_SHARED], ids=["lora", "lora-shared"])
def test_adapter_gradients_in_the_whole_model_follow_the_base_weight_gradient(settings):
    """y = (W + s B A) x, so dL/dB = s G A^T with G = dL/dW: the adapters are wired into every
    projection and expert of the decoder exactly as the base weight is."""
    model = adapted(settings, layers=2)
    for name, p in model.named_parameters():
        if not is_adapter_key(name) and (name.endswith("_proj.weight") or name.endswith("_proj")):
            p.requires_grad_(True)
    model(IDS, labels=torch.roll(IDS, -1, dims=1)).loss.backward()
    layer = model.model.language_model.layers[1]
    for target in settings.targets:
        if target.startswith("mlp.experts."):
            attr = target.rsplit(".", 1)[1]
            g = getattr(layer.mlp.experts, attr).grad.double()  # [E, out, in]
            ad = layer.mlp.experts.adapters[attr]
            want_b = ad.scaling * g @ ad.lora_A.detach().double().transpose(1, 2)
            if not settings.per_expert:
                want_b = want_b.sum(0, keepdim=True)
            got_b = ad.lora_B.grad.double()
        else:
            proj = layer.get_submodule(target)
            g = proj.weight.grad.double()
            want_b = proj.adapter.scaling * g @ proj.adapter.lora_A.detach().double().T
            got_b = proj.adapter.lora_B.grad.double()
        # both sides are float32 sums of the same per-token products in another order: relative
        # error n u with n = 18 tokens x 2 top-k ~ 40 terms, 40 x 6e-8 ~ 2.4e-6 of the gradient's
        # scale; 1e-4 of it leaves margin, while a mis-wired adapter is off by O(1) of it
        scale = want_b.abs().max().item()
        assert scale > 0, target
        torch.testing.assert_close(got_b, want_b, rtol=0, atol=1e-4 * scale)


def test_dora_is_magnitude_times_unit_direction():
    torch.manual_seed(0)
    model = adapted(DORA, dtype=torch.float64)
    proj = model.model.language_model.layers[0].self_attn.q_proj
    dora = proj.adapter
    x = torch.randn(5, proj.in_features, dtype=torch.float64)
    # direct computation of DoRA: W' = m * V / ||V||_row with V = W + (alpha / r) B A
    v = proj.weight + dora.alpha / dora.rank * dora.lora_B @ dora.lora_A
    direction = v / v.norm(dim=1, keepdim=True)
    w_direct = dora.lora_magnitude[:, None] * direction
    # float64: two matmuls over 32 and a norm, relative error a few x 32 x 2^-53 ~ 1e-14
    torch.testing.assert_close(proj(x), x @ w_direct.T, rtol=1e-12, atol=1e-12)
    merged = dora.merged(proj.weight)
    torch.testing.assert_close(merged, w_direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.norm(dim=1), dora.lora_magnitude.detach().double(), rtol=1e-12, atol=0)


@SCHEMES
def test_merged_weights_compute_what_the_adapted_model_computes(settings, tmp_path):
    model = adapted(settings)
    expected = model(IDS).logits
    plain = MuseSparkForCausalLM(tiny_config(), seed=None)
    plain.load_state_dict(merge_adapters(model), strict=True)
    tol = logits_tolerance(plain.config, IDS.shape[1])  # same math, (W + sBA) x vs W x + s B (A x): summation order
    torch.testing.assert_close(plain(IDS).logits, expected, rtol=0, atol=tol)
    export_merged(model, tmp_path / "merged")
    torch.testing.assert_close(load_checkpoint(tmp_path / "merged")(IDS).logits, expected, rtol=0, atol=tol)
    with pytest.raises(InputError):
        export_merged(model, tmp_path / "merged")  # never overwrites


@SCHEMES
def test_adapters_export_in_the_layout_hf_peft_loads(settings, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the base is local; peft must not look anything up
    peft = pytest.importorskip("peft")
    model = adapted(settings)
    expected = model(IDS).logits
    paths = export_adapters_hf_peft(model, tmp_path / "hf", settings)
    assert sorted(p.name for p in paths) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(MuseSparkForCausalLM(tiny_config(), seed=0), tmp_path / "hf")
    stored = load_file(tmp_path / "hf" / "adapter_model.safetensors")
    peft_state = peft.get_peft_model_state_dict(loaded)
    assert set(stored) == set(peft_state)  # every tensor found its module; nothing was left at its init
    for name, tensor in stored.items():
        assert torch.equal(peft_state[name], tensor), name
    # peft adds s B (A x) to W x as we do, or folds the experts' update into W first: summation order only
    tol = logits_tolerance(model.config, IDS.shape[1])
    torch.testing.assert_close(loaded(IDS).logits, expected, rtol=0, atol=tol)
    assert json.loads((tmp_path / "hf" / "adapter_config.json").read_text())["use_dora"] is (settings.scheme == "dora")


def test_adapter_checkpoint_holds_only_adapters_and_the_base_identity(tmp_path):
    model = adapted(LORA_ALL)
    identity = base_identity(model, path=None, revision=None, init_seed=0)
    save_adapters(model, tmp_path / "a", identity, LORA_ALL)
    stored = load_file(tmp_path / "a" / "adapters.safetensors")
    assert set(stored) == set(adapter_state_dict(model)) and all(is_adapter_key(k) for k in stored)
    meta = json.loads((tmp_path / "a" / "adapters.json").read_text())
    assert meta["base"] == identity and len(meta["base"]["sha256"]) == 64 and meta["peft"]["rank"] == 4
    fresh = adapted(LORA_ALL, trained=False)  # same base, adapters at their init
    load_adapters(fresh, tmp_path / "a")
    assert torch.equal(fresh(IDS).logits, model(IDS).logits)
    other = MuseSparkForCausalLM(tiny_config(), seed=5)  # another base
    apply_peft(other, LORA_ALL)
    with pytest.raises(InputError) as exc:
        load_adapters(other, tmp_path / "a")
    assert exc.value.field == "adapters.base"
    attention_only = MuseSparkForCausalLM(tiny_config(), seed=0)
    apply_peft(attention_only, DORA)
    with pytest.raises(InputError, match="do not match"):
        load_adapters(attention_only, tmp_path / "a")


def test_the_recipe_block_is_checked_and_unstated_values_are_filled_from_the_table():
    model = tiny_config()
    base = load_recipe("tiny-cpu", ["peft.scheme=lora"]).peft
    with pytest.raises(RecipeError) as exc:
        resolve(base, model)
    assert exc.value.field == "peft.targets"
    bad = load_recipe("tiny-cpu", ["peft.scheme=lora", "peft.targets=[self_attn.q_proj,mlp.shared_expert]"]).peft
    with pytest.raises(RecipeError) as exc:
        resolve(bad, model)
    assert exc.value.value == "mlp.shared_expert" and "mlp.shared_expert" in exc.value.message
    dora = load_recipe("lora-64", ["peft.scheme=dora"]).peft
    with pytest.raises(RecipeError) as exc:
        resolve(dora, model)
    assert exc.value.value == "mlp.experts.gate_up_proj"
    unstated = load_recipe("tiny-cpu", ["peft.scheme=lora", "peft.targets=[mlp.experts.down_proj]"]).peft
    with pytest.raises(RecipeError) as exc:
        resolve(unstated, model)
    assert exc.value.field == "peft.per_expert"
    ok = resolve(load_recipe("tiny-cpu", ["peft.scheme=dora", "peft.targets=[self_attn.q_proj]"]).peft, model)
    assert (ok.rank, ok.alpha, ok.dropout) == (32, 32.0, 0.0)
    assert ok.filled == ("peft.rank = 32", "peft.alpha = 32.0", "peft.dropout = 0.0")
    assert resolve(load_recipe("lora-64").peft, model).filled == ("peft.dropout = 0.0",)
