"""Adapter checkpoints of the megatron engine: which tensors, where each shard sits, and the base.

With ``recipe.peft`` set, a megatron step folder holds a megatron-core dist-checkpoint of the
adapter tensors and the optimizer state (which holds adapter parameters only), plus
``adapter_base.json``: the adapter settings and the identity of the frozen base they sit on.
The base weights are not copied.

Each adapter tensor is written under its *reference* name (the key
:func:`muse_stack.models.muse_spark.peft.adapter_state_dict` uses, e.g.
``model.language_model.layers.3.self_attn.q_proj.adapter.lora_B``) and its global shape, whatever
TP / PP / EP wrote it: a TP shard is placed by its rank along the split axis, a local expert's
factor at its global expert index of the stacked ``[E, ...]`` tensor (``[1, ...]`` when one
adapter is shared). So ``muse-stack export`` reads the adapters back whole, under the names the
reference model and the ``peft`` layout use.

Everything here is pure (no megatron-core): the engine turns each :class:`Placement` into a
``ShardedTensor.from_rank_offsets``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muse_stack.engines.mcore.peft import mcore_to_reference, parallel_mode, replicated_over_tp
from muse_stack.util.errors import InputError

ADAPTER_BASE = "adapter_base.json"
FORMAT = "muse-stack-mcore-adapters/1"


# ---- which tensors, where ---------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where one rank's adapter parameter sits in the checkpoint's global tensor."""

    key: str  #: the reference adapter name (the global tensor's key)
    rank_offsets: tuple[tuple[int, int, int], ...]  #: (axis, this rank's chunk, chunks), megatron-core's form
    prepend_axis_num: int  #: 1 for a local expert's factor inside the stacked [E, ...] tensor
    replica_id: tuple[int, int, int]  #: (0, 0, 0) on the one rank that writes it; other copies are replicas


def is_adapter_param(name: str) -> bool:
    """A megatron-core stage parameter that is an adapter tensor (``<module>.adapter.<factor>``)."""
    return ".adapter." in name


def placement(name: str, *, layer_offset: int, expert_offset: int, num_experts: int, per_expert: bool,
              tp_rank: int, tp_size: int, ep_rank: int, dp_rank: int, expert_dp_rank: int) -> Placement:
    """The checkpoint placement of the megatron-core adapter parameter ``name`` of one stage /
    rank. Dense factors: split along the axis their base weight splits over TP (column: B and
    the magnitude by rows; row: A by columns), whole otherwise and then replicated over TP;
    one copy per data-parallel group writes. Expert factors (ETP = 1): axis 0 of the stacked
    tensor is the global expert; a shared adapter is replicated over EP; one copy per
    expert-data-parallel group writes."""
    where = mcore_to_reference(name, layer_offset=layer_offset, expert_offset=expert_offset)
    if where.expert is not None:
        if per_expert:
            return Placement(where.hf_name, ((0, where.expert, num_experts),), 1, (0, 0, expert_dp_rank))
        return Placement(where.hf_name, ((0, 0, 1),), 1, (ep_rank, 0, expert_dp_rank))
    offsets: tuple[tuple[int, int, int], ...] = ()
    if tp_size > 1 and not replicated_over_tp(where.target, where.factor):
        axis = 1 if parallel_mode(where.target) == "row" else 0  # row: A [r, in/TP]; column: B / m [out/TP, ...]
        offsets = ((axis, tp_rank, tp_size),)
    tp_replica = tp_rank if tp_size > 1 and replicated_over_tp(where.target, where.factor) else 0
    return Placement(where.hf_name, offsets, 0, (0, tp_replica, dp_rank))


def adapter_keys(keys) -> list[str]:
    """The adapter tensors among a dist-checkpoint's (or a reference state dict's) keys."""
    from muse_stack.models.muse_spark.peft import is_adapter_key

    return sorted(k for k in keys if k.startswith("model.language_model.layers.") and is_adapter_key(k))


# ---- the base the adapters sit on ---------------------------------------------------------------
def safetensors_headers_sha256(directory: str | Path) -> str:
    """sha256 over an HF checkpoint's safetensors headers (each file's name and its JSON header:
    every tensor's name, dtype, shape and byte range), in file-name order. Reading a header costs
    8 bytes plus its length, whatever the weights weigh; it names the checkpoint's layout and
    encoding, not its values (two checkpoints of equal layout but other values hash alike)."""
    folder = Path(directory)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError("the pretrained checkpoint holds no .safetensors file", field="model.pretrained_checkpoint",
                         value=str(folder), fix="point it at an HF checkpoint folder (model.safetensors or shards)")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise InputError(f"{file.name} is truncated (no safetensors header)",
                                 field="model.pretrained_checkpoint", value=str(folder),
                                 fix="re-download or re-export the checkpoint")
            (size,) = struct.unpack("<Q", raw)
            header = handle.read(size)
            if len(header) != size:
                raise InputError(f"{file.name} is truncated (its header is cut short)",
                                 field="model.pretrained_checkpoint", value=str(folder),
                                 fix="re-download or re-export the checkpoint")
        digest.update(f"{file.name}|{size}\n".encode())
        digest.update(header)
    return digest.hexdigest()


def _config_sha256(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode()).hexdigest()


