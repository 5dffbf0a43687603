"""The perception towers' memory traffic outside their GEMMs and attention, counted by running their code.

The image path the engine runs (:func:`muse_stack.models.muse_spark.perception.media_features`: the vision
tower, the projector and the weightless norm) is run on the CPU under :class:`TrafficRecorder`, a
``TorchDispatchMode`` that sees every aten op the forward and the autograd backward execute, and sums for each
op the bytes of the tensors it reads and writes. The GEMMs (``mm``, ``addmm``, ``bmm``) and the fused
attention (every ``_scaled_dot_product_*`` kernel) count nothing: the planner prices them apart, on the
roofline and at the attention efficiency. Views count nothing (they move no data), nor does an allocation.

The engine's setup is reproduced: the modules built as ``build_perception`` builds them, every parameter in
the recipe's parameter dtype (bf16, or fp32 under ``precision: fp32``), no autocast, ``pixel_values`` in fp32
as the data gives them. The activations are then fp32 between the GEMMs (``wide_dtype``), each GEMM's input
cast to the weights' dtype and its output back; or, as ``engine_options.towers_bf16_activations`` sets them, in the
weights' dtype (``activations_dtype``), with no cast around the GEMMs.

Float values never steer the towers' code (only the integer patch coordinates and group indices do), so the
recorder computes no float kernel: it takes each float op's output shape, dtype and strides from the op on
meta tensors and hands back an uninitialised tensor of them. Integer work (coordinates, groups) runs for real.
Sizes come out exact, and a count at the released width takes seconds.

Bytes per op (``moved_bytes``): the distinct elements of its tensor inputs (a broadcast dimension, stride 0,
read once) and of its outputs, with these exceptions, each what the kernel touches: a gather (``index``) reads
the rows it gathers, not its whole input; a scatter (``index_put_``) reads its values and indices and writes
(or, accumulating, reads and writes) the rows it scatters to; ``copy_`` reads its source and writes its
destination; a fill writes its output; ``*_like`` and ``new_*`` factories read nothing of their input.

One correction to what the recorder sees: under any ``TorchDispatchMode`` autograd's ``index_backward`` takes
its path for tensor subclasses, the out-of-place ``index_put`` (a copy of the zero-filled gradient, then the
scatter) instead of the in-place ``_index_put_impl_`` into the zero-filled gradient that runs without one
(ATen's ``isTensorSubclassLike`` is true whenever a dispatch mode is on). An out-of-place accumulating
``index_put`` is therefore counted as the in-place scatter it stands for. ``tests/unit/test_tower_traffic.py``
checks with ``torch.profiler`` (no dispatch mode) that nothing else changes but gradient accumulation out of
place (``add`` for ``add_``: the same bytes read and written).

The result (:func:`count`) is bytes per patch for one micro-batch: the forward's, the backward's (the vision
tower and the projector training, the vision blocks kept or recomputed) and the backward's when only the
projector trains, each split into the work outside the encoder layers (patch embedding, coordinates, RoPE
tables, attention groups, ``ln_pre``, ``ln_post``, the pixel shuffle, the projector and its norm; per merged
token it is per patch x ``merge_size^2``) and the work of one window-attention and one full-attention
encoder layer. Each is the slope between two frame sizes (:func:`counting_frames`); what does not grow with
the patches (the position table's resampling and cast, the norms' gains cast to fp32, the bias gradients'
writes) is the intercept, left out: at the released width about one patch's bytes a layer.

The counting frames' sides exceed the window by unequal remainders, so a window layer attends in four group
sizes (whole windows, the last column's, the last row's and the corner's), the general case; a full-attention
layer attends in one (one frame size). A micro-batch whose frames bring more distinct group sizes pays more:
in the backward each size's gather and scatter write gradients the size of all the patches (a zero-filled one
for each of q, k and v, a copy of the output's) that are then added together.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from muse_stack.models.muse_spark.tower_config import TowersConfig

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The aten op packets of ``names`` this torch build has."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


#: priced apart by the planner: the GEMMs (roofline) and the fused attention kernels (attention efficiency)
PRICED_APART = _packets(
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward")
#: metadata only (not marked as views in their schemas) and allocations: no data moves
NO_DATA = _packets("_unsafe_view", "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided",
                   "new_empty", "new_empty_strided", "resize_", "set_")
#: factories that read nothing of their tensor input (its shape and dtype only) and write their output
FACTORIES = _packets("zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
                     "new_full", "scalar_tensor", "arange")
FILLS = _packets("fill_", "zero_")
SCATTERS = _packets("index_put_", "_index_put_impl_")
#: the parts of a count (bytes per patch)
PARTS = ("outside_layers", "window_attention", "full_attention")


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t``: a broadcast dimension (stride 0) counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _scattered_bytes(self: torch.Tensor, indices) -> int:
    """Bytes of the rows of ``self`` an index tuple addresses (the indices broadcast together)."""
    idx = [i for i in indices if i is not None]
    rows = math.prod(torch.broadcast_shapes(*(i.shape for i in idx))) if idx else 1
    return rows * math.prod(self.shape[len(indices):]) * self.element_size()


def moved_bytes(func, args, kwargs, out) -> int:
    """HBM bytes one op reads and writes (see the module docstring); 0 for an op priced apart."""
    packet = func.overloadpacket
    if func.is_view or packet in NO_DATA or packet in PRICED_APART:
        return 0
    outs = _tensors(out)
    if packet in FACTORIES:
        return sum(map(distinct_bytes, outs))
    if packet in FILLS:
        return distinct_bytes(args[0])
    if packet is aten.copy_:
        return distinct_bytes(args[1]) + distinct_bytes(args[0])
    if packet is aten.index:
        return 2 * sum(map(distinct_bytes, outs)) + sum(map(distinct_bytes, _tensors(args[1])))
    if packet in SCATTERS or packet is aten.index_put:
        self, indices, values = args[0], args[1], args[2]
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        rows = _scattered_bytes(self, indices)
        moved = distinct_bytes(values) + sum(map(distinct_bytes, _tensors(indices))) + rows * (1 + accumulate)
        if packet is aten.index_put and not accumulate:  # out of place: a copy of self first
            moved += 2 * distinct_bytes(self)
        return moved
    seen, read = set(), 0
    for t in _tensors((args, kwargs)):
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key not in seen:
            seen.add(key)
            read += distinct_bytes(t)
    return read + sum(map(distinct_bytes, outs))


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


class TrafficRecorder(TorchDispatchMode):
    """Sums :func:`moved_bytes` over the aten ops run under it (``bytes``; ``by_op``: per op), computing no
    float op (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.by_op: Counter[str] = Counter()

    def _run(self, func, args, kwargs):
        tensors = _tensors((args, kwargs))
        if func.is_view or func.overloadpacket in NO_DATA or not any(t.is_floating_point() for t in tensors):
            return func(*args, **kwargs)
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        try:
            meta = func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError):  # no meta kernel: compute it
            return func(*args, **kwargs)
        meta_outs = _tensors(meta)
        if not all(t.is_floating_point() for t in meta_outs):  # an integer result may steer the code
            return func(*args, **kwargs)
        if func._schema.is_mutable:  # in place: the (uncomputed) tensor it was given
            returns = func._schema.returns
            return args[0] if len(returns) == 1 else tuple(args[: len(returns)]) if returns else None
        device = tensors[0].device
        return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs)
        moved = moved_bytes(func, args, kwargs, out)
        if moved:
            self.bytes += moved
            self.by_op[str(func)] += moved
        return out


