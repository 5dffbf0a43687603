"""``muse-stack export RUN_DIR --hf OUT``: a run's latest checkpoint as a Hugging Face checkpoint.

OUT gets ``config.json`` (the run's model config) and the weights under the model's HF
names, in safetensors shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``
(or one ``model.safetensors``), exactly what :func:`muse_stack.model.load_checkpoint` and
Hugging Face loaders read. Both engines' checkpoints export:

* reference engine: the step folder already holds HF-named safetensors; they are re-sharded;
* megatron engine: a megatron-core dist-checkpoint (torch_dist) holds every tensor once under
  its global name, whatever TP/PP/EP/ETP/DP layout wrote it, so each tensor is read whole
  with ``torch.distributed.checkpoint`` and renamed through :mod:`muse_stack.engines.mcore.weights`.

Tensors are read one shard's worth at a time, so host memory stays near one shard. The
export is written to a private folder renamed to OUT only when complete; an existing OUT is
refused.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from muse_stack import atomic
from muse_stack.errors import InputError
from muse_stack.model.checkpoint import CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE
from muse_stack.model_config import ModelConfig
from muse_stack.recipes.catalogue import parse_recipe
from muse_stack.run import checkpoints


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


Getter = Callable[[str], torch.Tensor]


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the text decoder with this config."""
    from muse_stack.model import MuseSparkForCausalLM

    with torch.device("meta"):
        model = MuseSparkForCausalLM(config, seed=None)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# ---- sources ---------------------------------------------------------------------------
def reference_source(folder: Path) -> tuple[list[Spec], Getter]:
    """The HF-named safetensors of a reference-engine step folder."""
    from safetensors import safe_open

    from muse_stack.model.checkpoint import _weight_files

    files = _weight_files(folder)
    where: dict[str, str] = {}
    specs: list[Spec] = []
    for file, names in files.items():
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in names:
                s = handle.get_slice(name)
                specs.append(Spec(name, tuple(s.get_shape()), _st_dtype(s.get_dtype())))
                where[name] = file

    def get(name: str) -> torch.Tensor:
        with safe_open(str(folder / where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return specs, get


def _st_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32}[name]


_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def dist_key_to_hf(key: str) -> str | None:
    """HF name of a megatron-core dist-checkpoint model key (global names; None: not a weight).

    megatron-core writes a layer's tensors as ``decoder.layers.{global layer}.<name>``; the
    grouped experts' modules gain a second ``experts.`` (``mlp.experts.experts.linear_fc1.weight``,
    one tensor [experts, ...] over all experts, the GLU's gate and up halves in HF order
    whatever ETP split them)."""
    from muse_stack.engines.mcore.weights import EXPERT_NAMES, LAYER_NAMES, LM, TOP_NAMES

    if key in TOP_NAMES:
        return TOP_NAMES[key]
    m = _LAYER_KEY.match(key)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2).replace("mlp.experts.experts.", "mlp.experts.")
    if rest in LAYER_NAMES:
        return f"{LM}layers.{layer}.{LAYER_NAMES[rest]}"
    if rest in EXPERT_NAMES:
        return f"{LM}layers.{layer}.{EXPERT_NAMES[rest]}"
    return None


def megatron_source(folder: Path) -> tuple[list[Spec], Getter]:
    """The model tensors of a megatron-core torch_dist checkpoint, by HF name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    try:
        meta = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise InputError(f"cannot read the dist-checkpoint's metadata ({exc})", field="checkpoint",
                         value=str(folder), fix="the checkpoint is incomplete or not a torch_dist checkpoint") from exc
    keys: dict[str, str] = {}
    specs: list[Spec] = []
    for key, md in meta.state_dict_metadata.items():
        hf = dist_key_to_hf(key)
        if hf is None or not isinstance(md, TensorStorageMetadata):
            continue
        if hf in keys:
            raise InputError(f"two dist-checkpoint tensors map to {hf}: {keys[hf]} and {key}", field="checkpoint",
                             value=str(folder), fix="report this layout: the weight mapping is not one-to-one here")
        keys[hf] = key
        specs.append(Spec(hf, tuple(md.size), md.properties.dtype))

    by_name = {s.name: s for s in specs}

    def get(name: str) -> torch.Tensor:
        spec = by_name[name]
        box = {keys[name]: torch.empty(spec.shape, dtype=spec.dtype)}
        dcp.load(box, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
        return box[keys[name]]

    return specs, get


# ---- writing ---------------------------------------------------------------------------
def plan_shards(specs: list[Spec], max_bytes: int) -> list[list[Spec]]:
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_hf(out: Path, config: ModelConfig, specs: list[Spec], get: Getter, *,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Callable[[int], None] | None = None) -> Path:
    from safetensors.torch import save_file

    expected = expected_tensors(config)
    have = {s.name: s for s in specs}
    missing = [n for n in expected if n not in have]
    extra = [n for n in have if n not in expected]
    wrong = [f"{n}: checkpoint {list(have[n].shape)}, model {list(shape)}" for n, shape in expected.items()
             if n in have and tuple(have[n].shape) != shape]
    for problem, listed in (("missing from", missing), ("not in the model of", extra), ("mis-shaped in", wrong)):
        if listed:
            raise InputError(f"{len(listed)} tensor(s) {problem} the checkpoint, e.g. {listed[0]}",
                             field="checkpoint", value=listed[:5],
                             fix="export a checkpoint written by this version of muse-stack for this recipe")
    ordered = [have[n] for n in expected]  # the model's own order
    shards = plan_shards(ordered, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            file = SINGLE_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {s.name: get(s.name).contiguous() for s in shard}
            save_file(tensors, str(staging / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors
            if progress is not None:
                progress(len(shard))
        if len(shards) > 1:
            atomic.write_json(staging / INDEX_FILE, {"metadata": {"total_size": sum(s.nbytes for s in ordered)},
                                                     "weight_map": weight_map})
        atomic.write_json(staging / CONFIG_NAME, config.to_hf_config())
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def export_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> tuple[Path, int, int]:
    """Export the latest checkpoint of ``run_dir`` to ``out``; returns (out, step, tensors)."""
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise InputError("the export directory already exists; an export never overwrites", field="--hf",
                         value=str(out), fix="choose a new directory")
    current = checkpoints.latest(run_dir)
    if current is None:
        raise InputError("the run has no complete checkpoint (checkpoints/latest is missing)", field="RUN_DIR",
                         value=str(run_dir), fix="export a run that saved a checkpoint, or --resume it first")
    text = current.recipe_text()
    if text is None:
        raise InputError("the checkpoint does not record its recipe", field="RUN_DIR", value=str(current.path),
                         fix="export a checkpoint written by muse-stack run")
    recipe = parse_recipe(yaml.safe_load(text), str(current.path / checkpoints.RECIPE))
    config = recipe.model_config_resolved()
    if recipe.engine == "megatron":
        specs, get = megatron_source(current.path)
    else:
        specs, get = reference_source(current.path)
    if not progress:
        return write_hf(out, config, specs, get, max_shard_bytes=max_shard_bytes), current.step, len(specs)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(f"export step {current.step}", total=len(specs))
        write_hf(out, config, specs, get, max_shard_bytes=max_shard_bytes,
                 progress=lambda n: bar.update(task, advance=n))
    return out, current.step, len(specs)


