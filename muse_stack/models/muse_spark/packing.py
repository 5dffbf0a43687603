"""Packed rows: sequence boundaries, per-sequence positions and attention masks.

A packed row holds several sequences back to back. Boundaries are given either as
``segment_ids`` ``[B, T]`` (tokens of one sequence share an id; a new contiguous run starts a
new sequence) or as ``cu_seqlens``, the cumulative sequence lengths:

* a 1-D tensor/list over the flattened ``B * T`` tokens (the flash-attention / THD
  convention; for ``B == 1`` it is just the row's cumulative lengths), starting at 0 and
  ending at ``B * T``; a row start is always a boundary too;
* or a list of ``B`` 1-D tensors/lists, one per row, each starting at 0 and ending at or
  before ``T`` (tokens after the last boundary form one trailing padding sequence).

Attention never crosses a boundary, and positions restart at 0 at each sequence start.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muse_stack.util.errors import InputError

CuSeqlens = torch.Tensor | Sequence[int] | Sequence[torch.Tensor | Sequence[int]]


def _as_long(values: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long, device=device).reshape(-1)


def _check_cumulative(cu: torch.Tensor, total: int, *, exact_end: bool, what: str) -> None:
    rule = "cumulative lengths start at 0, never decrease, and end at the token count"
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise InputError(f"{what} must start at 0 and hold at least two entries", field="cu_seqlens",
                         value=cu.tolist(), rule=rule, fix="pass [0, len1, len1 + len2, ...]")
    if bool((cu[1:] < cu[:-1]).any()):
        raise InputError(f"{what} decreases", field="cu_seqlens", value=cu.tolist(), rule=rule,
                         fix="pass cumulative sums of the sequence lengths")
    end = int(cu[-1])
    if (exact_end and end != total) or end > total:
        raise InputError(f"{what} ends at {end} but the tokens number {total}", field="cu_seqlens",
                         value=cu.tolist(), rule=rule, fix="make the last entry the number of tokens")


def segment_ids_from_cu_seqlens(cu_seqlens: CuSeqlens, batch: int, seq_len: int,
                                device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, T]`` segment ids (unique per sequence within a row) from cumulative lengths."""
    device = torch.device(device)
    per_row = (isinstance(cu_seqlens, Sequence) and len(cu_seqlens) > 0
               and not isinstance(cu_seqlens[0], int)
               and not (isinstance(cu_seqlens[0], torch.Tensor) and cu_seqlens[0].dim() == 0))
    positions = torch.arange(seq_len, device=device)
    if per_row:
        if len(cu_seqlens) != batch:
            raise InputError(f"per-row cu_seqlens has {len(cu_seqlens)} rows but the batch has {batch}",
                             field="cu_seqlens", value=len(cu_seqlens), fix="pass one cumulative-length list per row")
        rows = []
        for row, cu in enumerate(cu_seqlens):
            cu = _as_long(cu, device)
            _check_cumulative(cu, seq_len, exact_end=False, what=f"cu_seqlens of row {row}")
            # boundaries[i] = number of boundaries <= position: the segment index
            rows.append(torch.searchsorted(cu[1:], positions, right=True))
        return torch.stack(rows)
    cu = _as_long(cu_seqlens, device)
    total = batch * seq_len
    _check_cumulative(cu, total, exact_end=True, what="cu_seqlens")
    flat = torch.searchsorted(cu[1:], torch.arange(total, device=device), right=True)
    return flat.view(batch, seq_len)


def sequence_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, T]``: True where a new sequence starts (row start or a change of id)."""
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def position_ids_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each sequence start, ``[B, T]``."""
    batch, seq_len = segment_ids.shape
    index = torch.arange(seq_len, device=segment_ids.device).expand(batch, seq_len)
    start_index = torch.where(sequence_starts(segment_ids), index, torch.zeros_like(index))
    return index - torch.cummax(start_index, dim=1).values


def run_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """Ids of contiguous runs: two tokens share a run id iff they are in one sequence."""
    return torch.cumsum(sequence_starts(segment_ids).long(), dim=1)


def attention_mask(seq_len: int, *, window: int | None, runs: torch.Tensor | None,
                   device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Boolean mask (True = may attend) of shape ``[B or 1, 1, T, T]``.

    Causal; with ``window`` a query at index i sees keys i-window+1 .. i (``window`` keys
    counting itself); with ``runs`` only keys of the same sequence. Returns None when plain
    causal attention suffices (no window, no packing).
    """
    if window is None and runs is None:
        return None
    query = torch.arange(seq_len, device=device)[:, None]
    key = torch.arange(seq_len, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    allowed = allowed[None, None]
    if runs is not None:
        allowed = allowed & (runs[:, None, :, None] == runs[:, None, None, :])
    return allowed
