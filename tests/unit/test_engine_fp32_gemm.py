"""The float32 GEMM path of the megatron engine (precision: fp32): TE's layouts reproduced by
torch, and the wrappers' routing (float32 to torch, anything else to TE's own function)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_stack.engines.mcore import fp32_gemm

U32 = 2.0 ** -24  # float32 unit roundoff


def bound(a64: torch.Tensor, b64: torch.Tensor, k: int) -> torch.Tensor:
    """Forward error of a float32 dot product of length k, elementwise: gamma_k sum |a||b| with
    gamma_k = k u / (1 - k u) (Higham, Accuracy and Stability, 3.1); the inputs are exact
    float32 values, so this is the whole error. Times 2 for the output's own rounding margin."""
    gamma = k * U32 / (1 - k * U32)
    return 2 * gamma * (a64.abs() @ b64.abs())


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 9), k=st.integers(1, 33), seed=st.integers(0, 2 ** 16))
def test_layouts_match_te_semantics(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)      # tokens x in-features
    w = torch.randn(n, k, generator=g)      # out-features x in-features (a linear's weight)
    dy = torch.randn(m, n, generator=g)     # gradient of the output
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    cases = {
        "TN": (fp32_gemm.torch_gemm(w, x, "TN"), x64, w64.t(), k),     # forward x W^T
        "NN": (fp32_gemm.torch_gemm(w, dy, "NN"), dy64, w64, n),       # data gradient dy W
        "NT": (fp32_gemm.torch_gemm(x, dy, "NT"), dy64.t(), x64, m),   # weight gradient dy^T x
    }
    for layout, (got, a, b, depth) in cases.items():
        want = a @ b
        assert got.dtype == torch.float32 and got.shape == want.shape, layout
        assert ((got.double() - want).abs() <= bound(a, b, depth)).all(), layout


def test_leading_dims_kept_and_bad_layout_refused():
    x = torch.randn(2, 3, 4)
    w = torch.randn(5, 4)
    assert fp32_gemm.torch_gemm(w, x, "TN").shape == (2, 3, 5)
    with pytest.raises(ValueError, match="TT"):
        fp32_gemm.torch_gemm(w, x, "TT")


def test_general_gemm_routes_fp32_to_torch_and_others_to_te():
    calls = []

    def te(A, B, **kw):
        calls.append((A.dtype, kw["layout"]))
        return "te", None, None, None

    gemm = fp32_gemm.wrap_general_gemm(te)
    w, x = torch.randn(3, 4), torch.randn(2, 4)
    assert gemm(w.bfloat16(), x.bfloat16(), layout="TN")[0] == "te"
    assert calls == [(torch.bfloat16, "TN")]
    out, *_ = gemm(w, x, layout="TN")
    assert torch.equal(out, x @ w.t()) and len(calls) == 1
    # accumulate into a float32 buffer, as TE's fused weight-gradient accumulation does
    acc = torch.ones(3, 4)
    dy = torch.randn(2, 3)
    res, *_ = gemm(x, dy, layout="NT", out=acc, accumulate=True, grad=True)
    assert res is acc and torch.equal(acc, 1 + dy.t() @ x)
    with pytest.raises(RuntimeError, match="bias"):
        gemm(w, x, layout="TN", bias=torch.zeros(3))


def test_grouped_gemm_single_output_and_lists():
    def te(*a, **k):
        raise AssertionError("float32 inputs must not reach TE")

    grouped = fp32_gemm.wrap_general_grouped_gemm(te)
    ws = [torch.randn(3, 4) for _ in range(3)]
    splits = [2, 0, 5]
    xs = [torch.randn(s, 4) for s in splits]
    out = torch.full((7, 3), float("nan"))
    got, _, _ = grouped(ws, xs, [out], [None] * 3, torch.float32, m_splits=splits, single_output=True)
    want = torch.cat([x @ w.t() for x, w in zip(xs, ws)])
    assert got is out and torch.equal(out, want)
    # weight gradients into per-expert buffers, accumulated
    dys = [torch.randn(s, 3) for s in splits]
    grads = [torch.ones(3, 4) for _ in range(3)]
    grouped(xs, dys, grads, [None] * 3, torch.float32, layout="NT", m_splits=splits, grad=True, accumulate=True)
    for g, x, dy in zip(grads, xs, dys):
        assert torch.equal(g, 1 + dy.t() @ x)
    # bf16 goes to TE
    seen = []
    routed = fp32_gemm.wrap_general_grouped_gemm(lambda *a, **k: seen.append(a[0][0].dtype) or ("te", [], []))
    routed([w.bfloat16() for w in ws], [x.bfloat16() for x in xs], [out.bfloat16()], [None] * 3, torch.bfloat16,
           m_splits=splits, single_output=True)
    assert seen == [torch.bfloat16]
