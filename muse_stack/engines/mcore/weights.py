"""Weight names of the megatron-core Muse Spark model and their Hugging Face checkpoint names.

The mapping is one-to-one: every megatron-core parameter (or buffer) of the model built by
:mod:`muse_stack.engines.mcore.model` is one checkpoint tensor, or one expert's slice of a
stacked expert tensor, or a tensor-parallel shard of one of those. Nothing is fused or
permuted, so the same checkpoint loads into the reference engine and into this one.

Names here are *global* (layer index over the whole decoder, expert index over all experts);
:func:`local_to_global` turns the names of one pipeline stage / expert-parallel rank into
them.
"""

from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass

from muse_stack.models.muse_spark.tower_config import PERCEPTION_MODULES

LM = "model.language_model."

#: megatron-core suffix inside ``decoder.layers.{l}.`` -> HF suffix inside ``layers.{l}.``
LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q.weight": "self_attn.q_proj.weight",
    "self_attention.linear_k.weight": "self_attn.k_proj.weight",
    "self_attention.linear_v.weight": "self_attn.v_proj.weight",
    "self_attention.linear_gate.weight": "self_attn.gate_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "post_attention_residual_gate.gate": "post_attention_residual_gate.gate",
    "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.fc1_latent_proj.weight": "mlp.pre_expert_proj.weight",
    "mlp.pre_expert_norm.weight": "mlp.pre_expert_norm.weight",
    "mlp.experts.post_expert_norm.weight": "mlp.experts.post_expert_norm.weight",
    "mlp.fc2_latent_proj.weight": "mlp.post_expert_proj.weight",
    "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight",
    "post_mlp_residual_gate.gate": "post_feedforward_residual_gate.gate",
}
#: stacked expert tensors: megatron-core keeps one weight per local expert
EXPERT_NAMES: dict[str, str] = {
    "mlp.experts.linear_fc1.weight": "mlp.experts.gate_up_proj",
    "mlp.experts.linear_fc2.weight": "mlp.experts.down_proj",
}
TOP_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": LM + "embed_tokens.weight",
    "decoder.final_layernorm.weight": LM + "norm.weight",
    "output_layer.weight": "lm_head.weight",
}

#: tensor-parallel split axis of each weight (absent: replicated over TP)
TP_AXIS: dict[str, int] = {
    "self_attention.linear_q.weight": 0,
    "self_attention.linear_k.weight": 0,
    "self_attention.linear_v.weight": 0,
    "self_attention.linear_gate.weight": 0,
    "self_attention.linear_proj.weight": 1,
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
}
#: expert-tensor-parallel split axis of the expert weights (fc1 splits gate and up halves alike)
ETP_AXIS: dict[str, int] = {"mlp.experts.linear_fc1.weight": 0, "mlp.experts.linear_fc2.weight": 1}

#: the perception towers and projector: transformers' module tree under ``model.`` is kept whole
#: under ``perception.`` on the first pipeline stage (replicated over TP)
TOWER_PREFIX, HF_TOWER_PREFIX = "perception.", "model."


def _tower_rest(name: str, prefix: str) -> str | None:
    """The name below the towers' prefix when ``name`` is a tower tensor, else None."""
    if name.startswith(prefix) and name[len(prefix):].split(".", 1)[0] in PERCEPTION_MODULES:
        return name[len(prefix):]
    return None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


@dataclass(frozen=True)
class Target:
    """Where one megatron-core tensor comes from in the checkpoint."""

    hf_name: str
    expert: int | None = None  #: index into the stacked expert tensor
    tp_axis: int | None = None  #: split over tensor parallelism (dense weights)
    etp_axis: int | None = None  #: split over expert tensor parallelism
    glu: bool = False  #: [gate; up] rows: each half splits separately


def mcore_to_hf(name: str) -> Target:
    """The checkpoint tensor of a *global* megatron-core name (see module doc)."""
    if name in TOP_NAMES:
        return Target(TOP_NAMES[name], tp_axis=TP_AXIS.get(name))
    tower = _tower_rest(name, TOWER_PREFIX)
    if tower is not None:
        return Target(HF_TOWER_PREFIX + tower)
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"not a Muse Spark megatron-core tensor: {name}")
    layer, rest = int(match.group(1)), match.group(2)
    prefix = f"{LM}layers.{layer}."
    if rest in LAYER_NAMES:
        return Target(prefix + LAYER_NAMES[rest], tp_axis=TP_AXIS.get(rest))
    expert = _EXPERT.match(rest)
    if expert is not None:
        base = expert.group(1)
        return Target(prefix + EXPERT_NAMES[base], expert=int(expert.group(2)), etp_axis=ETP_AXIS[base],
                      glu=base.endswith("fc1.weight"))
    raise KeyError(f"not a Muse Spark megatron-core tensor: {name}")


def dist_key_to_hf(key: str) -> str | None:
    """HF name of a key of this engine's dist-checkpoint (global names; None: not a weight).

    megatron-core writes a layer's tensors as ``decoder.layers.{global layer}.<name>``; the
    grouped experts' modules gain a second ``experts.`` (``mlp.experts.experts.linear_fc1.weight``,
    one tensor [experts, ...] over all experts, the GLU's gate and up halves in HF order
    whatever ETP split them)."""
    if key in TOP_NAMES:
        return TOP_NAMES[key]
    tower = _tower_rest(key, TOWER_PREFIX)
    if tower is not None:
        return HF_TOWER_PREFIX + tower
    match = _LAYER.match(key)
    if match is None:
        return None
    layer, rest = int(match.group(1)), match.group(2).replace("mlp.experts.experts.", "mlp.experts.")
    if rest in LAYER_NAMES:
        return f"{LM}layers.{layer}.{LAYER_NAMES[rest]}"
    if rest in EXPERT_NAMES:
        return f"{LM}layers.{layer}.{EXPERT_NAMES[rest]}"
    return None


