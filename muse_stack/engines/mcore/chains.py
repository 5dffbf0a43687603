"""The elementwise chains of the GPU layers: the norms, gates, residuals and softcap between two
matmuls, in fp32, exactly as :mod:`muse_stack.models.muse_spark` computes them. Each is one ``torch.compile``
graph under the recipe's ``engine_options.compile_elementwise`` (:mod:`.fuse`), so its fp32
intermediates stay in registers; eager otherwise. Nothing here needs megatron-core, so the chains
are checked against the reference model's norms on any machine.
"""

from __future__ import annotations

import torch

from muse_stack.engines.mcore.fuse import elementwise
from muse_stack.models.muse_spark.norms import rms_norm as _rms
from muse_stack.models.muse_spark.residual import ALPHA_SQUARED_FLOOR


class _Matmul:
    """The dtype the norms and gates hand to the matmuls: the parameters' dtype."""

    dtype = torch.bfloat16


def set_matmul_dtype(dtype: torch.dtype) -> None:
    """bf16 (``precision: bf16``) or fp32 (``precision: fp32``); set before the model runs."""
    _Matmul.dtype = dtype


@elementwise
def centered_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(x) * (1 + w) in the matmul dtype (the pre-norms and the pre-expert norm)."""
    return (_rms(x, eps) * (1.0 + w.float())).to(_Matmul.dtype)


@elementwise
def gain_first_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(x * (1 + w)) in fp32 (post-FFN and post-expert norms)."""
    return _rms(x.float() * (1.0 + w.float()), eps)


@elementwise
def weighted_gain_first_norm(x: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(x * (1 + w)) x the routing weight of each expert slot, in ``x``'s dtype (the post-expert
    norm and the weight in one chain: the fp32 intermediates never reach memory when compiled)."""
    return (_rms(x.float() * (1.0 + w.float()), eps) * probs.unsqueeze(-1).float()).to(x.dtype)


@elementwise
def gated_residual(stream: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, temperature: float) -> torch.Tensor:
    """alpha * s + beta * branch (fp32), coefficients from the stored gate vector."""
    u = gate.float() / temperature
    beta = torch.sigmoid(u)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-u) * (1.0 + beta), min=ALPHA_SQUARED_FLOOR))
    return alpha * stream + beta * branch.float()


@elementwise
def post_attention_residual(stream: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor, eps: float,
                            temperature: float) -> torch.Tensor:
    """Weightless rms of the attention branch (post-norm eps), then the gated residual."""
    return gated_residual(stream, _rms(attn, eps), gate, temperature)


@elementwise
def post_attention_residual_and_norm(stream: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor, eps: float,
                                     temperature: float, w: torch.Tensor, norm_eps: float
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The post-attention residual and the pre-MLP norm of its result in one chain: the new stream
    (fp32) and its centred norm (matmul dtype). Compiled, the stream is read once, and its
    backward sums the two gradients the new stream receives (from the norm and from the next
    residual) inside the kernel instead of in a separate pass over the fp32 stream."""
    new = post_attention_residual(stream, attn, gate, eps, temperature)
    return new, centered_norm(new, w, norm_eps)


@elementwise
def qk_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, eps).to(_Matmul.dtype)


@elementwise
def output_gate(o: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(o) per head x sigmoid(g), in the matmul dtype."""
    return (_rms(o, eps) * torch.sigmoid(g.float())).to(_Matmul.dtype)


@elementwise
def softcap_logits(raw: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    return cap * torch.tanh(raw.float() * (multiplier / cap))


@elementwise
def weightless_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(x) in fp32 (the norm after the embedding lookup: the residual stream starts in fp32)."""
    return _rms(x, eps)


@elementwise
def softcap_cross_entropy(raw: torch.Tensor, target: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    """Per-token cross-entropy of the soft-capped logits, in fp32, over the whole vocabulary (the
    logits are not split over tensor parallelism): ``logsumexp(z) - z[target]`` with
    ``z = cap * tanh(raw * multiplier / cap)``. One chain from the output layer's matmul to the
    loss: compiled, the float32 ``z`` and its softmax need not be written out (Inductor's
    partitioner may recompute them from the bf16 ``raw`` in the backward)."""
    z = cap * torch.tanh(raw.float() * (multiplier / cap))
    return torch.logsumexp(z, dim=-1) - z.gather(-1, target.unsqueeze(-1)).squeeze(-1)


@elementwise
def stored_gain_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(x) * w in the matmul dtype (the final norm)."""
    return (_rms(x, eps) * w).to(_Matmul.dtype)


def hold_padding_row(weight: torch.nn.Parameter, pad_token_id: int | None, vocab_start: int, vocab_end: int):
    """Give the embedding row of ``pad_token_id`` a zero gradient, as ``nn.Embedding(padding_idx=...)``
    does in transformers' model (``pad_token_id`` is its embedding's ``padding_idx``). ``weight``
    holds rows ``[vocab_start, vocab_end)`` of the vocabulary (this TP rank's part). Returns the
    hook's handle (None: the row is not here)."""
    if pad_token_id is None or not vocab_start <= pad_token_id < vocab_end:
        return None
    row = pad_token_id - vocab_start

    def zero_row(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[row] = 0
        return grad

    return weight.register_hook(zero_row)
