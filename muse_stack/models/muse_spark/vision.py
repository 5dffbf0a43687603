"""Muse Spark's vision tower (transformers' ``MuseSparkVisionModel``), written from the math.

Module tree (parameter names are transformers', relative to ``model.vision_tower``)::

    MuseSparkVisionModel
      patch_embedder.patch_embedding.weight        [D, T*3*P*P]   no bias
      patch_embedder.position_embedding_table.weight  [S*S, D]    learned S x S grid (S = pos_emb_height)
      ln_pre.{weight,bias}                         [D]
      layers.{l}.norm1.{weight,bias}               [D]            LayerNorm, eps 1e-5
      layers.{l}.attn.{q,k,v}_proj.{weight,bias}   [D, D], [D]
      layers.{l}.attn.proj.{weight,bias}           [D, D], [D]
      layers.{l}.norm2.{weight,bias}               [D]
      layers.{l}.mlp.fc1.{weight,bias}             [I, D], [I]    exact GELU between
      layers.{l}.mlp.fc2.{weight,bias}             [D, I], [D]
      ln_post.{weight,bias}                        [D]

Input: ``pixel_values`` [N, T*3*P*P], one row per patch, frames of each image or video in order
and patches in raster order within a frame, as transformers' image and video processors lay
them out (each row is (temporal, channel, row, column)); ``grid_thw`` [num_media, 3] gives
(t, h, w) in patches for each. Output: [N / m^2, D * m^2] with m = merge_size.

The forward, per frame of h x w patches:

1. ``x = patch_embedding(p) + pos``, where ``pos`` is the S x S table resampled bilinearly
   (``align_corners=False``, zero padding outside the table: ``F.grid_sample``) to a grid of w
   rows and h columns, read in the patches' raster order. For a square grid that is the table
   resampled to h x w; for a non-square one it is the reference's layout, a (w, h) grid read
   row by row, which transformers reproduces (its patch embedder swaps h and w).
2. ``x = ln_pre(x)``.
3. Pre-LN blocks ``x += attn(norm1(x)); x += mlp(norm2(x))``. Attention is bidirectional,
   with 2D axial RoPE and one of two scopes: ``full_attention`` layers attend within the frame;
   ``window_attention`` layers within S x S-patch windows tiled from the frame's top-left corner
   (the last row and column of windows may be partial).
4. ``x = ln_post(x)``, then the pixel shuffle: each m x m block of patches becomes one token of
   width D*m^2 whose channel ``d * m^2 + k`` is channel d of the block's patch k (k = row * m +
   column within the block); tokens in block raster order.

RoPE: the head is split into rotate-half pairs (j, j + head_dim/2). The first head_dim/4 pairs
rotate by ``(col + 1) * f_j``, the next head_dim/4 by ``(row + 1) * f_j``, with
``f_j = theta^(-4j / head_dim)``: transformers' axial layout, positions counted from 1 as in
the reference.

Numerics: activations in fp32, or float64 when the weights are float64; matmuls in the weights'
dtype, the attention's two (scores and weighted values) included: with bf16 weights q, k and v
enter the attention in bf16 (a fused kernel), and its output returns to fp32. An engine may set
the activations to the weights' dtype instead (``MuseSparkVisionModel.activations_dtype``: the megatron
engine's ``engine_options.towers_bf16_activations``), as transformers runs the tower in bf16: the
residual stream, the norms' and the GELU's outputs and the residual adds in bf16 (LayerNorm and GELU
compute in fp32 inside their kernels and round their output), no cast around any GEMM; RoPE stays in
fp32 (the tables are fp32 whatever the activations, so q and k are promoted, rotated and rounded back,
as transformers' ``apply_rotary_pos_emb_vision`` does).

Attention groups (frames, windows) are found once per forward (:func:`attention_groups`) and
grouped by size, so each layer runs one attention call per distinct group size (a few per image
shape: whole windows, and the partial ones of the last row and column), not one per group.
An engine may instead run each layer's attention as one variable-length call
(``MuseSparkVisionModel.attention = "varlen"``: the megatron engine's
``engine_options.towers_varlen_attention``): the blocks then run on the patches in window order (each frame
whole, and within it each window's patches together, in raster order, as transformers orders them), where every
frame and every window is a contiguous run of rows, so a layer attends over their cumulative lengths
(:class:`Segments`) with PyTorch's ``varlen_attn`` and gathers nothing; the patches return to their order
before ``ln_post``. The function is the same; only the kernels differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from muse_stack.models.muse_spark.tower_config import VISION_BLOCK_NORM_EPS, VisionConfig


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of activations: float64 stays float64, anything else computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with ``x`` cast to the weight's dtype (the autocast dtype under autocast)."""
    if not torch.is_autocast_enabled(x.device.type):
        x = x.to(layer.weight.dtype)
    return F.linear(x, layer.weight, layer.bias)


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm in ``x``'s dtype (fp32 or float64)."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.bias.to(x.dtype), norm.eps)


