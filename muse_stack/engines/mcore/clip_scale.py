"""The gradient clip's scale without a pass on unclipped steps, and without a host sync.

megatron-core's device clip path (``optimizer/clip_grads.py``, ``clip_grad_by_total_norm_fp32``)
clamps the coefficient ``clip_grad / (norm + 1e-6)`` at 1 on the GPU and multiplies every fp32
gradient by it with TE's ``multi_tensor_scale_tensor``, every step: on a step whose norm is
below ``clip_grad`` that is a read and a write of the whole gradient buffer to multiply by exactly
1. Its host path skips the pass but reads the norm with ``.item()``, a host sync each step.

:func:`scale_unless_one` has the signature of TE's ``multi_tensor_scale_tensor`` (megatron-core
calls it through ``multi_tensor_applier``) and the same result: ``out = in * coefficient`` in
fp32. Each program of its Triton kernel reads the coefficient from the GPU first and stops there
when it is exactly 1 (the clamp's value on an unclipped step), where the multiplication would
leave every number as it is and every NaN a NaN (TE's multiplication by 1 returns the GPU's
canonical NaN; the skipped pass keeps the one it found). Any other coefficient, NaN included,
multiplies as TE does. The
gradients megatron-core hands it are views into the gradient buffer: consecutive views are
scaled as one flat span, so a step costs one or a few launches, not one per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch without Triton: the engine keeps TE's multi_tensor_scale_tensor
    triton = None

#: elements per program and loop iteration (fp32: 16 KiB)
BLOCK = 4096
#: programs per streaming multiprocessor: enough resident loads to keep HBM busy on a clipped step
PROGRAMS_PER_SM = 8


if triton is not None:

    @triton.jit
    def _scale(x_ptr, y_ptr, c, n, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        stride = tl.num_programs(0).to(tl.int64) * BLOCK
        for first in range(start, n, stride):
            offsets = first + tl.arange(0, BLOCK)
            mask = offsets < n
            x = tl.load(x_ptr + offsets, mask=mask)
            tl.store(y_ptr + offsets, x * c, mask=mask)

    @triton.jit
    def _scale_unless_one_kernel(x_ptr, y_ptr, coeff_ptr, n, BLOCK: tl.constexpr, IN_PLACE: tl.constexpr):
        c = tl.load(coeff_ptr)
        if IN_PLACE:
            # c == 1 leaves every number as it is (x * 1.0 == x, inf included) and a NaN a NaN:
            # nothing to do. A NaN coefficient fails the comparison and multiplies, as TE's would.
            if c != 1.0:
                _scale(x_ptr, y_ptr, c, n, BLOCK)
        else:
            _scale(x_ptr, y_ptr, c, n, BLOCK)


def flat_spans(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (contiguous, distinct, one dtype and device) as few flat tensors as cover exactly their
    elements: tensors that follow each other in one storage, with nothing between them, become one
    span. Every element belongs to exactly one span."""
    spans: list[torch.Tensor] = []
    run: list[torch.Tensor] = []

    def close() -> None:
        if not run:
            return
        first, count = run[0], sum(t.numel() for t in run)
        span = torch.empty(0, dtype=first.dtype, device=first.device)
        span.set_(first.untyped_storage(), first.storage_offset(), (count,), (1,))
        spans.append(span)
        run.clear()

    def key(t: torch.Tensor) -> tuple[int, int]:
        return t.untyped_storage().data_ptr(), t.storage_offset()

    for t in sorted((t for t in tensors if t.numel()), key=key):
        if run:
            last = run[-1]
            same = last.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            if not (same and last.storage_offset() + last.numel() == t.storage_offset()):
                close()
        run.append(t)
    close()
    return spans


def _launch(x: torch.Tensor, y: torch.Tensor, coeff: torch.Tensor) -> None:
    n = x.numel()
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = max(1, min(triton.cdiv(n, BLOCK), sms * PROGRAMS_PER_SM))
    else:  # Triton's interpreter (TRITON_INTERPRET=1): a few programs, each looping
        programs = max(1, min(triton.cdiv(n, BLOCK), 4))
    _scale_unless_one_kernel[(programs,)](x, y, coeff, n, BLOCK=BLOCK, IN_PLACE=x is y)


