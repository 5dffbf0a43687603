"""The word embedding's gradient added into main_grad (``muse_stack/engines/mcore/embedding_grad.py``) and, with it,
the post-expert norm's one-pass backward (``norm_backward.py``): whether the engine runs them, chosen from the
step (``h200.sh embedgrad``).

    python benchmarks/scripts/embedgrad_choose.py DIR [--write FILE]

Reads ``with.json`` and ``with-again.json`` (``engine_steps.py`` as shipped: the embedding's lookup adds into
main_grad; first and last in one call), ``without.json`` (``--dense-embedding-grad``) and ``both.json`` (as
shipped with ``--fused-norm-backward``). :mod:`levers_choose`'s rule (the mean of with and with-again is the
baseline, their relative difference the drift; a change is kept when it gains more than twice the drift and at
least 0.5%) decides, with that drift:

* **the embedding alone:** the baseline against ``without``;
* **the pair** (stated before the measurement, as ``early-expert-counts-and-pre-mlp-norm/`` and ``te-swiglu-backward-and-first-microbatch-writes/`` measured theirs): ``both`` against
  ``without``. Where the embedding alone falls short and the pair clears the rule, both are kept;
* **the norm backward on top:** ``both`` against the baseline, where the embedding alone is kept.

``--write`` writes the verdict as JSON. What the engine runs unset is each option's default in the engine option
table (``embedding_into_main_grad`` and ``one_pass_norm_backward`` in ``muse_stack/recipes/options.py``), which
``tests/lab/test_benchmarks_embedgrad.py`` checks against the committed verdict.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import datafiles  # noqa: E402
from levers_choose import baseline, runs_tps  # noqa: E402

RUNS = ("with", "with-again", "without", "both")


def verdict(folder: pathlib.Path) -> dict:
    tps = runs_tps(folder, RUNS)
    base, drift, threshold = baseline(tps["with"], tps["with-again"])
    alone = base / tps["without"] - 1
    pair = tps["both"] / tps["without"] - 1
    on_top = tps["both"] / base - 1
    embedding = alone > threshold or pair > threshold
    norm_backward = pair > threshold if alone <= threshold else on_top > threshold
    return {"tokens_per_s": tps, "baseline": base, "drift": drift, "threshold": threshold,
            "embedding_alone": alone, "pair": pair, "norm_backward_on_top": on_top,
            "embedding_into_main_grad_kept": embedding, "one_pass_norm_backward_kept": norm_backward}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--write", type=pathlib.Path, help="write the verdict here (JSON)")
    args = ap.parse_args(argv)
    r = verdict(args.folder)
    t = r["tokens_per_s"]
    print(f"with {t['with']:,.0f} / {t['with-again']:,.0f}, without {t['without']:,.0f}, both {t['both']:,.0f} "
          f"tokens/s; drift {r['drift']:.2%}, keep when gain > {r['threshold']:.2%}: the embedding alone "
          f"{r['embedding_alone']:+.2%}, the pair {r['pair']:+.2%}, the norm backward on top "
          f"{r['norm_backward_on_top']:+.2%}; the embedding's gradient into main_grad "
          f"{'kept' if r['embedding_into_main_grad_kept'] else 'rejected'}, the one-pass norm backward "
          f"{'kept' if r['one_pass_norm_backward_kept'] else 'rejected'}")
    if args.write:
        args.write.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
