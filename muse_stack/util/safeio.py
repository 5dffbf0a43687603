"""Reading what a user hands over: text files, YAML and JSON, with a clear error for every way
they can be wrong (missing, a directory, unreadable, not UTF-8, truncated, hostile).

YAML is read with a loader that refuses duplicate keys and bounds alias expansion: the document
is composed as a node graph first and its size *after* expanding every alias is counted (with
memoisation, so counting is linear in the graph) before any Python object is built, so a
"billion laughs" document fails in microseconds instead of growing without end.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from muse_stack.util.credentials import FIX, REDACTED, URL_CREDENTIALS, findings, redact_text, shape, short_repr
from muse_stack.util.errors import InputError, MuseStackError, RecipeError, UsageError

__all__ = ["MAX_TEXT_BYTES", "MAX_YAML_NODES", "REDACTED", "URL_CREDENTIALS", "load_json", "load_yaml", "read_bytes",
           "read_json", "read_text", "read_yaml", "redact_urls", "refuse_rewrite", "refuse_secrets", "sha256_file",
           "short_repr"]

#: nodes a document may hold once its aliases are expanded (the largest recipe holds ~600)
MAX_YAML_NODES = 200_000
#: a file larger than this is not a recipe, record or metadata file
MAX_TEXT_BYTES = 64 * 1024 * 1024

#: the credential shapes, kept in :mod:`muse_stack.util.credentials` (which imports nothing of muse-stack)
redact_urls = redact_text


def refuse_secrets(data: Any, *, field: str, error: type[Exception] = RecipeError,
                   what: str = "the value") -> None:
    """Raise ``error`` naming ``field`` (and the path inside ``data``) when ``data`` holds a literal
    credential (:func:`muse_stack.util.credentials.findings`); the value is never shown."""
    found = findings(data, field) if isinstance(data, (dict, list)) else \
        [(field, f"{what} holds {shape(data)}")] if isinstance(data, str) and shape(data) else []
    if found:
        where, why = found[0]
        raise error(f"{why}; a credential is never written to a recipe, a run directory, a launch file or "
                    "the terminal", field=where, value=REDACTED,
                    rule="secrets come only by reference, ${env:NAME}, resolved when the job runs"
                         + (f"; also at {', '.join(p for p, _ in found[1:4])}" if len(found) > 1 else ""),
                    fix=FIX)


def refuse_rewrite(text: str, *, field: str, what: str) -> str:
    """``text`` when the last guard on written text (:func:`muse_stack.util.credentials.redact_text`)
    leaves it as it is; else a :class:`UsageError` naming ``field`` and the first line the guard
    would change, shown redacted. A launch file carries every value as given or is not written:
    a redacted value in a script or a manifest is a job that fails or runs somewhere else."""
    guarded = redact_text(text)
    if guarded == text:
        return text
    lines = list(zip(text.splitlines(), guarded.splitlines()))
    number, line = next(((n, b) for n, (a, b) in enumerate(lines, 1) if a != b), (len(lines), ""))
    raise UsageError(f"line {number} of {what} would hold a credential ({line.strip()[:160]}); a launch file "
                     "is written as given or not at all", field=field, value=REDACTED,
                     rule="secrets come only by reference, ${env:NAME}, resolved when the job runs", fix=FIX)


def read_text(path: str | Path, *, field: str, what: str = "file", missing: type[Exception] = InputError,
              fix: str | None = None, limit: int | None = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file's contents; every failure is an :class:`InputError` naming ``field``.
    ``limit`` bounds the size of documents (recipes, records, metadata); None for logs that grow
    with a run (metrics)."""
    path = Path(path)
    fix = fix or f"give the path of a UTF-8 {what}"
    data = read_bytes(path, field=field, what=what, missing=missing, fix=fix, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                         f"it is binary or in another encoding", field=field, value=str(path),
                         fix=f"give a UTF-8 {what} (convert it with iconv -t UTF-8)") from exc


#: bytes read at a time from a file whose size is not known in advance
_CHUNK = 1 << 20


def read_bytes(path: str | Path, *, field: str, what: str = "file", missing: type[Exception] = InputError,
               fix: str | None = None, limit: int | None = MAX_TEXT_BYTES) -> bytes:
    """A file's bytes, reading at most ``limit`` + 1 of them whatever the file claims to be (a
    device such as /dev/zero or a FIFO reports size 0 and never ends; a file can grow while it is
    read), so no input is read whole before its size is checked; every failure is an
    :class:`InputError` naming ``field``. ``limit`` None: a regular file only (its size is known)."""
    path = Path(path)
    fix = fix or f"give the path of a {what}"
    too_large = f"too large for {'an' if what[:1] in 'aeiou' else 'a'} {what}"
    try:
        if path.is_dir():
            raise InputError(f"{path} is a directory, not a {what}", field=field, value=str(path), fix=fix)
        with open(path, "rb") as fh:
            info = os.fstat(fh.fileno())
            if limit is None and not stat.S_ISREG(info.st_mode):
                raise InputError(f"{path} is not a regular file (a device, socket or pipe has no end to read to)",
                                 field=field, value=str(path), fix=fix)
            if limit is not None and stat.S_ISREG(info.st_mode) and info.st_size > limit:
                raise InputError(f"{path} is {info.st_size:,} bytes, {too_large}", field=field, value=str(path),
                                 rule=f"at most {limit:,} bytes", fix=fix)
            if limit is None:
                return fh.read()
            chunks, got = [], 0
            while got <= limit:
                chunk = fh.read(min(_CHUNK, limit + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            if got > limit:
                raise InputError(f"{path} holds more than {limit:,} bytes, {too_large}", field=field,
                                 value=str(path), rule=f"at most {limit:,} bytes", fix=fix)
            return b"".join(chunks)
    except FileNotFoundError as exc:
        raise missing(f"{what} not found", field=field, value=str(path), fix=fix) from exc
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}", field=field, value=str(path),
                         fix="check the path and its permissions") from exc


