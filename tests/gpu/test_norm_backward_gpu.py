"""On a GPU: the post-expert norm's one-pass Triton backward (muse_stack.engines.mcore.norm_backward) and the
compiled chain's own backward, both against the exact gradients within the bounds derived in
tests/unit/test_norm_backward.py, at a width of the slice (4,096) and an odd number of rows."""

import importlib.util
from pathlib import Path

import pytest
import torch
from norm_backward_bounds import bf16_spacing, exact, inputs

def kernels_launches() -> list[tuple[int, int, int]]:
    """benchmarks/scripts/kernels.py's grid of launches (programs per SM, warps, rows per iteration)."""
    path = Path(__file__).parents[2] / "benchmarks" / "scripts" / "kernels.py"
    spec = importlib.util.spec_from_file_location("kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAUNCHES


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_one_pass_backward_and_the_compiled_chains_are_within_the_bounds():
    from muse_stack.engines.mcore import fuse, norm_backward
    from muse_stack.engines.mcore.chains import weighted_gain_first_norm

    if not norm_backward.available():
        pytest.skip("needs Triton")
    fuse.configure(True)
    try:
        x, w, p, dy = inputs(4099, 4096, seed=4, device="cuda")
        ex, ew, ep, b = (t.cuda() if torch.is_tensor(t) else {k: v.cuda() for k, v in t.items()}
                         for t in exact(*(t.cpu() for t in (x, w, p, dy)), eps=1e-8))
        for name, fn in (("one pass", norm_backward.weighted_gain_first_norm), ("compiled", weighted_gain_first_norm)):
            xs, ws, ps = (t.clone().requires_grad_() for t in (x, w, p))
            fn(xs, ws, ps, 1e-8).backward(dy)
            assert ((xs.grad.double() - ex).abs() <= bf16_spacing(ex) + b["dx"]).all(), name
            assert ((ws.grad.double() - ew).abs() <= b["dw"]).all(), name
            assert ((ps.grad.double() - ep).abs() <= b["dp"]).all(), name
        for per_sm, warps, tile in kernels_launches():  # any launch kernels.py times may be the one shipped
            dx, dw, dp = norm_backward.backward(x, w, p, dy, 1e-8, programs_per_sm=per_sm, num_warps=warps,
                                                rows_per_iteration=tile)
            launch = f"{per_sm} per SM, {warps} warps, {tile} rows"
            assert ((dx.double() - ex).abs() <= bf16_spacing(ex) + b["dx"]).all(), launch
            assert ((dw.double() - ew).abs() <= b["dw"]).all(), launch
            assert ((dp.double() - ep).abs() <= b["dp"]).all(), launch
    finally:
        fuse.configure(False)
