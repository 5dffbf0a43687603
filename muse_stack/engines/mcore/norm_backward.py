"""The post-expert norm's backward in one pass over its input.

The post-expert norm with the routing weight (:func:`.chains.weighted_gain_first_norm`) computes,
per expert slot ``i`` (a row of the experts' output ``x``, width ``D``), with the gain ``g = 1 + w``
and the slot's routing weight ``p``::

    z = x * g;   r = 1 / sqrt(mean(z^2) + eps);   y = z * r * p

Its gradients, from ``dy``, with ``zh = z * r``::

    dp  = sum_j dy * zh                                   (per row)
    dz  = r * (dy * p - zh * mean(dy * p * zh))           (per row)
    dx  = dz * g
    dw  = sum over rows of dz * x                          (per column)

TorchInductor compiles that backward as two kernels: the row pass (``dx``, ``dp``) and the column
sum for ``dw``, which reads ``x`` and ``dy`` a second time (on slice-1gpu: 1.28 + 0.75 ms a call,
``benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/kernels.json``; its mix-order reduction, which fuses the two, needs a
persistent row pass, and at 4,096 columns Inductor's is not). :func:`weighted_gain_first_norm`
here runs the same compiled forward and this backward: one Triton kernel in which each program
takes a run of rows, writes their ``dx`` and ``dp``, and keeps its share of ``dw`` in registers;
the programs' shares are then summed (a [programs, D] fp32 sum). ``x`` and ``dy`` are read once.

The same function in fp32 as Inductor's, summed in another order: ``tests/unit/test_norm_backward.py``
(Triton's interpreter, CPU) bounds the difference from the exact values.

Measured on an H200 (``benchmarks/results/normbwd/``): 1.25 ms a call at its fastest launch, against
2.30 ms for Inductor's two kernels; in the step, +0.48% tokens/s, below the 0.5% a lever must gain
(``benchmarks/scripts/levers_choose.py``), so the engine did not run it then. It runs since
``benchmarks/results/embedgrad/``, kept with the word embedding's gradient into main_grad, the pair chosen
together (+1.16% in the step): ``engine_options.one_pass_norm_backward``, unset on, which
:func:`muse_stack.engines.mcore.layers.install_one_pass_norm_backward` sets on the expert layers.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the chain's own backward
    triton = None

from muse_stack.engines.mcore.launch import launches

#: the launch on a GPU: programs per streaming multiprocessor, warps per program and rows per
#: iteration (a power of two), read from launch.json (``norm_backward``: the fastest of the grid
#: ``benchmarks/scripts/kernels.py`` timed at the slice's shape on an H200, written by
#: ``normbwd_choose.py launch --write``; :mod:`.launch`)
_LAUNCH = launches().norm_backward.value
PROGRAMS_PER_SM, NUM_WARPS, ROWS_PER_ITERATION = _LAUNCH.programs_per_sm, _LAUNCH.num_warps, _LAUNCH.rows_per_iteration
#: programs under Triton's interpreter (TRITON_INTERPRET=1), where each is run in turn on the CPU
INTERPRETER_PROGRAMS = 3


if triton is not None:

    @triton.jit
    def _backward(x_ptr, dy_ptr, w_ptr, p_ptr, dx_ptr, dp_ptr, dw_part_ptr, rows, width, eps, rows_per_program,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        tile = tl.arange(0, ROWS)
        g = 1.0 + tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        dw = g * 0.0  # fp32 zeros of the block's shape
        first = program.to(tl.int64) * rows_per_program
        for k in range(0, rows_per_program, ROWS):  # ROWS rows at a time: [ROWS, BLOCK] tiles
            row = first + k + tile
            ours = (row < rows) & (k + tile < rows_per_program)
            at = row[:, None] * width + cols[None, :]
            both = ours[:, None] & inside[None, :]
            # a row outside is all zeros: its dz, dx and share of dw are zero (r is finite: eps > 0)
            x = tl.load(x_ptr + at, mask=both, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + at, mask=both, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + row, mask=ours, other=0.0).to(tl.float32)
            z = x * g[None, :]
            r = 1.0 / tl.sqrt(tl.sum(z * z, axis=1) / width + eps)
            zh = z * r[:, None]
            dyp = dy * p[:, None]
            c = tl.sum(dyp * zh, axis=1) / width
            dz = r[:, None] * (dyp - zh * c[:, None])
            tl.store(dx_ptr + at, (dz * g[None, :]).to(dx_ptr.dtype.element_ty), mask=both)
            tl.store(dp_ptr + row, tl.sum(dy * zh, axis=1), mask=ours)
            dw += tl.sum(dz * x, axis=0)
        tl.store(dw_part_ptr + program.to(tl.int64) * width + cols, dw, mask=inside)


def available() -> bool:
    return triton is not None


def backward(x: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, dy: torch.Tensor, eps: float, *,
             programs_per_sm: int | None = None, num_warps: int | None = None,
             rows_per_iteration: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw fp32, dp fp32) of the weighted gain-first norm, from ``dy`` ([rows, width]).
    ``programs_per_sm``, ``num_warps`` and ``rows_per_iteration`` override the launch's constants above
    (``benchmarks/scripts/kernels.py`` tries a grid of them)."""
    rows, width = x.shape
    x, dy, probs = x.contiguous(), dy.contiguous(), probs.contiguous()
    dx = torch.empty_like(x)
    dp = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return dx, torch.zeros(width, dtype=torch.float32, device=x.device), dp
    if x.is_cuda:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count * (programs_per_sm or
                                                                                       PROGRAMS_PER_SM)
    else:
        programs = INTERPRETER_PROGRAMS
    programs = min(programs, rows)
    per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per_program)
    parts = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    tile = rows_per_iteration or ROWS_PER_ITERATION
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"rows_per_iteration must be a power of two, not {tile}")
    kwargs = {"num_warps": num_warps or NUM_WARPS or min(16, max(4, block // 256))} if x.is_cuda else {}
    _backward[(programs,)](x, dy, w.contiguous(), probs, dx, dp, parts, rows, width, eps, per_program,
                           BLOCK=block, ROWS=tile, **kwargs)
    return dx, parts.sum(0), dp


class _WeightedGainFirstNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: D102
        from muse_stack.engines.mcore.chains import weighted_gain_first_norm as chain

        ctx.save_for_backward(x, w, probs)
        ctx.eps = eps
        return chain(x, w, probs, eps)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: D102
        x, w, probs = ctx.saved_tensors
        dx, dw, dp = backward(x, w, probs, dy, ctx.eps)
        return dx, dw.to(w.dtype), dp.to(probs.dtype), None


def weighted_gain_first_norm(x: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`.chains.weighted_gain_first_norm` (its forward, compiled as the recipe says) with the
    one-pass backward above; ``x`` is [rows, width]."""
    return _WeightedGainFirstNorm.apply(x, w, probs, eps)
