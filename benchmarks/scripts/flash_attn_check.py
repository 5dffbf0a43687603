"""flash-attn as the replay built it: the machine code it carries, one forward and one backward against torch.

Run on the GPU machine inside the replay's isolated venv, after flash-attn was built there from the set's sdist
(``replay.sh fa-start`` / ``fa-status``, which runs this once the build is installed):

    replay.sh fa-check LOCK      # = VENV/bin/python -E -s -u benchmarks/scripts/flash_attn_check.py --lock LOCK --out DIR

It writes ``DIR/flash-attn-check.json`` (every figure) and ``DIR/result.json`` (the result folder's header,
benchmarks/schema.py), and exits 1 unless every check holds:

- ``flash_attn`` imports at the lock's version, from the venv;
- the ``.nv_fatbin`` of the loaded ``flash_attn_2_cuda`` carries exactly the lock's architectures
  (``components.flash_attn.cuda_archs``), as ``stack selfcheck`` reads it;
- for each case (bf16 and fp16, causal and not), ``flash_attn_func``'s output and its gradients of q, k and v
  agree with torch's scaled_dot_product_attention, by flash-attn's own test bound: its error against an fp32
  reference (SDPA's math backend on the inputs upcast) is at most twice (output) or three times (gradients)
  the error of the same attention computed by PyTorch at the input precision (flash-attn 2.7.4.post1,
  tests/test_flash_attn.py, test_flash_attn_output: ``attention_ref(..., upcast=False, reorder_ops=True)``
  against ``attention_ref(...)`` in fp32). SDPA runs with its math backend only: torch's cuDNN backend refuses
  the set's cuDNN 9.22 (docs/images.md, "Which cuDNN a run uses").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: flash-attn's own test bound: its error at most this many times PyTorch's at the same precision
BOUND = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
#: the cases: (dtype name, causal); one shape, a head dimension every arch builds
CASES = [("bfloat16", False), ("bfloat16", True), ("float16", False), ("float16", True)]
SHAPE = {"batch": 2, "seqlen": 1024, "heads": 8, "head_dim": 128}


def reference(q, k, v, causal: bool):
    """torch's scaled_dot_product_attention (math backend) on (batch, seqlen, heads, dim) tensors."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def same_precision(q, k, v, causal: bool):
    """Attention computed by PyTorch at the inputs' precision, as flash-attn's test computes its `out_pt`
    (attention_ref with upcast=False, reorder_ops=True: k scaled, scores and softmax in the input dtype)."""
    import torch

    d = q.shape[-1]
    scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if causal:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(s - t + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    attn = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhts,bshd->bthd", attn, v)


def compare(candidate: Callable, dtype_name: str, causal: bool, device: str, shape: dict[str, int] = SHAPE,
            seed: int = 0) -> dict:
    """One case: the candidate's output and q, k, v gradients against the fp32 SDPA reference, next to PyTorch's
    own error at the input precision; passes by flash-attn's test bound."""
    import torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(seed)
    size = (shape["batch"], shape["seqlen"], shape["heads"], shape["head_dim"])
    q, k, v = (torch.randn(size, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(size, generator=g, device=device, dtype=dtype)

    def run(fn, *inputs):
        out = fn(*inputs, causal)
        return [out.detach(), *torch.autograd.grad(out, inputs, dout.to(out.dtype))]

    got = run(candidate, q, k, v)
    ups = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = run(reference, *ups)
    pt = run(same_precision, q, k, v)
    case: dict = {"dtype": dtype_name, "causal": causal, "shape": shape, "tensors": {}}
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), got, ref, pt):
        err = (a.float() - r).abs().max().item()
        err_pt = (p.float() - r).abs().max().item()
        finite = bool(torch.isfinite(a).all().item())
        case["tensors"][name] = {"max_abs_error": err, "pytorch_max_abs_error": err_pt, "bound": BOUND[name],
                                 "ratio": err / err_pt if err_pt > 0 else (0.0 if err == 0 else math.inf),
                                 "ok": finite and err <= BOUND[name] * err_pt}
    case["ok"] = all(t["ok"] for t in case["tensors"].values())
    return case


def check(lock_name: str, out: Path) -> dict:
    import torch

    from muse_stack.stack import load, selfcheck

    lk = load(lock_name)
    fa = lk.lock.components.flash_attn
    report: dict = {"lock": lock_name, "lock_sha256": lk.sha256, "want_version": fa.version,
                    "want_archs": list(fa.cuda_archs), "python": sys.executable, "checks": {}}
    if not torch.cuda.is_available():
        raise SystemExit("flash_attn_check: no CUDA device; run it on the GPU machine, in the replay's venv")
    report["device"] = torch.cuda.get_device_name(0)
    report["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    report["torch"] = torch.__version__
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except Exception as exc:  # an import that fails is the finding
        report["checks"]["import"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        report["ok"] = False
        return report
    report["checks"]["import"] = {"ok": flash_attn.__version__ == fa.version, "version": flash_attn.__version__,
                                  "file": flash_attn.__file__,
                                  "in_venv": Path(flash_attn.__file__).resolve().is_relative_to(Path(sys.prefix).resolve())}
    item = selfcheck.device_code_item("flash-attn machine code", list(fa.cuda_archs),
                                      selfcheck._extension_file(("flash_attn_2_cuda",), "flash_attn"))
    report["checks"]["archs"] = {"ok": item.ok, "want": item.want, "got": item.got, "file": item.note}
    cases = [compare(flash_attn_func, d, c, "cuda") for d, c in CASES]
    report["checks"]["attention"] = {"ok": all(c["ok"] for c in cases), "cases": cases}
    report["ok"] = all(c["ok"] and c.get("in_venv", True) for c in report["checks"].values())
    return report


def result_header(report: dict, lock_name: str) -> dict:
    """result.json of the result folder benchmarks/results/replay-LOCK-flash-attn."""
    archs = ";".join(a.replace(".", "") for a in report["want_archs"])
    verdict = "agree with" if report.get("ok") else "do not all agree with"
    return {
        "schema": "muse-stack-benchmark-result/1",
        "id": f"replay-{lock_name}-flash-attn",
        "claim": (f"flash-attn {report['want_version']} built from the {lock_name} set's sdist for {archs} in the "
                  f"isolated replay venv: its machine code, forward and backward {verdict} the lock and torch's SDPA "
                  "within flash-attn's own test bound."),
        "status": "current",
        "date": dt.date.today().isoformat(),
        "hardware": f"1 x {report.get('device', 'not recorded')}",
        "fingerprint": "not recorded",
        "commands": [f"bash benchmarks/scripts/replay.sh fa-start {lock_name}",
                     f"bash benchmarks/scripts/replay.sh fa-status {lock_name}",
                     f"bash benchmarks/scripts/replay.sh fa-check {lock_name}"],
        "method": "not applicable",
        "measured": [
            {"name": "ok", "unit": "true/false", "source": "flash-attn-check.json#/ok"},
            {"name": "flash-attn machine code", "unit": "architectures", "source": "flash-attn-check.json#/checks/archs/got"},
            {"name": "output error over PyTorch's, bf16", "unit": "ratio (bound 2)",
             "source": "flash-attn-check.json#/checks/attention/cases/0/tensors/out/ratio"},
            {"name": "dq error over PyTorch's, bf16", "unit": "ratio (bound 3)",
             "source": "flash-attn-check.json#/checks/attention/cases/0/tensors/dq/ratio"},
        ],
        "figures": {"flash-attn-check.json": "the import, the machine code and each attention case's errors",
                    "fa-build.log": "the build's log (pip, ninja)"},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lock", required=True, help="the lock whose flash-attn was built (b200, h200, gb200)")
    ap.add_argument("--out", type=Path, required=True, help="folder for flash-attn-check.json and result.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = check(args.lock, args.out)
    (args.out / "flash-attn-check.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "result.json").write_text(json.dumps(result_header(report, args.lock), indent=2) + "\n")
    for name, c in report["checks"].items():
        print(f"{name}: {'ok' if c['ok'] else 'FAILED'}")
    for case in report["checks"].get("attention", {}).get("cases", []):
        worst = max(case["tensors"].items(), key=lambda kv: kv[1]["ratio"] / kv[1]["bound"])
        print(f"  {case['dtype']} causal={case['causal']}: {'ok' if case['ok'] else 'FAILED'}; "
              f"worst {worst[0]} at {worst[1]['ratio']:.2f}x PyTorch's error (bound {worst[1]['bound']:g}x)")
    print(f"flash-attn check {'ok' if report['ok'] else 'FAILED'}: {args.out / 'flash-attn-check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
