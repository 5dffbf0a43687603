"""Built rows in memory and on disk, and the rows sha256.

Rows sha256 (stable across machines, independent of the parquet encoding): one sha256 over, for
each row in order,

* the row's ``N`` token ids as little-endian int32 (``4N`` bytes), then
* the row's ``N`` loss-mask values as uint8 0/1 (``N`` bytes), then, for packed rows only,
* the number ``k`` of sequences in the row as little-endian int32, the ``k`` sequence lengths
  (tokens before alignment padding) and the ``k`` padded lengths, all little-endian int32.

The mask is per input token: 1 where that token is a supervised target (see
:mod:`muse_stack.data.chat`). Parquet columns: ``input_ids`` (fixed-size list of int32),
``loss_mask`` (fixed-size list of uint8), ``seq_lengths`` and ``seq_lengths_padded`` (lists of
int32; a fixed or synthetic row has one sequence, its non-padding length).

Image-text rows (:mod:`muse_stack.data.multimodal`) also hold, per row, the encoded bytes of its
images in the order of their placeholders (parquet column ``images``, list of binary) and their
(t, h, w) patch grids (``image_grid_thw``, 3 int32 per image). Their rows sha256 adds, after each
row's bytes above, the row's image count as little-endian int32 and, per image, its grid as 3
little-endian int32 and the 32-byte sha256 of its bytes; so the hash covers every image. Text
rows hash as before.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Rows:
    ids: np.ndarray  # [R, N] int32
    mask: np.ndarray  # [R, N] uint8
    seq_lengths: list[np.ndarray] = field(default_factory=list)  # per row, int32
    seq_lengths_padded: list[np.ndarray] = field(default_factory=list)
    packed: bool = False
    #: image-text rows only: per row, the encoded images and their [k, 3] int32 (t, h, w) grids
    images: list[list[bytes]] | None = None
    image_grids: list[np.ndarray] | None = None
    #: the image processor settings (:class:`muse_stack.data.images.ImageSpec`) collation makes pixels with
    image_spec: object | None = None

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def row_tokens(self) -> int:
        return int(self.ids.shape[1])


def row_bytes(ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray | None = None,
              padded: np.ndarray | None = None) -> bytes:
    out = ids.astype("<i4", copy=False).tobytes() + mask.astype("u1", copy=False).tobytes()
    if lengths is not None:
        out += np.asarray([len(lengths)], dtype="<i4").tobytes()
        out += np.asarray(lengths, dtype="<i4").tobytes() + np.asarray(padded, dtype="<i4").tobytes()
    return out


def media_bytes(images: list[bytes], grids: np.ndarray) -> bytes:
    grids = np.asarray(grids, dtype="<i4").reshape(-1, 3)
    out = np.asarray([len(images)], dtype="<i4").tobytes()
    for data, grid in zip(images, grids, strict=True):
        out += grid.tobytes() + hashlib.sha256(data).digest()
    return out


def rows_sha256(rows: Rows) -> str:
    h = hashlib.sha256()
    for r in range(rows.num_rows):
        if rows.packed:
            h.update(row_bytes(rows.ids[r], rows.mask[r], rows.seq_lengths[r], rows.seq_lengths_padded[r]))
        else:
            h.update(row_bytes(rows.ids[r], rows.mask[r]))
        if rows.images is not None:
            h.update(media_bytes(rows.images[r], rows.image_grids[r]))
    return h.hexdigest()


def _table(rows: Rows, lo: int, hi: int):
    import pyarrow as pa

    n = rows.row_tokens
    ids = pa.FixedSizeListArray.from_arrays(pa.array(rows.ids[lo:hi].reshape(-1), type=pa.int32()), n)
    mask = pa.FixedSizeListArray.from_arrays(pa.array(rows.mask[lo:hi].reshape(-1), type=pa.uint8()), n)
    lens = pa.array([x.tolist() for x in rows.seq_lengths[lo:hi]], type=pa.list_(pa.int32()))
    padded = pa.array([x.tolist() for x in rows.seq_lengths_padded[lo:hi]], type=pa.list_(pa.int32()))
    columns = {"input_ids": ids, "loss_mask": mask, "seq_lengths": lens, "seq_lengths_padded": padded}
    if rows.images is not None:
        columns["images"] = pa.array(rows.images[lo:hi], type=pa.list_(pa.binary()))
        columns["image_grid_thw"] = pa.array([np.asarray(g, np.int32).reshape(-1).tolist()
                                              for g in rows.image_grids[lo:hi]], type=pa.list_(pa.int32()))
    return pa.table(columns)


def write_parquet(rows: Rows, path: Path, chunk_rows: int = 256, on_chunk=None) -> None:
    """Write ``rows`` to ``path`` in row groups of ``chunk_rows``; ``on_chunk(rows_written)`` after each."""
    import pyarrow.parquet as pq

    schema = _table(rows, 0, 0).schema
    metadata = {b"muse_stack.packed": b"1" if rows.packed else b"0"}
    with pq.ParquetWriter(str(path), schema.with_metadata(metadata), compression="zstd") as writer:
        for lo in range(0, rows.num_rows, chunk_rows):
            hi = min(lo + chunk_rows, rows.num_rows)
            writer.write_table(_table(rows, lo, hi))
            if on_chunk is not None:
                on_chunk(hi)


def read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    packed = (table.schema.metadata or {}).get(b"muse_stack.packed") == b"1"
    ids_col = table.column("input_ids").combine_chunks()
    n = ids_col.type.list_size
    ids = ids_col.flatten().to_numpy().astype(np.int32).reshape(-1, n)
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(np.uint8).reshape(-1, n)
    lens = [np.asarray(x, dtype=np.int32) for x in table.column("seq_lengths").to_pylist()]
    padded = [np.asarray(x, dtype=np.int32) for x in table.column("seq_lengths_padded").to_pylist()]
    images = grids = None
    if "images" in table.column_names:
        images = [list(x) for x in table.column("images").to_pylist()]
        grids = [np.asarray(x, dtype=np.int32).reshape(-1, 3) for x in table.column("image_grid_thw").to_pylist()]
    return Rows(ids=ids, mask=mask, seq_lengths=lens, seq_lengths_padded=padded, packed=packed, images=images,
                image_grids=grids)
