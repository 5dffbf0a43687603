"""Transformer Engine's FusedAdam step as one persistent Triton launch per parameter group.

Under the precision-aware optimizer (``optimizer.precision_aware``) megatron-core hands its bf16
weights and fp32 main gradients to TE's ``FusedAdam``, which keeps the fp32 master weights and
both moments, and updates them with ``multi_tensor_adam``: a CUDA kernel launched through
``multi_tensor_apply`` over 65,536-element chunks, at most 320 blocks a launch, 4-byte loads. Each
parameter moves 30 bytes (it reads the gradient, the master and both moments in fp32, and writes
the master, the moments and the bf16 weight); at the slice's 4.33 B parameters that is 130 GB a
step, which TE's kernel moves at about 3.1 TB/s of an H200's 4.8
(``benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/kernels.json``).

:func:`step` replaces ``FusedAdam.step`` for the case the engine runs (:func:`unsupported` says
which): each parameter group's tensors become a table of work items, a row per chunk of one
tensor (the element offsets of its gradient, weight, moments and master from the first tensor
of each kind, and its length). The table is built once and kept while the tensors stay where
they are. One launch of enough programs to fill the GPU walks it, with 16-byte loads where every
offset allows them. The step counter, the lazy state initialisation and the skipped parameters
without a gradient are TE's; the update is TE's arithmetic in the same order in fp32
(``adam.cu``'s ``adam_update``):

- the moments ``m = beta1 m + (1 - beta1) g`` and ``v = beta2 v + ((1 - beta2) g) g``;
- the bias corrections as TE's host code computes them: ``1 - beta^step`` in double, rounded to
  fp32;
- IEEE division and square root (``div_rn``, ``sqrt_rn``);
- the update with AdamW's decoupled weight decay (or, in L2 mode, the decay added to the
  gradient first), the master ``w - lr * update``, and the bf16 weight the master rounded to
  nearest-even.

Every multiply-add that nvcc may contract into an FMA is written as one here (``tl.fma``, the
first product of a sum), so the results match TE's unless nvcc contracted otherwise:
``tests/gpu/test_adam_step_gpu.py`` bounds the difference from the exact values for both and counts
the elements that differ, and ``tests/unit/test_adam_step.py`` checks the kernel under Triton's
interpreter on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: TE's step stays
    triton = None

from muse_stack.engines.mcore.launch import FILE as LAUNCH_FILE
from muse_stack.engines.mcore.launch import launches
from muse_stack.util.errors import InputError

#: the launch on a GPU: programs per streaming multiprocessor, warps per program and elements a
#: program updates per iteration, read from launch.json (``adam_step``: the fastest of the grid
#: ``benchmarks/scripts/kernels.py --only adam`` timed on an H200, written by ``adam_choose.py launch
#: --write``; :mod:`.launch`)
_LAUNCH = launches().adam_step.value
PROGRAMS_PER_SM, NUM_WARPS, BLOCK = _LAUNCH.programs_per_sm, _LAUNCH.num_warps, _LAUNCH.block
#: elements per work item (a multiple of BLOCK)
CHUNK = 65536
if CHUNK % BLOCK:
    raise InputError(f"{LAUNCH_FILE}: adam_step.value.block does not divide a work item of {CHUNK} elements",
                     field="adam_step.value.block", value=BLOCK, fix=f"a power of two up to {CHUNK:,}")
#: programs under Triton's interpreter (TRITON_INTERPRET=1), where each is run in turn on the CPU
INTERPRETER_PROGRAMS = 3
#: the offsets' alignment (elements) that lets a load of 16 fp32 or bf16 values be one or two
#: 16-byte accesses; a table whose offsets are not all multiples of it runs with no alignment hint
ALIGN = 16
#: a table row: the element offsets of gradient, weight, first moment, second moment, master, then
#: the item's length
ROW = 6


if triton is not None:

    @triton.jit
    def _update(g, w, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, eps, decay, neg_lr,
                ADAM_W: tl.constexpr):
        if not ADAM_W:  # L2: the decay joins the gradient
            g = tl.fma(decay, w, g)
        m = tl.fma(beta1, m, one_minus_beta1 * g)
        v = tl.fma(beta2, v, (one_minus_beta2 * g) * g)
        denom = tl.sqrt_rn(tl.math.div_rn(v, bc2)) + eps
        ratio = tl.math.div_rn(tl.math.div_rn(m, bc1), denom)
        if ADAM_W:
            update = tl.fma(decay, w, ratio)
        else:
            update = ratio
        w = tl.fma(neg_lr, update, w)
        return w, m, v

    @triton.jit
    def _bf16_nearest_even(x):
        """fp32 to bf16, rounded to nearest with ties to even, in integer arithmetic (what the GPU's
        conversion does; Triton's interpreter truncates instead, so the CPU tests could not see it);
        a NaN stays a NaN."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _block(g_ptr, p_ptr, m_ptr, v_ptr, w_ptr, go, po, mo, vo, wo, offs, mask, beta1, beta2, one_minus_beta1,
               one_minus_beta2, bc1, bc2, eps, decay, neg_lr, ADAM_W: tl.constexpr, MASTER: tl.constexpr):
        g = tl.load(g_ptr + go + offs, mask=mask)
        m = tl.load(m_ptr + mo + offs, mask=mask)
        v = tl.load(v_ptr + vo + offs, mask=mask)
        if MASTER:
            w = tl.load(w_ptr + wo + offs, mask=mask)
        else:
            w = tl.load(p_ptr + po + offs, mask=mask)
        w, m, v = _update(g, w, m, v, beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, eps, decay,
                          neg_lr, ADAM_W)
        tl.store(m_ptr + mo + offs, m, mask=mask)
        tl.store(v_ptr + vo + offs, v, mask=mask)
        if MASTER:  # a bf16 weight: the master rounded to nearest-even
            tl.store(w_ptr + wo + offs, w, mask=mask)
            tl.store(p_ptr + po + offs, _bf16_nearest_even(w), mask=mask)
        else:
            tl.store(p_ptr + po + offs, w, mask=mask)

    @triton.jit
    def _adam(table_ptr, items, g_ptr, p_ptr, m_ptr, v_ptr, w_ptr, beta1, beta2, one_minus_beta1, one_minus_beta2,
              bc1, bc2, eps, decay, neg_lr, ADAM_W: tl.constexpr, MASTER: tl.constexpr, BLOCK: tl.constexpr,
              ALIGN: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        for item in range(tl.program_id(0), items, tl.num_programs(0)):
            row = table_ptr + item * 6  # items are few (a row per CHUNK elements): int32 suffices
            go = tl.multiple_of(tl.load(row), ALIGN)
            po = tl.multiple_of(tl.load(row + 1), ALIGN)
            mo = tl.multiple_of(tl.load(row + 2), ALIGN)
            vo = tl.multiple_of(tl.load(row + 3), ALIGN)
            wo = tl.multiple_of(tl.load(row + 4), ALIGN)
            n = tl.load(row + 5)
            whole = (n // BLOCK) * BLOCK
            for start in range(0, whole, BLOCK):  # full blocks: no mask, so the loads stay vectors
                _block(g_ptr, p_ptr, m_ptr, v_ptr, w_ptr, go, po, mo, vo, wo, start + cols, None, beta1, beta2,
                       one_minus_beta1, one_minus_beta2, bc1, bc2, eps, decay, neg_lr, ADAM_W, MASTER)
            if whole < n:  # the tensor's last, partial block
                offs = whole + cols
                _block(g_ptr, p_ptr, m_ptr, v_ptr, w_ptr, go, po, mo, vo, wo, offs, offs < n, beta1, beta2,
                       one_minus_beta1, one_minus_beta2, bc1, bc2, eps, decay, neg_lr, ADAM_W, MASTER)


def bias_corrections(beta1: float, beta2: float, step: int, bias_correction: bool) -> tuple[float, float]:
    """``1 - beta^step`` for both betas as TE's host code computes them: the fp32 beta raised in
    double (C++'s ``std::pow(float, int)``), the difference rounded to fp32; 1 without correction."""
    if not bias_correction:
        return 1.0, 1.0
    return tuple(float(np.float32(1.0 - float(np.float32(b)) ** step)) for b in (beta1, beta2))


@dataclass
class Table:
    """One group's work items for one kind of parameter (bf16 with a master, or fp32)."""
    key: tuple
    rows: torch.Tensor  # [items, ROW] int64 on the parameters' device
    bases: tuple[torch.Tensor, ...]  # gradient, weight, first moment, second moment, master (or the weight)
    align: int
    elements: int


def build_table(entries: Sequence[tuple[torch.Tensor, ...]], *, chunk: int = CHUNK, key: tuple = ()) -> Table:
    """The work items over ``entries`` (each ``(grad, param, exp_avg, exp_avg_sq, master)``; for an
    fp32 parameter the master is the parameter itself): a row per ``chunk`` elements of each."""
    bases = tuple(entries[0])
    rows: list[list[int]] = []
    align = ALIGN
    for entry in entries:
        offsets = []
        for t, base in zip(entry, bases):
            delta = t.data_ptr() - base.data_ptr()
            offsets.append(delta // t.element_size())
        for off in offsets:
            align = math.gcd(align, off)
        for start in range(0, entry[0].numel(), chunk):
            rows.append([off + start for off in offsets] + [min(chunk, entry[0].numel() - start)])
    if align != ALIGN:
        align = 1
    if any(b.data_ptr() % 16 for b in bases):
        align = 1
    device = bases[0].device
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, ROW).to(device)
    return Table(key=key, rows=table, bases=bases, align=align, elements=sum(e[0].numel() for e in entries))


def unsupported(adam: Any) -> str | None:
    """Why :func:`step` cannot run ``adam``'s step (None: it can)."""
    if type(adam).__name__ != "FusedAdam" or not hasattr(adam, "adam_w_mode"):
        return f"{type(adam).__name__} is not Transformer Engine's FusedAdam"
    if adam.capturable:
        return "the capturable FusedAdam (the optimizer's CUDA graph) keeps lr and step on the GPU"
    if not adam.master_weights or adam.master_weight_dtype != torch.float32:
        return "the step here keeps fp32 master weights only"
    if adam.store_param_remainders:
        return "the master weights are int16 remainders (optimizer.param_remainders)"
    if adam.exp_avg_dtype != torch.float32 or adam.exp_avg_sq_dtype != torch.float32:
        return "the moments are not fp32"
    for group in adam.param_groups:
        for p in group["params"]:
            if type(p.data) is not torch.Tensor or p.dtype not in (torch.bfloat16, torch.float32):
                return f"a parameter of type {type(p.data).__name__} and dtype {p.dtype}"
    return None


def _launch(table: Table, group: dict, adam: Any, bc1: float, bc2: float, master: bool) -> None:
    beta1, beta2 = group["betas"]
    g, p, m, v, w = table.bases
    items = table.rows.shape[0]
    if g.is_cuda:
        sms = torch.cuda.get_device_properties(g.device).multi_processor_count
        programs = max(1, min(items, sms * PROGRAMS_PER_SM))
    else:  # Triton's interpreter
        programs = max(1, min(items, INTERPRETER_PROGRAMS))
    b1, b2 = np.float32(beta1), np.float32(beta2)
    _adam[(programs,)](table.rows, items, g, p, m, v, w, float(b1), float(b2), float(np.float32(1) - b1),
                       float(np.float32(1) - b2), bc1, bc2, float(group["eps"]), float(group["weight_decay"]),
                       -float(np.float32(group["lr"])), ADAM_W=bool(adam.adam_w_mode), MASTER=master, BLOCK=BLOCK,
                       ALIGN=table.align, num_warps=NUM_WARPS)


def _entries(adam: Any, group: dict) -> tuple[list, list]:
    """The group's (grad, param, exp_avg, exp_avg_sq, master) tuples: bf16 parameters with their
    masters, fp32 parameters (updated in place, as TE does)."""
    half, full = [], []
    for p in group["params"]:
        state = adam.state[p]
        if len(state) == 0:
            adam.initialize_state(p, False)
        grad = getattr(p, "decoupled_grad", None) if adam.use_decoupled_grad else p.grad
        if grad is None or p.numel() == 0:
            continue
        if grad.dtype != torch.float32 or not (grad.is_contiguous() and p.is_contiguous()):
            raise RuntimeError(f"the Triton Adam step needs contiguous fp32 gradients; a {tuple(p.shape)} parameter "
                               f"has a {grad.dtype} gradient (set engine_options.triton_adam=false in the recipe "
                               "for TE's step)")
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if p.dtype == torch.bfloat16:
            half.append((grad, p.data, m, v, state["master_param"]))
        else:
            full.append((grad, p.data, m, v, p.data))
    return half, full


def step(adam: Any, closure=None, grad_scaler=None):
    """``FusedAdam.step`` for the case :func:`unsupported` allows: TE's bookkeeping, this module's kernel."""
    if grad_scaler is not None:
        raise RuntimeError("the Triton Adam step takes no grad scaler (bf16 training)")
    loss = closure() if closure is not None else None
    tables: dict = adam.__dict__.setdefault("_muse_adam_tables", {})
    for index, group in enumerate(adam.param_groups):
        group["step"] = group["step"] + 1 if "step" in group else 1  # TE's: before an empty group is skipped
        if not group["params"]:
            continue
        bc1, bc2 = bias_corrections(*group["betas"], group["step"], bool(group["bias_correction"]))
        for master, entries in zip((True, False), _entries(adam, group)):
            if not entries:
                continue
            key = tuple((e[0].data_ptr(), e[1].data_ptr(), e[2].data_ptr(), e[3].data_ptr(), e[4].data_ptr(),
                         e[0].numel()) for e in entries)
            table = tables.get((index, master))
            if table is None or table.key != key:
                table = tables[(index, master)] = build_table(entries, key=key)
            _launch(table, group, adam, bc1, bc2, master)
    return loss


def _fused_adams(optimizer: Any) -> list[Any]:
    out = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is not None and type(inner).__name__ == "FusedAdam":
            out.append(inner)
    return out


def install(optimizer: Any) -> str | None:
    """Run :func:`step` for every TE FusedAdam inside megatron-core's ``optimizer``. Returns why
    not (and leaves TE's step) where it does not apply; None when installed."""
    if triton is None:
        return "no Triton"
    adams = _fused_adams(optimizer)
    if not adams:
        return "no Transformer Engine FusedAdam (optimizer.precision_aware off)"
    for adam in adams:
        why = unsupported(adam)
        if why is not None:
            return why
    for adam in adams:
        adam.step = partial(step, adam)
    return None


def installed(adam: Any) -> bool:
    s = adam.__dict__.get("step")
    return isinstance(s, partial) and s.func is step


def install_triton_adam(engine: Any, on: bool) -> str | None:
    """``engine_options.triton_adam``: :func:`install` into ``engine``'s optimizer (on), or TE's step left
    as it is (off); why not though asked (None: as asked)."""
    return install(engine.optimizer) if on else None