def patch_coordinates(grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every patch row of ``pixel_values``: (frame, row, col). ``frame`` numbers the frames of
    all media in order, so that it identifies a frame globally."""
    frames, rows, cols = [], [], []
    frame_base = 0
    for t, h, w in grid_thw.tolist():
        r = torch.arange(h, device=device).repeat_interleave(w)
        c = torch.arange(w, device=device).repeat(h)
        frames.append(torch.arange(frame_base, frame_base + t, device=device).repeat_interleave(h * w))
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
        frame_base += t
    return torch.cat(frames), torch.cat(rows), torch.cat(cols)


def axial_rope_cos_sin(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] of the 2D axial RoPE (see the module docstring)."""
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, dtype=torch.float64, device=rows.device) * 4 / head_dim)
    col_angles = (cols.to(torch.float64) + 1)[:, None] * inv_freq
    row_angles = (rows.to(torch.float64) + 1)[:, None] * inv_freq
    angles = torch.cat([col_angles, row_angles, col_angles, row_angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def attention_groups(group: torch.Tensor) -> list[torch.Tensor]:
    """The patches of each attention group (``group`` [N]: each patch's frame or window id), as
    [n, s] index tensors, one per distinct group size s, each row one group's patches in their
    order. Every patch is in exactly one row."""
    order = torch.argsort(group, stable=True)
    sizes = torch.unique_consecutive(group[order], return_counts=True)[1].tolist()
    by_size: dict[int, list[torch.Tensor]] = {}
    for idx in torch.split(order, sizes):
        by_size.setdefault(idx.numel(), []).append(idx)
    return [torch.stack(rows) for rows in by_size.values()]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---- the elementwise work between the GEMMs, as four chains ----------------------------------------------------
# A block's forward as written above casts the normed activations to the GEMM dtype once per projection, returns
# every GEMM output to the wide dtype and back, and runs RoPE, GELU and the residual adds as separate kernels. With
# chains (``MuseSparkVisionEncoderLayer.chains``, set by an engine: the megatron engine's
# ``engine_options.compile_towers`` compiles each with torch.compile) a block computes the same values: v and the
# GEMM outputs stay in the GEMM dtype (the round trips are exact), and each norm with its casts, RoPE, GELU and each
# residual add reads and writes the activations once when compiled.


def chain_normed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, out_dtype: torch.dtype,
                 copies: int) -> tuple[torch.Tensor, ...]:
    """LayerNorm of ``x`` in its dtype (as :func:`layer_norm`), handed to each of ``copies`` GEMMs in ``out_dtype``:
    one cast per GEMM, as the written block makes, so that the GEMMs' input gradients are summed in ``x``'s dtype."""
    normed = F.layer_norm(x, (x.shape[-1],), weight.to(x.dtype), bias.to(x.dtype), eps)
    return tuple(normed.to(out_dtype) for _ in range(copies))


def chain_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wide: torch.dtype,
               out_dtype: torch.dtype) -> torch.Tensor:
    """2D RoPE of ``t`` [N, heads, head_dim] in ``wide``, handed to the attention in ``out_dtype``."""
    t = t.to(wide)
    return (t * cos[:, None] + rotate_half(t) * sin[:, None]).to(out_dtype)


