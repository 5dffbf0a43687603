"""Build (or find in the cache) the training rows of a recipe.

:func:`build_for_recipe` resolves the recipe's data section into builder parameters, looks the
build up in the cache, and on a miss loads the source, renders and masks every conversation,
builds the rows and writes ``rows.parquet`` + ``build.json`` into a private temporary directory
that is renamed into place only when complete. An interrupted build therefore leaves no final
output; the next build removes the dead build's temporary directory and starts again.

The cache key is the sha256 of the builder parameters (builder, row/pack size, alignment, seed,
limits; for image-text rows also the prompt, the image processor's settings and the image token
id), the source fingerprint (sha256 of each local file, or dataset id + revision + split; for
image-text rows also of each image file the rows name), the tokenizer.json and chat template
sha256, the template kwargs and the loss mask type. Image-text rows are built by
:mod:`muse_stack.data.multimodal`. The
cache directory is ``--cache``, else ``$MUSE_STACK_CACHE/data``, else ``~/.cache/muse-stack/data``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse_stack.util.atomic import write_json
from muse_stack.data.builders import build_fixed, build_packed, build_synthetic
from muse_stack.data.chat import LOSS_MASKS, ChatTokenizer
from muse_stack.data.packing import pack_alignment
from muse_stack.data.rows import Rows, read_parquet, rows_sha256, write_parquet
from muse_stack.data.sources import load_source, messages_of, resolve_path
from muse_stack.util.errors import InputError, RecipeError
from muse_stack.recipes.schema import Recipe

log = logging.getLogger("muse_stack.data")

FORMAT_VERSION = 1
CACHE_ENV = "MUSE_STACK_CACHE"


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) / "data" if env else Path.home() / ".cache" / "muse-stack" / "data"


@dataclass
class Plan:
    """What a recipe's data section asks for, resolved."""

    builder: str
    row_tokens: int
    seed: int
    alignment: int = 1
    limit: int | None = None
    overlong: str = "drop"
    messages_key: str = "messages"
    gbs: int | None = None
    vocab_size: int | None = None
    tokenizer_dir: Path | None = None
    label: str = "rows"
    #: why there is no tokenizer_dir, when the plan was made without one (``data show``)
    tokenizer_missing: str | None = None
    #: image-text rows: the prompt, the image processor's settings and the model's image_token_id
    image: dict[str, Any] | None = None

    def params(self) -> dict[str, Any]:
        out = {"builder": self.builder, "row_tokens": self.row_tokens, "seed": self.seed}
        if self.image is not None:
            out["image"] = dict(self.image)
        if self.builder == "fixed":
            out["limit"] = self.limit
        if self.builder == "packed":
            out.update(alignment=self.alignment, overlong=self.overlong)
        if self.builder == "synthetic":
            out.update(limit=self.limit, vocab_size=self.vocab_size)
        else:
            out["messages_key"] = self.messages_key
        return out


def _resolve_tokenizer(recipe: Recipe) -> Path:
    d, m = recipe.data, recipe.model
    candidates = [(f, v) for f, v in (("data.tokenizer", d.tokenizer), ("model.pretrained_checkpoint",
                  m.pretrained_checkpoint), ("model.config_path", m.config_path)) if v]
    for fieldname, value in candidates:
        path = resolve_path(value)
        if path.is_file():
            path = path.parent
        if (path / "tokenizer.json").is_file():
            return path
        if fieldname == "data.tokenizer" and "/" in value and not path.exists():
            cached = _hub_tokenizer(value, m.revision if m.hf_id == value else None)
            if cached is not None:
                return cached
    if m.hf_id:
        cached = _hub_tokenizer(m.hf_id, m.revision)
        if cached is not None:
            return cached
        candidates.append(("model.hf_id", f"{m.hf_id}@{m.revision} in the local Hugging Face cache"))
    hint = f" (tried {', '.join(v for _, v in candidates)})" if candidates else ""
    raise InputError(f"no tokenizer.json for the recipe's data{hint}", field="data.tokenizer", value=d.tokenizer,
                     fix="set data.tokenizer to a directory with tokenizer.json and chat_template.jinja "
                         "(or a Hugging Face model id already in the local cache, HF_HOME)")


