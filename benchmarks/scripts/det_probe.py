"""Where two runs of one recipe part ways: hashes of the initial weights, of every module's
output in one forward pass, and of every gradient after one training step.

Run it twice in separate processes and pass both files to ``--diff``: the first initial weight,
module output (in call order) or gradient whose hash differs names where the runs diverge.

    PYTHONPATH=. python benchmarks/scripts/det_probe.py proxy-1gpu numerics.deterministic=true --out a.json
    PYTHONPATH=. python benchmarks/scripts/det_probe.py proxy-1gpu numerics.deterministic=true --out b.json
    python benchmarks/scripts/det_probe.py --diff a.json b.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import megatron_engine  # noqa: E402


def _digest(t) -> str:
    """sha256 of the tensor's bytes (its dtype reinterpreted as bytes: equal digests, equal bits)."""
    import torch

    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()[:16]


def probe(recipe_name: str, overrides: list[str]) -> dict:
    import torch

    _, engine, steps = megatron_engine(recipe_name, overrides, 2)
    module = engine.model.module
    weights = {n: _digest(p) for n, p in module.named_parameters()}
    outputs: list[list[str]] = []

    def hook(name):
        def fn(_mod, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_tensor(t):
                outputs.append([name, _digest(t)])
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if n]
    first = next(steps.data.stream)
    batch = engine._prepare(first)
    with torch.no_grad():
        module(batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    for h in handles:
        h.remove()
    stats = steps.step(1)
    grads = {}
    for n, p in module.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is not None:
            grads[n] = _digest(g)
    return {"recipe": recipe_name, "overrides": overrides, "weights": weights, "forward": outputs, "grads": grads,
            "step1_loss": stats.loss, "step1_grad_norm": stats.grad_norm}


def diff(a: dict, b: dict) -> dict:
    out: dict = {"step1_loss": [a["step1_loss"], b["step1_loss"]]}
    out["weights_differ"] = [n for n in a["weights"] if a["weights"][n] != b["weights"].get(n)]
    first = next(((i, x[0]) for i, (x, y) in enumerate(zip(a["forward"], b["forward"])) if x != y), None)
    out["first_forward_difference"] = {"index": first[0], "module": first[1]} if first else None
    out["forward_outputs"] = len(a["forward"])
    out["grads_differ"] = [n for n in a["grads"] if a["grads"][n] != b["grads"].get(n)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", nargs="?")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--diff", nargs=2, default=None)
    args = ap.parse_args(argv)
    if args.diff:
        a, b = (json.load(open(p)) for p in args.diff)
        print(json.dumps(diff(a, b), indent=1))
        return 0
    result = probe(args.recipe, args.overrides)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(json.dumps({"step1_loss": result["step1_loss"], "modules": len(result["forward"])}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
