"""A step's first micro-batch writes the weight gradients of Transformer Engine's GEMMs into the main
gradients instead of adding them to zeros, so the step zeroes only the rest of the grad buffers.

megatron-core's DDP zeroes every grad buffer at the start of a step (``zero_grad_buffer``): one
write pass over the fp32 main gradients, 17.3 GB on ``slice-1gpu``. Under gradient accumulation
fusion, TE's weight-gradient GEMMs add their product into ``main_grad``; a weight that carries
``overwrite_main_grad`` when its module's forward runs gets the product written instead (TE
reads the attribute in the forward and keeps it for the backward). :class:`FirstMicroBatchWrites`
sets that attribute on the weights whose whole gradient is such a GEMM, for the first micro-batch
of a step only, and has the step's ``zero_grad_buffer`` leave those weights' ranges alone.

Which weights: the TE modules of the decoder (every layer runs on every micro-batch) with
``fuse_wgrad_accumulation``, whose weights train and appear once in the model. Not the towers
(an image-free micro-batch skips them), and not under a recompute of whole layers or of the MoE
layer (the recomputed forward runs in the backward, after the attribute is cleared; the
attention core and the SwiGLU hold no weight). Two guards keep the gradients
whole where a forward does not go as planned:

* a module that did not run in the first micro-batch has its main gradients zeroed when the
  micro-batch's forward returns (before any backward), so the later micro-batches add to zeros;
* a module that runs twice in the first micro-batch stops the step with an error: the second
  backward would overwrite the first.

An expert that gets no token in the first micro-batch runs a GEMM of no rows; its main gradients
are zeroed by :func:`zero_unrouted` from the host's counts (TE's grouped GEMM need not write a
product of nothing).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

#: TE's attribute: the weight-gradient GEMM writes ``main_grad`` instead of adding to it
FLAG = "overwrite_main_grad"


def module_weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A TE linear's weights: ``weight`` (Linear, LayerNormLinear) or ``weight0 .. weightN-1``
    (GroupedLinear)."""
    if isinstance(getattr(module, "weight", None), torch.nn.Parameter):
        return [module.weight]
    out, i = [], 0
    while isinstance(getattr(module, f"weight{i}", None), torch.nn.Parameter):
        out.append(getattr(module, f"weight{i}"))
        i += 1
    return out


def why_not(config: Any, ddp_config: Any) -> str | None:
    """Why the whole buffer must be zeroed under these settings (None: the first micro-batch can write)."""
    from muse_stack.recipes.options import first_writes_blocker

    reason = first_writes_blocker(config.gradient_accumulation_fusion, config.recompute_granularity,
                                  config.recompute_modules)
    if reason is not None:
        return reason
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        return "CUDA graphs replay the forward with the flags it was captured with"
    if getattr(ddp_config, "use_megatron_fsdp", False):
        return "megatron FSDP keeps its own main gradients"
    return None


