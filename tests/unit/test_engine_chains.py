"""The GPU layers' elementwise chains (:mod:`muse_stack.engines.mcore.chains`) against the
reference model's norms, on CPU: eager, and through torch.compile's graph capture."""

import pytest
import torch

from muse_stack.engines.mcore import chains, fuse
from muse_stack.models.muse_spark.norms import CenteredRMSNorm, GainFirstRMSNorm


class Capture:
    """A torch.compile backend that runs the captured graph as is (the graph, not a kernel)."""

    graphs = 0  # class-wide: reset per test by the fixture

    def __call__(self, gm, example_inputs):
        Capture.graphs += 1
        return gm.forward


@pytest.fixture(params=[False, True], ids=["eager", "captured"])
def mode(request):
    torch._dynamo.reset()
    Capture.graphs = 0
    fuse.configure(request.param, backend=Capture())
    yield request.param
    fuse.configure(False)
    torch._dynamo.reset()


def _slots(tokens=37, width=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width, generator=g), torch.randn(width, generator=g) * 0.3,
            torch.rand(tokens, generator=g))


def test_weighted_post_expert_norm_is_the_reference_norm_times_the_routing_weight(mode):
    """The same float32 operations in the same order as GainFirstRMSNorm followed by the weight:
    equal bit for bit in float32, and the bf16 result is that value rounded once."""
    x, w, p = _slots()
    ref = GainFirstRMSNorm(64, 1e-8)
    with torch.no_grad():
        ref.weight.copy_(w)
    expected = ref(x) * p.unsqueeze(-1)
    assert torch.equal(chains.weighted_gain_first_norm(x, w, p, 1e-8), expected)
    got = chains.weighted_gain_first_norm(x.bfloat16(), w, p, 1e-8)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (ref(x.bfloat16()) * p.unsqueeze(-1)).bfloat16())
    assert (Capture.graphs > 0) == mode  # captured as one graph when compilation is on


def test_weighted_post_expert_norm_gradients_match_the_unfused_chain(mode):
    """Gradients to the slots, the gain and the routing weights are those of the two-step chain
    it replaces (norm, then weight): the same float32 operations, so equal bit for bit."""
    x, w, p = _slots(seed=1)
    grad = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    leaves = [t.clone().requires_grad_() for t in (x, w, p)]
    chains.weighted_gain_first_norm(*leaves, 1e-8).backward(grad)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, p)]
    rx, rw, rp = ref_leaves
    (chains.gain_first_norm(rx, rw, 1e-8) * rp.unsqueeze(-1)).backward(grad)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    # a different weight moves the result: the weight is applied, not dropped
    assert not torch.allclose(chains.weighted_gain_first_norm(x, w, p * 2, 1e-8),
                              chains.weighted_gain_first_norm(x, w, p, 1e-8))


def test_centered_norm_matches_the_reference_pre_norm(mode):
    x, w, _ = _slots(seed=3)
    ref = CenteredRMSNorm(64, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(w)
    chains.set_matmul_dtype(torch.float32)
    try:
        assert torch.equal(chains.centered_norm(x, w, 1e-5), ref(x))
    finally:
        chains.set_matmul_dtype(torch.bfloat16)


def test_softcap_cross_entropy_is_the_reference_loss(mode):
    """Against float64 cross-entropy of the soft-capped logits (the reference model's loss):
    each per-token value is a logsumexp over V terms of magnitude <= cap plus one picked term,
    so its float32 error is at most about (log V + 2) * cap * u32 * a few; with cap 20, V 512 the
    bound below (1e-4 absolute) is far above that (8 * 20 * 6e-8 = 1e-5) and far below a wrong
    softcap or a missing multiplier (which move the loss by O(0.1))."""
    g = torch.Generator().manual_seed(4)
    raw = torch.randn(9, 512, generator=g) * 30
    target = torch.randint(0, 512, (9,), generator=g)
    multiplier, cap = 2 ** -2.5, 20.0
    z64 = cap * torch.tanh(raw.double() * multiplier / cap)
    expected = torch.nn.functional.cross_entropy(z64, target, reduction="none")
    got = chains.softcap_cross_entropy(raw, target, multiplier, cap)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4)
    uncapped = torch.nn.functional.cross_entropy(raw.double() * multiplier, target, reduction="none")
    assert (uncapped - expected).abs().max() > 0.1  # the softcap matters at this logit scale


