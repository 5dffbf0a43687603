"""On a GPU: Transformer Engine's FusedAdam stepped by TE (multi_tensor_adam) and by the engine's Triton step
(muse_stack.engines.mcore.adam_step), from the same states and gradients, both against the update in fp64
within the bounds of tests/helpers/adam_bounds.py; the bf16 weights the masters rounded to nearest-even; and how many
elements differ from TE's (printed: run with -s to see them)."""

import pytest
import torch
from adam_bounds import bf16_nearest_even, bias_corrections, reference, within

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(1024, 4096), (4096,), (8191,), (3, 1000, 33), (64, 512)]


def _pair(adam_w_mode: bool):
    from transformer_engine.pytorch.optimizers import FusedAdam

    gen = torch.Generator(device="cuda").manual_seed(5)
    made = []
    for _ in range(2):
        half = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).bfloat16() * 0.02) for s in SHAPES]
        full = [torch.nn.Parameter(torch.randn(777, device="cuda", generator=gen))]
        groups = [dict(params=half[:3] + full, weight_decay=0.1), dict(params=half[3:], weight_decay=0.0, lr=1e-3)]
        made.append((FusedAdam(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, master_weights=True,
                               use_decoupled_grad=True, adam_w_mode=adam_w_mode), half + full))
    (te, te_params), (ours, our_params) = made
    for a, b in zip(te_params, our_params):
        b.data.copy_(a.data)
    return te, te_params, ours, our_params


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_triton_step_and_tes_are_within_the_bounds(adam_w_mode):
    from muse_stack.engines.mcore import adam_step

    te, te_params, ours, our_params = _pair(adam_w_mode)
    assert adam_step.unsupported(ours) is None
    differ = total = 0
    twin = {id(a): b for a, b in zip(te_params, our_params)}
    for k in range(3):
        for a, b in zip(te_params, our_params):
            a.decoupled_grad = torch.randn(a.shape, device="cuda") * 10.0 ** -(k + 1)
            b.decoupled_grad = a.decoupled_grad.clone()
        if k:  # the same state before the step: TE's
            for a, b in zip(te_params, our_params):
                b.data.copy_(a.data)
                for name, t in te.state[a].items():
                    ours.state[b][name].copy_(t)
        before = {id(a): (a.detach().clone(), {n: t.clone() for n, t in te.state[a].items()}) for a in te_params} \
            if k else None
        te.step()
        adam_step.step(ours)
        if not k:
            continue  # the first step initialises the states; TE's and ours are compared from the second
        for group_te in te.param_groups:
            bc1, bc2 = bias_corrections(0.9, 0.95, group_te["step"])
            for a in group_te["params"]:
                b = twin[id(a)]
                w0, st = before[id(a)]
                half = a.dtype == torch.bfloat16
                exact, bounds = reference(a.decoupled_grad, st["master_param"] if half else w0, st["exp_avg"],
                                          st["exp_avg_sq"], beta1=0.9, beta2=0.95, eps=1e-8,
                                          decay=group_te["weight_decay"], lr=group_te["lr"], bc1=bc1, bc2=bc2,
                                          adam_w=adam_w_mode)
                for who, opt, p in (("TE", te, a), ("Triton", ours, b)):
                    got = (opt.state[p]["master_param"] if half else p.detach(), opt.state[p]["exp_avg"],
                           opt.state[p]["exp_avg_sq"])
                    for name, g, e, bound in zip(("master", "m", "v"), got, exact, bounds):
                        ok, worst = within(g, e, bound)
                        assert ok, f"{who}'s {name} of {tuple(p.shape)}: {worst:.2f} of its bound"
                    if half:
                        assert torch.equal(p.detach(), bf16_nearest_even(opt.state[p]["master_param"]))
                mine = ours.state[b]["master_param"] if half else b.detach()
                theirs = te.state[a]["master_param"] if half else a.detach()
                differ += int((mine != theirs).sum()) + sum(int((ours.state[b][n] != te.state[a][n]).sum())
                                                            for n in ("exp_avg", "exp_avg_sq"))
                total += 3 * a.numel()
    assert [g["step"] for g in ours.param_groups] == [g["step"] for g in te.param_groups] == [3, 3]
    print(f"adam_w_mode={adam_w_mode}: {differ} of {total} master and moment elements differ from TE's")


def test_the_step_skips_a_parameter_without_a_gradient():
    from muse_stack.engines.mcore import adam_step

    te, te_params, ours, our_params = _pair(True)
    for p in our_params:
        p.decoupled_grad = torch.ones_like(p, dtype=torch.float32)
    del our_params[1].decoupled_grad
    kept = our_params[1].detach().clone()
    adam_step.step(ours)
    assert torch.equal(our_params[1].detach(), kept)
    assert not torch.equal(our_params[0].detach(), te_params[0].detach())