def counting_frames(towers: TowersConfig) -> list[tuple[int, int, int]]:
    """Three frames (t, h, w), multiples of the merge, of the same rows and growing by whole windows in width,
    whose sides exceed a multiple of the window by unequal remainders (four window sizes each, see the module
    docstring): :func:`count` uses the first two, ``tests/unit/test_tower_traffic.py`` checks the third lies
    on their line."""
    v = towers.vision_config
    m, window = v.merge_size, v.window_patches
    rows, cols = (window // m + 1) * m, (window // m + 2) * m  # the first multiples of the merge above it
    step = math.lcm(window, m)
    if rows % window == 0 or cols % window == 0 or rows % window == cols % window:
        raise ValueError(f"no frame of window {window} and merge {m} with four window sizes")
    return [(1, rows, cols + k * step) for k in range(3)]


def _host(towers: TowersConfig, text_hidden_size: int, params_dtype: torch.dtype, layer_types: list[str]):
    """The perception modules as the engine builds them (``build_perception``), with the vision layers
    ``layer_types``, in ``params_dtype``; uninitialised (their values steer nothing)."""
    from muse_stack.models.muse_spark.perception import MuseSparkPerception

    vision = towers.vision_config.model_copy(update={"num_hidden_layers": len(layer_types),
                                                     "layer_types": list(layer_types)})
    config = towers.model_copy(update={"vision_config": vision})
    with torch.device("meta"):
        host = MuseSparkPerception(config, text_hidden_size=text_hidden_size, text_rms_norm_eps=1e-6)
    return host.to(dtype=params_dtype).to_empty(device="cpu")


def run_image_path(towers: TowersConfig, text_hidden_size: int, params_dtype: torch.dtype, frames, *,
                   layer_types: list[str], vision_trains: bool = True, projector_trains: bool = True,
                   recompute: bool = False, activations_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes of one micro-batch's image path (``frames``: rows (t, h, w) of ``image_grid_thw``) through towers
    of the vision layers ``layer_types``: its forward and, where a part trains, its backward (``recompute``:
    the vision blocks recomputed in it; ``activations_dtype``: the vision tower's, as an engine sets it, None
    for its own fp32)."""
    from muse_stack.models.muse_spark.perception import media_features

    host = _host(towers, text_hidden_size, params_dtype, layer_types)
    host.vision_tower.recompute = recompute
    host.vision_tower.activations_dtype = activations_dtype
    for name, trains in (("vision_tower", vision_trains), ("audio_tower", False),
                         ("vision_adapter", projector_trains), ("vision_projection", projector_trains)):
        getattr(host, name).requires_grad_(trains)
    grid = torch.tensor(frames, dtype=torch.int64)
    pixel_values = torch.empty(int(grid.prod(dim=1).sum()), towers.vision_config.patch_dim, dtype=torch.float32)
    with TrafficRecorder() as forward:
        features = media_features(host, towers, pixel_values=pixel_values, image_grid_thw=grid)
    out = {"forward": forward.bytes, "backward": 0}
    if features.requires_grad:
        grad = torch.empty_like(features)
        with TrafficRecorder() as backward:
            features.backward(grad)
        out["backward"] = backward.bytes
    return out


@dataclass(frozen=True)
class TowerTraffic:
    """Bytes per patch of one micro-batch (see the module docstring), each by :data:`PARTS`."""

    forward: dict[str, float]
    backward: dict[str, float]
    backward_recomputed: dict[str, float]
    #: the vision tower frozen, the projector training: its backward only (outside the layers)
    backward_projector: float


#: the towers counted to tell the layers apart: one window layer, two, one full layer (see _layer_split)
LAYER_RUNS = {"window": ["window_attention"], "windows": ["window_attention"] * 2, "full": ["full_attention"]}


def _layer_split(got: dict[str, int]) -> dict[str, int]:
    """The bytes of :data:`PARTS` from those of the towers of :data:`LAYER_RUNS`."""
    per_window = got["windows"] - got["window"]
    return {"outside_layers": got["window"] - per_window, "window_attention": per_window,
            "full_attention": got["full"] - got["window"] + per_window}


def count_frames(towers: TowersConfig, text_hidden_size: int, params_dtype: torch.dtype, frames,
                 activations_dtype: torch.dtype | None = None) -> dict:
    """Bytes of one micro-batch of ``frames``, by quantity of :class:`TowerTraffic` and part."""
    def runs(**kw) -> dict[str, dict[str, int]]:
        return {name: run_image_path(towers, text_hidden_size, params_dtype, frames, layer_types=types,
                                     activations_dtype=activations_dtype, **kw)
                for name, types in LAYER_RUNS.items()}

    kept, recomputed = runs(), runs(recompute=True)
    projector = run_image_path(towers, text_hidden_size, params_dtype, frames, layer_types=LAYER_RUNS["window"],
                               vision_trains=False, activations_dtype=activations_dtype)["backward"]
    return {"forward": _layer_split({k: v["forward"] for k, v in kept.items()}),
            "backward": _layer_split({k: v["backward"] for k, v in kept.items()}),
            "backward_recomputed": _layer_split({k: v["backward"] for k, v in recomputed.items()}),
            "backward_projector": projector}


def _patches(frames) -> int:
    return sum(t * h * w for t, h, w in frames)


def count(towers: TowersConfig, text_hidden_size: int, params_dtype: torch.dtype, *,
          activations_dtype: torch.dtype | None = None) -> TowerTraffic:
    """Bytes per patch (see the module docstring): the slope between the first two
    :func:`counting_frames`; ``activations_dtype`` the vision tower's (None: its own fp32)."""
    frames = counting_frames(towers)[:2]
    small, large = (count_frames(towers, text_hidden_size, params_dtype, [f], activations_dtype) for f in frames)
    span = _patches([frames[1]]) - _patches([frames[0]])

    def slope(a, b):
        return {k: (b[k] - a[k]) / span for k in a} if isinstance(a, dict) else (b - a) / span

    return TowerTraffic(**{k: slope(small[k], large[k]) for k in small})
