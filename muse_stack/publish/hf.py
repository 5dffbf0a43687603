"""``muse-stack export RUN_DIR --hf OUT``: a run's latest checkpoint as a Hugging Face checkpoint.

OUT gets ``config.json`` (the run's model config) and the weights under the model's HF
names, in safetensors shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``
(or one ``model.safetensors``), exactly what :func:`muse_stack.models.muse_spark.load_checkpoint` and
Hugging Face loaders read. Both engines' checkpoints export:

* reference engine: the step folder already holds HF-named safetensors; they are re-sharded
  (a model with perception towers saved them there too, and they are exported as they are);
* megatron engine: a megatron-core dist-checkpoint (torch_dist) holds every tensor once under
  its global name, whatever TP/PP/EP/ETP/DP layout wrote it, so each tensor is read whole
  with ``torch.distributed.checkpoint`` and renamed through :mod:`muse_stack.engines.mcore.weights`.

An adapter checkpoint (a peft run, either engine) exports with ``--adapters-only`` (the Hugging
Face ``peft`` layout, :func:`muse_stack.models.muse_spark.peft_io.export_adapters_hf_peft`) or ``--merge``
(the base, rebuilt as the engine built it from the recipe's towers, the seed and the checkpoint it
names, and checked against the saved identity, with the adapters folded in, written with every file
a plain export has); a megatron base initialised from the seed is not on disk, so ``--merge`` of it
is refused.

An image-text run's export also holds ``processor_config.json`` (:func:`processor_config`), so that
``AutoProcessor.from_pretrained`` builds transformers' processor for it.

Tensors are read one shard's worth at a time, so host memory stays near one shard. The
export is written to a private folder renamed to OUT only when complete; an existing OUT is
refused.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from muse_stack.util import atomic
from muse_stack.engines.spec import engine_spec
from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.hf_config import full_config
from muse_stack.models.muse_spark.checkpoint import (CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, TensorGetter,
                                         TensorSpec)
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes.catalogue import parse_recipe
from muse_stack.run import checkpoints

if TYPE_CHECKING:
    from muse_stack.models.muse_spark.hf_export import Towers


Spec = TensorSpec
Getter = TensorGetter


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the text decoder with this config."""
    from muse_stack.models.muse_spark import MuseSparkForCausalLM

    with torch.device("meta"):
        model = MuseSparkForCausalLM(config, seed=None)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# ---- sources ---------------------------------------------------------------------------
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
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Callable[[int], None] | None = None,
             towers: "Towers | None" = None, extras: Callable[[Path], None] | None = None) -> Path:
    """Write the decoder's tensors (``specs``, read through ``get``) and ``towers`` (default: the
    placeholder towers of seed 0) in transformers' layout; ``extras`` adds files to the folder
    before it is renamed to ``out``."""
    from safetensors.torch import save_file

    from muse_stack.models.muse_spark.hf_export import placeholder_towers

    towers = towers if towers is not None else placeholder_towers(config, seed=0)

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
    tower_specs = [Spec(n, towers.shapes[n], towers.dtypes[n]) for n in towers.names]
    sources = {**{s.name: get for s in ordered}, **{s.name: towers.get for s in tower_specs}}
    ordered += tower_specs
    shards = plan_shards(ordered, max_shard_bytes)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = atomic.make_temp_dir(out)
    except OSError as exc:
        raise _write_error(out, exc) from exc
    try:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            file = SINGLE_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {s.name: sources[s.name](s.name).contiguous() for s in shard}
            save_file(tensors, str(staging / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors
            if progress is not None:
                progress(len(shard))
        if len(shards) > 1:
            atomic.write_json(staging / INDEX_FILE, {"metadata": {"total_size": sum(s.nbytes for s in ordered)},
                                                     "weight_map": weight_map})
        atomic.write_json(staging / CONFIG_NAME, full_config(config, towers.config))
        if extras is not None:
            extras(staging)
        atomic.follow_umask(staging)  # safetensors writes its files 0600
        os.rename(staging, out)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _refused_write(exc, staging, out):
            raise _write_error(out, exc) from exc
        raise
    return out


def _refused_write(exc: BaseException, staging: Path, out: Path) -> bool:
    """Whether ``exc`` is the file system refusing the export's own writes (into ``staging``, or its rename
    to ``out``), not a checkpoint file that could not be read: a full disk however a writer wraps it, or an
    OSError on a path of the export."""
    if not isinstance(exc, Exception):
        return False
    if atomic.disk_full(exc):
        return True
    if not isinstance(exc, OSError):
        return False
    if exc.filename is None:
        return exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    path = Path(os.fsdecode(exc.filename))
    return path == out or path == staging or staging in path.parents


def _write_error(out: Path, exc: BaseException) -> InputError:
    """An export that the file system refused (full, read-only, not permitted): the path, the cause, and
    that nothing was left behind."""
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    if atomic.disk_full(exc):
        try:
            room = f"; {shutil.disk_usage(next(p for p in out.parents if p.exists())).free / 2**30:.1f} GiB free"
        except (OSError, StopIteration):
            room = ""
        return InputError(f"the export's file system is full ({cause}{room}); nothing was left at {out}",
                          field="--hf", value=str(out),
                          fix="free space there, or export to a file system with room for the checkpoint "
                              "(about the size of its step folder)")
    return InputError(f"cannot write the export at {out}: {cause}; nothing was left", field="--hf", value=str(out),
                      fix="choose a --hf path on a file system and under a folder you can write to")


# ---- adapter checkpoints (LoRA / DoRA) ---------------------------------------------------
def _adapted_model(config: ModelConfig, settings, tensors: dict[str, torch.Tensor], *, base: torch.nn.Module | None):
    """A reference model with ``settings``' adapters holding ``tensors``: on the meta device
    (adapters only real) when ``base`` is None, else ``base`` itself with the adapters attached."""
    from muse_stack.models.muse_spark import MuseSparkForCausalLM
    from muse_stack.models.muse_spark.peft import adapter_state_dict, apply_peft

    if base is None:
        with torch.device("meta"):
            base = MuseSparkForCausalLM(config, seed=None)
    apply_peft(base, settings, seed=0)  # initial values are replaced below
    wanted = adapter_state_dict(base)
    missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    shaped = [k for k in wanted if k in tensors and tuple(tensors[k].shape) != tuple(wanted[k].shape)]
    if missing or extra or shaped:
        what = (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}" if extra
                else f"wrong shape {shaped[:3]}")
        raise InputError(f"the checkpoint's adapters do not match its recipe's peft settings: {what}",
                         field="checkpoint", value=len(tensors), fix="export a checkpoint written by this version")
    meta_device = next(base.parameters()).device.type == "meta"
    with torch.no_grad():
        if meta_device:
            base.load_state_dict({k: tensors[k].to(wanted[k].dtype, copy=True) for k in wanted}, strict=False,
                                 assign=True)  # owned, aligned memory, not the mapped file
        else:
            for k, t in wanted.items():
                t.copy_(tensors[k])
    return base


def _merge_base(config: ModelConfig, engine: str, base_id: dict, folder: Path, *, towers, seed: int) -> torch.nn.Module:
    """The base model the adapters sit on, on the CPU, built as the run's engine built it (the
    recipe's towers, the run's seed, then the checkpoint it started from), checked against the
    saved identity."""
    from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_weights_into

    spec = engine_spec(engine)
    path = base_id.get("path")
    if path and not Path(path).is_dir():
        raise InputError(f"--merge needs the base checkpoint the adapters sit on; {path} is not a directory here",
                         field="--merge", value=path,
                         fix="run the export where that checkpoint is, or use --adapters-only")
    spec.check_base(None, path, base_id, folder)  # refusals before anything is built
    init_seed = base_id.get("init_seed")
    model = MuseSparkForCausalLM(config, seed=init_seed if init_seed is not None and not path else seed, towers=towers)
    if path:
        load_weights_into(model, path)
    spec.check_base(model, path, base_id, folder)
    return model


def export_adapter_run(folder: Path, recipe, config: ModelConfig, meta: dict, out: Path, *, merge: bool,
                       run_dir: Path, step: int, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       progress: Callable[[int], None] | None = None) -> int:
    """--adapters-only (the ``peft`` layout) or --merge: the base with the adapters folded in,
    written as the plain export writes a run (the towers, tokenizer, generation config, model card)."""
    from muse_stack.models.muse_spark.peft import merge_adapters
    from muse_stack.models.muse_spark.peft_io import export_adapters_hf_peft
    from muse_stack.models.muse_spark.peft_config import PeftSettings

    p = meta["peft"]
    settings = PeftSettings(scheme=p["scheme"], rank=p["rank"], alpha=p["alpha"], dropout=p["dropout"],
                            targets=tuple(p["targets"]), per_expert=p["per_expert"])
    base_id = meta.get("base") or {}
    towers_config = recipe.towers_config_resolved(config)
    seed = recipe.training.seed if recipe.training.seed is not None else 0
    # refusals before any tensor is read
    base = _merge_base(config, recipe.engine, base_id, folder, towers=towers_config, seed=seed) if merge else None
    tensors = engine_spec(recipe.engine).adapter_tensors(folder)
    model = _adapted_model(config, settings, tensors, base=base)
    if not merge:
        export_adapters_hf_peft(model, out, settings, base_model_name_or_path=base_id.get("hf_id") or base_id.get("path"),
                                revision=base_id.get("revision"))
        return len(tensors)
    from muse_stack.models.muse_spark.hf_export import towers_from_tensors

    merged = merge_adapters(model)
    del model, base
    specs = [Spec(name, tuple(t.shape), t.dtype) for name, t in merged.items()]
    own = None
    if towers_config is not None:
        own = towers_from_tensors(specs, merged.__getitem__, towers_config.to_hf(),
                                  source=f"this run's base (its step {step} adapters sit on it)")
        if own is not None:
            specs = [s for s in specs if s.name not in set(own.names)]
    towers, extras = _export_companions(run_dir, recipe, config, step, out, own=own)
    write_hf(out, config, specs, merged.__getitem__, max_shard_bytes=max_shard_bytes, progress=progress,
             towers=towers, extras=extras)
    return len(tensors)


def export_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False,
               merge: bool = False, adapters_only: bool = False) -> tuple[Path, int, int]:
    """Export the latest checkpoint of ``run_dir`` to ``out``; returns (out, step, tensors).
    An adapter checkpoint needs ``merge`` (base + folded adapters) or ``adapters_only``."""
    run_dir, out = Path(run_dir), Path(out)
    if merge and adapters_only:
        raise InputError("--merge and --adapters-only exclude each other", field="--merge", value=True,
                         fix="pass one: --merge (a plain HF checkpoint) or --adapters-only (the peft layout)")
    if out.is_symlink() and not out.exists():
        raise InputError(f"the export path is a symbolic link to {os.readlink(out)}, which does not exist; an "
                         "export never writes through a link", field="--hf", value=str(out),
                         fix="choose a new directory (or remove the link)")
    if out.exists():
        raise InputError("the export directory already exists; an export never overwrites", field="--hf",
                         value=str(out), fix="choose a new directory")
    current = checkpoints.latest(run_dir)
    if current is None:
        raise InputError("the run has no complete checkpoint (neither checkpoints/latest nor a complete step "
                         "folder)", field="RUN_DIR", value=str(run_dir),
                         fix="export a run that saved a checkpoint, or --resume it first")
    text = current.recipe_text()
    if text is None:
        raise InputError("the checkpoint does not record its recipe", field="RUN_DIR", value=str(current.path),
                         fix="export a checkpoint written by muse-stack run")
    from muse_stack.util.safeio import load_yaml

    source = str(current.path / checkpoints.RECIPE)
    recipe = parse_recipe(load_yaml(text, source=source, field="RUN_DIR", error=InputError), source)
    config = recipe.model_config_resolved()
    engine = engine_spec(recipe.engine)
    meta = engine.adapter_meta(current.path)
    if meta is None and (merge or adapters_only):
        flag = "--merge" if merge else "--adapters-only"
        raise InputError(f"{flag} exports adapters, but the checkpoint holds a full model", field=flag, value=True,
                         fix=f"drop {flag}: the full model exports as it is")
    if meta is not None:
        if not (merge or adapters_only):
            raise InputError("the checkpoint holds adapters only (the base is not copied)", field="--hf",
                             value=str(current.path),
                             fix="pass --adapters-only (the Hugging Face peft layout) or --merge (the base with "
                                 "the adapters folded in, as a plain HF checkpoint)")
        if not (merge and progress):
            count = export_adapter_run(current.path, recipe, config, meta, out, merge=merge, run_dir=run_dir,
                                       step=current.step, max_shard_bytes=max_shard_bytes)
            return out, current.step, count
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(f"export step {current.step} (merged)", total=None)
            count = export_adapter_run(current.path, recipe, config, meta, out, merge=True, run_dir=run_dir,
                                       step=current.step, max_shard_bytes=max_shard_bytes,
                                       progress=lambda n: bar.update(task, advance=n))
        return out, current.step, count
    specs, get = engine.hf_tensors(current.path)
    from muse_stack.models.muse_spark.hf_export import towers_of_step

    own = towers_of_step(current.path, specs, get, recipe.towers_config_resolved())  # either engine's
    if own is not None:
        own.source = f"this run's step {current.step} checkpoint (trained with the run)"
        names = set(own.names)
        specs = [s for s in specs if s.name not in names]  # written as the towers, not as decoder tensors
    towers, extras = _export_companions(run_dir, recipe, config, current.step, out, own=own)
    if not progress:
        write_hf(out, config, specs, get, max_shard_bytes=max_shard_bytes, towers=towers, extras=extras)
        return out, current.step, len(specs)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(f"export step {current.step}", total=len(specs) + len(towers.names))
        write_hf(out, config, specs, get, max_shard_bytes=max_shard_bytes,
                 progress=lambda n: bar.update(task, advance=n), towers=towers, extras=extras)
    return out, current.step, len(specs)


