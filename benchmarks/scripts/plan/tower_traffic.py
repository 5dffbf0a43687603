"""The perception towers' memory traffic per patch for every tower shape of the shipped recipes (CPU only).

    python benchmarks/scripts/plan/tower_traffic.py [--write]

For each shipped recipe that holds the towers, the shape its plan reads (:func:`muse_stack.plan.towers.traffic_shape`:
the vision tower's configuration, the projector's widths, the parameters' and the activations' dtypes), and the same
shape with ``engine_options.towers_bf16_activations`` where the option applies, is counted once by running the
towers' code on the CPU (:func:`muse_stack.plan.towers.count_traffic`: the bytes the ops outside the GEMMs and
attention read and write, per patch, forward, backward and recomputed forward). It prints them; ``--write`` writes
them to ``muse_stack/plan/tower_traffic.json``, of which this script is the only writer (the file is validated by
the product's own model first and written whole). ``tests/unit/test_tower_traffic.py`` counts each entry again
and compares, and checks that the file holds every shipped recipe's shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datafiles  # noqa: E402

from muse_stack.plan.towers import TRAFFIC_COMMAND, TRAFFIC_FILE, TrafficCount, TrafficFile, count_traffic  # noqa: E402


def shipped_shapes() -> dict[str, tuple[dict, list[str]]]:
    """Each tower shape of the shipped recipes (as JSON) -> (the shape, the recipes that hold it)."""
    from muse_stack.plan.towers import tower_plan, traffic_shape
    from muse_stack.recipes.catalogue import load_recipe, recipe_names
    from muse_stack.resolve.recipe import finalize

    from muse_stack.recipes import options

    shapes: dict[str, tuple] = {}
    for name in recipe_names():
        variants = [(name, load_recipe(name))]
        if variants[0][1].engine == "megatron" and \
                options.why_not(variants[0][1], "towers_bf16_activations") is None:
            bf16 = options.row("towers_bf16_activations").override(True)
            variants.append((f"{name} {bf16}", load_recipe(name, [bf16])))
        for label, recipe in variants:
            plan = tower_plan(finalize(recipe))
            if plan is None:
                continue
            shape = traffic_shape(plan.towers, plan.text_hidden_size, plan.params_dtype, plan.activations_dtype)
            key = json.dumps(shape, sort_keys=True)
            shapes.setdefault(key, (shape, []))[1].append(label)
    return shapes


def counts() -> list[TrafficCount]:
    """The file's entries, one per shipped shape, in the order of the recipes that first hold them."""
    out = []
    for shape, recipes in shipped_shapes().values():
        out.append(count_traffic(shape))
        print(f"{', '.join(recipes)}: {out[-1].model_dump_json()}")
    return out


def file_text(entries: list[TrafficCount]) -> str:
    return datafiles.validated(TRAFFIC_FILE, TrafficFile, {"command": TRAFFIC_COMMAND,
                                                            "counts": [e.model_dump(mode="json") for e in entries]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write muse_stack/plan/tower_traffic.json")
    args = parser.parse_args(argv)
    text = file_text(counts())
    if args.write:
        datafiles.write(TRAFFIC_FILE, text)
        print(f"wrote {datafiles.rel(TRAFFIC_FILE)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
