"""On a GPU: the vision tower with bf16 activations (``engine_options.towers_bf16_activations``) against
transformers' own bf16 tower, forward and gradients, within the bound tests/unit/test_towers_bf16_activations.py
derives on the CPU (tests/helpers/towers_bf16_checks.py)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_bf16_activations_round_where_transformers_bf16_tower_rounds_on_the_gpu(recompute):
    import towers_bf16_checks as checks

    checks.check_rounds_where_transformers_rounds(checks.reference("cuda"), recompute)
