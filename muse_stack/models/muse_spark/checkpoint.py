"""Hugging Face-style checkpoints of the Muse Spark text decoder.

A checkpoint directory holds ``config.json`` (:func:`muse_stack.models.muse_spark.hf_config.full_config`) and either
``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name:
file}}``), exactly as Hugging Face writes them. Tensor names are the model's parameter
names, so the released checkpoint loads 1:1. Its perception towers (anything outside
``model.language_model.`` and ``lm_head.``) are skipped and counted in the load report, unless
``load_checkpoint(..., towers=True)`` asks for them: then a checkpoint whose config.json has
``vision_config`` and ``audio_config`` and which holds tower tensors loads as the whole model
(:class:`MuseSparkForCausalLM` with ``towers``), every tensor checked. A model with towers saves
them, with their configs in config.json (:func:`muse_stack.models.muse_spark.hf_config.full_config`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from muse_stack.util.atomic import follow_umask, make_temp_dir, write_json
from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.decoder import MuseSparkForCausalLM
from muse_stack.models.muse_spark.config import ModelConfig

if TYPE_CHECKING:
    from muse_stack.models.muse_spark.tower_config import TowersConfig

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: largest shard written by default (bytes), as Hugging Face's "5GB"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
TEXT_PREFIXES = ("model.language_model.", "lm_head.")
#: tensors that stay fp32 whatever dtype the rest of the model has
FP32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
#: config fields that do not change the computation (ids, limits)
_NON_NUMERIC_FIELDS = {"bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
                       "first_padding_token_id"}


@dataclass
class LoadReport:
    directory: str
    files: list[str]
    loaded: int  #: tensors loaded (text decoder, plus the towers' when the model has them)
    ignored: int  #: tensors outside the text decoder (perception towers), skipped
    ignored_prefixes: list[str] = field(default_factory=list)
    bytes_read: int = 0  #: bytes of tensor data read (each loaded tensor once; skipped ones not at all)
    towers: int = 0  #: of ``loaded``, the perception towers' and projector's tensors

    def summary(self) -> str:
        if self.towers:
            text = (f"loaded {self.loaded} tensors ({self.loaded - self.towers} text decoder, {self.towers} "
                    f"perception towers and projector) from {len(self.files)} file(s) in {self.directory}")
        else:
            text = f"loaded {self.loaded} text-decoder tensors from {len(self.files)} file(s) in {self.directory}"
        if self.ignored:
            text += f"; ignored {self.ignored} non-text tensors ({', '.join(self.ignored_prefixes)})"
        return text


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF name, shape and dtype (read from a header, nothing loaded)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


#: reads one tensor by HF name
TensorGetter = Callable[[str], torch.Tensor]


def safetensors_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors header's dtype name."""
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32}[name]


#: the safetensors dtypes a weight may have (every Muse Spark tensor is a float: an integer one is
#: no weight of this model, and copied into one it would silently round the values it stood for)
FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")


def _refuse_non_float(name: str, dtype: str, file: Path) -> None:
    if dtype not in FLOAT_DTYPES:
        raise InputError(f"tensor {name} is stored as {dtype}; every weight of the model is a float "
                         f"({', '.join(FLOAT_DTYPES)})", field="checkpoint.tensor", value=f"{file.name}: {name}",
                         fix="export the checkpoint's weights as floats (bf16 or fp32), e.g. with "
                             "save_pretrained of the loaded model")


def is_text_tensor(name: str) -> bool:
    return name.startswith(TEXT_PREFIXES)


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


# ---- saving ------------------------------------------------------------------------------
def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _is_checkpoint_file(name: str) -> bool:
    return name in (CONFIG_NAME, SINGLE_FILE, INDEX_FILE) or (name.startswith("model-") and name.endswith(".safetensors"))


def checkpoint_config(model: MuseSparkForCausalLM) -> dict:
    """The config.json of ``model``: its text config with its own towers' configs when it has
    towers, else with the smallest consistent ones (:func:`muse_stack.models.muse_spark.hf_config.full_config`)."""
    from muse_stack.models.muse_spark.hf_config import full_config

    towers = getattr(model, "towers_config", None)
    return full_config(model.config, towers.to_hf() if towers is not None else None)