def eligible_modules(model: torch.nn.Module, decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's TE modules whose weights' only gradient is their fused weight-gradient GEMM."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    out = []
    for m in decoder.modules():
        if not isinstance(m, TransformerEngineBaseModule) or not getattr(m, "fuse_wgrad_accumulation", False):
            continue
        weights = module_weights(m)
        if weights and all(p.requires_grad and seen.get(id(p)) == 1 for p in weights):
            out.append(m)
    return out


def zero_unrouted(weights_fc1: list[torch.nn.Parameter], weights_fc2: list[torch.nn.Parameter],
                  counts: list[int]) -> None:
    """Under the first micro-batch's writes: zero the main gradients of the experts with no token."""
    if not weights_fc1 or not getattr(weights_fc1[0], FLAG, False) or all(counts):
        return
    for weights in (weights_fc1, weights_fc2):
        # one weight per expert, or all experts in one (TE's single grouped weight)
        grads = ([p.main_grad for p in weights] if len(weights) == len(counts)
                 else list(weights[0].main_grad.view(len(counts), -1)))
        for grad, n in zip(grads, counts):
            if n == 0:
                grad.zero_()


class FirstMicroBatchWrites:
    """The first micro-batch's TE GEMMs write their weights' main gradients (see the module's text)."""

    def __init__(self, ddp: Any, modules: list[torch.nn.Module]) -> None:
        self.ddp = ddp
        self.modules = modules
        self.weights = [p for m in modules for p in module_weights(m)]
        self.armed = False
        self._calls: dict[int, int] = {}
        written = {id(p) for p in self.weights}
        #: per grad buffer: the element ranges still to zero (everything but the written weights')
        self.to_zero: list[tuple[Any, list[tuple[int, int]]]] = []
        for buffer in list(ddp.buffers) + list(ddp.expert_parallel_buffers):
            kept = sorted((start, end) for p, (start, end, _) in buffer.param_index_map.items() if id(p) in written)
            self.to_zero.append((buffer, complement(kept, buffer.grad_data.numel())))
        self.written_elements = sum(p.numel() for p in self.weights)
        self.buffer_elements = sum(b.grad_data.numel() for b, _ in self.to_zero)
        self._hooks = [m.register_forward_pre_hook(self._count) for m in modules]

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        if not self.armed:
            return
        n = self._calls.get(id(module), 0) + 1
        self._calls[id(module)] = n
        if n > 1:
            raise RuntimeError(
                f"{type(module).__name__} ran twice in the step's first micro-batch: its second weight gradient "
                "would overwrite the first. Set engine_options.first_micro_batch_writes: false in the recipe")

    @contextmanager
    def _partial_reset(self) -> Iterator[None]:
        """While megatron-core's ``zero_grad_buffer`` runs, each buffer's ``reset`` zeroes only the
        ranges the first micro-batch does not write."""
        saved = []
        for buffer, ranges in self.to_zero:
            def reset(buffer=buffer, ranges=ranges) -> None:
                for a, b in ranges:
                    buffer.grad_data[a:b].zero_()
                for grad in getattr(buffer, "extra_main_grads", ()):
                    grad.zero_()
            saved.append(buffer)
            buffer.reset = reset
        try:
            yield
        finally:
            for buffer in saved:
                del buffer.reset  # megatron-core's own method again

    def zero_grad_buffer(self) -> None:
        """The step's ``zero_grad_buffer`` without the written ranges, then the flags armed."""
        with self._partial_reset():
            self.ddp.zero_grad_buffer()
        self.arm()

    def arm(self) -> None:
        self._calls = {}
        for p in self.weights:
            setattr(p, FLAG, True)
        self.armed = True

    def disarm(self) -> None:
        """After the first micro-batch's forward: the flags off, and the main gradients of any module
        that did not run zeroed, so the later micro-batches add to zeros."""
        if not self.armed:
            return
        self.armed = False
        for p in self.weights:
            setattr(p, FLAG, False)
        for m in self.modules:
            if self._calls.get(id(m), 0) == 0:
                for p in module_weights(m):
                    p.main_grad.zero_()

    def describe(self) -> str:
        return (f"the step's first micro-batch writes the main gradients of {len(self.modules)} TE modules' "
                f"weights ({self.written_elements:,} of {self.buffer_elements:,} elements); the rest is zeroed")


def install_first_micro_batch_writes(engine: Any, on: bool) -> str | None:
    """``engine_options.first_micro_batch_writes``: ``engine.first_writes``, the first micro-batch's writes over
    the decoder's TE modules (on, where the built config allows), or None (off: the whole buffer zeroed); why
    not though asked (None: as asked)."""
    engine.first_writes = None
    if not on:
        return None
    reason = why_not(engine.config, engine.model.ddp_config)
    if reason is not None:
        return reason
    modules = eligible_modules(engine.model.module, engine.model.module.decoder)
    if not modules:
        return "no TE module of the decoder has a trainable weight"
    engine.first_writes = FirstMicroBatchWrites(engine.model, modules)
    return None


def complement(kept: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges of [0, size) outside the sorted ``kept`` ranges, adjacent ones merged."""
    out, at = [], 0
    for a, b in kept:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < size:
        out.append((at, size))
    return out
