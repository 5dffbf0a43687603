"""Chat rendering with a tokenizer's own template, and the ``muse_spark`` loss mask.

A tokenizer directory holds ``tokenizer.json`` (the ``tokenizers`` format), ``chat_template.jinja``
and optionally ``tokenizer_config.json`` (bos/eos/pad token strings). The template is rendered as
Hugging Face ``transformers`` does: a sandboxed, immutable jinja2 environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter, with ``messages``, ``add_generation_prompt``, the special
token strings and the recipe's ``data.template_kwargs`` as variables.

The ``muse_spark`` mask supervises the assistant turns only: each assistant message's content and
the end-of-turn token the template writes after it; system and user turns, role headers, BOS and
EOS are not supervised. The supervised character span of assistant message ``i`` is found by
rendering incrementally: it starts where ``render(messages[:i], add_generation_prompt=True)`` ends
(the conversation so far plus the assistant header) and ends where ``render(messages[:i+1])`` ends.
Both must be prefixes of the full rendering (a template that rewrites earlier turns is rejected).
A token is supervised when the character it starts at lies inside a supervised span; offsets come
from the tokenizer's offset mapping, so no token boundary is guessed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from muse_stack.util.errors import InputError

LOSS_MASKS = ("muse_spark",)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Tokenized:
    """One conversation as token ids and a 0/1 mask (1 = supervised target token)."""

    ids: np.ndarray  # int32
    mask: np.ndarray  # uint8

    def __len__(self) -> int:
        return int(self.ids.shape[0])


class ChatTokenizer:
    """A ``tokenizer.json`` + ``chat_template.jinja`` pair that renders and masks conversations."""

    def __init__(self, directory: str | Path, template_kwargs: dict[str, Any] | None = None,
                 field: str = "data.tokenizer") -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.template_kwargs = dict(template_kwargs or {})
        tok_path = self.directory / "tokenizer.json"
        tpl_path = self.directory / "chat_template.jinja"
        for path in (tok_path, tpl_path):
            if not path.is_file():
                raise InputError(f"the tokenizer directory has no {path.name}", field=field, value=str(self.directory),
                                 fix="point data.tokenizer at a directory with tokenizer.json and chat_template.jinja")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # the tokenizers library raises plain Exception on a bad file
            raise InputError(f"cannot read {tok_path}: {exc}", field=field, value=str(tok_path),
                             fix="give a tokenizer.json written by the tokenizers library") from exc
        from muse_stack.util.safeio import read_json, read_text

        self.template_source = read_text(tpl_path, field=field, what="chat template",
                                         fix="give a UTF-8 chat_template.jinja")
        self.tokenizer_sha256 = _sha256_file(tok_path)
        self.template_sha256 = hashlib.sha256(self.template_source.encode("utf-8")).hexdigest()
        config: dict[str, Any] = {}
        cfg_path = self.directory / "tokenizer_config.json"
        if cfg_path.is_file():
            config = read_json(cfg_path, field=field, what="tokenizer_config.json",
                               fix="restore tokenizer_config.json (a JSON object), or remove it")
        for key in ("bos_token", "eos_token", "pad_token"):
            tok = _token_str(config.get(key))
            if tok is not None and not isinstance(tok, str):
                raise InputError(f"tokenizer_config.json: {key} is a {type(tok).__name__}, not a token string",
                                 field=f"tokenizer_config.json {key}", value=tok,
                                 fix='write the token as a string, e.g. "<|eos|>"')
        self.bos_token = _token_str(config.get("bos_token")) or self._find_special(("<|bos|>", "<s>", "<|begin_of_text|>"))
        self.eos_token = _token_str(config.get("eos_token")) or self._find_special(("<|eos|>", "</s>", "<|end_of_text|>"))
        self.pad_token = _token_str(config.get("pad_token")) or self._find_special(("<|pad|>", "<pad>"))
        if self.eos_token is None or self.tokenizer.token_to_id(self.eos_token) is None:
            raise InputError("the tokenizer has no EOS token", field=field, value=str(self.directory),
                             fix="set eos_token in tokenizer_config.json to a token of tokenizer.json")

    def _find_special(self, names: tuple[str, ...]) -> str | None:
        for name in names:
            if self.tokenizer.token_to_id(name) is not None:
                return name
        return None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.token_to_id(self.eos_token))

    @property
    def pad_id(self) -> int:
        """The pad token's id, else 0."""
        pid = self.tokenizer.token_to_id(self.pad_token) if self.pad_token else None
        return int(pid) if pid is not None else 0

    @cached_property
    def _template(self):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.template_source)
        except TemplateError as exc:
            raise InputError(f"chat_template.jinja does not compile: {exc}", field="data.tokenizer",
                             value=str(self.directory), fix="fix the template syntax") from exc

    @cached_property
    def _resolved_kwargs(self) -> dict[str, Any]:
        """The template kwargs with each ${env:NAME} reference read from the environment now; the
        references, never the values, are what the cache key and build.json record."""
        import os

        from muse_stack.recipes.schema import ENV_REFERENCE

        out = {}
        for key, value in self.template_kwargs.items():
            ref = ENV_REFERENCE.fullmatch(value) if isinstance(value, str) else None
            if ref:
                if ref.group(1) not in os.environ:
                    raise InputError(f"the environment has no {ref.group(1)}", field=f"data.template_kwargs.{key}",
                                     value=value, fix=f"export {ref.group(1)} before the run")
                value = os.environ[ref.group(1)]
            out[key] = value
        return out

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                eos_token=self.eos_token, pad_token=self.pad_token or "", **self._resolved_kwargs)
        except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"the chat template failed on a conversation: {exc}", field="data.tokenizer",
                             value=str(self.directory),
                             fix="check the conversation's roles and the template's rules") from exc

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character spans of each assistant turn (content + end of turn)."""
        text = self.render(messages)
        spans = []
        for i, msg in enumerate(messages):
            if msg.get("role") != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True))
            upto = self.render(messages[: i + 1])
            if not text.startswith(upto) or start > len(upto):
                raise InputError("the chat template is not prefix-stable: rendering the first turns of a "
                                 "conversation does not give a prefix of the whole rendering",
                                 field="data.tokenizer", value=str(self.directory),
                                 fix="use a template that renders earlier turns the same whatever follows")
            spans.append((start, len(upto)))
        return text, spans

    def tokenize(self, messages: list[dict[str, Any]]) -> Tokenized:
        text, spans = self.assistant_spans(messages)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
        mask = np.zeros(ids.shape[0], dtype=np.uint8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = 1
        return Tokenized(ids=ids, mask=mask)

    def describe(self) -> dict[str, Any]:
        return {"directory": str(self.directory), "vocab_size": self.vocab_size,
                "bos": [self.bos_token, self.bos_id], "eos": [self.eos_token, self.eos_id],
                "pad": [self.pad_token, self.pad_id], "tokenizer_sha256": self.tokenizer_sha256,
                "template_sha256": self.template_sha256, "template_kwargs": self.template_kwargs}
