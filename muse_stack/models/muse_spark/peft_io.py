"""Adapter checkpoints, merged exports and the Hugging Face ``peft`` layout.

* :func:`save_adapters` / :func:`load_adapters`: a folder with ``adapters.safetensors`` (the
  adapter tensors only, by their names in the model) and ``adapters.json`` (the adapter
  settings and the base's identity: path, revision and a sha256 over the base tensors). Loading
  refuses adapters whose base hash differs from the model's base.
* :func:`merge_adapters` (from :mod:`muse_stack.models.muse_spark.peft`): the plain state dict;
  :func:`export_merged` writes it as an HF-style checkpoint that loads into a model without
  adapters.
* :func:`export_adapters_hf_peft`: ``adapter_config.json`` + ``adapter_model.safetensors`` as
  ``peft`` writes them, so that ``PeftModel.from_pretrained(MuseSparkForCausalLM(...), OUT)``
  loads them. Projections map 1:1 (``<module>.lora_A.weight`` [r, in], ``lora_B.weight``
  [out, r], DoRA's ``lora_magnitude_vector`` [out]). Stacked experts use ``peft``'s
  ``target_parameters`` layout: A [E r, in] expert-major, B [out, r E] rank-major, the
  ``gate_up_proj`` wrapper inside the ``down_proj`` one (``experts.base_layer.lora_A``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from muse_stack.util.atomic import follow_umask, make_temp_dir, write_json
from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.peft import adapter_modules, adapter_state_dict, base_state_dict, merge_adapters
from muse_stack.models.muse_spark.peft_config import EXPERT_TARGETS, PeftSettings

ADAPTER_FILE = "adapters.safetensors"
ADAPTER_META = "adapters.json"
FORMAT = "muse-stack-adapters/1"
HF_CONFIG = "adapter_config.json"
HF_WEIGHTS = "adapter_model.safetensors"

__all__ = ["base_difference", "base_digests", "base_identity", "base_sha256", "export_adapters_hf_peft", "export_merged", "load_adapters",
           "merge_adapters", "save_adapters"]


def base_part(name: str) -> str:
    """The part of the model a base tensor belongs to: the module under ``model.`` (``language_model``,
    ``vision_tower``, ``audio_tower``, ...) or the top-level one (``lm_head``)."""
    pieces = name.split(".")
    return pieces[1] if pieces[0] == "model" and len(pieces) > 1 else pieces[0]


def base_digests(model: torch.nn.Module) -> tuple[str, dict[str, str]]:
    """sha256 over the base tensors in name order (each name, dtype, shape and little-endian
    bytes), and the same over each part's tensors (:func:`base_part`). They depend on the values
    only, not on how a checkpoint shards or encodes them."""
    digest = hashlib.sha256()
    parts: dict[str, Any] = {}
    for name, tensor in sorted(base_state_dict(model).items()):
        t = tensor.detach().to("cpu").contiguous()
        chunks = (f"{name}|{t.dtype}|{list(t.shape)}\n".encode(), t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        part = parts.setdefault(base_part(name), hashlib.sha256())
        for chunk in chunks:
            digest.update(chunk)
            part.update(chunk)
    return digest.hexdigest(), {k: v.hexdigest() for k, v in sorted(parts.items())}


def base_sha256(model: torch.nn.Module) -> str:
    """sha256 over the base tensors (:func:`base_digests`)."""
    return base_digests(model)[0]


def base_identity(model: torch.nn.Module, *, path: str | None, revision: str | None,
                  hf_id: str | None = None, init_seed: int | None = None) -> dict[str, Any]:
    """What the adapters were trained on: the base checkpoint's path and revision (None for a
    seeded initialisation, whose seed is recorded instead), the base tensors' sha256, that of each
    part (so that a differing base names what differs) and the torch that built it."""
    total, parts = base_digests(model)
    return {"path": path, "revision": revision, "hf_id": hf_id, "init_seed": None if path else init_seed,
            "sha256": total, "parts": parts, "torch": torch.__version__.split("+")[0]}


def base_difference(model: torch.nn.Module, base: dict[str, Any]) -> str | None:
    """None when ``model``'s base is the one ``base`` (:func:`base_identity`) records, else what
    differs and why it can: parts one has and the other lacks, or the parts whose values differ
    and where those values came from (the checkpoint at the recorded path, or the seed)."""
    total, parts = base_digests(model)
    if total == base.get("sha256"):
        return None
    saved = base.get("parts")
    path, seed = base.get("path"), base.get("init_seed")
    if not isinstance(saved, dict):  # recorded before the parts were
        return (f"the base tensors' sha256 differs ({total[:12]}, recorded {str(base.get('sha256'))[:12]}): "
                + (f"the checkpoint at {path} holds other weights than when the run started, or the recipe's "
                   "model (its towers) differs" if path else
                   f"the initialisation from seed {seed} gives other values here, or the recipe's model (its "
                   "towers) differs"))
    lacking, extra = sorted(set(saved) - set(parts)), sorted(set(parts) - set(saved))
    if lacking or extra:
        return ("the base rebuilt from the run's recipe has other parts than the one the run trained on: "
                + "; ".join(x for x in (f"the run's had {', '.join(lacking)}" if lacking else "",
                                        f"this one has {', '.join(extra)}" if extra else "") if x))
    differing = ", ".join(k for k in saved if saved[k] != parts[k])
    if path:
        return f"the checkpoint at {path} holds other weights than when the run started (in {differing})"
    here = torch.__version__.split("+")[0]
    return (f"the initialisation from seed {seed} gives other values in {differing} here (torch {here}; the run "
            f"used torch {base.get('torch', 'unrecorded')})")


def _stage(target: Path) -> Path:
    if target.exists() and not target.is_dir():
        raise InputError("the output path exists and is not a directory", field="--out", value=str(target),
                         fix="choose a directory path")
    target.parent.mkdir(parents=True, exist_ok=True)
    return make_temp_dir(target)


def _publish(staging: Path, target: Path, *, replace: bool) -> None:
    follow_umask(staging)  # safetensors writes its files 0600
    if target.exists():
        if not replace:
            shutil.rmtree(staging, ignore_errors=True)
            raise InputError("the output directory exists; an export never overwrites", field="--out",
                             value=str(target), fix="choose a new directory")
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


def save_adapters(model: torch.nn.Module, directory: str | os.PathLike[str], base: dict[str, Any],
                  settings: PeftSettings, *, replace: bool = True) -> list[Path]:
    """Write only the adapter tensors and ``base`` (see :func:`base_identity`) to ``directory``,
    atomically (a reader sees the old folder or the whole new one)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_state_dict(model).items()}
    if not tensors:
        raise InputError("the model has no adapters to save", field="peft", value=None,
                         fix="apply_peft(model, settings) before saving adapters")
    target = Path(directory)
    staging = _stage(target)
    try:
        save_file(tensors, str(staging / ADAPTER_FILE), metadata={"format": "pt"})
        write_json(staging / ADAPTER_META, {"format": FORMAT, "peft": settings.as_dict(), "base": base,
                                            "tensors": len(tensors)})
        _publish(staging, target, replace=replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [target / ADAPTER_FILE, target / ADAPTER_META]


def read_adapter_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    from muse_stack.util.safeio import read_json

    meta = read_json(Path(directory) / ADAPTER_META, field="adapters", what="adapter metadata",
                     fix="point at a folder written by save_adapters")
    if meta.get("format") != FORMAT:
        raise InputError(f"not an adapter checkpoint of this format ({meta.get('format')!r})", field="adapters",
                         value=str(directory), fix=f"use a folder written by save_adapters ({FORMAT})")
    return meta


def load_adapters(model: torch.nn.Module, directory: str | os.PathLike[str], *,
                  check_base: bool = True) -> dict[str, Any]:
    """Copy saved adapter tensors into ``model`` (which already has the same adapters). Refuses
    a missing, extra or mis-shaped tensor, and (``check_base``) adapters trained on another base.
    Returns the saved metadata."""
    path = Path(directory)
    meta = read_adapter_meta(path)
    if check_base:
        ours = base_sha256(model)
        if meta["base"].get("sha256") != ours:
            raise InputError("the adapters were trained on another base model (the base tensors' sha256 differs)",
                             field="adapters.base", value=meta["base"],
                             fix=f"load the base they name ({meta['base'].get('path') or 'seeded init'}) first; "
                                 f"this model's base sha256 is {ours}")
    try:
        saved = load_file(str(path / ADAPTER_FILE))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise InputError(f"cannot read {ADAPTER_FILE} ({exc})", field="adapters", value=str(path),
                         fix="the file is corrupt or truncated") from exc
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if k in adapter_state_dict(model)}
    missing = sorted(set(targets) - set(saved))
    extra = sorted(set(saved) - set(targets))
    shaped = [k for k in targets if k in saved and saved[k].shape != targets[k].shape]
    if missing or extra or shaped:
        what = (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
                else f"wrong shape {shaped[:3]}")
        raise InputError(f"the saved adapters do not match the model's adapters: {what}", field="adapters",
                         value=str(path), fix="apply the same peft settings as the saved adapters.json before loading")
    with torch.no_grad():
        for k, t in targets.items():
            t.copy_(saved[k])
    return meta


