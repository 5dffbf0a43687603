"""On a GPU: the vision tower's chains compiled by TorchInductor (Triton) against the same chains in plain PyTorch,
within the bounds derived in tests/unit/test_towers_chains.py, and the chained blocks equal to the written ones bit
for bit at a width of the released tower."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_compiled_chains_on_the_gpu_stay_within_the_cpu_bounds():
    from towers_chain_bounds import check_chains

    from muse_stack.engines.mcore import towers

    torch._dynamo.reset()
    try:  # the released tower's widths, an odd number of patches
        check_chains(towers.compiled_chains(), rows=4099, width=1536, inner=8960, heads=16, device="cuda")
    finally:
        torch._dynamo.reset()


def test_chained_blocks_equal_the_written_ones_on_the_gpu():
    from muse_stack.engines.mcore import towers
    from muse_stack.models.muse_spark.tower_config import VisionConfig
    from muse_stack.models.muse_spark.vision import EAGER_CHAINS, MuseSparkVisionModel

    torch.manual_seed(0)
    model = MuseSparkVisionModel(VisionConfig(num_hidden_layers=2)).to(device="cuda", dtype=torch.bfloat16)
    grid = torch.tensor([[1, 40, 44], [1, 18, 20]], device="cuda")
    pixels = torch.randn(int(grid.prod(dim=1).sum()), model.config.patch_dim, device="cuda")
    outs = []
    for chains in (None, EAGER_CHAINS):
        towers.set_chains(model, chains)
        model.zero_grad(set_to_none=True)
        out = model(pixels, grid)
        out.float().square().mean().backward()
        outs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))