def generation_config(model: ModelConfig, tokenizer_dir: Path | None) -> dict[str, object]:
    """``generation_config.json``: the ids of the tokenizer the run trained with where it has
    them (its end-of-turn token as a further stop id), else the model config's."""
    bos, eos, pad = model.bos_token_id, model.eos_token_id, model.pad_token_id
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        from muse_stack.data.chat import ChatTokenizer

        tok = ChatTokenizer(tokenizer_dir)
        stops = [tok.eos_id]
        end_of_turn = tok.tokenizer.token_to_id("<|eot|>")
        if end_of_turn is not None and end_of_turn not in stops:
            stops.append(end_of_turn)
        bos, eos, pad = tok.bos_id, stops if len(stops) > 1 else stops[0], tok.pad_id
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}


#: the processor classes transformers 5.24 maps ``muse_spark`` to (models/auto/processing_auto.py,
#: image_processing_auto.py, video_processing_auto.py, feature_extraction_auto.py)
PROCESSOR_CLASSES = {"processor_class": "MuseSparkProcessor", "image_processor_type": "MuseGlimmerImageProcessor",
                     "video_processor_type": "MuseGlimmerVideoProcessor",
                     "feature_extractor_type": "MuseSparkFeatureExtractor"}
PROCESSOR_FILE = "processor_config.json"


