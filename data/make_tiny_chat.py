"""Write the shipped fixtures: ``data/tiny-chat.jsonl`` and ``data/tiny-tokenizer/``.

The conversations follow the Tulu 3 SFT schema ({"id", "messages": [{"role", "content"}], "source"})
and are generated from a fixed seed, so running this script again writes the same bytes. The
tokenizer is a byte-level BPE (vocabulary 512, special tokens first) trained with the
``tokenizers`` library on the rendered conversations.

    .venv/bin/python data/make_tiny_chat.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261001
NUM_CONVERSATIONS = 400
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|eot|>"]

CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}\n"
    "{%- if has_system or current_date is defined or reasoning_effort is defined -%}\n"
    "<|system|>\n"
    "{%- if current_date is defined %}Date: {{ current_date }}.{% endif -%}\n"
    "{%- if reasoning_effort is defined %} Effort: {{ reasoning_effort }}.{% endif -%}\n"
    "{%- if has_system %} {{ messages[0]['content'] | trim }}{% endif -%}\n"
    "<|eot|>\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if loop.first and has_system -%}{%- continue -%}{%- endif -%}\n"
    "{%- if message['role'] not in ['user', 'assistant', 'tool'] -%}\n"
    "{{- raise_exception('unknown role ' ~ message['role']) -}}\n"
    "{%- endif -%}\n"
    "<|{{ message['role'] }}|>{{ message['content'] | trim }}<|eot|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}\n"
)

COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
ANIMALS = {"cat": "meows", "dog": "barks", "cow": "moos", "duck": "quacks", "sheep": "bleats", "lion": "roars",
           "owl": "hoots", "horse": "neighs"}
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
            "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Chile": "Santiago"}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful tutor.", "Be friendly and exact."]
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "planet", "candle", "forest", "bridge"]


def _arith(rng: random.Random) -> list[tuple[str, str]]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.5:
        turns = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.")]
        if rng.random() < 0.5:
            c = rng.randint(1, 9)
            turns.append((f"And if you add {c} more?", f"Then it is {a + b + c}."))
        return turns
    hi, lo = max(a, b), min(a, b)
    return [(f"What is {hi} minus {lo}?", f"{hi} minus {lo} is {hi - lo}.")]


def _capital(rng: random.Random) -> list[tuple[str, str]]:
    country = rng.choice(sorted(CAPITALS))
    turns = [(f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}.")]
    if rng.random() < 0.4:
        other = rng.choice(sorted(CAPITALS))
        turns.append((f"And of {other}?", f"The capital of {other} is {CAPITALS[other]}."))
    return turns


def _animal(rng: random.Random) -> list[tuple[str, str]]:
    animal = rng.choice(sorted(ANIMALS))
    return [(f"What sound does a {animal} make?", f"A {animal} {ANIMALS[animal]}.")]


def _reverse(rng: random.Random) -> list[tuple[str, str]]:
    word = rng.choice(WORDS)
    return [(f"Spell {word} backwards.", f"Backwards, {word} is {word[::-1]}.")]


def _count(rng: random.Random) -> list[tuple[str, str]]:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    n = word.count(letter)
    return [(f"How many times does the letter {letter} appear in {word}?",
             f"The letter {letter} appears {NUMBER_WORDS[n]} time{'s' if n != 1 else ''} in {word}.")]


def _colors(rng: random.Random) -> list[tuple[str, str]]:
    picks = rng.sample(COLORS, 3)
    return [(f"List three colors starting with {picks[0]}.", f"Here are three colors: {', '.join(picks)}."),
            ("Which one is last?", f"The last one is {picks[-1]}.")]


def _words(rng: random.Random) -> list[tuple[str, str]]:
    n = rng.randint(0, 10)
    return [(f"Write the number {n} as a word.", f"{n} is written as {NUMBER_WORDS[n]}.")]


TOPICS = [("tiny-arith", _arith), ("tiny-capitals", _capital), ("tiny-animals", _animal), ("tiny-reverse", _reverse),
          ("tiny-count", _count), ("tiny-colors", _colors), ("tiny-numbers", _words)]


def conversations(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        source, make = TOPICS[i % len(TOPICS)]
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for user, assistant in make(rng):
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
        out.append({"id": f"{source}-{i:04d}", "messages": messages, "source": source})
    return out


def write_conversations(path: Path) -> list[dict]:
    convs = conversations()
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs), encoding="utf-8")
    return convs


def train_tokenizer(convs: list[dict], out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for c in convs for m in c["messages"]]
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
              "model_max_length": 4096, "vocab_size": tok.get_vocab_size()}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    convs = write_conversations(HERE / "tiny-chat.jsonl")
    train_tokenizer(convs, HERE / "tiny-tokenizer")


if __name__ == "__main__":
    main()
