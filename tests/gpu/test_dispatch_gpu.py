"""The allgather dispatcher that reads the experts' token counts early (muse_stack.engines.mcore.dispatch)
against megatron-core's, on a GPU: the same permuted tokens, counts, routing weights, combined output
and gradients, bit for bit, with the fused and the unfused permutation; and no host sync after the
counts' copy, where megatron-core's dispatcher blocks twice."""

from types import SimpleNamespace

import pytest
import torch

from muse_stack.engines.megatron_available import missing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or missing() is not None,
                                 reason=f"needs CUDA, Transformer Engine and megatron-core ({missing()})")]

TOKENS, EXPERTS, TOPK, WIDTH = 1531, 32, 8, 96  # an odd token count: no expert gets a round share


def _routing(seed: int):
    """A top-8 routing map, and values for which every sum below is exact in any order: the unfused
    unpermute and the gradient of the unfused permute add a token's slots with scatter_add /
    index_add, whose order on the GPU is not fixed. Activations and gradients are integers in
    [-3, 3] and weights multiples of 1/8 in (0, 1], so a slot's output is a multiple of 1/8 within
    [-3, 3], a token's sum of 8 slots one within [-24, 24] (at most 385 values: bf16's 8
    significant bits hold them all), and the weights' gradients are integer dot products of 96
    terms of at most 9 in fp32. So bitwise equality is what the same numbers look like."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(TOKENS, EXPERTS, device="cuda", generator=gen)
    top = scores.topk(TOPK, dim=1)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool, device="cuda").scatter_(1, top.indices, True)
    eighths = torch.randint(1, 9, (TOKENS, TOPK), device="cuda", generator=gen).float() / 8
    probs = torch.zeros(TOKENS, EXPERTS, device="cuda").scatter_(1, top.indices, eighths)
    hidden = torch.randint(-3, 4, (TOKENS, 1, WIDTH), device="cuda", generator=gen).bfloat16()
    grad = torch.randint(-3, 4, (TOKENS, 1, WIDTH), device="cuda", generator=gen).bfloat16()
    return routing_map, probs, hidden, grad


def _dispatcher(cls, fused: bool):
    config = SimpleNamespace(moe_router_topk=TOPK, add_bias_linear=False, moe_permute_fusion=fused)
    groups = SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)  # one rank: every expert local
    dispatcher = cls(EXPERTS, list(range(EXPERTS)), config=config, pg_collection=groups)
    if hasattr(dispatcher, "prefetch_counts"):  # ours: engine_options.early_expert_counts on, as the engine installs it
        dispatcher.early_counts = True
    return dispatcher


def _round_trip(dispatcher, routing_map, probs, hidden, grad, prefetch: bool, sync_debug: str = "default"):
    """Dispatch, a stand-in for the experts (each slot's row times its weight), combine, backward."""
    h, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    if prefetch:
        dispatcher.prefetch_counts(routing_map)
    x, q = dispatcher.dispatch_preprocess(h, routing_map, p)
    x, q = dispatcher.token_dispatch(x, q)
    if sync_debug != "default" and hasattr(dispatcher, "_take_counts"):
        counts = dispatcher._take_counts()  # the one wait by design: the counts' copy
        dispatcher._take_counts = lambda: counts
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(sync_debug)
    try:
        permuted, counts, weights = dispatcher.dispatch_postprocess(x, q)
        out = (permuted.float() * weights.unsqueeze(-1)).bfloat16()
        combined = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(out)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    combined.backward(grad)
    return {"permuted": permuted, "counts": counts, "weights": weights, "combined": combined,
            "hidden_grad": h.grad, "probs_grad": p.grad}


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-permute", "fused-permute"])
def test_same_numbers_as_megatron_core_bitwise(fused):
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from muse_stack.engines.mcore.dispatch import EarlyCountAllGatherDispatcher

    routing_map, probs, hidden, grad = _routing(seed=1)
    theirs = _round_trip(_dispatcher(MoEAllGatherTokenDispatcher, fused), routing_map, probs, hidden, grad, False)
    early = _dispatcher(EarlyCountAllGatherDispatcher, fused)
    ours = _round_trip(early, routing_map, probs, hidden, grad, True)
    assert ours["counts"].device.type == "cpu" and ours["counts"].dtype == torch.int64
    assert int(ours["counts"].sum()) == TOKENS * TOPK
    for name, want in theirs.items():
        assert torch.equal(ours[name].cpu(), want.cpu()), name
    # not prefetched (or prefetched for another map): megatron-core's path, the same numbers
    again = _round_trip(early, routing_map, probs, hidden, grad, False)
    for name, want in theirs.items():
        assert torch.equal(again[name].cpu(), want.cpu()), name


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-permute", "fused-permute"])
def test_nothing_blocks_after_the_counts_copy(fused):
    """CUDA's sync debug mode raises on a blocking call: megatron-core's dispatch_postprocess makes
    two (.cpu() and masked_select); the early-count one none once its counts are on the host."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from muse_stack.engines.mcore.dispatch import EarlyCountAllGatherDispatcher

    routing_map, probs, hidden, grad = _routing(seed=2)
    with pytest.raises(RuntimeError, match="synchroniz"):
        _round_trip(_dispatcher(MoEAllGatherTokenDispatcher, fused), routing_map, probs, hidden, grad, False,
                    sync_debug="error")
    _round_trip(_dispatcher(EarlyCountAllGatherDispatcher, fused), routing_map, probs, hidden, grad, True,
                sync_debug="error")


def test_switched_off_it_is_megatron_core():
    from muse_stack.engines.mcore import dispatch

    routing_map, probs, hidden, grad = _routing(seed=3)
    d = _dispatcher(dispatch.EarlyCountAllGatherDispatcher, True)
    d.early_counts = False
    d.prefetch_counts(routing_map)
    assert d._prefetched is None and not d.local_only()
    with pytest.raises(RuntimeError, match="synchroniz"):
        _round_trip(d, routing_map, probs, hidden, grad, True, sync_debug="error")