def save_checkpoint(model: MuseSparkForCausalLM, directory: str | os.PathLike[str], *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write ``config.json`` and the weights (sharded above ``max_shard_bytes``) to ``directory``;
    a model with towers writes theirs too, and their configs (:func:`checkpoint_config`).

    The files are written into a hidden sibling directory that replaces ``directory`` only when
    complete, so a reader sees the old checkpoint or the whole new one. Other files already in
    ``directory`` (e.g. a tokenizer) are kept. Returns the written paths.
    """
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise InputError("the checkpoint path exists and is not a directory", field="checkpoint.directory",
                         value=str(target), fix="choose a directory path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    shards = _shard(tensors, max_shard_bytes)
    staging = make_temp_dir(target)
    try:
        names: list[str] = []
        if len(shards) == 1:
            save_file(shards[0], str(staging / SINGLE_FILE), metadata={"format": "pt"})
            names.append(SINGLE_FILE)
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                shard_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / shard_name), metadata={"format": "pt"})
                names.append(shard_name)
                weight_map.update(dict.fromkeys(shard, shard_name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            write_json(staging / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
            names.append(INDEX_FILE)
        write_json(staging / CONFIG_NAME, checkpoint_config(model))
        names.append(CONFIG_NAME)
        follow_umask(staging)  # safetensors writes its files 0600
        if target.exists():
            for entry in target.iterdir():
                if not _is_checkpoint_file(entry.name):
                    os.replace(entry, staging / entry.name)
            backup = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, backup)
            os.replace(staging, target)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [target / name for name in names]


# ---- reading -----------------------------------------------------------------------------
def _checkpoint_dir(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise InputError("checkpoint directory not found", field="checkpoint.directory", value=str(path),
                         fix="point it at a directory holding config.json and model*.safetensors")
    if not (path / CONFIG_NAME).is_file():
        raise InputError("the checkpoint has no config.json", field="checkpoint.directory", value=str(path),
                         fix="copy the model's config.json next to the safetensors files")
    return path


def _weight_files(path: Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names it holds (from the index, else from the single file)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(f"{INDEX_FILE} is not a valid index ({exc})", field="checkpoint.index",
                             value=str(index), fix="restore the index written with the shards") from exc
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file in files:
            if not (path / file).is_file():
                raise InputError(f"shard {file} named in {INDEX_FILE} is missing", field="checkpoint.shard",
                                 value=str(path / file), fix="copy every shard the index names")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise InputError("no weights: neither model.safetensors nor model.safetensors.index.json",
                         field="checkpoint.directory", value=str(path),
                         fix="save the weights with save_checkpoint or copy the checkpoint's safetensors files")
    return {SINGLE_FILE: _keys_of(single)}


def _keys_of(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise InputError(f"cannot read {file.name} ({exc})", field="checkpoint.shard", value=str(file),
                         fix="the file is corrupt or truncated; copy it again") from exc


def _read_text_tensors(path: Path, expected: dict[str, torch.Size], device: torch.device | str,
                       consume: Callable[[str, torch.Tensor], None] | None = None, *, towers: bool = False
                       ) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Check every text tensor's presence and shape from the headers (no data read), then read
    each once. With ``consume``, each tensor is handed over as it is read and not kept, so host
    memory holds one tensor at a time; without, they are returned. With ``towers`` the model
    holds the perception towers too: every tensor of the checkpoint is the model's, none is
    skipped."""
    files = _weight_files(path)
    where: dict[str, str] = {}
    ignored: set[str] = set()
    ignored_count = 0
    unexpected: list[str] = []
    mis_shaped: list[str] = []
    for file, names in files.items():
        try:
            with safe_open(str(path / file), framework="pt") as handle:
                available = set(handle.keys())
                for name in names:
                    if not towers and not is_text_tensor(name):
                        ignored_count += 1
                        ignored.add(".".join(name.split(".")[:2]))
                        continue
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    if name not in available:
                        continue  # reported as missing below
                    piece = handle.get_slice(name)
                    _refuse_non_float(name, piece.get_dtype(), path / file)
                    shape = tuple(piece.get_shape())
                    if shape != tuple(expected[name]):
                        mis_shaped.append(f"{name}: checkpoint {list(shape)}, model {list(expected[name])}")
                        continue
                    where[name] = file
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"cannot read {file} ({exc})", field="checkpoint.shard", value=str(path / file),
                             fix="the file is corrupt or truncated; copy it again") from exc
    missing = [name for name in expected if name not in where and not any(name in m for m in mis_shaped)]
    if mis_shaped:
        raise InputError(f"{len(mis_shaped)} tensor(s) have the wrong shape, e.g. {mis_shaped[0]}",
                         field="checkpoint.tensor", value=mis_shaped[:5],
                         fix="the checkpoint was saved for another model config; load it with load_checkpoint "
                             "(which builds the model from its config.json) or fix config.json")
    if missing:
        raise InputError(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[0]}",
                         field="checkpoint.tensor", value=missing[:5],
                         fix="copy every shard of the checkpoint; a text checkpoint needs every "
                             "model.language_model.* tensor and lm_head.weight"
                             + (", a model with towers every model.vision_tower/audio_tower/vision_adapter/"
                                "vision_projection tensor too" if towers else ""))
    if unexpected:
        raise InputError(f"{len(unexpected)} unexpected {'' if towers else 'text '}tensor(s), e.g. {unexpected[0]}",
                         field="checkpoint.tensor", value=unexpected[:5],
                         fix="the checkpoint does not match config.json (more layers or other modules); "
                             "fix config.json or use the matching checkpoint")
    found: dict[str, torch.Tensor] = {}
    nbytes = 0
    by_file: dict[str, list[str]] = {}
    for name, file in where.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(str(path / file), framework="pt", device=str(device)) as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    nbytes += tensor.numel() * tensor.element_size()
                    if consume is not None:
                        consume(name, tensor)
                    else:
                        found[name] = tensor
                    del tensor
        except Exception as exc:
            raise InputError(f"cannot read {file} ({exc})", field="checkpoint.shard", value=str(path / file),
                             fix="the file is corrupt or truncated; copy it again") from exc
    report = LoadReport(str(path), sorted(files), len(where), ignored_count, sorted(ignored), bytes_read=nbytes,
                        towers=sum(1 for name in where if not is_text_tensor(name)))
    log.info(report.summary())
    return found, report