def hf_to_mcore(hf_name: str, num_experts: int) -> list[str]:
    """Global megatron-core names that read ``hf_name`` (a stacked expert tensor gives one per expert)."""
    for mc, hf in TOP_NAMES.items():
        if hf == hf_name:
            return [mc]
    tower = _tower_rest(hf_name, HF_TOWER_PREFIX)
    if tower is not None:
        return [TOWER_PREFIX + tower]
    match = re.match(rf"^{re.escape(LM)}layers\.(\d+)\.(.+)$", hf_name)
    if match is None:
        raise KeyError(f"not a Muse Spark text-decoder tensor: {hf_name}")
    layer, rest = int(match.group(1)), match.group(2)
    for mc, hf in LAYER_NAMES.items():
        if hf == rest:
            return [f"decoder.layers.{layer}.{mc}"]
    for mc, hf in EXPERT_NAMES.items():
        if hf == rest:
            return [f"decoder.layers.{layer}.{mc}{e}" for e in range(num_experts)]
    raise KeyError(f"not a Muse Spark text-decoder tensor: {hf_name}")


def local_to_global(name: str, layer_offset: int, expert_offset: int) -> str:
    """Name on one pipeline stage / expert-parallel rank -> global name."""
    match = _LAYER.match(name)
    if match is None:
        return name
    layer, rest = int(match.group(1)) + layer_offset, match.group(2)
    expert = _EXPERT.match(rest)
    if expert is not None:
        rest = f"{expert.group(1)}{int(expert.group(2)) + expert_offset}"
    return f"decoder.layers.{layer}.{rest}"


def global_to_local(name: str, layer_offset: int, expert_offset: int) -> str:
    """Global name -> the name on the pipeline stage / expert-parallel rank holding it."""
    match = _LAYER.match(name)
    if match is None:
        return name
    layer, rest = int(match.group(1)) - layer_offset, match.group(2)
    expert = _EXPERT.match(rest)
    if expert is not None:
        rest = f"{expert.group(1)}{int(expert.group(2)) - expert_offset}"
    return f"decoder.layers.{layer}.{rest}"


def rank_names(hf_names: list[str], num_experts: int, *, ep_rank: int, ep_size: int, layers: range) -> list[str]:
    """Local megatron-core names of the tensors an expert-parallel rank holding ``layers``
    (global indices) loads from a checkpoint with ``hf_names``."""
    per_rank = num_experts // ep_size
    offset = ep_rank * per_rank
    out = []
    for hf_name in hf_names:
        for name in hf_to_mcore(hf_name, num_experts):
            match = _LAYER.match(name)
            if match is not None and int(match.group(1)) not in layers:
                continue
            target = mcore_to_hf(name)
            if target.expert is not None and not offset <= target.expert < offset + per_rank:
                continue
            out.append(global_to_local(name, layers.start, offset))
    return out


def shard(tensor, target: Target, tp_rank: int, tp_size: int, etp_rank: int, etp_size: int):
    """This rank's part of a full checkpoint tensor (already indexed by expert)."""
    axis, rank, size = (target.tp_axis, tp_rank, tp_size) if target.etp_axis is None \
        else (target.etp_axis, etp_rank, etp_size)
    if axis is None or size == 1:
        return tensor
    if target.glu:
        gate, up = tensor.chunk(2, dim=axis)
        return _cat([gate.chunk(size, dim=axis)[rank], up.chunk(size, dim=axis)[rank]], axis)
    if tensor.shape[axis] % size:
        raise ValueError(f"{target.hf_name}: dimension {axis} of size {tensor.shape[axis]} does not split over {size} ranks")
    return tensor.chunk(size, dim=axis)[rank]


def _cat(parts, axis):
    import torch

    return torch.cat(parts, dim=axis)


def dist_hf_source(folder: Path):
    """The model tensors of this engine's torch_dist checkpoint by HF name ((TensorSpec list, getter)):
    each tensor is read whole under its global key when asked for."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from muse_stack.util.errors import InputError
    from muse_stack.models.muse_spark.checkpoint import TensorSpec

    reader = dcp.FileSystemReader(str(folder))
    try:
        meta = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise InputError(f"cannot read the dist-checkpoint's metadata ({exc})", field="checkpoint",
                         value=str(folder), fix="the checkpoint is incomplete or not a torch_dist checkpoint") from exc
    keys: dict[str, str] = {}
    specs: list[TensorSpec] = []
    for key, md in meta.state_dict_metadata.items():
        hf = dist_key_to_hf(key)  # the engine's own mapping
        if hf is None or not isinstance(md, TensorStorageMetadata):
            continue
        if hf in keys:
            raise InputError(f"two dist-checkpoint tensors map to {hf}: {keys[hf]} and {key}", field="checkpoint",
                             value=str(folder), fix="report this layout: the weight mapping is not one-to-one here")
        keys[hf] = key
        specs.append(TensorSpec(hf, tuple(md.size), md.properties.dtype))

    by_name = {s.name: s for s in specs}

    def get(name: str):
        spec = by_name[name]
        box = {keys[name]: torch.empty(spec.shape, dtype=spec.dtype)}
        dcp.load(box, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
        return box[keys[name]]

    return specs, get