def scale_unless_one(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
                     coeff: torch.Tensor) -> None:
    """``tensor_lists[1][i] = tensor_lists[0][i] * coeff`` for fp32 tensors and a one-element fp32
    ``coeff`` on the GPU, as TE's ``multi_tensor_scale_tensor(chunk_size, noop_flag, tensor_lists,
    scale)``; in place (each target is its source, megatron-core's call), no work where ``coeff``
    is exactly 1. ``chunk_size`` and ``noop_flag`` are TE's
    arguments (its kernel never reads the flag to skip work; neither does this one)."""
    del chunk_size, noop_flag
    if triton is None:
        raise RuntimeError("scale_unless_one needs Triton")
    sources, targets = tensor_lists
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} source and {len(targets)} target tensors")
    if coeff.numel() != 1 or coeff.dtype != torch.float32:
        raise ValueError(f"the coefficient must be one fp32 value, got {tuple(coeff.shape)} {coeff.dtype}")
    for s, t in zip(sources, targets):
        if s.dtype != torch.float32 or t.dtype != torch.float32 or s.shape != t.shape:
            raise ValueError("the clip scales fp32 gradients into fp32 tensors of the same shape")
        if not (s.is_contiguous() and t.is_contiguous()):
            raise ValueError("the clip scales contiguous gradients only (megatron-core's are views into its "
                             "gradient buffer)")
    if all(s is t for s, t in zip(sources, targets)):  # in place, megatron-core's case: one launch per span
        for span in flat_spans(sources):
            _launch(span, span, coeff)
        return
    for s, t in zip(sources, targets):
        if s.numel():
            _launch(s, t, coeff)


#: megatron-core's own scale (TE's ``multi_tensor_scale_tensor``) while :func:`install` has put ours in its place
_replaced: list = []


def install() -> bool:
    """Make megatron-core's device clip path use :func:`scale_unless_one` (for the process).
    False where megatron-core has no device path here (no TE ``multi_tensor_scale_tensor``) or
    Triton is missing; the clip then stays as megatron-core runs it."""
    from megatron.core.optimizer import clip_grads

    if installed():
        return True
    if triton is None or clip_grads.multi_tensor_scale_tensor_impl is None:
        return False
    _replaced[:] = [clip_grads.multi_tensor_scale_tensor_impl]
    clip_grads.multi_tensor_scale_tensor_impl = scale_unless_one
    return True


def uninstall() -> None:
    """megatron-core's own scale again, where :func:`install` replaced it in this process."""
    from megatron.core.optimizer import clip_grads

    if installed():
        clip_grads.multi_tensor_scale_tensor_impl = _replaced.pop()


def installed() -> bool:
    from megatron.core.optimizer import clip_grads

    return clip_grads.multi_tensor_scale_tensor_impl is scale_unless_one


def install_clip_skip_unclipped(engine, on: bool) -> str | None:
    """``engine_options.clip_skip_unclipped``: the scale of megatron-core's device clip path by
    :func:`scale_unless_one` (on), or TE's every step (off); why not though asked (None: as asked)."""
    if not on:
        uninstall()
        return None
    return None if install() else "no Triton, or no device clip path in megatron-core here"


def install_clip_on_device(engine, on: bool) -> str | None:
    """``engine_options.clip_on_device``: on, megatron-core's device clip path (its own when TE's scale is
    importable); off, each optimizer step of ``engine`` runs megatron-core's host path (:func:`host_clip_step`)."""
    if not on:
        engine.optimizer.step = partial(host_clip_step, engine.optimizer.step)
    return None


def host_clip_step(step):
    """megatron-core's optimizer step on its host clip path (``engine_options.clip_on_device: false``):
    without TE's ``multi_tensor_scale_tensor`` its ``clip_grads`` reads the norm on the host
    (``.item()``) and scales only when the norm exceeds ``clip_grad``. Only for this call."""
    from megatron.core.optimizer import clip_grads

    saved = clip_grads.multi_tensor_scale_tensor_impl
    clip_grads.multi_tensor_scale_tensor_impl = None
    try:
        return step()
    finally:
        clip_grads.multi_tensor_scale_tensor_impl = saved