def processor_config(recipe, towers: "Towers") -> dict[str, object] | None:
    """``processor_config.json`` of an image-text run, as ``MuseSparkProcessor.save_pretrained``
    lays it out, so that ``AutoProcessor.from_pretrained(OUT)`` builds transformers' processor:
    the image settings the run's rows were built with (patch, temporal patch and merge sizes of its
    vision tower, the image token limit, the rescale and normalisation of
    :mod:`muse_stack.data.images`), the same sizes for video, and the audio tower's samples per
    token. A key left out takes the transformers class's default. None for a text run."""
    if recipe.data is None or recipe.data.kind != "multimodal":
        return None
    from muse_stack.data.build import image_spec_for
    from muse_stack.data.images import IMAGE_MEAN, IMAGE_STD, RESCALE_FACTOR
    from muse_stack.models.muse_spark.tower_config import TowersConfig

    spec = image_spec_for(recipe)
    sizes = {"patch_size": spec.patch_size, "temporal_patch_size": spec.temporal_patch_size,
             "merge_size": spec.merge_size}
    return {
        "processor_class": PROCESSOR_CLASSES["processor_class"],
        "image_processor": {"image_processor_type": PROCESSOR_CLASSES["image_processor_type"], **sizes,
                            "max_image_tokens": spec.max_image_tokens, "rescale_factor": RESCALE_FACTOR,
                            "image_mean": [IMAGE_MEAN] * 3, "image_std": [IMAGE_STD] * 3},
        "video_processor": {"video_processor_type": PROCESSOR_CLASSES["video_processor_type"], **sizes},
        "feature_extractor": {"feature_extractor_type": PROCESSOR_CLASSES["feature_extractor_type"],
                              "samples_per_token": TowersConfig.from_hf(towers.config).audio_config.samples_per_token},
    }


