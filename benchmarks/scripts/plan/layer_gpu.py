"""The planner's GPU time of one decoder layer against host_sync_probe.py's measurement of it (CPU only).

    python benchmarks/scripts/plan/layer_gpu.py benchmarks/results/host-sync-probe/host_sync_layer.json \
        [--gpu H100] [--json FILE]

``host_sync_probe.py --block layer`` times one megatron-core decoder layer (attention, then the MoE block with one
GPU's share of a published model's experts) on one GPU, forward and backward, at token counts from 128 up. Where
the GPU outlasts the host, its CUDA-event time is the layer's GPU time. This prices the same layer with the
at-scale model (:func:`muse_stack.plan.scale.estimate`): the probe's layer as a one-layer model of its widths (its
local experts and top-k, the probe's attention: the generic GQA block or the model's own), on one GPU of
``--gpu`` (the probe's card; a row of the machine table), one micro-batch of the token count, nothing to
communicate, no host term. The planner's layer time is its GEMMs, attention core, elementwise passes and FP8 casts,
forward and backward; its output layer is a vocabulary of one, which adds nothing measurable.

Each row gives the measured forward-and-backward event time, the planned GPU time and their ratio, and whether the
layer was GPU-bound at that count: its forward-and-backward wall time at least twice the host floor the probe
measured at its smallest count (below that the event time holds the GPU's wait for the host, not its work). Only the
GPU-bound rows say anything about the planner's GPU terms.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from muse_stack.plan.published import load
from muse_stack.plan.scale import ScaleCalibration, estimate

#: the planner's terms that are the layer's GPU work (no communication, pipeline, optimizer or host)
GPU_TERMS = ("dense_gemm", "expert_gemm", "attention", "elementwise", "fp8_cast", "recompute")
#: host_sync_probe.py's generic attention block (its --attention generic)
GENERIC = {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
#: a layer is GPU-bound at a count whose forward-and-backward wall time is at least this times the host floor
GPU_BOUND = 2.0


def planned_layer_s(probe: dict, tokens: int, gpu: str) -> float:
    """The planner's forward-and-backward GPU seconds of ``probe``'s layer at ``tokens`` tokens on ``gpu``."""
    step = layer_step(probe, tokens, gpu)
    return sum(step.terms_s[k] for k in GPU_TERMS)


def layer_step(probe: dict, tokens: int, gpu: str):
    """The planner's step (:class:`muse_stack.plan.scale.ScaleStep`) of ``probe``'s layer alone, one micro-batch of
    ``tokens`` tokens on one ``gpu``."""
    published = load()
    s = probe["shape"]
    base = published.models[s["model"]]
    attention = probe.get("attention") or {}
    update = {"num_layers": 1, "num_experts": s["experts"], "experts_per_token": s["topk"], "vocab_size": 1,
              "dense_layers": 0, "dense_ffn_hidden_size": 0, "shared_ffn_hidden_size": 0, "mtp_layers": 0}
    if attention.get("kind") == "model":
        if attention.get("window") != "sliding":
            update |= {"sliding_window": None}
        update |= {"attention_sinks": base.attention_sinks}
    else:  # the generic GQA block, causal, for every model
        update |= {"attention": "gqa", **GENERIC, "sliding_window": None, "attention_sinks": False}
    shape = base.model_copy(update=update)
    system = next(name for name, sys_ in published.systems.items() if sys_.machine == gpu)
    name = f"probe-{s['model']}"
    row = published.run(published.rows[0].id).model_copy(update={
        "id": name, "model": name, "system": system, "gpus": 1, "gbs": 1, "mbs": 1, "seq": tokens, "tp": 1, "pp": 1,
        "cp": 1, "vp": 1, "ep": 1, "etp": 1, "precision": probe["precision"], "mtp": False, "recompute": [],
        "cuda_graphs": ["moe_router", "moe_preprocess"], "a2a_overlap": False})
    one = published.model_copy(update={"models": {**published.models, name: shape}})
    return estimate(one, row, cal=ScaleCalibration().model_copy(update={"moe_sync_gap_s": 0.0}))


def compare(record: dict, gpu: str) -> list[dict]:
    if record.get("block") != "layer":
        raise SystemExit("the probe timed the MoE block alone (--block moe): this compares whole layers")
    rows = []
    for probe in record["probes"]:
        floor = probe["host_fwd_s"] + probe["host_bwd_s"]
        for r in probe["rows"]:
            planned = planned_layer_s(probe, r["tokens"], gpu)
            rows.append({"model": probe["shape"]["model"], "precision": probe["precision"],
                         "attention": (probe.get("attention") or {}).get("kind", "generic"), "tokens": r["tokens"],
                         "measured_s": r["fwd_bwd_event_s"], "planned_s": planned,
                         "measured_over_planned": r["fwd_bwd_event_s"] / planned,
                         "gpu_bound": r["fwd_bwd_wall_s"] >= GPU_BOUND * floor})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", type=Path, help="a host_sync_probe.py --block layer JSON")
    ap.add_argument("--gpu", default="H100", help="the probe's card: a machine-table row a published system uses")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = compare(json.loads(args.probe.read_text()), args.gpu)
    for r in rows:
        print(f"{r['model']:>16} {r['precision']:>6} {r['attention']:>7} {r['tokens']:6d} tokens: measured "
              f"{r['measured_s'] * 1e3:8.2f} ms, planned {r['planned_s'] * 1e3:8.2f} ms, "
              f"{r['measured_over_planned']:.2f}x{'' if r['gpu_bound'] else '  (host-bound)'}")
    if args.json:
        args.json.write_text(json.dumps({"probe": str(args.probe), "gpu": args.gpu, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
