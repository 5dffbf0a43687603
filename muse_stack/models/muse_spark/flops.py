"""Model FLOPs of a training step, written down so every MFU figure can be checked.

Per token, forward:
  matmuls   2 x N_active             (N_active: every matmul weight one token uses, the
                                      output layer included; the router counts, the
                                      embedding lookup and norm gains do not)
  attention 2 x 2 x (heads x head_dim) x C_l per layer l, for QK^T and PV, where C_l is
            the mean number of keys a query attends to in layer l: causal full attention
            over a sequence of length S gives (S + 1) / 2; a sliding window of W keys
            (counting the query) gives the mean of min(p + 1, W) over positions p.
Training = forward + backward = 3 x forward. With packed rows C_l is taken per sequence.

With adapters (LoRA / DoRA on a frozen base) the base computes its forward and its backward to
the inputs, but no weight gradients: 2 x 2 x N_active for the matmuls; attention has no weights,
so its whole backward runs: 3 x attention; the adapters train in full: 6 x N_adapter, where
N_adapter is the adapter parameters one token passes through (every dense adapter; of the
expert adapters, top-k of E when each expert has its own, k passes through a shared one).
The 6N form becomes 4 x N_active + 6 x N_adapter.

Perception towers (image-text recipes; :func:`tower_flops_per_sequence`), per image of ``t`` merged
tokens (``4t`` patches of the 2 x 2 merge), forward:
  vision    2 x (patch_dim x D + layers x (4 D^2 + 2 D I)) per patch (the patch embedding, q/k/v/proj
            and the MLP), plus 4 x D x keys per patch and layer for attention, keys = the patches
            of the frame on full-attention layers and of a window (at most S x S) on window layers
  projector 2 x (out_hidden x P + P^2 + P x H) per merged token (adapter fc1, fc2, projection)
  audio     0: image-text data holds no audio, so the audio tower does not run
A part that trains counts 3 x its forward; a frozen part counts its forward once (nothing
upstream of the towers trains, so no gradient flows through them). Per text token, the
sequence's tower FLOPs are divided by its length.

MFU = model FLOP/s per GPU / peak FLOP/s per GPU. The 6N form, 6 x N_active x tokens/s /
peak, leaves attention out; it is reported beside MFU so numbers compare with records
that use it.
"""

from __future__ import annotations

from collections.abc import Sequence

from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.models.muse_spark.tower_config import TowersConfig


def mean_keys_causal(seq_len: int) -> float:
    return (seq_len + 1) / 2


def mean_keys_sliding(seq_len: int, window: int) -> float:
    if seq_len <= window:
        return mean_keys_causal(seq_len)
    # positions 0..W-1 see p+1 keys, the rest see W
    head = window * (window + 1) / 2
    return (head + (seq_len - window) * window) / seq_len


def attention_flops_per_token(cfg: ModelConfig, seq_lens: Sequence[int]) -> float:
    """Forward attention FLOPs per token, averaged over the tokens of ``seq_lens``."""
    total_tokens = sum(seq_lens)
    if total_tokens == 0:
        return 0.0
    width = cfg.num_attention_heads * cfg.head_dim
    flops = 0.0
    for layer_type in cfg.resolved_layer_types:
        for s in seq_lens:
            keys = mean_keys_sliding(s, cfg.sliding_window) if layer_type == "sliding_attention" else mean_keys_causal(s)
            flops += 4 * width * keys * s
    return flops / total_tokens


def adapter_params_per_token(settings, cfg: ModelConfig) -> float:
    """N_adapter: the adapter parameters one token passes through (see the module docstring)."""
    from muse_stack.models.muse_spark.peft_config import adapter_params_per_layer

    dense, expert = adapter_params_per_layer(settings, cfg)
    k = cfg.num_experts_per_tok
    per_token_expert = expert * k / cfg.num_local_experts if settings.per_expert else expert * k
    return float(cfg.num_hidden_layers * (dense + per_token_expert))


def training_flops_per_token(cfg: ModelConfig, seq_lens: Sequence[int], peft=None) -> dict[str, float]:
    """Per-token FLOPs; ``peft`` (resolved adapter settings) for a frozen base with adapters."""
    matmul = 2 * cfg.active_params
    attention = attention_flops_per_token(cfg, seq_lens)
    if peft is not None:
        adapters = adapter_params_per_token(peft, cfg)
        return {"matmul_forward": float(matmul), "attention_forward": attention,
                "adapter_params_per_token": adapters,
                "training": 2 * matmul + 3 * attention + 6 * adapters,
                "training_6n": 4.0 * cfg.active_params + 6 * adapters}
    return {
        "matmul_forward": float(matmul),
        "attention_forward": attention,
        "training": 3 * (matmul + attention),
        "training_6n": 6.0 * cfg.active_params,
    }