def sha256_file(path: str | Path, *, field: str, what: str = "file", fix: str | None = None) -> str:
    """The sha256 of a regular file, read a chunk at a time (a data file may be larger than memory);
    a device, socket or pipe, which has no end, is refused as :func:`read_bytes` refuses it."""
    import hashlib

    path = Path(path)
    fix = fix or f"give the path of a {what}"
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise InputError(f"{path} is not a regular file (a device, socket or pipe has no end to read to)",
                                 field=field, value=str(path), fix=fix)
            for chunk in iter(lambda: fh.read(_CHUNK), b""):
                digest.update(chunk)
    except FileNotFoundError as exc:
        raise InputError(f"{what} not found", field=field, value=str(path), fix=fix) from exc
    except IsADirectoryError as exc:
        raise InputError(f"{path} is a directory, not a {what}", field=field, value=str(path), fix=fix) from exc
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}", field=field, value=str(path),
                         fix="check the path and its permissions") from exc
    return digest.hexdigest()


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and bounds the expanded document size."""

    def construct_document(self, node: Node) -> Any:
        _check_expanded_size(node)
        return super().construct_document(node)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # keys merged in with << may be overridden; only literal keys must be unique
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {short_repr(key)} (first at line {seen[key].line + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _check_expanded_size(root: Node) -> None:
    sizes: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    active: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            if isinstance(node, SequenceNode):
                total = 1 + sum(sizes[id(c)] for c in node.value)
            else:
                total = 1 + sum(sizes[id(k)] + sizes[id(v)] for k, v in node.value)
            if total > MAX_YAML_NODES:
                raise yaml.YAMLError(
                    f"the document expands to more than {MAX_YAML_NODES:,} nodes through its aliases "
                    f"(near line {node.start_mark.line + 1})")
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if isinstance(node, ScalarNode):
            sizes[key] = 1
            continue
        if key in active:
            raise yaml.YAMLError(f"the document refers to itself through an alias (line {node.start_mark.line + 1})")
        active.add(key)
        stack.append((node, True))
        children = node.value if isinstance(node, SequenceNode) else [x for kv in node.value for x in kv]
        stack.extend((c, False) for c in children if id(c) not in sizes)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where (line, column), without PyYAML's excerpt of the document: the
    excerpt would print the text around the error, which may hold a secret."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc)
    parts = [p for p in (exc.context, exc.problem) if p]
    mark = exc.problem_mark or exc.context_mark
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return "; ".join(parts) + where


def load_yaml(text: str, *, source: str, field: str, error: type[Exception] = RecipeError) -> Any:
    """Parse one YAML document: duplicate keys refused, alias expansion bounded."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise error(f"{source} is not valid YAML: {_yaml_problem(exc)[:600]}", field=field, value=source,
                    fix="fix the YAML at the position shown (each key once, no recursive or huge aliases)") from exc
    except RecursionError as exc:
        raise error(f"{source} nests too deeply", field=field, value=source,
                    fix="flatten the document") from exc


def read_yaml(path: str | Path, *, field: str, what: str = "YAML file", fix: str | None = None,
              error: type[Exception] = InputError) -> Any:
    """A YAML file read and parsed; missing, binary, not UTF-8 or malformed is ``error`` (an
    :class:`InputError` by default: a damaged file) naming ``field``."""
    text = read_text(path, field=field, what=what, fix=fix)
    try:
        return load_yaml(text, source=str(path), field=field, error=error)
    except MuseStackError as exc:
        if fix and exc.fix != fix:
            exc.fix = fix
            exc.args = (exc.render(),)
        raise


def load_json(text: str, *, source: str, field: str, fix: str, want: type | None = dict) -> Any:
    """Parse JSON; malformed or of the wrong top-level type is an :class:`InputError` (corrupt input)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"{source} is not valid JSON ({str(exc)[:200]})", field=field, value=source,
                         fix=fix) from exc
    if want is not None and not isinstance(data, want):
        raise InputError(f"{source} holds a JSON {type(data).__name__}, not a {want.__name__}", field=field,
                         value=source, fix=fix)
    return data


def read_json(path: str | Path, *, field: str, fix: str, want: type | None = dict, what: str = "JSON file") -> Any:
    return load_json(read_text(path, field=field, what=what, fix=fix), source=str(path), field=field, fix=fix,
                     want=want)
