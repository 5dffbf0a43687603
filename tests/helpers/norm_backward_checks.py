"""The checks of tests/unit/test_norm_backward.py, run as ``TRITON_INTERPRET=1 python tests/helpers/norm_backward_checks.py
CHECK`` (a process of their own: the interpreter must be on before Triton is imported). Prints ``ok CHECK``;
a failed check raises. The bounds are derived in tests/unit/test_norm_backward.py's docstring."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from muse_stack.engines.mcore import norm_backward as nb  # noqa: E402
from muse_stack.engines.mcore.chains import weighted_gain_first_norm  # noqa: E402
from norm_backward_bounds import EPS, bf16_spacing as _bf16_spacing, exact as _exact, inputs as _inputs  # noqa: E402


def gradients(rows: int, width: int, tile: int = 1) -> None:
    """``tile`` rows per iteration: with 3 programs, a tile that does not divide a program's rows
    has rows masked out, which must add nothing."""
    x, w, p, dy = _inputs(rows, width, seed=rows)
    dx, dw, dp = nb.backward(x, w, p, dy, EPS, rows_per_iteration=tile)
    ex, ew, ep, b = _exact(x, w, p, dy)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32 and dp.dtype == torch.float32
    assert ((dx.double() - ex).abs() <= _bf16_spacing(ex) + b["dx"]).all(), "dx"
    assert ((dw.double() - ew).abs() <= b["dw"]).all(), "dw"
    assert ((dp.double() - ep).abs() <= b["dp"]).all(), "dp"


def tight() -> None:
    """The same bounds fail for gradients off by one part in 10^4: they can see an error in the algebra."""
    x, w, p, dy = _inputs(37, 96, seed=3)
    dx, dw, dp = nb.backward(x, w, p, dy, EPS)
    _, ew, ep, b = _exact(x, w, p, dy)
    assert not ((dw.double() * (1 + 1e-4) - ew).abs() <= b["dw"]).all()
    assert not ((dp.double() * (1 + 1e-4) - ep).abs() <= b["dp"]).all()


def autograd() -> None:
    """The autograd function: the chain's forward, bit for bit, and the kernel's gradients."""
    x, w, p, dy = _inputs(23, 64, seed=9)
    xs, ws, ps = (t.clone().requires_grad_() for t in (x, w, p))
    y = nb.weighted_gain_first_norm(xs, ws, ps, EPS)
    assert torch.equal(y, weighted_gain_first_norm(x, w, p, EPS))
    y.backward(dy)
    dx, dw, dp = nb.backward(x, w, p, dy, EPS)
    assert torch.equal(xs.grad, dx) and torch.equal(ws.grad, dw) and torch.equal(ps.grad, dp)


def not_a_power_of_two() -> None:
    x, w, p, dy = _inputs(4, 32, seed=1)
    try:
        nb.backward(x, w, p, dy, EPS, rows_per_iteration=3)
    except ValueError as e:
        assert "rows_per_iteration" in str(e)
    else:
        raise AssertionError("a tile of 3 rows was taken")


def no_rows() -> None:
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    dx, dw, dp = nb.backward(x, torch.zeros(32), torch.empty(0), x.clone(), EPS)
    assert dx.shape == (0, 32) and dp.shape == (0,) and torch.equal(dw, torch.zeros(32))


def main(check: str) -> None:
    name, *dims = check.split(":")
    {"gradients": gradients, "tight": tight, "autograd": autograd, "no_rows": no_rows,
     "not_a_power_of_two": not_a_power_of_two}[name](*map(int, dims))
    print(f"ok {check}")


if __name__ == "__main__":
    main(sys.argv[1])
