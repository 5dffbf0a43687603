"""Where the conversations come from: local parquet/jsonl files or a Hugging Face dataset.

``data.files`` (parquet or jsonl with the dataset's schema) wins when given; otherwise
``data.dataset`` at ``data.revision`` is loaded with the ``datasets`` library from its local cache
(``HF_HOME``) only: the hub is not contacted unless ``MUSE_STACK_DATA_DOWNLOAD=1``. Nothing
is fetched silently in place of a missing source: it is an :class:`InputError` naming the field and
saying how to provide the data. ``data.split`` (e.g. ``train[:100000]``) slices either source.
Relative paths are taken from the working directory, else from the source tree's root.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muse_stack.util.errors import InputError
from muse_stack.recipes.schema import Data

REPO_ROOT = Path(__file__).resolve().parents[2]

OFFLINE_FIX = ("pre-download it on a connected machine (python -c \"import datasets; datasets.load_dataset("
               "'{ds}', revision='{rev}', split='{split}')\"), copy the Hugging Face cache here and set HF_HOME to it "
               "(or allow downloads with MUSE_STACK_DATA_DOWNLOAD=1), or export the rows to parquet/jsonl and give data.files=[...]")


def resolve_path(text: str) -> Path:
    """A path as given, else relative to the working directory, else to the source tree's root."""
    path = Path(text).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


@dataclass
class Source:
    """Loaded conversations and a fingerprint of where they came from (for the build cache)."""

    records: list[dict[str, Any]]
    fingerprint: dict[str, Any]
    description: str


def _slice(n: int, split: str | None) -> tuple[int, int]:
    if not split:
        return 0, n
    from datasets.arrow_reader import ReadInstruction

    name = split.split("[", 1)[0].strip() or "train"
    try:
        instr = ReadInstruction.from_spec(split).to_absolute({name: n})
    except (ValueError, AssertionError) as exc:
        raise InputError(f"cannot read the split: {exc}", field="data.split", value=split,
                         fix="write e.g. train, train[:1000], train[10%:20%]") from exc
    if len(instr) != 1:
        raise InputError("only one split slice is supported for local files", field="data.split", value=split,
                         fix="write a single slice, e.g. train[:1000]")
    return instr[0].from_, instr[0].to


def _read_file(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        from muse_stack.util.safeio import load_json

        out = []
        fix = "write one JSON object per line (a conversation with its messages), UTF-8"
        try:  # streamed line by line: a dataset file may be far larger than memory wants to hold twice
            with path.open("rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise InputError(f"{path}:{lineno} is not UTF-8 text", field="data.files", value=str(path),
                                         fix=fix) from exc
                    if line.strip():
                        out.append(load_json(line, source=f"{path}:{lineno}", field="data.files", fix=fix))
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror or exc}", field="data.files", value=str(path),
                             fix=fix) from exc
        return out
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{path} is not a readable parquet file ({str(exc)[:200]})", field="data.files",
                             value=str(path), fix="give an intact parquet file (re-export it)") from exc
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise InputError(f"{path}: row {bad} is not a record", field="data.files", value=str(path),
                             fix="give a table with the dataset's columns")
        return rows
    raise InputError("unsupported file type", field="data.files", value=str(path), fix="give .parquet or .jsonl files")


def load_files(files: list[str], split: str | None = None) -> Source:
    records: list[dict[str, Any]] = []
    hashes = []
    for text in files:
        path = resolve_path(text)
        if not path.is_file():
            raise InputError("a data file does not exist", field="data.files", value=text,
                             fix="give existing parquet/jsonl files with the dataset's schema, or set data.dataset")
        hashes.append({"name": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
        records.extend(_read_file(path))
    lo, hi = _slice(len(records), split)
    desc = ", ".join(files) + (f" [{split}]" if split else "")
    return Source(records=records[lo:hi], fingerprint={"files": hashes, "split": split}, description=desc)


DOWNLOAD_ENV = "MUSE_STACK_DATA_DOWNLOAD"


@contextlib.contextmanager
def _hub_mode():
    """Offline (cache only) unless ``MUSE_STACK_DATA_DOWNLOAD=1``; restores the libraries' settings after."""
    import datasets.config as dcfg
    import huggingface_hub.constants as hcst

    offline = os.environ.get(DOWNLOAD_ENV, "0") != "1"
    saved = (hcst.HF_HUB_OFFLINE, dcfg.HF_HUB_OFFLINE)
    if offline:
        hcst.HF_HUB_OFFLINE = True
        dcfg.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hcst.HF_HUB_OFFLINE, dcfg.HF_HUB_OFFLINE = saved


def load_hub(data: Data) -> Source:
    ds_id, rev, split = data.dataset, data.revision, data.split or "train"
    fix = OFFLINE_FIX.format(ds=ds_id, rev=rev, split=split)
    try:
        import datasets

        kwargs: dict[str, Any] = {"revision": rev, "split": split}
        if data.subset:
            kwargs["data_files"] = data.subset
        with _hub_mode():
            ds = datasets.load_dataset(ds_id, **kwargs)
    except InputError:
        raise
    except Exception as exc:  # datasets raises many types for "not cached and no network"
        raise InputError(f"the dataset is not available on this machine ({type(exc).__name__}: {exc})",
                         field="data.dataset", value=f"{ds_id}@{rev}", fix=fix) from exc
    fingerprint = {"dataset": ds_id, "revision": rev, "split": split, "subset": data.subset,
                   "fingerprint": getattr(ds, "_fingerprint", None)}
    return Source(records=ds.to_list(), fingerprint=fingerprint, description=f"{ds_id}@{rev} [{split}]")


def load_source(data: Data) -> Source:
    if data.files:
        return load_files(data.files, data.split)
    if data.dataset:
        return load_hub(data)
    raise InputError("the recipe names no data source", field="data.dataset", value=None,
                     fix="set data.dataset (a Hugging Face dataset id, with data.revision) or data.files=[...]")


def messages_of(record: dict[str, Any], key: str = "messages") -> list[dict[str, Any]]:
    msgs = record.get(key)
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
        raise InputError(f"a record has no {key!r} list of {{role, content}} messages", field="data.details.messages_key",
                         value=record.get("id"), fix="give rows in the Tulu 3 schema or set data.details.messages_key")
    return msgs