def check_readable(directory: str | os.PathLike[str]) -> ModelConfig:
    """What loading a checkpoint refuses that its files alone show, read from ``config.json`` and
    the safetensors headers (no tensor data): a config transformers' keys do not read as a Muse
    Spark model (e.g. a NaN), a broken shard index (unreadable, a shard missing, a tensor not in
    the shard it names), an unreadable header, an integer-typed tensor. ``run`` checks a
    checkpoint to start from with it before the run directory exists, and ``launch`` before it
    writes a job (:func:`muse_stack.run.inputs.check_inputs`). Returns the text model's config."""
    path = _checkpoint_dir(directory)
    config = ModelConfig.from_hf_config(path / CONFIG_NAME)
    _towers_of(path)  # the tower configs, where config.json has them, read as the model reads them
    for file, names in _weight_files(path).items():
        try:
            with safe_open(str(path / file), framework="pt") as handle:
                available = set(handle.keys())
                absent = [name for name in names if name not in available]
                if absent:
                    raise InputError(f"{len(absent)} tensor(s) that {INDEX_FILE} places in {file} are not in it, "
                                     f"e.g. {absent[0]}", field="checkpoint.index", value=str(path / INDEX_FILE),
                                     fix="restore the index written with the shards")
                for name in names:
                    _refuse_non_float(name, handle.get_slice(name).get_dtype(), path / file)
        except InputError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise InputError(f"cannot read {file} ({exc})", field="checkpoint.shard", value=str(path / file),
                             fix="the file is corrupt or truncated; copy it again") from exc
    return config


def _check_same_config(model_config: ModelConfig, checkpoint_config: ModelConfig, path: Path) -> None:
    ours, theirs = model_config.model_dump(), checkpoint_config.model_dump()
    ours["layer_types"] = model_config.resolved_layer_types
    theirs["layer_types"] = checkpoint_config.resolved_layer_types
    differing = [key for key in ours if key not in _NON_NUMERIC_FIELDS and ours[key] != theirs[key]]
    if differing:
        key = differing[0]
        raise InputError(
            f"the checkpoint's config.json differs from the model's config in {differing} "
            f"(e.g. {key}: checkpoint {theirs[key]!r}, model {ours[key]!r})",
            field="checkpoint.config", value=str(path / CONFIG_NAME),
            fix="build the model from the checkpoint (load_checkpoint) or load a checkpoint of this config")


def _towers_of(path: Path) -> "TowersConfig | None":
    """The towers' config in ``path``'s config.json, or None when it has no ``vision_config`` and
    ``audio_config``."""
    from muse_stack.models.muse_spark.hf_config import perception_of
    from muse_stack.util.safeio import read_json
    from muse_stack.models.muse_spark.tower_config import TowersConfig

    raw = read_json(path / CONFIG_NAME, field="checkpoint.config", what="config.json",
                    fix="restore the checkpoint's config.json (a JSON object)")
    perception = perception_of(raw)
    return TowersConfig.from_hf(perception) if perception is not None else None


