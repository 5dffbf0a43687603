"""The post-expert norm's one-pass backward (muse_stack.engines.mcore.norm_backward), run under Triton's
interpreter, against the exact gradients of the chain it replaces, computed in fp64 from the same inputs.
The checks are tests/helpers/norm_backward_checks.py, each run in its own process: TRITON_INTERPRET=1 must be set
before Triton is first imported (Triton's own reductions are defined then), so not in this one.

The bounds follow from fp32 arithmetic (unit roundoff u = 2^-24): each row sum over D terms is off
by at most D u times the sum of its terms' magnitudes (recursive summation), and the few other
operations on a value add at most 10 u of it. The sum over rows for the gain's gradient adds R u of
the sum of its terms' magnitudes. dx is then rounded once to bf16: at most one bf16 spacing.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECKS = Path(__file__).resolve().parents[1] / "helpers" / "norm_backward_checks.py"


@pytest.mark.parametrize("check", ["gradients:37:96", "gradients:5:128", "gradients:64:200", "gradients:37:96:4",
                                   "gradients:64:200:2", "gradients:2:64:8", "tight", "autograd", "no_rows",
                                   "not_a_power_of_two"])
def test_norm_backward(check):
    root = str(CHECKS.parents[2])  # this checkout's muse_stack, whatever the environment has installed
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(CHECKS), check], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"ok {check}"