def chain_gelu(h: torch.Tensor, wide: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """The exact GELU of ``h`` in ``wide``, handed to the second GEMM in ``out_dtype``."""
    return F.gelu(h.to(wide)).to(out_dtype)


def chain_residual(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``x + branch`` in ``x``'s dtype."""
    return x + branch.to(x.dtype)


class VisionChains(NamedTuple):
    """The four chains a block runs between its GEMMs (each a function of tensors, dtypes and floats)."""

    normed: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]
    gelu: Callable[..., torch.Tensor]
    residual: Callable[..., torch.Tensor]


#: the chains as plain PyTorch (each op its own kernel)
EAGER_CHAINS = VisionChains(chain_normed, chain_rope, chain_gelu, chain_residual)


def resampled_position_table(table: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[height * width, D]: the S x S table [S*S, D] resampled bilinearly to ``height`` rows and
    ``width`` columns (pixel centres, ``align_corners=False``; samples outside the table read 0),
    in raster order."""
    side = int(round(table.shape[0] ** 0.5))
    grid = table.T.reshape(1, table.shape[1], side, side)  # [1, D, S rows, S cols]
    # normalised sample coordinates of output pixel centres: (2i + 1) / n - 1
    ys = (2 * torch.arange(height, dtype=table.dtype, device=table.device) + 1) / height - 1
    xs = (2 * torch.arange(width, dtype=table.dtype, device=table.device) + 1) / width - 1
    sample = torch.stack(torch.broadcast_tensors(xs[None, :], ys[:, None]), dim=-1)  # [height, width, (x, y)]
    out = F.grid_sample(grid, sample[None], mode="bilinear", padding_mode="zeros", align_corners=False)
    return out[0].reshape(table.shape[1], height * width).T


def pixel_shuffle(x: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[N, D] patches -> [N / m^2, D * m^2] tokens: each m x m block of a frame becomes one token,
    channel ``d * m^2 + k`` holding channel d of the block's patch k (row-major in the block)."""
    out, start = [], 0
    for t, h, w in grid_thw.tolist():
        n = t * h * w
        block = x[start:start + n].reshape(t, h // merge, merge, w // merge, merge, x.shape[-1])
        # -> [t, block row, block col, channel, row in block, col in block]
        block = block.permute(0, 1, 3, 5, 2, 4)
        out.append(block.reshape(t * (h // merge) * (w // merge), x.shape[-1] * merge * merge))
        start += n
    return torch.cat(out)


class MuseSparkVisionPatchEmbedder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        self.position_embedding_table = nn.Embedding(config.pos_emb_height * config.pos_emb_width, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """The patches' embeddings in ``dtype`` (None: :func:`wide_dtype` of the GEMM's)."""
        embeds = dense(self.patch_embedding, pixel_values)
        embeds = embeds.to(dtype or wide_dtype(embeds.dtype))
        table = self.position_embedding_table.weight.to(embeds.dtype)
        # per frame: a (w rows, h cols) resampling read in the (h, w) patches' raster order
        pos = torch.cat([resampled_position_table(table, w, h).repeat(t, 1) for t, h, w in grid_thw.tolist()])
        return embeds + pos


class Segments(NamedTuple):
    """Contiguous attention groups of rows: ``cu_seqlens`` [groups + 1] (int32, their cumulative lengths) and
    the longest one's length."""

    cu_seqlens: torch.Tensor
    max_len: int


def segments(group: torch.Tensor) -> Segments:
    """The :class:`Segments` of ``group`` [N] (each row's group id), whose equal ids are contiguous."""
    counts = torch.unique_consecutive(group, return_counts=True)[1]
    cu = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    return Segments(cu, int(counts.max()))


def varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """PyTorch's variable-length attention (``torch.nn.attention.varlen.varlen_attn``, CUDA), None where this torch
    has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def attend_per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                       max_q: int, max_k: int) -> torch.Tensor:
    """``varlen_attn``'s function where its kernel does not run (a CPU): one attention call per segment."""
    bounds = cu_q.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    parts = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in seg)).transpose(0, 1)
             for seg in zip(*(torch.split(t, lengths) for t in (q, k, v)))]
    return torch.cat(parts)


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Bidirectional attention of ``q``, ``k``, ``v`` [N, heads, head_dim] within each contiguous segment, in one
    variable-length call on a GPU (:func:`varlen_kernel`), per segment elsewhere."""
    kernel = varlen_kernel() if q.is_cuda else None
    return (kernel or attend_per_segment)(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor] | Segments) -> torch.Tensor:
    """The attention of a layer within its groups: :func:`attend_segments` for :class:`Segments`, else
    :func:`attend_groups`."""
    return attend_segments(q, k, v, groups) if isinstance(groups, Segments) else attend_groups(q, k, v, groups)


def attend_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
    """Bidirectional attention of ``q``, ``k``, ``v`` [N, heads, head_dim] within each group of patches
    (:func:`attention_groups`: one call per group size), in ``q``'s dtype."""
    out = torch.empty_like(q)
    for idx in groups:  # [groups of this size, patches of each]
        qg, kg, vg = (t[idx].transpose(1, 2) for t in (q, k, v))  # [groups, heads, patches, head_dim]
        attended = F.scaled_dot_product_attention(qg, kg, vg).transpose(1, 2)
        out[idx.reshape(-1)] = attended.reshape(-1, *q.shape[1:]).to(out.dtype)
    return out


class MuseSparkVisionAttention(nn.Module):
    """Bidirectional multi-head attention with biases and 2D RoPE, within groups of patches."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[torch.Tensor] | Segments) -> torch.Tensor:
        """``x`` [N, D] (normed); each patch attends to the patches of its own group (its frame, or
        its window within the frame): ``groups`` as :func:`attention_groups` makes them, or the :class:`Segments`
        of rows in window order."""
        n = x.shape[0]
        dtype = x.dtype
        q, k, v = (dense(p, x).to(dtype).view(n, self.num_heads, self.head_dim) for p in
                   (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        if not torch.is_autocast_enabled(x.device.type):  # the attention's matmuls in the weights' dtype
            q, k, v = (t.to(self.q_proj.weight.dtype) for t in (q, k, v))
        return dense(self.proj, attend(q, k, v, groups).reshape(n, -1)).to(dtype)

    def forward_chained(self, h: tuple[torch.Tensor, ...], *, cos: torch.Tensor, sin: torch.Tensor,
                        groups: list[torch.Tensor] | Segments, chains: VisionChains,
                        wide: torch.dtype) -> torch.Tensor:
        """:meth:`forward` of ``h``, the normed input already in the GEMM dtype once for each of q, k and v, with
        RoPE as ``chains.rope``; returns the projection's output in the GEMM dtype."""
        n, gemm = h[0].shape[0], h[0].dtype
        q, k, v = (F.linear(x, p.weight, p.bias).view(n, self.num_heads, self.head_dim) for x, p in
                   zip(h, (self.q_proj, self.k_proj, self.v_proj), strict=True))
        q, k = chains.rope(q, cos, sin, wide, gemm), chains.rope(k, cos, sin, wide, gemm)
        return F.linear(attend(q, k, v, groups).reshape(n, -1), self.proj.weight, self.proj.bias)


class MuseSparkVisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(self.fc2, F.gelu(dense(self.fc1, x).to(x.dtype))).to(x.dtype)

    def forward_chained(self, h: torch.Tensor, *, chains: VisionChains, wide: torch.dtype) -> torch.Tensor:
        """:meth:`forward` of ``h``, the normed input already in the GEMM dtype, with the GELU as ``chains.gelu``;
        returns the second GEMM's output in the GEMM dtype."""
        return F.linear(chains.gelu(F.linear(h, self.fc1.weight, self.fc1.bias), wide, h.dtype), self.fc2.weight,
                        self.fc2.bias)


class MuseSparkVisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=VISION_BLOCK_NORM_EPS)
        self.attn = MuseSparkVisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=VISION_BLOCK_NORM_EPS)
        self.mlp = MuseSparkVisionMLP(config)
        #: the elementwise chains between the GEMMs (:class:`VisionChains`), an engine's setting; None: the block
        #: as written, op by op. Not under autocast (there the autocast dtype, not the weights', rules the GEMMs)
        self.chains: VisionChains | None = None

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                frames: list[torch.Tensor] | Segments, windows: list[torch.Tensor] | Segments) -> torch.Tensor:
        """``frames`` and ``windows``: the patches of each frame and of each window (:func:`attention_groups`, or
        :class:`Segments` of the rows in window order)."""
        groups = windows if self.layer_type == "window_attention" else frames
        chains = self.chains
        if chains is not None and not torch.is_autocast_enabled(x.device.type):
            gemm, wide = self.attn.q_proj.weight.dtype, x.dtype
            h = chains.normed(x, self.norm1.weight, self.norm1.bias, self.norm1.eps, gemm, 3)
            x = chains.residual(x, self.attn.forward_chained(h, cos=cos, sin=sin, groups=groups, chains=chains,
                                                             wide=wide))
            (h,) = chains.normed(x, self.norm2.weight, self.norm2.bias, self.norm2.eps, gemm, 1)
            return chains.residual(x, self.mlp.forward_chained(h, chains=chains, wide=wide))
        x = x + self.attn(layer_norm(self.norm1, x), cos=cos, sin=sin, groups=groups)
        return x + self.mlp(layer_norm(self.norm2, x))


class MuseSparkVisionModel(nn.Module):
    """``model.vision_tower``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedder = MuseSparkVisionPatchEmbedder(config)
        self.ln_pre = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(MuseSparkVisionEncoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.ln_post = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        #: side of a window in patches, and the RoPE base (plain attributes, read at every forward)
        self.window = config.window_patches
        self.rope_theta = config.rope_theta
        #: recompute each block in the backward (keep only the blocks' inputs): an engine's setting
        self.recompute = False
        #: the activations' dtype between the GEMMs, an engine's setting (see the module docstring); None: fp32
        #: (:func:`wide_dtype` of the weights')
        self.activations_dtype: torch.dtype | None = None
        #: how a layer attends within its groups, an engine's setting: "grouped" (one call per group size) or
        #: "varlen" (the patches in window order, one variable-length call; see the module docstring)
        self.attention: str = "grouped"

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        from muse_stack.util.errors import InputError

        cfg = self.config
        if grid_thw is None or grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
            raise InputError("must be [num_images_or_videos, 3] (t, h, w in patches)", field="grid_thw",
                             value=None if grid_thw is None else tuple(grid_thw.shape),
                             fix="pass the image processor's image_grid_thw")
        if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise InputError(f"must be [patches, {cfg.patch_dim}] (frames x 3 x patch_size^2 per row)",
                             field="pixel_values", value=tuple(pixel_values.shape),
                             fix="pass the image processor's pixel_values")
        for i, (t, h, w) in enumerate(grid_thw.tolist()):
            if t < 1 or h % cfg.merge_size or w % cfg.merge_size or h < 1 or w < 1:
                raise InputError(f"row {i} is not a positive grid whose h and w are multiples of merge_size "
                                 f"{cfg.merge_size}", field="grid_thw", value=(t, h, w),
                                 fix="make the inputs with the image or video processor")
        total = int(grid_thw.prod(dim=1).sum())
        if total != pixel_values.shape[0]:
            raise InputError(f"grid_thw covers {total} patches but pixel_values has {pixel_values.shape[0]} rows",
                             field="pixel_values", value=tuple(pixel_values.shape),
                             fix="pass pixel_values and grid_thw from the same processor call")

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [N, T*3*P*P], ``grid_thw`` [M, 3] -> merged features [N / m^2, D m^2]."""
        self.check_inputs(pixel_values, grid_thw)
        cfg = self.config
        x = self.patch_embedder(pixel_values, grid_thw, self.activations_dtype)
        frame, row, col = patch_coordinates(grid_thw, x.device)
        cos, sin = axial_rope_cos_sin(row, col, cfg.head_dim, self.rope_theta, wide_dtype(x.dtype))
        # window (row // S, col // S) of the frame, tiled from its top-left corner; numbered globally
        rows_of_windows = -(-int(grid_thw[:, 1].max()) // self.window)
        cols_of_windows = -(-int(grid_thw[:, 2].max()) // self.window)
        window = (frame * rows_of_windows + row // self.window) * cols_of_windows + col // self.window
        x = layer_norm(self.ln_pre, x)
        order = None
        if self.attention == "varlen":
            # window order: the window ids grow with the frame, then the window's row and column, and a stable sort
            # keeps each window's patches in raster order
            order = torch.argsort(window, stable=True)
            x, cos, sin = (t.index_select(0, order) for t in (x, cos, sin))
            groups = {"frames": segments(frame[order]), "windows": segments(window[order])}
        else:
            groups = {"frames": attention_groups(frame), "windows": attention_groups(window)}
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False, cos=cos, sin=sin, **groups)
            else:
                x = layer(x, cos=cos, sin=sin, **groups)
        if order is not None:  # back to the patches' order
            x = x.index_select(0, torch.argsort(order))
        x = layer_norm(self.ln_post, x)
        return pixel_shuffle(x, grid_thw, cfg.merge_size)
