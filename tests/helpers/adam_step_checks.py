"""The checks of tests/unit/test_adam_step.py, run as ``TRITON_INTERPRET=1 python tests/helpers/adam_step_checks.py CHECK``
(a process of their own: the interpreter must be on before Triton is imported). Prints ``ok CHECK``; a failed
check raises. The bounds are derived in tests/helpers/adam_bounds.py."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from adam_bounds import bf16_nearest_even, bias_corrections, reference, within  # noqa: E402

from muse_stack.engines.mcore import adam_step  # noqa: E402

SENTINEL = -1536.0  # exact in bf16 and fp32
GAP = 64  # elements between neighbouring views of one storage (megatron-core pads a parameter's start to 64)


class FusedAdam:
    """The attributes and the state layout of Transformer Engine's FusedAdam that adam_step reads and writes
    (TE's optimizer needs CUDA; the GPU test steps the real one): per-parameter ``exp_avg``, ``exp_avg_sq``
    and ``master_param`` created on a parameter's first step, gradients in ``decoupled_grad``."""

    def __init__(self, groups, adam_w_mode=1):
        self.param_groups = groups
        self.state: dict = {}
        self.adam_w_mode = adam_w_mode
        self.capturable = False
        self.master_weights = True
        self.master_weight_dtype = self.exp_avg_dtype = self.exp_avg_sq_dtype = torch.float32
        self.store_param_remainders = False
        self.use_decoupled_grad = True

    def initialize_state(self, p, store_param_remainders):
        assert not store_param_remainders
        self.state.setdefault(p, {})
        # not zeros, unlike TE: every element's moments then take part in the checks
        self.state[p]["exp_avg"] = torch.randn(p.shape) * 1e-3
        self.state[p]["exp_avg_sq"] = torch.rand(p.shape) * 1e-6
        self.state[p]["master_param"] = p.detach().float() + torch.randn(p.shape) * 1e-3


def starts(sizes, first: int = 0) -> list[int]:
    """Where each of ``sizes`` starts: ``first``, then each after the one before and at least one gap element,
    rounded up to 64 elements from ``first`` (megatron-core pads a parameter's start in its buffers to 64)."""
    out, at = [], first
    for n in sizes:
        out.append(at)
        at = first + -(-(at - first + n + 1) // GAP) * GAP
    return out


def views(storage: torch.Tensor, sizes, first: int = 0) -> list[torch.Tensor]:
    return [storage[s:s + n] for s, n in zip(starts(sizes, first), sizes)]


def storage(sizes, dtype, first: int = 0) -> torch.Tensor:
    return torch.full((starts(sizes, first)[-1] + sizes[-1] + GAP,), SENTINEL, dtype=dtype)


def model(first: int = 0, adam_w_mode: int = 1, bias_correction: bool = True):
    """Two groups of bf16 and fp32 parameters, the gradients views of one fp32 storage with gaps (as
    megatron-core's grad buffer), a parameter with no gradient, and an empty group."""
    half_sizes, full_sizes = [5000, 37, 4096, 7001], [300, 2048]
    gen = torch.Generator().manual_seed(7)
    weights = storage(half_sizes, torch.bfloat16, first)
    half = [torch.nn.Parameter(t, requires_grad=False) for t in views(weights, half_sizes, first)]
    for p in half:
        p.data.copy_(torch.randn(p.shape, generator=gen).bfloat16())
    full = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in full_sizes]
    grads = storage(half_sizes + full_sizes, torch.float32, first)
    for p, g in zip(half + full, views(grads, half_sizes + full_sizes, first)):
        g.copy_(torch.randn(p.shape, generator=gen) * 1e-2)
        p.decoupled_grad = g
    idle = torch.nn.Parameter(torch.randn(40).bfloat16())  # no gradient: skipped, as TE skips it
    common = dict(betas=(0.9, 0.95), eps=1e-8, bias_correction=bias_correction)
    groups = [dict(params=[half[0], full[0], half[1], idle, half[2]], lr=3e-4, weight_decay=0.1, **common),
              dict(params=[], lr=3e-4, weight_decay=0.0, **common),
              dict(params=[full[1], half[3]], lr=1e-3, weight_decay=0.0, **common)]
    return FusedAdam(groups, adam_w_mode), weights, grads, idle


def one_step(adam, check_tables: bool = True) -> None:
    """Step ``adam`` with adam_step.step and check every parameter against the reference from the states before."""
    before = {}
    for group in adam.param_groups:
        for p in group["params"]:
            st = adam.state.get(p)
            before[p] = None if not st else {k: t.clone() for k, t in st.items()}
    weights_before = {p: p.detach().clone() for p in before}
    steps = [g.get("step", 0) for g in adam.param_groups]
    adam_step.step(adam)
    assert [g["step"] for g in adam.param_groups] == [s + 1 for s in steps], "every group's step, empty ones too"
    for group in adam.param_groups:
        bc1, bc2 = bias_corrections(*group["betas"], group["step"]) if group["bias_correction"] else (1.0, 1.0)
        for p in group["params"]:
            st = adam.state[p]
            if getattr(p, "decoupled_grad", None) is None:
                assert torch.equal(p.detach(), weights_before[p]), "a parameter without gradient is not updated"
                continue
            old = before[p]
            if old is None:  # initialised by this step: what initialize_state made is the state before
                raise AssertionError("the checks initialise the state before the first checked step")
            half = p.dtype == torch.bfloat16
            w0 = old["master_param"] if half else weights_before[p]
            (w1, m1, v1), (dw, dm, dv) = reference(p.decoupled_grad, w0, old["exp_avg"], old["exp_avg_sq"],
                                                  beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                                                  decay=group["weight_decay"], lr=group["lr"], bc1=bc1, bc2=bc2,
                                                  adam_w=bool(adam.adam_w_mode))
            for name, got, exact, bound in (("m", st["exp_avg"], m1, dm), ("v", st["exp_avg_sq"], v1, dv),
                                            ("master", st["master_param"] if half else p.detach(), w1, dw)):
                ok, worst = within(got, exact, bound)
                assert ok, f"{name} of a {p.dtype} parameter of {p.numel()}: {worst:.2f} of its bound"
            if half:
                assert torch.equal(p.detach(), bf16_nearest_even(st["master_param"])), "bf16 weight = rounded master"


def initialise(adam) -> None:
    for group in adam.param_groups:
        for p in group["params"]:
            adam.initialize_state(p, False)


def gaps_untouched(buffer: torch.Tensor, sizes_first) -> None:
    sizes, first = sizes_first
    mask = torch.ones(buffer.numel(), dtype=torch.bool)
    for s, n in zip(starts(sizes, first), sizes):
        mask[s:s + n] = False
    assert (buffer[mask].float() == SENTINEL).all(), "an element between two tensors was written"


def steps(adam_w_mode: str = "1", bias: str = "1") -> None:
    """Three steps of both groups; the tables are built once and kept."""
    adam, weights, grads, _ = model(adam_w_mode=int(adam_w_mode), bias_correction=bias == "1")
    initialise(adam)
    one_step(adam)
    tables = dict(adam._muse_adam_tables)
    assert set(tables) == {(0, True), (0, False), (2, True), (2, False)}
    assert all(t.align == adam_step.ALIGN for t in tables.values()), "starts at multiples of 64 elements: aligned"
    for _ in range(2):
        one_step(adam)
    assert all(adam._muse_adam_tables[k] is t for k, t in tables.items()), "the tables are kept"
    gaps_untouched(weights, ([5000, 37, 4096, 7001], 0))
    gaps_untouched(grads, ([5000, 37, 4096, 7001, 300, 2048], 0))


def unaligned() -> None:
    """Views that start 3 elements into their storage: no alignment hint, the same results."""
    adam, weights, grads, _ = model(first=3)
    initialise(adam)
    one_step(adam)
    assert {t.align for t in adam._muse_adam_tables.values()} == {1}
    gaps_untouched(weights, ([5000, 37, 4096, 7001], 3))


def replaced() -> None:
    """A state tensor replaced (as a checkpoint load does): the table is built again, for the new tensor."""
    adam, _, _, _ = model()
    initialise(adam)
    one_step(adam)
    old = adam._muse_adam_tables[(0, True)]
    p = adam.param_groups[0]["params"][0]
    adam.state[p]["exp_avg"] = adam.state[p]["exp_avg"].clone()
    one_step(adam)
    assert adam._muse_adam_tables[(0, True)] is not old


def tight() -> None:
    """The bounds fail for an update with the bias corrections swapped, and for a master off by one part in
    10^5 of the learning rate's step: they can see an error in the algebra."""
    adam, _, _, _ = model()
    initialise(adam)
    group = adam.param_groups[0]
    p = group["params"][0]
    st = {k: t.clone() for k, t in adam.state[p].items()}
    adam_step.step(adam)
    bc1, bc2 = bias_corrections(*group["betas"], group["step"])
    kw = dict(beta1=0.9, beta2=0.95, eps=1e-8, decay=0.1, lr=3e-4)
    (w1, _, _), (dw, _, _) = reference(p.decoupled_grad, st["master_param"], st["exp_avg"], st["exp_avg_sq"],
                                      bc1=bc1, bc2=bc2, **kw)
    got = adam.state[p]["master_param"]
    assert within(got, w1, dw)[0]
    (w_swapped, _, _), _ = reference(p.decoupled_grad, st["master_param"], st["exp_avg"], st["exp_avg_sq"],
                                     bc1=bc2, bc2=bc1, **kw)
    assert not within(got, w_swapped, dw)[0]
    off = got.double() - 1e-5 * (w1 - st["master_param"].double())
    assert not within(off, w1, dw)[0]


def nan_stays_nan() -> None:
    """A NaN gradient gives a NaN master and a NaN bf16 weight (not an infinity or a number)."""
    adam, _, _, _ = model()
    initialise(adam)
    p = adam.param_groups[0]["params"][0]
    p.decoupled_grad[:5] = float("nan")
    adam_step.step(adam)
    assert adam.state[p]["master_param"][:5].isnan().all() and p.detach()[:5].isnan().all()
    assert not p.detach()[5:].isnan().any()


CHECKS = {"steps": steps, "unaligned": unaligned, "replaced": replaced, "tight": tight, "nan": nan_stays_nan}

if __name__ == "__main__":
    name, *args = sys.argv[1].split(":")
    CHECKS[name](*args)
    print(f"ok {sys.argv[1]}")