def _export_companions(run_dir: Path, recipe, config: ModelConfig, step: int, out: Path, *,
                       own: "Towers | None" = None):
    """The towers an export carries (the run's ``own``, read from its step folder; else the
    pretrained checkpoint's; else placeholders from the run's seed) and the writer of its other
    files: generation config, tokenizer, model card and, for an image-text run, the processor's
    config (:func:`processor_config`)."""
    from muse_stack.models.muse_spark import hf_export

    towers = own
    pretrained = recipe.model.pretrained_checkpoint
    if towers is None and pretrained and Path(pretrained).is_dir():
        towers = hf_export.towers_from_checkpoint(pretrained)
    if towers is None:
        towers = hf_export.placeholder_towers(config, seed=recipe.training.seed)
    tokenizer = Path(recipe.data.tokenizer) if recipe.data is not None and recipe.data.tokenizer else None

    processor = processor_config(recipe, towers)

    def extras(folder: Path) -> None:
        atomic.write_json(folder / "generation_config.json", generation_config(config, tokenizer))
        copied = hf_export.copy_tokenizer(tokenizer, folder)
        if processor is not None:
            atomic.write_json(folder / PROCESSOR_FILE, processor)
        card = hf_export.model_card(recipe=recipe.name, run_dir=run_dir.resolve(), step=step,
                                    loss=hf_export.final_loss(run_dir, step),
                                    fingerprint_sha256=hf_export.file_sha256(run_dir / "fingerprint.json"),
                                    towers=towers, tokenizer_files=copied, out_name=str(out))
        atomic.write_text(folder / "README.md", card)

    return towers, extras