def base_identity(*, pretrained_checkpoint: str | None, revision: str | None, hf_id: str | None,
                  hf_config: dict[str, Any], init_seed: int, layout: dict[str, int]) -> dict[str, Any]:
    """What base the megatron engine's adapters sit on. From a pretrained checkpoint: its path,
    revision, hf_id and :func:`safetensors_headers_sha256`. From the seeded initialisation (no
    weights on disk): the seed, the model config's sha256 and the model-parallel layout, which
    together fix megatron-core's initial weights (its per-TP/PP/EP-rank RNG streams)."""
    ident: dict[str, Any] = {"engine": "megatron", "path": pretrained_checkpoint, "revision": revision,
                             "hf_id": hf_id, "config_sha256": _config_sha256(hf_config)}
    if pretrained_checkpoint:
        ident.update(init_seed=None, layout=None, headers_sha256=safetensors_headers_sha256(pretrained_checkpoint))
    else:
        ident.update(init_seed=init_seed, layout=dict(layout), headers_sha256=None)
    return ident


def _describe(base: dict[str, Any]) -> str:
    if base.get("path"):
        sha = base.get("headers_sha256") or "?"
        return f"pretrained checkpoint {base['path']} (revision {base.get('revision')}, headers sha256 {sha[:12]})"
    return (f"seeded initialisation (seed {base.get('init_seed')}, layout {base.get('layout')}, "
            f"config sha256 {(base.get('config_sha256') or '?')[:12]})")


def same_base(saved: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Whether two identities name the same base: the model config, and then the checkpoint's
    headers hash (the path may move), or the seed and layout of a seeded initialisation."""
    if saved.get("config_sha256") != ours.get("config_sha256"):
        return False
    if bool(saved.get("path")) != bool(ours.get("path")):
        return False
    if ours.get("path"):
        return saved.get("headers_sha256") == ours.get("headers_sha256")
    return saved.get("init_seed") == ours.get("init_seed") and saved.get("layout") == ours.get("layout")


def read_meta(directory: Path) -> dict[str, Any] | None:
    """``adapter_base.json`` of a megatron step folder, or None when the folder holds a full model."""
    from muse_stack.util.safeio import read_json

    path = Path(directory) / ADAPTER_BASE
    if not path.exists():
        return None
    meta = read_json(path, field="--resume", what="adapter base identity",
                     fix="the checkpoint is truncated or corrupt; start a new run (the run directory keeps its metrics)")
    if meta.get("format") != FORMAT:
        raise InputError(f"not a megatron adapter checkpoint of this format ({meta.get('format')!r})",
                         field="--resume", value=str(directory), fix=f"resume from a checkpoint written as {FORMAT}")
    return meta


def check_resume(directory: Path, meta: dict[str, Any] | None, *, settings: dict[str, Any] | None,
                 ours: dict[str, Any] | None) -> None:
    """Refuse a checkpoint whose kind (adapters / full model), adapter settings or base differ
    from the run's; each refusal names both sides and the fix."""
    if settings is None:
        if meta is not None:
            raise InputError("the checkpoint holds adapters (adapter_base.json), but the recipe has no peft block",
                             field="--resume", value=str(directory),
                             fix=f"resume with the peft settings it was trained with: {meta.get('peft')}")
        return
    if meta is None:
        raise InputError("the checkpoint holds a full model, but the recipe trains adapters (peft)",
                         field="--resume", value=str(directory),
                         fix="resume without the peft block, or start a new adapter run")
    mine = {k: v for k, v in settings.items() if k != "filled"}
    theirs = {k: v for k, v in (meta.get("peft") or {}).items() if k != "filled"}
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise InputError(f"the saved adapters have other settings ({', '.join(f'peft.{k}' for k in diff)}): "
                         f"saved {theirs}, recipe {mine}", field=f"peft.{diff[0]}", value=mine.get(diff[0]),
                         fix=f"resume with the saved setting peft.{diff[0]}={theirs.get(diff[0])}")
    saved = meta.get("base") or {}
    if not same_base(saved, ours or {}):
        raise InputError(f"the adapters were trained on another base model: saved {_describe(saved)}, "
                         f"this run {_describe(ours or {})}", field="adapters.base", value=saved,
                         fix=f"resume with the base they name ({saved.get('path') or 'seeded init'}: "
                             "model.pretrained_checkpoint, training.seed and the layout as saved), or start a new run")


def dist_adapter_tensors(folder: Path) -> dict:
    """The adapter tensors of this engine's dist-checkpoint step folder by their reference names,
    whole (the checkpoint stores them so)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from muse_stack.util.errors import InputError

    try:
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise InputError(f"cannot read the dist-checkpoint's metadata ({exc})", field="checkpoint",
                         value=str(folder), fix="the checkpoint is incomplete or not a torch_dist checkpoint") from exc
    entries = meta.state_dict_metadata
    box = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype)
           for k in adapter_keys(entries) if isinstance(entries[k], TensorStorageMetadata)}
    if not box:
        raise InputError("the dist-checkpoint holds no adapter tensors", field="checkpoint", value=str(folder),
                         fix="export a checkpoint written by a peft run of this version of muse-stack")
    dcp.load(box, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return box
