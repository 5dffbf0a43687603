"""The loss bound of the parity runs' training steps (lab.verify.parity.loss_bound): a logits difference bounds the
mean token loss difference, on any logits (CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.verify.parity import logits_deviation, loss_bound


def _loss(z: torch.Tensor, labels: torch.Tensor) -> float:
    return float(F.cross_entropy(z.reshape(-1, z.shape[-1]).double(), labels.reshape(-1), ignore_index=-100))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 3.0, 20.0]),
       noise=st.sampled_from([1e-4, 1e-2, 0.3, 3.0]))
def test_the_loss_difference_is_within_the_bound(seed, scale, noise):
    gen = torch.Generator().manual_seed(seed)
    z32 = torch.randn(1, 40, 97, generator=gen, dtype=torch.float64) * scale
    labels = torch.randint(0, 97, (1, 40), generator=gen)
    labels[0, ::7] = -100  # tokens without a loss
    zme = z32 + noise * torch.randn(z32.shape, generator=gen, dtype=torch.float64)
    dev = logits_deviation(zme, zme, z32, labels)
    bound = loss_bound(dev["token_loss_grad_rms"], dev["token_logits_diff_rms_megatron"])
    assert abs(_loss(zme, labels) - _loss(z32, labels)) <= bound * (1 + 1e-12)


def test_the_bound_is_tight_to_first_order():
    """Along the loss gradient itself Cauchy-Schwarz is an equality: the bound's first-order term is attained."""
    gen = torch.Generator().manual_seed(3)
    z32 = torch.randn(1, 30, 50, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 50, (1, 30), generator=gen)
    grad = torch.softmax(z32, dim=-1)
    grad.view(-1, 50)[torch.arange(30), labels.view(-1)] -= 1.0
    zme = z32 + 1e-6 * grad / grad.norm(dim=-1, keepdim=True)  # each token moved by 1e-6 along its gradient
    dev = logits_deviation(zme, zme, z32, labels)
    moved = _loss(zme, labels) - _loss(z32, labels)
    assert 0.99 < moved / loss_bound(dev["token_loss_grad_rms"], dev["token_logits_diff_rms_megatron"]) <= 1.0 + 1e-9