def export_merged(model: torch.nn.Module, directory: str | os.PathLike[str]) -> list[Path]:
    """Base plus merged adapters as a plain HF-style checkpoint (config.json + safetensors)."""
    from muse_stack.models.muse_spark.checkpoint import save_checkpoint
    from muse_stack.models.muse_spark.decoder import MuseSparkForCausalLM

    target = Path(directory)
    if target.exists():
        raise InputError("the output directory exists; an export never overwrites", field="--hf",
                         value=str(target), fix="choose a new directory")
    merged = merge_adapters(model)
    with torch.device("meta"):
        plain = MuseSparkForCausalLM(model.config, seed=None)
    plain.load_state_dict(merged, strict=True, assign=True)
    return save_checkpoint(plain, target)


def _hf_expert_names(prefix: str, attrs: list[str]) -> dict[str, str]:
    """peft nests one ParamWrapper per targeted expert tensor, the first in model order innermost."""
    order = [a for a in ("gate_up_proj", "down_proj") if a in attrs]
    return {a: f"{prefix}." + "base_layer." * (len(order) - 1 - k) for k, a in enumerate(order)}


def export_adapters_hf_peft(model: torch.nn.Module, out_dir: str | os.PathLike[str], settings: PeftSettings, *,
                            base_model_name_or_path: str | None = None, revision: str | None = None) -> list[Path]:
    """Write the adapters as ``peft`` saves a LoRA/DoRA adapter (see module doc)."""
    tensors: dict[str, torch.Tensor] = {}
    expert_attrs: dict[str, list[str]] = {}
    mods = adapter_modules(model)
    for name, module in mods.items():
        if ".experts.adapters." in name:
            owner, attr = name.split(".adapters.")
            expert_attrs.setdefault(owner, []).append(attr)
    for name, module in mods.items():
        if ".experts.adapters." in name:
            owner, attr = name.split(".adapters.")
            where = _hf_expert_names(f"base_model.model.{owner}", expert_attrs[owner])[attr]
            a, b = module.lora_A.detach(), module.lora_B.detach()  # [n, r, in], [n, out, r]
            experts = getattr(model.get_submodule(owner), attr).shape[0]
            if a.shape[0] != experts:  # one shared adapter: the same factors for every expert
                a, b = a.expand(experts, -1, -1), b.expand(experts, -1, -1)
            n, r, fan_in = a.shape
            tensors[where + "lora_A.weight"] = a.reshape(n * r, fan_in).contiguous()
            # peft reads B [out, r x E] as [out, r, E]: column j x E + e is rank j of expert e
            tensors[where + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * n).contiguous()
        else:
            owner = name.removesuffix(".adapter")
            tensors[f"base_model.model.{owner}.lora_A.weight"] = module.lora_A.detach().contiguous()
            tensors[f"base_model.model.{owner}.lora_B.weight"] = module.lora_B.detach().contiguous()
            if hasattr(module, "lora_magnitude"):
                tensors[f"base_model.model.{owner}.lora_magnitude_vector"] = module.lora_magnitude.detach().contiguous()
    dense = [t for t in settings.targets if t not in EXPERT_TARGETS]
    config = {
        "peft_type": "LORA", "task_type": None, "r": settings.rank, "lora_alpha": settings.alpha,
        # dropout acts in training only; peft's expert wrapper refuses any, so it is written as 0 with experts
        "lora_dropout": 0.0 if settings.expert_targets else settings.dropout,
        "target_modules": dense, "target_parameters": list(settings.expert_targets) or None,
        "use_dora": settings.scheme == "dora", "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path, "revision": revision,
    }
    target = Path(out_dir)
    staging = _stage(target)
    try:
        save_file({k: v.to("cpu").contiguous() for k, v in tensors.items()}, str(staging / HF_WEIGHTS),
                  metadata={"format": "pt"})
        write_json(staging / HF_CONFIG, config)
        _publish(staging, target, replace=False)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [target / HF_CONFIG, target / HF_WEIGHTS]