def _check_same_towers(towers: "TowersConfig", path: Path) -> None:
    theirs = _towers_of(path)
    if theirs is None:
        raise InputError("the model has perception towers but the checkpoint's config.json has no vision_config "
                         "and audio_config", field="checkpoint.config", value=str(path / CONFIG_NAME),
                         fix="load a checkpoint saved with towers, or build the model without towers")
    if theirs != towers:
        ours, saved = towers.to_hf(), theirs.to_hf()
        differing = [key for key in ours if ours[key] != saved[key]]
        raise InputError(f"the checkpoint's towers differ from the model's in {differing}",
                         field="checkpoint.config", value=str(path / CONFIG_NAME),
                         fix="build the model from the checkpoint (load_checkpoint(..., towers=True)) or load a "
                             "checkpoint of these towers")


def _holds_towers(path: Path) -> bool:
    return any(not is_text_tensor(name) for names in _weight_files(path).values() for name in names)


def load_weights_into(model: MuseSparkForCausalLM, directory: str | os.PathLike[str]) -> LoadReport:
    """Copy a checkpoint's text weights into ``model`` (keeping the model's dtypes and device);
    a model with towers takes the checkpoint's towers too, whose configs must equal its own.

    Every tensor the model expects must be present with its shape, and the checkpoint's
    config.json must describe the same computation; otherwise :class:`InputError`.
    """
    path = _checkpoint_dir(directory)
    _check_same_config(model.config, ModelConfig.from_hf_config(path / CONFIG_NAME), path)
    towers = getattr(model, "towers_config", None)
    if towers is not None:
        _check_same_towers(towers, path)
    targets = model.state_dict(keep_vars=True)

    @torch.no_grad()
    def copy(name: str, tensor: torch.Tensor) -> None:
        targets[name].copy_(tensor)

    # each tensor goes straight into its parameter: host memory holds one at a time
    _, report = _read_text_tensors(path, {k: v.shape for k, v in targets.items()}, "cpu", consume=copy,
                                   towers=towers is not None)
    model.load_report = report
    return report


def load_checkpoint(directory: str | os.PathLike[str], dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu", *, towers: bool = False) -> MuseSparkForCausalLM:
    """Build a model from ``config.json`` and load its weights.

    ``dtype`` None keeps the stored dtypes; otherwise every tensor is cast to ``dtype`` except
    the router weight and ``e_score_correction_bias``, which stay fp32. The returned model
    carries the :class:`LoadReport` as ``model.load_report``.

    ``towers`` False builds the text decoder alone (tower tensors are skipped and counted as
    ignored). ``towers`` True builds the perception towers too when config.json has
    ``vision_config`` and ``audio_config`` and the checkpoint holds tower tensors; then every
    tensor is loaded and checked (nothing missing, unexpected or mis-shaped). A checkpoint
    without either loads as the text decoder alone, as the report says.
    """
    path = _checkpoint_dir(directory)
    config = ModelConfig.from_hf_config(path / CONFIG_NAME)
    tower_config = _towers_of(path) if towers and _holds_towers(path) else None
    with torch.device("meta"):
        model = MuseSparkForCausalLM(config, seed=None, towers=tower_config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tensors, report = _read_text_tensors(path, expected, device, towers=tower_config is not None)
    # each tensor gets its own allocation: safetensors 0.8 hands out tensors over the mapped file,
    # at the file's offsets rather than the allocator's 64-byte alignment; an unaligned weight takes
    # other SIMD paths, so the loaded model would not compute bitwise what the saved one did, and it
    # would depend on the file staying as it is
    for name, tensor in tensors.items():
        target = torch.float32 if keeps_fp32(name) else (dtype or tensor.dtype)
        tensors[name] = tensor.to(target, copy=True)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.load_report = report
    return model


def hf_tensor_source(folder: Path) -> tuple[list[TensorSpec], TensorGetter]:
    """Every tensor of an HF-layout folder (a checkpoint, or a reference-engine step folder) by
    name, from the headers; each is read only when asked for."""
    from safetensors import safe_open

    files = _weight_files(folder)
    where: dict[str, str] = {}
    specs: list[TensorSpec] = []
    for file, names in files.items():
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in names:
                s = handle.get_slice(name)
                specs.append(TensorSpec(name, tuple(s.get_shape()), safetensors_dtype(s.get_dtype())))
                where[name] = file

    def get(name: str) -> torch.Tensor:
        with safe_open(str(folder / where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return specs, get
