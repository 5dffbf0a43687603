"""The megatron engine's per-token loss: divided by the step's supervised tokens before the
backward, and megatron-core's after-the-fact division switched off (CPU: no megatron needed)."""

import torch

from muse_stack.engines.megatron import _finalize_prescaled, _per_token_loss


def test_loss_is_scaled_before_backward_and_reported_unscaled():
    per_token = torch.tensor([[0.5, 2.0, 0.0], [1.25, 0.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    loss, count, reported = _per_token_loss(mask, 1 / 8, per_token)
    loss.backward()
    assert int(count) == 4
    # 6.75 / 8 and a gradient of 1/8 on every entry: exact in binary floating point
    assert loss.item() == 6.75 / 8 and torch.equal(per_token.grad, torch.full((2, 3), 1 / 8))
    assert reported["lm loss"].tolist() == [6.75, 4.0]  # the sum and the count, for the step's mean


def test_finalize_drops_megatrons_token_count_and_passes_the_rest():
    calls = []

    def finalize(model, num_tokens, **kwargs):
        calls.append((model, num_tokens, kwargs))

    _finalize_prescaled(finalize, ["chunk"], torch.tensor(123), pg_collection="pg", force_all_reduce=False)
    assert calls == [(["chunk"], None, {"pg_collection": "pg", "force_all_reduce": False})]
