"""On a GPU: the checks of tests/helpers/embedding_grad_checks.py with CUDA's index_put_, the same sums on every run at the
slice's shape (16,384 tokens into a 32,768 x 8,192 table), and the dense path megatron-core runs within one bf16
rounding of each row's sum of it."""

import pytest
import torch
from embedding_grad_checks import check_add_rows, check_dense_without_main_grad, check_lookup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("pad_row", [5, None])
def test_the_checks_on_cuda(pad_row):
    check_add_rows("cuda", pad_row)
    check_lookup("cuda", pad_row)
    check_dense_without_main_grad("cuda", pad_row)


def test_the_slices_shape_the_same_every_run_and_within_a_rounding_of_the_dense_path():
    from muse_stack.engines.mcore.embedding_grad import add_rows

    gen = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, 32768, (4, 4096), device="cuda", generator=gen)
    ids[:, :512] = 17  # a row most tokens of a long padding-free run reach
    grad = torch.randn(4, 4096, 8192, device="cuda", generator=gen).bfloat16()
    runs = []
    for _ in range(2):
        main_grad = torch.zeros(32768, 8192, device="cuda")
        add_rows(main_grad, ids, grad, None)
        runs.append(main_grad)
    assert torch.equal(runs[0], runs[1])
    weight = torch.zeros(32768, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.embedding(ids, weight).backward(grad)
    dense = weight.grad.float()
    # the dense path rounds its fp32 row sum s1 to bf16 once (u = 2^-8); s1 and ours, s2, are each within the
    # fp32 summation bound B = k u sum|g| <= k^2 u max|g| of the exact sum (tests/helpers/embedding_grad_checks.py; k at
    # most 2,100 tokens a row here), so |bf16(s1) - s2| <= 2^-8 |s2| + (1 + 2^-8) 2B, under 2^-8 |s2| + 3B
    bound = 2100 * 2100 * 2.0**-24 * grad.abs().max().float()
    tol = 2.0**-8 * runs[0].abs() + 3 * bound
    assert torch.all((dense - runs[0]).abs() <= tol)