def test_softcap_cross_entropy_gradient_is_softmax_minus_one_hot(mode):
    """d loss / d raw = (softmax(z) - onehot(target)) * m * (1 - tanh^2): against float64
    autograd of the reference form; float32 error of each entry is a few u32 relative to the
    largest term (<= m = 0.18), so 1e-6 absolute leaves a wide margin."""
    g = torch.Generator().manual_seed(5)
    raw = (torch.randn(6, 256, generator=g) * 30).requires_grad_()
    target = torch.randint(0, 256, (6,), generator=g)
    multiplier, cap = 2 ** -2.5, 20.0
    weights = torch.rand(6, generator=g)
    (chains.softcap_cross_entropy(raw, target, multiplier, cap) * weights).sum().backward()
    raw64 = raw.detach().double().requires_grad_()
    z64 = cap * torch.tanh(raw64 * multiplier / cap)
    (torch.nn.functional.cross_entropy(z64, target, reduction="none") * weights.double()).sum().backward()
    torch.testing.assert_close(raw.grad.double(), raw64.grad, rtol=0, atol=1e-6)


def test_weightless_and_final_norms_are_the_reference_norms(mode):
    x, w, _ = _slots(seed=6)
    from muse_stack.models.muse_spark.norms import StoredGainRMSNorm, rms_norm

    assert torch.equal(chains.weightless_norm(x, 1e-5), rms_norm(x, 1e-5))
    ref = StoredGainRMSNorm(64, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(1 + w)
    chains.set_matmul_dtype(torch.float32)
    try:
        assert torch.equal(chains.stored_gain_norm(x, 1 + w, 1e-5), ref(x))
    finally:
        chains.set_matmul_dtype(torch.bfloat16)


def test_residual_and_pre_mlp_norm_in_one_chain_are_the_two_chains(mode):
    """The post-attention residual and the pre-MLP norm as one chain: the same operations as the
    two chains it replaces, so the new stream, the bf16 norm and every gradient (the stream's two
    gradients summed) are equal bit for bit; and the norm is that of the new stream."""
    gen = torch.Generator().manual_seed(7)
    stream, gate, w = torch.randn(37, 64, generator=gen), torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    attn = torch.randn(37, 64, generator=gen).bfloat16()
    g_stream, g_norm = torch.randn(37, 64, generator=gen), torch.randn(37, 64, generator=gen).bfloat16()

    def leaves():
        return [t.clone().requires_grad_() for t in (stream, attn, gate, w)]

    fused = leaves()
    new, normed = chains.post_attention_residual_and_norm(fused[0], fused[1], fused[2], 1e-8, 0.5, fused[3], 1e-5)
    torch.autograd.backward([new, normed], [g_stream, g_norm])
    apart = leaves()
    ref_new = chains.post_attention_residual(apart[0], apart[1], apart[2], 1e-8, 0.5)
    ref_normed = chains.centered_norm(ref_new, apart[3], 1e-5)
    torch.autograd.backward([ref_new, ref_normed], [g_stream, g_norm])
    assert normed.dtype == torch.bfloat16 and new.dtype == torch.float32
    assert torch.equal(new, ref_new) and torch.equal(normed, ref_normed)
    for got, want in zip(fused, apart):
        assert torch.equal(got.grad, want.grad)
    assert (Capture.graphs > 0) == mode
    # the norm's gain reaches the output, and the stream's gradient carries the norm's part
    assert not torch.equal(chains.post_attention_residual_and_norm(stream, attn, gate, 1e-8, 0.5, w * 2, 1e-5)[1],
                           normed.detach())
    alone = leaves()
    chains.post_attention_residual(alone[0], alone[1], alone[2], 1e-8, 0.5).backward(g_stream)
    assert not torch.equal(alone[0].grad, fused[0].grad)
