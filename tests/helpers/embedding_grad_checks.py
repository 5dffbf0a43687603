"""The checks of muse_stack.engines.mcore.embedding_grad, on any device: tests/unit/test_embedding_grad.py runs them on
the CPU, tests/gpu/test_embedding_grad_gpu.py on CUDA (where index_put_ is the kernel the engine runs).

The bound. Every gradient value is a bf16 number, exact in fp32, and so is every starting value of main_grad
used here; a row that k tokens reach is main_grad's value plus k terms, summed in fp32 in some order. A sum of
n = k + 1 terms in binary floating point with unit roundoff u (2^-24 for fp32, round to nearest) is within
gamma(n - 1) * sum(|term|) of the exact sum, gamma(m) = m u / (1 - m u) (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., eq. 4.4), whatever the order. The reference sums the same terms in fp64, whose
own error (the same bound with u = 2^-53) is 2^-29 of this one and is added to it."""

from __future__ import annotations

import torch

U32, U64 = 2.0**-24, 2.0**-53


def gamma(m: torch.Tensor, u: float) -> torch.Tensor:
    return m * u / (1 - m * u)


def rows_and_grad(device: str, tokens: int = 600, vocab: int = 37, width: int = 48, seed: int = 0):
    """Ids with many repeats (``tokens`` over ``vocab`` rows, some rows never hit) and a bf16 gradient."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 3, (2, tokens // 2), generator=gen)  # the last 3 rows get no token
    grad = (torch.randn(2, tokens // 2, width, generator=gen) * 3).bfloat16()
    start = torch.randn(vocab, width, generator=gen).bfloat16().float()
    return ids.to(device), grad.to(device), start.to(device)


def reference(start: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, pad_row: int | None):
    """The exact sums in fp64, each row's bound, and each row's token count."""
    rows, values = ids.reshape(-1).cpu(), grad.reshape(ids.numel(), -1).cpu().double()
    exact = start.cpu().double().index_add(0, rows, values)
    magnitude = start.cpu().double().abs().index_add(0, rows, values.abs())
    counts = torch.bincount(rows, minlength=start.shape[0]).double().unsqueeze(1)
    bound = (gamma(counts, U32) + gamma(counts, U64)) * magnitude
    if pad_row is not None:
        exact[pad_row] = 0
    return exact, bound, counts


def check_add_rows(device: str, pad_row: int | None = 5) -> None:
    from muse_stack.engines.mcore.embedding_grad import add_rows

    ids, grad, start = rows_and_grad(device)
    if pad_row is not None:
        start[pad_row] = 0  # every step starts from a zeroed main_grad
    main_grad = start.clone()
    add_rows(main_grad, ids, grad, pad_row)
    exact, bound, counts = reference(start, ids, grad, pad_row)
    got = main_grad.cpu().double()
    assert torch.all((got - exact).abs() <= bound), float(((got - exact).abs() - bound).max())
    untouched = counts.squeeze(1) == 0
    assert untouched.sum() >= 3 and torch.equal(main_grad[untouched.to(device)], start[untouched.to(device)])
    if pad_row is not None:
        assert counts[pad_row] > 0 and torch.all(main_grad[pad_row] == 0)


def check_lookup(device: str, pad_row: int | None = 5) -> None:
    """The lookup's forward is F.embedding's; its backward adds into main_grad exactly as add_rows does with
    the gradient autograd hands it, marks the weight, and gives autograd the dummy itself (no copy)."""
    from muse_stack.engines.mcore import embedding_grad
    from muse_stack.engines.mcore.embedding_grad import LookupIntoMainGrad, add_rows

    ids, grad, start = rows_and_grad(device)
    weight = torch.nn.Parameter(torch.randn(start.shape, device=device).bfloat16())
    weight.main_grad = torch.zeros(start.shape, device=device)
    out = LookupIntoMainGrad.apply(ids, weight, pad_row)
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight))
    out.backward(grad)
    expected = torch.zeros(start.shape, device=device)
    add_rows(expected, ids, grad, pad_row)
    assert torch.equal(weight.main_grad, expected)
    assert weight.grad_added_to_main_grad is True
    dummy = embedding_grad._dummies[(tuple(weight.shape), weight.dtype, weight.device)]
    assert weight.grad.untyped_storage().data_ptr() == dummy.untyped_storage().data_ptr()


def check_dense_without_main_grad(device: str, pad_row: int | None = 5) -> None:
    """No main_grad (no DDP around the weight): the dense gradient, within the bound and one bf16 rounding."""
    from muse_stack.engines.mcore.embedding_grad import LookupIntoMainGrad

    ids, grad, start = rows_and_grad(device)
    weight = torch.nn.Parameter(torch.zeros(start.shape, device=device).bfloat16())
    LookupIntoMainGrad.apply(ids, weight, pad_row).backward(grad)
    exact, bound, _ = reference(torch.zeros_like(start), ids, grad, pad_row)
    got = weight.grad.cpu().double()
    assert weight.grad.dtype == torch.bfloat16
    assert torch.all((got - exact).abs() <= bound + 2.0**-8 * (exact.abs() + bound))  # bf16: u = 2^-8
    if pad_row is not None:
        assert torch.all(weight.grad[pad_row] == 0)
