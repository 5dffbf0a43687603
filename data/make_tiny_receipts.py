"""Write the shipped image-text fixture: ``data/tiny-receipts.jsonl``, ``data/tiny-receipts/*.png``
and ``data/tiny-mm-tokenizer/``.

The rows follow CORD-v2's schema: an ``image`` (here the path of a PNG, relative to the JSONL
file) and ``ground_truth``, a JSON string whose ``gt_parse`` holds the receipt's menu lines and
totals with CORD's keys (``menu.nm``, ``menu.cnt``, ``menu.price``, ``total.total_price``, ...).
The receipts are drawn with PIL from a fixed seed: shop name, one line per item (count, name,
price) and the total, in black on white, on canvases of a few sizes so that images of
different aspect ratios (and so different patch grids) occur. Running the script again writes
the same rows and images.

The tokenizer is ``data/tiny-tokenizer``'s byte-level BPE with the media tokens transformers'
Muse Spark processor uses added as special tokens after it (``<|patch|>``, ``<|image_start|>``,
``<|image_end|>``, the video and audio ones), and a chat template that renders a message's
content list: text parts as text, each image part as one ``<|patch|>`` (the processor's image
token, which the data builder expands to ``<|image_start|>`` + ``<|patch|>`` x N + ``<|image_end|>``).

    .venv/bin/python data/make_tiny_receipts.py

``--scale N`` draws the same receipts N times larger in each direction (each canvas pixel a
block of N x N: nearest-neighbour, still multiples of 28) into ``runs/receipts-xN.jsonl`` and
``runs/receipts-xN/`` (not shipped), the image-text rows of the GPU slice ``slice-1gpu-mm``:
at N = 6 an image is 672-1008 pixels a side and 864-1080 merged tokens, the size class of a
phone photo of a receipt after the image processor.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261202
NUM_RECEIPTS = 64
#: (width, height) canvases in pixels; multiples of 28 keep the drawing unresampled
CANVASES = [(112, 168), (140, 168), (112, 196), (168, 140)]
MEDIA_TOKENS = ["<|image_start|>", "<|patch|>", "<|image_end|>", "<|vid_start|>", "<|video|>",
                "<|vid_frame_separator|>", "<|vid_end|>", "<|soft_audio_start|>", "<|audio|>", "<|soft_audio_end|>"]

CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- macro content_of(content) -%}\n"
    "{%- if content is string -%}{{ content | trim }}\n"
    "{%- else -%}\n"
    "{%- for part in content -%}\n"
    "{%- if part['type'] == 'image' -%}<|patch|>\n"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}\n"
    "{%- else -%}{{- raise_exception('unknown content part ' ~ part['type']) -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}\n"
    "{{- raise_exception('unknown role ' ~ message['role']) -}}\n"
    "{%- endif -%}\n"
    "<|{{ message['role'] }}|>{{ content_of(message['content']) }}<|eot|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}\n"
)

SHOPS = ["CAFE LUNA", "BAKERY 9", "NOODLE BAR", "TEA HOUSE", "GRILL & CO"]
ITEMS = {"TEA": 3, "COFFEE": 4, "BUN": 2, "CAKE": 5, "SOUP": 6, "RICE": 4, "NOODLE": 7, "JUICE": 3}


def receipt(rng: random.Random, index: int) -> tuple[dict, tuple[int, int]]:
    """One receipt's gt_parse (CORD's keys) and canvas size."""
    lines = []
    for name in rng.sample(sorted(ITEMS), rng.randint(1, 3)):
        count = rng.randint(1, 3)
        lines.append({"nm": name, "cnt": str(count), "price": f"{ITEMS[name] * count}.00"})
    total = sum(int(float(x["price"])) for x in lines)
    parse = {"menu": lines, "total": {"total_price": f"{total}.00"}}
    return parse, CANVASES[index % len(CANVASES)]


def draw(shop: str, parse: dict, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    pen = ImageDraw.Draw(image)
    y = 4
    pen.text((4, y), shop, fill=(0, 0, 0))
    y += 16
    for line in parse["menu"]:
        pen.text((4, y), f"{line['cnt']} {line['nm']}", fill=(0, 0, 0))
        pen.text((size[0] - 40, y), line["price"], fill=(0, 0, 0))
        y += 14
    pen.line((4, y + 2, size[0] - 4, y + 2), fill=(0, 0, 0))
    pen.text((4, y + 6), "TOTAL", fill=(0, 0, 0))
    pen.text((size[0] - 40, y + 6), parse["total"]["total_price"], fill=(0, 0, 0))
    return image


def write_receipts(jsonl: Path, folder: Path, scale: int = 1) -> list[dict]:
    rng = random.Random(SEED)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    rows = []
    for i in range(NUM_RECEIPTS):
        shop = rng.choice(SHOPS)
        parse, size = receipt(rng, i)
        name = f"receipt-{i:04d}.png"
        image = draw(shop, parse, size)
        if scale > 1:
            from PIL import Image

            size = (size[0] * scale, size[1] * scale)
            image = image.resize(size, Image.Resampling.NEAREST)
        image.save(folder / name, format="PNG", optimize=False)
        truth = {"gt_parse": parse, "meta": {"version": "tiny-receipts", "split": "train", "image_id": i,
                                             "image_size": {"width": size[0], "height": size[1]}},
                 "valid_line": []}
        rows.append({"id": f"receipt-{i:04d}", "image": f"{folder.name}/{name}",
                     "ground_truth": json.dumps(truth, ensure_ascii=False)})
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return rows


def write_tokenizer(source: Path, out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MEDIA_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(vocab_size=tok.get_vocab_size(), image_token="<|patch|>", image_start_token="<|image_start|>",
                  image_end_token="<|image_end|>")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=1, help="draw each receipt N times larger (not shipped: runs/)")
    args = ap.parse_args(argv)
    if args.scale < 1:
        ap.error(f"--scale must be 1 or more, got {args.scale}")
    if args.scale > 1:
        runs = HERE.parent / "runs"
        runs.mkdir(exist_ok=True)
        write_receipts(runs / f"receipts-x{args.scale}.jsonl", runs / f"receipts-x{args.scale}", scale=args.scale)
        return
    write_receipts(HERE / "tiny-receipts.jsonl", HERE / "tiny-receipts")
    write_tokenizer(HERE / "tiny-tokenizer", HERE / "tiny-mm-tokenizer")


if __name__ == "__main__":
    main()
