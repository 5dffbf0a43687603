"""Chat rendering and the muse_spark loss mask on the shipped tokenizer and fixture."""

import json
from pathlib import Path

import pytest

from muse_stack.data.chat import ChatTokenizer
from muse_stack.util.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "data" / "tiny-tokenizer"


def _convs():
    return [json.loads(line) for line in (ROOT / "data" / "tiny-chat.jsonl").read_text().splitlines()]


def test_shipped_tokenizer_ids():
    tok = ChatTokenizer(TOK)
    assert tok.vocab_size == 512
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)


def test_fixture_schema_and_variety():
    convs = _convs()
    assert 300 <= len(convs) <= 500
    assert len({c["id"] for c in convs}) == len(convs)
    assert len({c["source"] for c in convs}) >= 5
    for c in convs:
        roles = [m["role"] for m in c["messages"]]
        assert "assistant" in roles and set(roles) <= {"system", "user", "assistant"}


def test_mask_covers_exactly_assistant_content_and_end_of_turn():
    tok = ChatTokenizer(TOK, {"current_date": "2026-10-01", "reasoning_effort": "high"})
    eot = tok.tokenizer.token_to_id("<|eot|>")
    for conv in _convs()[:120]:
        t = tok.tokenize(conv["messages"])
        assert len(t.ids) == len(t.mask)
        # the supervised tokens, split at each end-of-turn, decode to exactly the assistant contents
        runs, cur = [], []
        prev = 0
        for i, m in zip(t.ids.tolist(), t.mask.tolist()):
            if m:
                cur.append(i)
            elif prev:
                runs.append(cur)
                cur = []
            prev = m
        if cur:
            runs.append(cur)
        contents = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
        assert len(runs) == len(contents)
        for run, content in zip(runs, contents):
            assert run[-1] == eot
            assert tok.tokenizer.decode(run[:-1], skip_special_tokens=False) == content
        # nothing else is supervised: no role header, no system or user text
        for special in ("<|bos|>", "<|system|>", "<|user|>", "<|assistant|>"):
            sid = tok.tokenizer.token_to_id(special)
            assert not any(m for i, m in zip(t.ids.tolist(), t.mask.tolist()) if i == sid)
        user_eots = sum(1 for m in conv["messages"] if m["role"] != "assistant")
        assert int((t.ids == eot).sum()) == len(contents) + user_eots + (0 if conv["messages"][0]["role"] == "system" else 1)


def test_template_kwargs_render():
    tok = ChatTokenizer(TOK, {"current_date": "2026-10-01", "reasoning_effort": "xhigh"})
    text = tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|bos|><|system|>Date: 2026-10-01. Effort: xhigh.<|eot|><|user|>hi<|eot|><|assistant|>"


def test_template_that_rewrites_earlier_turns_is_rejected(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((TOK / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_bytes((TOK / "tokenizer_config.json").read_bytes())
    # drops the content of assistant turns that are not the last message: not prefix-stable
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}"
        "<|eot|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = ChatTokenizer(d)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(InputError, match="prefix-stable"):
        tok.tokenize(msgs)


def test_sandbox_blocks_unsafe_template(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((TOK / "tokenizer.json").read_bytes())
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match="unsafe|access"):
        ChatTokenizer(d).render([{"role": "user", "content": "x"}])


def test_missing_template_names_field(tmp_path):
    with pytest.raises(InputError) as exc:
        ChatTokenizer(tmp_path)
    assert exc.value.field == "data.tokenizer"
