"""The word embedding's backward adds each token's gradient, in fp32, into the table's main gradient.

megatron-core's ``VocabParallelEmbedding`` looks rows up with ``F.embedding``, whose backward builds
a dense gradient the size of the whole table in bf16 (zeros, then each row's tokens summed in fp32
and rounded once); megatron-core's DDP hook then adds that into the fp32 ``main_grad``. On
``slice-1gpu`` that is a 32,768 x 8,192 table: a 0.5 GB zero fill and 1.5 GB of the add's reads
and writes per micro-batch for the rows of 16,384 tokens.

:func:`install` gives the module a lookup whose backward adds the tokens' gradients straight into
the rows of ``main_grad`` (:func:`add_rows`: ``index_put_(accumulate=True)``, which sorts the ids
and sums each row's tokens in order on CUDA: the same sums on every run), marks the weight
``grad_added_to_main_grad`` as TE's fused weight-gradient GEMMs do, and hands autograd a dummy
gradient so megatron-core's hook adds nothing (:func:`dummy_grad`, as TE's ``get_dummy_wgrad``).
The padding row learns nothing, as in transformers' ``nn.Embedding(padding_idx=...)``: its row of
``main_grad`` is zeroed after each add, and since only its own tokens ever reach that row, that is
the same as never adding them (``chains.hold_padding_row``'s hook is removed: it would copy the
dummy).

Numerics: a row's sum over a micro-batch stays in fp32 where the dense path rounds it to bf16
before the add, so the embedding's gradient differs from the dense path's by at most that rounding.

It applies where the table is whole on this rank and trains: TP 1 (under TP megatron-core masks the
other ranks' ids around its lookup and reduces the output), no GTP rematerialisation of the weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_dummies: dict[tuple, torch.Tensor] = {}


def dummy_grad(weight: torch.Tensor) -> torch.Tensor:
    """A gradient of ``weight``'s shape and dtype for autograd to accumulate and megatron-core's hook
    to drop: one uninitialised tensor per shape, handed out detached (a new tensor of its own, so
    autograd takes it as the weight's ``.grad`` without copying it)."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _dummies:
        _dummies[key] = torch.empty(key[0], dtype=weight.dtype, device=weight.device)
    return _dummies[key].detach()


def add_rows(main_grad: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, pad_row: int | None) -> None:
    """``main_grad[ids[i]] += grad[i]`` for every token i, in ``main_grad``'s dtype; the ``pad_row``
    row (None: none here) left as it was before any of its tokens (zero, as every step starts)."""
    rows = ids.reshape(-1)
    values = grad.reshape(rows.numel(), -1).to(main_grad.dtype)
    main_grad.index_put_((rows,), values, accumulate=True)
    if pad_row is not None:
        main_grad[pad_row].zero_()


class LookupIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)``; the backward adds into ``weight.main_grad`` (see the module's text).
    A weight without ``main_grad`` (no megatron-core DDP around it) gets the dense gradient instead."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, pad_row: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids, weight)
        ctx.pad_row = pad_row
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ids, weight = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            dense = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            add_rows(dense, ids, grad, ctx.pad_row)
            return None, dense.to(weight.dtype), None
        add_rows(main_grad, ids, grad, ctx.pad_row)
        weight.grad_added_to_main_grad = True
        return None, dummy_grad(weight), None


def why_not(words: torch.nn.Module) -> str | None:
    """Why ``words`` (megatron-core's ``VocabParallelEmbedding``) keeps its dense lookup (None: it can add
    into main_grad)."""
    if not words.weight.requires_grad:
        return "the embedding is frozen"
    if words.tp_group.size() > 1:
        return "the table is split over TP: megatron-core masks the other ranks' ids around its lookup"
    if getattr(words, "gtp_remat_size", 1) > 1:
        return "megatron-core rematerialises the weight (GTP)"
    return None


def install(words: torch.nn.Module, padding_hook: Any, pad_row: int | None) -> str | None:
    """Give ``words`` the lookup that adds into main_grad, in place of its forward, and remove the
    padding row's gradient hook (``padding_hook``, None: no padding row here); ``pad_row`` is the
    row in this rank's part. Returns why not (None: installed)."""
    reason = why_not(words)
    if reason is not None:
        return reason
    if padding_hook is not None:
        padding_hook.remove()

    def forward(input_: torch.Tensor) -> torch.Tensor:
        return LookupIntoMainGrad.apply(input_, words.weight, pad_row)

    words.forward = forward
    words.lookup_into_main_grad = True
    return None


def installed(words: torch.nn.Module) -> bool:
    return getattr(words, "lookup_into_main_grad", False)


def install_embedding_into_main_grad(engine: Any, on: bool) -> str | None:
    """``engine_options.embedding_into_main_grad``: :func:`install` on the word embedding of ``engine``'s
    model (on; the first pipeline stage holds it), or megatron-core's lookup left as it is (off); why not
    though asked (None: as asked)."""
    if not on:
        return None
    module = engine.model.module
    if not module.pre_process:
        return "the embedding is on the first pipeline stage"
    return install(module.embedding.word_embeddings, module.padding_hook, module.pad_row)