def vision_forward_flops_per_patch(towers: TowersConfig, frame_patches: int) -> dict[str, float]:
    """Forward FLOPs per patch of the vision tower for frames of ``frame_patches`` patches."""
    v = towers.vision_config
    d, i = v.hidden_size, v.intermediate_size
    matmul = 2.0 * (v.patch_dim * d + v.num_hidden_layers * (4 * d * d + 2 * d * i))
    window = min(v.window_patches**2, frame_patches)
    attention = sum(4.0 * d * (frame_patches if kind == "full_attention" else window) for kind in v.layer_types)
    return {"matmul": matmul, "attention": attention}


def projector_forward_flops_per_token(towers: TowersConfig, text_hidden_size: int) -> float:
    """Forward FLOPs per merged image token of the vision adapter and projection."""
    p = towers.projector_hidden_size
    return 2.0 * (towers.out_hidden_size * p + p * p + p * text_hidden_size)


def tower_flops_per_sequence(towers: TowersConfig, text_hidden_size: int, image_tokens: int, *,
                             vision_trains: bool, projector_trains: bool) -> dict[str, float]:
    """Model FLOPs of the towers for one sequence holding one image of ``image_tokens`` merged tokens
    (see the module docstring): forward, training and the 6N-style matmul-only training figure."""
    merge = towers.vision_config.merge_size**2
    patches = image_tokens * merge
    vision = vision_forward_flops_per_patch(towers, patches)
    projector = projector_forward_flops_per_token(towers, text_hidden_size) * image_tokens
    vision_fwd = (vision["matmul"] + vision["attention"]) * patches
    fv, fp = (3 if vision_trains else 1), (3 if projector_trains else 1)
    return {"image_tokens": float(image_tokens), "vision_forward": vision_fwd, "projector_forward": projector,
            "training": fv * vision_fwd + fp * projector,
            "training_6n": fv * vision["matmul"] * patches + fp * projector}


def image_training_flops(towers: TowersConfig, text_hidden_size: int, grid_thw, *, vision_trains: bool,
                         projector_trains: bool) -> dict[str, float]:
    """The towers' model FLOPs for the images of one batch (``grid_thw`` rows (t, h, w) in patches;
    each frame of h x w patches is its own attention group), summed: training and its 6N form."""
    merge = towers.vision_config.merge_size**2
    total = {"training": 0.0, "training_6n": 0.0}
    for t, h, w in grid_thw:
        per_frame = tower_flops_per_sequence(towers, text_hidden_size, int(h) * int(w) // merge,
                                             vision_trains=vision_trains, projector_trains=projector_trains)
        for key in total:
            total[key] += int(t) * per_frame[key]
    return total


TOWERS_FORMULA = ("; plus the perception towers' FLOPs of the step's images per token (3 x the forward of a "
                  "part that trains, 1 x of a frozen one; muse_stack/models/muse_spark/flops.py)")
PEFT_FORMULA = ("model FLOPs/token with adapters on a frozen base = 2 x 2 x N_active (forward, backward to inputs) "
                "+ 3 x attention + 6 x N_adapter (adapter parameters a token passes through)")
FORMULA = ("model FLOPs/token = 3 x (2 x N_active + sum over layers of 4 x heads x head_dim x mean keys per query); "
           "mean keys = (S+1)/2 for full attention, mean of min(p+1, W) for sliding layers")


class TowerFlops:
    """The perception towers' model FLOPs of the images one process trained on, per token of
    the steps it ran (what the MFU adds for the towers). ``vision_trains`` / ``projector_trains``:
    whether the vision tower and the projector receive gradients (3 x their forward) or are
    frozen (1 x). Audio clips add nothing: no recipe feeds audio (the audio tower stays frozen
    and unused on image-text data)."""

    def __init__(self, towers: TowersConfig, text_hidden_size: int, *, vision_trains: bool,
                 projector_trains: bool) -> None:
        self.towers, self.hidden = towers, text_hidden_size
        self.vision_trains, self.projector_trains = vision_trains, projector_trains
        self.flops = {"training": 0.0, "training_6n": 0.0}
        self.tokens = 0

    def add(self, micro_batches) -> None:
        """Count one step's micro-batches (dicts with ``input_ids`` and, with images, ``image_grid_thw``)."""
        for mb in micro_batches:
            self.tokens += mb["input_ids"].numel()
            for key in ("image_grid_thw", "video_grid_thw"):
                if mb.get(key) is not None:
                    got = image_training_flops(self.towers, self.hidden, mb[key].tolist(),
                                               vision_trains=self.vision_trains,
                                               projector_trains=self.projector_trains)
                    for name in self.flops:
                        self.flops[name] += got[name]

    def per_token(self) -> dict[str, float] | None:
        if not self.tokens:
            return None
        return {key: value / self.tokens for key, value in self.flops.items()}
