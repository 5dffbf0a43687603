"""Gradients, freezing, the loss and its mask, and mixed precision."""

from __future__ import annotations

import pytest
import torch

from muse_stack.util.errors import RecipeError
from muse_stack.models.muse_spark import (
    IGNORE_INDEX,
    MuseSparkForCausalLM,
    causal_lm_loss,
    freeze,
    named_trainable_parameters,
    shift_labels,
    trainable_parameters,
    unfreeze,
)
from tiny_model import tiny_config



pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0) -> MuseSparkForCausalLM:
    return MuseSparkForCausalLM(tiny_config(), seed=seed)


def batch(seed: int = 0, rows: int = 4, length: int = 24):
    ids = torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(seed))
    labels, mask = shift_labels(ids)
    return ids, labels, mask


def test_every_trainable_parameter_gets_a_gradient():
    model = tiny_model()
    ids, labels, mask = batch()
    model(ids, labels=labels, loss_mask=mask).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    for layer in model.model.language_model.layers:
        bias = layer.mlp.gate.e_score_correction_bias
        assert not bias.requires_grad and bias.grad is None
    assert not any("e_score_correction_bias" in n for n, _ in model.named_parameters())
    assert "model.language_model.layers.0.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_frozen_modules_get_no_gradient():
    model = tiny_model()
    frozen = freeze(model, ["model.language_model.embed_tokens", "*.self_attn.*", "lm_head.weight"])
    assert "model.language_model.embed_tokens.weight" in frozen
    assert "model.language_model.layers.3.self_attn.gate_proj.weight" in frozen
    assert len(frozen) == 2 + 4 * 5
    trainable = dict(named_trainable_parameters(model))
    assert not set(frozen) & set(trainable)
    assert len(trainable_parameters(model)) == len(list(model.parameters())) - len(frozen)
    ids, labels, mask = batch()
    model(ids, labels=labels, loss_mask=mask).loss.backward()
    for name, param in model.named_parameters():
        if name in frozen:
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert unfreeze(model, "lm_head") == ["lm_head.weight"]
    assert model.lm_head.weight.requires_grad


def test_freeze_pattern_matching_nothing_is_an_error():
    with pytest.raises(RecipeError) as err:
        freeze(tiny_model(), ["model.vision_tower"])
    assert err.value.field == "freeze" and "model.vision_tower" in str(err.value)


def test_shift_convention():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1]])
    labels, label_mask = shift_labels(ids, mask)
    # position t predicts token t+1; the mask is that of the target token
    assert labels.tolist() == [[IGNORE_INDEX, 12, 13, IGNORE_INDEX, 15, IGNORE_INDEX]]
    assert label_mask.tolist() == [[False, True, True, False, True, False]]
    # packed: the last token of a sequence does not predict the first of the next
    labels, label_mask = shift_labels(ids, cu_seqlens=[0, 3, 6])
    assert label_mask.tolist() == [[True, True, False, True, True, False]]
    assert labels.tolist() == [[11, 12, IGNORE_INDEX, 14, 15, IGNORE_INDEX]]


def test_loss_is_mean_over_supervised_tokens_and_ignores_unsupervised_targets():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 1]])
    result = causal_lm_loss(logits, labels, mask)
    assert result.num_tokens.item() == 5
    nll = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(result.loss, nll[mask.bool()].mean())
    changed = torch.where(mask.bool(), labels, (labels + 3) % 11)
    torch.testing.assert_close(causal_lm_loss(logits, changed, mask).loss, result.loss)
    assert causal_lm_loss(logits, torch.where(mask.bool(), (labels + 3) % 11, labels), mask).loss != result.loss
    empty = causal_lm_loss(logits, labels, torch.zeros_like(mask))
    assert empty.num_tokens.item() == 0 and empty.loss.item() == 0.0


def test_model_loss_with_mask():
    model = tiny_model()
    ids, labels, _ = batch(rows=2, length=10)
    mask = torch.zeros_like(labels)
    mask[:, 4:8] = 1
    out = model(ids, labels=labels, loss_mask=mask)
    assert out.num_tokens.item() == 8
    other = torch.where(mask.bool(), labels, torch.zeros_like(labels))
    torch.testing.assert_close(model(ids, labels=other, loss_mask=mask).loss, out.loss)
    torch.testing.assert_close(out.loss, causal_lm_loss(out.logits, labels, mask).loss)


def test_bf16_autocast_runs_and_stays_close():
    model = tiny_model()
    ids, labels, mask = batch(rows=2, length=12)
    reference = model(ids, labels=labels, loss_mask=mask).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=labels, loss_mask=mask)
    assert out.logits.dtype == torch.float32
    assert abs(out.loss.item() - reference.item()) < 0.05
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    ids, labels, mask = batch(rows=4, length=16)
    losses = []
    for _ in range(15):
        loss = model(ids, labels=labels, loss_mask=mask).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
