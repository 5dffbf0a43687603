"""Token cross entropy over supervised tokens.

Shift convention: ``labels[b, t]`` is the token that position t predicts, i.e.
``input_ids[b, t + 1]``; the loss at position t is ``-log p(labels[b, t] | tokens <= t)``.
``loss_mask[b, t]`` belongs to that target token (1 = supervised, e.g. assistant tokens in
SFT). Labels equal to ``IGNORE_INDEX`` (-100) are never supervised. The loss is the mean
over supervised tokens (each token weighs the same, whichever row it sits in); the count
of supervised tokens comes back too, so callers can re-weight across micro-batches
(``loss * num_tokens`` is the token-summed loss).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from muse_stack.models.muse_spark.packing import CuSeqlens, segment_ids_from_cu_seqlens

IGNORE_INDEX = -100


class LossResult(NamedTuple):
    loss: torch.Tensor  #: scalar fp32 mean over supervised tokens (0 when there are none)
    num_tokens: torch.Tensor  #: scalar int64 count of supervised tokens


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> LossResult:
    """Mean cross entropy of ``logits`` [B, T, V] against already-shifted ``labels`` [B, T]."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape[:-1])}")
    mask = labels != IGNORE_INDEX
    if loss_mask is not None:
        mask = mask & loss_mask.to(torch.bool)
    safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), safe_labels.reshape(-1),
                                reduction="none").view(labels.shape)
    num_tokens = mask.sum()
    total = (per_token * mask).sum()
    return LossResult(total / num_tokens.clamp(min=1), num_tokens)


def shift_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None, *,
                 segment_ids: torch.Tensor | None = None,
                 cu_seqlens: CuSeqlens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and label mask from unshifted ``input_ids`` [B, T] and a per-token ``loss_mask``.

    ``labels[:, t] = input_ids[:, t + 1]`` and its mask is ``loss_mask[:, t + 1]`` (the mask of
    the target token). The last position of each row, and with packing the last token of each
    sequence (whose "next" token opens another sequence), are not supervised.
    """
    batch, seq_len = input_ids.shape
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    mask[:, :-1] = True if loss_mask is None else loss_mask[:, 1:].to(torch.bool)
    if cu_seqlens is not None and segment_ids is None:
        segment_ids = segment_ids_from_cu_seqlens(cu_seqlens, batch, seq_len, input_ids.device)
    if segment_ids is not None:
        mask[:, :-1] &= segment_ids[:, 1:] == segment_ids[:, :-1]
    labels = torch.where(mask, labels, torch.full_like(labels, IGNORE_INDEX))
    return labels, mask
