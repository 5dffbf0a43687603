"""Packing whole conversations into fixed-size sequences for THD attention.

Each conversation is padded to the alignment multiple (:func:`pack_alignment`), then the padded
lengths are packed by first-fit decreasing: conversations are taken longest first (ties in the
order given, which the builder makes a seeded permutation) and each goes into the first pack, in
creation order, with room for it; a new pack is opened when none has room. Packs never split a
conversation. A max-segment tree over the packs' free space finds the first fit in O(log packs).
"""

from __future__ import annotations

from collections.abc import Sequence

from muse_stack.util.errors import LayoutError
from muse_stack.recipes.layout import pack_alignment as layout_alignment
from muse_stack.recipes.schema import Batch, Layout


def pack_alignment(layout: Layout, batch: Batch | None = None) -> int:
    """The multiple each packed sequence is padded to.

    ``batch.pack_alignment`` when the recipe states it; otherwise, as Megatron-Bridge pads for
    context parallelism: ``lcm(2*CP, TP*CP)`` with sequence parallelism and CP > 1, ``2*CP`` with
    CP > 1, else 1.
    """
    if batch is not None and batch.pack_alignment:
        return int(batch.pack_alignment)
    return layout_alignment(layout)


def align_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _FirstFit:
    """Free space per pack in a max-segment tree; ``find(size)`` is the first pack with room."""

    def __init__(self, capacity: int, max_packs: int) -> None:
        self.capacity = capacity
        self.size = 1
        while self.size < max(1, max_packs):
            self.size *= 2
        self.tree = [0] * (2 * self.size)
        self.count = 0

    def _set(self, i: int, free: int) -> None:
        i += self.size
        self.tree[i] = free
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2

    def place(self, length: int) -> int:
        if self.tree[1] >= length:
            i = 1
            while i < self.size:
                i = 2 * i if self.tree[2 * i] >= length else 2 * i + 1
            pack = i - self.size
        else:
            pack = self.count
            self.count += 1
            self._set(pack, self.capacity)
        self._set(pack, self.tree[pack + self.size] - length)
        return pack


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into packs of total length <= ``capacity``.

    Every length must be in ``1..capacity``. Within a pack, indices are in placement order.
    """
    for n in lengths:
        if n < 1 or n > capacity:
            raise ValueError(f"length {n} does not fit a pack of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep the given order
    ff = _FirstFit(capacity, len(lengths))
    packs: list[list[int]] = []
    for i in order:
        p = ff.place(lengths[i])
        if p == len(packs):
            packs.append([])
        packs[p].append(i)
    return packs


def check_pack_size(size: int, alignment: int) -> None:
    if size % alignment:
        raise LayoutError("the pack size is not a multiple of the packing alignment", field="data.packed_size",
                          value=size, rule=f"each packed sequence is padded to a multiple of {alignment}",
                          fix=f"use a pack size divisible by {alignment}")
