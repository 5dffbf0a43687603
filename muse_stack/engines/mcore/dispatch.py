"""The allgather token dispatcher with the experts' token counts read before the latent GEMM.

The grouped GEMMs of the experts need each local expert's token count on the host. megatron-core's
allgather dispatcher reads them in ``dispatch_postprocess`` with a blocking ``.cpu()``, and then
selects each slot's routing weight with ``masked_select``, whose output size is data-dependent, so
it blocks too. After each, the GPU has nothing queued, and it idles while Python prepares the
permutation and the first grouped GEMM (1.3 to 2.6 ms per MoE layer and micro-batch on the slice;
``benchmarks/results/clip-skip-and-gated-residual/profile-shipped.json``).

Where the dispatch moves no tokens (tensor and expert parallel sizes 1: every expert is local and
``token_dispatch`` is the identity), the counts are known as soon as the router has run. Here:

* :meth:`EarlyCountAllGatherDispatcher.prefetch_counts` sums the routing map per expert and copies
  the sums to pinned host memory without blocking, before the MoE layer launches its latent GEMM,
  and records an event behind the copy;
* ``dispatch_postprocess`` waits on that event only. The latent GEMM and the pre-expert norm are
  still queued on the GPU while the host prepares the grouped GEMM;
* the routing weights travel through the same permutation as the tokens (megatron-core's
  ``permute`` with ``probs``: a gather of the same rows, fixed output size), not ``masked_select``.

The tokens, the weights and their gradients are the same numbers either way: both orders are
expert-major with tokens ascending within an expert, and every step is a copy of one element
(``tests/gpu/test_dispatch_gpu.py`` against megatron-core's dispatcher, bitwise). With more than one tensor or expert parallel rank the map is gathered first,
so the dispatcher runs megatron-core's code unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


def expert_counts(routing_map: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Tokens routed to experts ``first..last`` (inclusive), int64, on the map's device."""
    return routing_map[:, first:last + 1].sum(dim=0, dtype=torch.int64)


class EarlyCountAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's allgather dispatcher, with the local counts read early where no tokens move."""

    #: ``engine_options.early_expert_counts``, set by the engine when it builds the model
    #: (:func:`install_early_expert_counts`). False: megatron-core's dispatch_postprocess as it is
    #: (``.cpu()`` then ``masked_select``)
    early_counts: bool

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prefetched: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None

    def local_only(self) -> bool:
        """True when this rank's dispatch moves no tokens: every expert is local."""
        return self.early_counts and self.tp_size == 1 and self.ep_size == 1

    def prefetch_counts(self, routing_map: torch.Tensor) -> None:
        """Start the copy of the local experts' counts to the host; call before the latent GEMM."""
        self._prefetched = None
        if not self.local_only() or not routing_map.is_cuda:
            return
        counts = expert_counts(routing_map, self.local_expert_indices[0], self.local_expert_indices[-1])
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._prefetched = (routing_map, host, ready)

    def _take_counts(self) -> torch.Tensor | None:
        """The prefetched counts, once copied, if they were taken from this step's routing map."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is None or prefetched[0] is not self.routing_map or not self.local_only():
            return None
        _, host, ready = prefetched
        ready.synchronize()
        return host

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tokens_per_expert = self._take_counts()
        if tokens_per_expert is None:
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1]
        self.local_map = self.routing_map[:, first:last + 1].contiguous()
        local_probs = probs[:, first:last + 1].contiguous()
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states, self.local_map, probs=local_probs, num_out_tokens=int(tokens_per_expert.sum()),
            fused=self.config.moe_permute_fusion)
        # megatron-core keeps the selected weights here (token_combine reads their dtype)
        self.local_probs = permuted_probs
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs


def install_early_expert_counts(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.early_expert_counts`` on every MoE layer's dispatcher of ``model`` (an allgather
    dispatcher is this one, :class:`~muse_stack.engines.mcore.layers.MuseSparkMoE`); why it is off though asked
    (None: as asked, or no dispatcher of this kind here)."""
    for m in model.modules():
        dispatcher = getattr(m, "token_dispatcher", None)
        if isinstance(dispatcher, EarlyCountAllGatherDispatcher):
            dispatcher.early_counts = on
    return None
