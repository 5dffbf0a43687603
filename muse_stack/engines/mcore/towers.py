"""The vision tower's elementwise chains compiled (``engine_options.compile_towers``), and its activations in
the weights' dtype (``engine_options.towers_bf16_activations``).

The towers run the reference modules (:mod:`muse_stack.models.muse_spark.vision`), whose blocks keep their
activations in fp32 between bf16 GEMMs: each block casts the normed activations once per projection, returns every
GEMM output to fp32, and runs its LayerNorms, RoPE, exact GELU and residual adds as separate kernels. On one GPU
that elementwise work and its casts were more than half of the multimodal step's kernel time
(``benchmarks/results/mm-slice-profile-h100/``). With this option every block runs its chained forward
(:class:`~muse_stack.models.muse_spark.vision.VisionChains`: the same values; v and the GEMM outputs stay in the
GEMM dtype), each chain one ``torch.compile`` graph whose fp32 intermediates stay in registers. One compiled set
serves every block; automatic dynamic shapes compile a chain again once the patch count changes, then with that
dimension symbolic.

With ``towers_bf16_activations`` the tower keeps its activations in the weights' dtype (bf16) between the GEMMs,
as transformers runs it in bf16 (:class:`~muse_stack.models.muse_spark.vision.MuseSparkVisionModel`'s
``activations_dtype``): no cast around any GEMM, and every pass over the activations reads and writes half the
bytes. It changes numerics (the residual stream is rounded to bf16 at each add); with the chains above, the chains
run on bf16 activations.

With ``towers_varlen_attention`` each vision layer attends in one variable-length call over its frames or windows
(PyTorch's ``varlen_attn``), the blocks running on the patches in window order, where each group is a contiguous
run of rows: no gather or scatter per layer and one attention kernel per layer instead of one per group size.
Nothing here needs megatron-core.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from muse_stack.models.muse_spark.vision import (EAGER_CHAINS, MuseSparkVisionEncoderLayer, MuseSparkVisionModel,
                                                 VisionChains, varlen_kernel, wide_dtype)


def compiled_chains(backend: Any = "inductor") -> VisionChains:
    """The four chains, each compiled by ``torch.compile`` on ``backend`` (lazily, at its first call)."""
    return VisionChains(*(torch.compile(fn, dynamic=None, backend=backend) for fn in EAGER_CHAINS))


@functools.cache
def inductor_chains() -> VisionChains:
    """The one compiled set every block of this process runs (TorchInductor)."""
    return compiled_chains("inductor")


def set_chains(model: torch.nn.Module, chains: VisionChains | None) -> int:
    """Every vision block of ``model`` runs ``chains`` (None: its forward as written); returns the blocks set."""
    blocks = 0
    for m in model.modules():
        if isinstance(m, MuseSparkVisionEncoderLayer):
            m.chains = chains
            blocks += 1
    return blocks


def install_compile_towers(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.compile_towers`` on every vision block of ``model`` (this rank's), compiled by
    TorchInductor; why it is off though asked (None: as asked, or no vision tower on this rank: a later pipeline
    stage)."""
    set_chains(model, inductor_chains() if on else None)
    return None


def describe_chains(model: torch.nn.Module) -> str | None:
    """How the vision blocks of ``model`` run their elementwise work, asked of the blocks (None: no block)."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, MuseSparkVisionEncoderLayer):
            kinds.add("as written, op by op" if m.chains is None else
                      "chained, plain PyTorch" if m.chains is EAGER_CHAINS else
                      "chained, each chain compiled by torch.compile (engine_options.compile_towers)")
    return ", ".join(sorted(kinds)) or None


def install_towers_bf16_activations(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.towers_bf16_activations`` on every vision tower of ``model`` (this rank's): its activations
    in its weights' dtype (on) or in fp32 (off); why it is off though asked (None: as asked, or no vision tower on
    this rank: a later pipeline stage)."""
    for m in model.modules():
        if isinstance(m, MuseSparkVisionModel):
            m.activations_dtype = m.patch_embedder.patch_embedding.weight.dtype if on else None
    return None


def describe_activations(model: torch.nn.Module) -> str | None:
    """The dtype of the vision tower's activations between its GEMMs, asked of the towers (None: no tower)."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, MuseSparkVisionModel):
            weights = m.patch_embedder.patch_embedding.weight.dtype
            act = m.activations_dtype or wide_dtype(weights)
            kinds.add(f"{str(act).removeprefix('torch.')}"
                      + (" (the weights' dtype: engine_options.towers_bf16_activations)" if m.activations_dtype
                         else f", the GEMMs in {str(weights).removeprefix('torch.')}"))
    return ", ".join(sorted(kinds)) or None


def install_towers_varlen_attention(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.towers_varlen_attention`` on every vision tower of ``model`` (this rank's); why it is off
    though asked (this torch has no ``varlen_attn``), else None."""
    why = None
    if on and varlen_kernel() is None:
        why = f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (PyTorch 2.9 and later)"
    for m in model.modules():
        if isinstance(m, MuseSparkVisionModel):
            m.attention = "varlen" if on and why is None else "grouped"
    return why


def describe_attention(model: torch.nn.Module) -> str | None:
    """How the vision tower's layers attend, asked of the towers (None: no tower)."""
    kinds = {"one variable-length call a layer over the patches in window order (torch's varlen_attn; "
             "engine_options.towers_varlen_attention)" if m.attention == "varlen" else
             "one attention call per group size, its groups gathered (torch's scaled_dot_product_attention)"
             for m in model.modules() if isinstance(m, MuseSparkVisionModel)}
    return ", ".join(sorted(kinds)) or None