def _hub_tokenizer(repo_id: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import hf_hub_download

        tok = hf_hub_download(repo_id, "tokenizer.json", revision=revision, local_files_only=True)
        hf_hub_download(repo_id, "chat_template.jinja", revision=revision, local_files_only=True)
        return Path(tok).parent
    except Exception:  # not in the local cache
        return None


def plan_for_recipe(recipe: Recipe, *, require_tokenizer: bool = True) -> Plan:
    """The build plan of a recipe's data. Without ``require_tokenizer`` a tokenizer that cannot be
    found leaves ``tokenizer_dir`` None and says why in ``tokenizer_missing`` (what ``data show``
    can report without it), instead of raising."""
    d, b, t = recipe.data, recipe.batch, recipe.training
    seed = next((s for s in (d.seed, t.data_seed, t.seed) if s is not None), 0)
    label = d.build_name or recipe.name
    image = _image_plan(recipe) if d.kind == "multimodal" else None
    builder = "synthetic" if d.kind == "synthetic" else (d.builder or ("packed" if b.packed or image else "fixed"))
    if builder == "synthetic":
        if not b.seq_length:
            raise RecipeError("synthetic rows need a row length", field="batch.seq_length", value=None,
                              fix="set batch.seq_length")
        rows = d.rows or ((b.gbs or 1) * t.steps if t.steps else None)
        if not rows:
            raise RecipeError("synthetic rows need a count", field="data.rows", value=None,
                              fix="set data.rows, or training.steps and batch.gbs")
        vocab = recipe.model_config_resolved().vocab_size
        return Plan(builder="synthetic", row_tokens=b.seq_length, seed=seed, limit=rows, vocab_size=vocab,
                    gbs=b.gbs, label=label)
    if d.loss_mask not in (None, *LOSS_MASKS):
        raise RecipeError("unknown loss mask type", field="data.loss_mask", value=d.loss_mask,
                          fix=f"use one of {', '.join(LOSS_MASKS)}")
    overlong = d.details.get("overlong", "drop")
    if overlong not in ("drop", "truncate"):
        raise RecipeError("unknown policy for conversations longer than a pack", field="data.details.overlong",
                          value=overlong, fix="use drop or truncate")
    missing = None
    try:
        tok_dir: Path | None = _resolve_tokenizer(recipe)
    except InputError as exc:
        if require_tokenizer:
            raise
        tok_dir, missing = None, exc.message
    key = d.details.get("messages_key", "messages")
    if builder == "fixed":
        if not b.seq_length:
            raise RecipeError("fixed rows need a row length", field="batch.seq_length", value=None,
                              fix="set batch.seq_length")
        return Plan(builder="fixed", row_tokens=b.seq_length, seed=seed, limit=d.rows, messages_key=key,
                    gbs=b.gbs, tokenizer_dir=tok_dir, label=label, tokenizer_missing=missing)
    size = d.packed_size or b.seq_length
    if not size:
        raise RecipeError("packed rows need a pack size", field="data.packed_size", value=None,
                          fix="set data.packed_size or batch.seq_length")
    return Plan(builder="packed", row_tokens=size, seed=seed, alignment=pack_alignment(recipe.layout, b),
                overlong=overlong, messages_key=key, gbs=b.gbs, tokenizer_dir=tok_dir, label=label,
                tokenizer_missing=missing, image=image)


def _image_plan(recipe: Recipe) -> dict[str, Any]:
    """What image-text rows are built with: packed whole conversations, the ``muse_spark`` loss
    mask, the prompt, the image processor's settings (the vision tower's patch, temporal patch and
    merge sizes; transformers' 4096 merged tokens at most) and the model's image_token_id."""
    from muse_stack.data.images import MAX_IMAGE_PIXELS, MAX_IMAGE_TOKENS
    from muse_stack.data.multimodal import DEFAULT_PROMPT

    d, b = recipe.data, recipe.batch
    builder = d.builder or ("packed" if b.packed is not False else "fixed")
    if builder != "packed":
        raise RecipeError("image-text rows are packed whole: fixed rows cut the stream anywhere, also through an "
                          "image's placeholders", field="data.builder", value=builder,
                          fix="set data.builder: packed (or batch.packed: true)")
    if d.details.get("overlong") == "truncate":
        raise RecipeError("an image-text conversation is never cut: its image placeholders must all reach the model",
                          field="data.details.overlong", value="truncate", fix="use drop (conversations longer "
                          "than a pack are left out and counted)")
    if (d.loss_mask or "muse_spark") != "muse_spark":
        raise RecipeError("image-text rows supervise assistant text only", field="data.loss_mask", value=d.loss_mask,
                          fix="use muse_spark")
    det = d.details
    prompt = det.get("prompt", DEFAULT_PROMPT)
    limits = {"max_image_tokens": det.get("max_image_tokens", MAX_IMAGE_TOKENS),
              "max_image_pixels": det.get("max_image_pixels", MAX_IMAGE_PIXELS)}
    if not isinstance(prompt, str) or not prompt.strip():
        raise RecipeError("the user prompt beside each image must be text", field="data.details.prompt", value=prompt,
                          fix='give a sentence, e.g. "Describe this image." (Megatron-Bridge\'s)')
    for name, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            default = MAX_IMAGE_TOKENS if name == "max_image_tokens" else MAX_IMAGE_PIXELS
            raise RecipeError("must be a positive whole number", field=f"data.details.{name}", value=value,
                              fix=f"leave it out (default {default})")
    towers = recipe.towers_config_resolved()
    v = towers.vision_config
    return {"prompt": prompt, "patch_size": v.patch_size, "temporal_patch_size": v.patch_temporal,
            "merge_size": v.merge_size, **limits, "image_token_id": towers.image_token_id}


def image_spec_for(recipe: Recipe):
    """The image processor settings (an ImageSpec) an image-text recipe's rows are built with."""
    return image_spec_of(_image_plan(recipe))


def image_spec_of(image: dict[str, Any]):
    from muse_stack.data.images import ImageSpec

    return ImageSpec(patch_size=image["patch_size"], temporal_patch_size=image["temporal_patch_size"],
                     merge_size=image["merge_size"], max_image_tokens=image["max_image_tokens"],
                     max_image_pixels=image["max_image_pixels"])


def source_fingerprint(recipe: Recipe) -> dict[str, Any]:
    d = recipe.data
    if d.files:
        files = []
        for text in d.files:
            path = resolve_path(text)
            if not path.is_file():
                raise InputError("a data file does not exist", field="data.files", value=text,
                                 fix="give existing parquet/jsonl files with the dataset's schema, or set data.dataset")
            files.append({"name": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
        out = {"files": files, "split": d.split}
        if d.kind == "multimodal":  # the image files the rows name: their bytes, not only their paths
            from muse_stack.data.multimodal import image_files_fingerprint

            out["images"] = image_files_fingerprint(d)
        return out
    if d.dataset:
        out: dict[str, Any] = {"dataset": d.dataset, "revision": d.revision, "split": d.split or "train",
                               "subset": d.subset}
        local = Path(d.dataset).expanduser()
        if local.is_dir():  # a dataset folder on disk: its content, not its name, keys the cache
            out["files"] = [{"name": str(f.relative_to(local)), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                            for f in sorted(local.rglob("*")) if f.is_file()]
        return out
    raise InputError("the recipe names no data source", field="data.dataset", value=None,
                     fix="set data.dataset (a Hugging Face dataset id, with data.revision) or data.files=[...]")


@dataclass
class BuiltData:
    """A finished build: ``path`` holds ``rows.parquet`` and ``build.json``."""

    path: Path
    rows_sha256: str
    num_rows: int
    stats: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    _rows: Rows | None = field(default=None, repr=False)

    @property
    def parquet(self) -> Path:
        return self.path / "rows.parquet"

    @property
    def row_tokens(self) -> int:
        return int(self.stats["row_tokens"])

    def rows(self) -> Rows:
        if self._rows is None:
            try:
                self._rows = read_parquet(self.parquet)
            except Exception as exc:  # pyarrow's errors for a truncated or foreign file have no common base
                raise InputError(f"{self.parquet} cannot be read ({type(exc).__name__}: {str(exc)[:200]})",
                                 field="rows.parquet", value=str(self.parquet),
                                 fix=f"the build is corrupt; remove {self.path} and build it again") from exc
        image = (self.meta.get("inputs") or {}).get("params", {}).get("image")
        if self._rows.images is not None and self._rows.image_spec is None and isinstance(image, dict):
            self._rows.image_spec = image_spec_of(image)
        return self._rows

    def batches(self, micro_batch_size: int, seed: int | None = 0, rank: int = 0, world_size: int = 1,
                epochs: int | None = 1):
        """Training micro-batches for one data-parallel rank; see :func:`muse_stack.data.batches.iterate`."""
        from muse_stack.data.batches import iterate

        return iterate(self.rows(), micro_batch_size, seed=seed, rank=rank, world_size=world_size, epochs=epochs,
                       pad_id=int(self.meta.get("pad_id", 0)))

    @classmethod
    def open(cls, path: str | Path) -> "BuiltData":
        path = Path(path)
        meta_path = path / "build.json"
        if not meta_path.is_file() or not (path / "rows.parquet").is_file():
            raise InputError("not a finished data build", field="path", value=str(path),
                             fix="run `muse-stack data build RECIPE`")
        from muse_stack.util.safeio import read_json

        fix = f"the build is corrupt; remove {path} and build it again (`muse-stack data build RECIPE --force`)"
        meta = read_json(meta_path, field="build.json", what="data build record", fix=fix)
        stats = meta.get("stats")
        if not (isinstance(meta.get("rows_sha256"), str) and isinstance(stats, dict)
                and isinstance(stats.get("rows"), int) and isinstance(meta.get("parquet_sha256"), str)):
            raise InputError(f"{meta_path} lacks rows_sha256, parquet_sha256 or stats.rows", field="build.json",
                             value=str(meta_path), fix=fix)
        return cls(path=path, rows_sha256=meta["rows_sha256"], num_rows=stats["rows"], stats=stats, meta=meta)

    def mismatch(self) -> str | None:
        """Why the stored rows.parquet is not the file this build recorded (its sha256), or None."""
        digest = hashlib.sha256()
        with open(self.parquet, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        got, want = digest.hexdigest(), self.meta["parquet_sha256"]
        return None if got == want else f"rows.parquet has sha256 {got[:16]}..., build.json recorded {want[:16]}..."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(final: Path) -> None:
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def cache_key(recipe: Recipe, plan: Plan, tokenizer: ChatTokenizer | None) -> tuple[str, dict[str, Any]]:
    inputs: dict[str, Any] = {"format": FORMAT_VERSION, "params": plan.params()}
    if tokenizer is not None:
        inputs.update(source=source_fingerprint(recipe), tokenizer_sha256=tokenizer.tokenizer_sha256,
                      template_sha256=tokenizer.template_sha256, template_kwargs=tokenizer.template_kwargs,
                      loss_mask=recipe.data.loss_mask or "muse_spark")
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest(), inputs


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    disable=not enabled, transient=False)


def _make_rows(recipe: Recipe, plan: Plan, tokenizer: ChatTokenizer | None, progress) -> tuple[Rows, dict]:
    if plan.builder == "synthetic":
        return build_synthetic(plan.limit or 1, plan.row_tokens, plan.vocab_size or 2, plan.seed)
    assert tokenizer is not None
    if plan.image is not None:
        return _make_image_rows(recipe, plan, tokenizer, progress)
    source = load_source(recipe.data)
    task = progress.add_task("tokenize", total=len(source.records))
    convs = []
    for rec in source.records:
        convs.append(tokenizer.tokenize(messages_of(rec, plan.messages_key)))
        progress.advance(task)
    if plan.builder == "fixed":
        rows, stats = build_fixed(convs, plan.row_tokens, plan.seed, tokenizer.eos_id, tokenizer.pad_id, plan.limit)
    else:
        rows, stats = build_packed(convs, plan.row_tokens, plan.alignment, plan.seed, tokenizer.eos_id,
                                   tokenizer.pad_id, plan.overlong, plan.gbs)
    stats["source"] = source.description
    return rows, stats


def _make_image_rows(recipe: Recipe, plan: Plan, tokenizer: ChatTokenizer, progress) -> tuple[Rows, dict]:
    from muse_stack.data.multimodal import (
        cord_messages,
        load_image_records,
        media_ids,
        record_image_bytes,
        tokenize_image_text,
    )

    spec = image_spec_of(plan.image)
    ids = media_ids(tokenizer, plan.image["image_token_id"])
    records, description = load_image_records(recipe.data)
    task = progress.add_task("tokenize and size images", total=len(records))
    convs = []
    for item in records:
        messages = cord_messages(item.record, plan.image["prompt"], item.row)
        image = record_image_bytes(item, spec.max_image_bytes)  # read no further than an image can take
        convs.append(tokenize_image_text(tokenizer, messages, [image], ids, spec, item.row))
        progress.advance(task)
    rows, stats = build_packed(convs, plan.row_tokens, plan.alignment, plan.seed, tokenizer.eos_id,
                               tokenizer.pad_id, plan.overlong, plan.gbs)
    rows.image_spec = spec
    stats["image_tokens"] = int((rows.ids == ids.patch).sum())
    stats["media_ids"] = ids.describe()
    stats["source"] = description
    return rows, stats


def _cache_write_failed(exc: Exception, root: Path) -> bool:
    """Whether a build failed because the cache's file system refused a write: full or over quota (however
    a writer, pyarrow's included, wraps it), read-only or not permitted on a path of the cache."""
    from muse_stack.util.atomic import disk_full

    if disk_full(exc):
        return True
    if not isinstance(exc, OSError) or exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        return False
    return exc.filename is None or root in Path(os.fsdecode(exc.filename)).parents


def _cache_error(root: Path, exc: Exception) -> InputError:
    from muse_stack.util.atomic import disk_full

    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    if disk_full(exc):
        try:
            room = f"; {shutil.disk_usage(root).free / 2**20:.1f} MiB free there"
        except OSError:
            room = ""
        return InputError(f"the data cache's file system is full: writing the built rows failed ({cause}{room}); "
                          "nothing half-built is left", field="--cache", value=str(root),
                          fix="free space there, or give a --cache (or MUSE_STACK_CACHE) on a file system with room")
    return InputError(f"cannot write the built rows into the data cache: {cause}; nothing half-built is left",
                      field="--cache", value=str(root), fix="give a writable --cache (or set MUSE_STACK_CACHE)")


def build_for_recipe(recipe: Recipe, cache_dir: str | Path | None = None, progress: bool = True,
                     force: bool = False) -> BuiltData:
    """The recipe's rows, from the cache or freshly built (then cached)."""
    plan = plan_for_recipe(recipe)
    tokenizer = None
    if plan.builder != "synthetic":
        assert plan.tokenizer_dir is not None
        tokenizer = ChatTokenizer(plan.tokenizer_dir, recipe.data.template_kwargs)
    key, inputs = cache_key(recipe, plan, tokenizer)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"{plan.label}-{key[:16]}"
    if final.is_dir() and not force:
        # a cached build is used only when its rows.parquet is the file it recorded; a swapped,
        # truncated or corrupt one is rebuilt, so the fingerprint carries the rows actually trained on
        try:
            cached = BuiltData.open(final)
            why = cached.mismatch()
        except (InputError, OSError) as exc:
            why = exc.render() if isinstance(exc, InputError) else str(exc)
        else:
            if why is None:
                return cached
        log.warning("the cached data build %s does not match its record (%s); rebuilding it", final, why)
        from rich.console import Console

        Console(stderr=True).print(f"[yellow]warning:[/] the cached data build {final} does not match its record "
                                   f"({why}); rebuilding it", highlight=False, soft_wrap=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale(final)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise InputError(f"cannot create the data cache folder: {exc.strerror or exc}", field="--cache",
                         value=str(root), fix="give a writable --cache (or set MUSE_STACK_CACHE)") from exc
    start = time.perf_counter()
    try:
        with _progress(progress) as bar:
            rows, stats = _make_rows(recipe, plan, tokenizer, bar)
            digest = rows_sha256(rows)
            task = bar.add_task("write rows", total=rows.num_rows)
            write_parquet(rows, tmp / "rows.parquet", on_chunk=lambda done: bar.update(task, completed=done))
        stats["build_seconds"] = round(time.perf_counter() - start, 3)
        meta = {"format": FORMAT_VERSION, "recipe": recipe.name, "label": plan.label, "cache_key": key,
                "inputs": inputs, "rows_sha256": digest,
                "parquet_sha256": hashlib.sha256((tmp / "rows.parquet").read_bytes()).hexdigest(),
                "parquet_bytes": (tmp / "rows.parquet").stat().st_size, "stats": stats,
                "pad_id": tokenizer.pad_id if tokenizer else 0,
                "tokenizer": tokenizer.describe() if tokenizer else None}
        write_json(tmp / "build.json", meta)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, InputError) and _cache_write_failed(exc, root):
            raise _cache_error(root, exc) from exc
        raise
    built = BuiltData.open(final)
    built._rows = rows
    return built
