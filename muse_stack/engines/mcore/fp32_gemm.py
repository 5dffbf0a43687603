"""float32 GEMMs for the megatron engine under ``precision: fp32``.

Transformer Engine 2.20 runs every GEMM whose inputs are float32 with cuBLAS's compute type
``CUBLAS_COMPUTE_32F_FAST_TF32``: the inputs are rounded to TF32 (10 mantissa bits, unit
roundoff 2^-11) inside the kernel, and TE has no setting that turns this off. A recipe that says
``precision: fp32`` would therefore train in TF32, and a float32 parity check would measure TF32
rounding (about 8,000 times float32's 2^-24) instead of the engine's formulas.

:func:`install` routes TE's linear and grouped-linear GEMMs to torch's float32 GEMM (with TF32
off) whenever both inputs are plain float32 tensors. Every other GEMM (bf16, fp16, FP8, the
userbuffer overlaps) still goes to TE's kernels unchanged, so installing it in a process that
also runs bf16 engines changes nothing for them. The layouts follow TE's ``general_gemm``
(row-major; ``A`` is the first operand, ``B`` the second):

    "TN": out = B @ A^T   (forward: x W^T)
    "NN": out = B @ A     (data gradient: dy W)
    "NT": out = B^T @ A   (weight gradient: dy^T x)
"""

from __future__ import annotations

from typing import Any

import torch

#: the TE modules whose GEMM names are rerouted (each imports them into its own namespace)
GEMM_MODULES = ("linear", "layernorm_linear", "layernorm_mlp")
GROUPED_MODULES = ("grouped_linear",)


def _plain_fp32(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32


def torch_gemm(a: torch.Tensor, b: torch.Tensor, layout: str = "TN") -> torch.Tensor:
    """The product TE's ``general_gemm(a, b, layout=...)`` computes, in float32 through torch."""
    if layout not in ("TN", "NN", "NT"):
        raise ValueError(f"GEMM layout {layout!r}: TE uses TN, NN or NT")
    trans_a, trans_b = layout[0] == "T", layout[1] == "T"
    a2 = a.reshape(-1, a.shape[-1])
    if trans_b:  # weight gradient: both operands are [tokens, features]
        return b.reshape(-1, b.shape[-1]).t() @ a2
    lead = b.shape[:-1]
    out = b.reshape(-1, b.shape[-1]) @ (a2.t() if trans_a else a2)
    return out.reshape(*lead, out.shape[-1])


def _store(result: torch.Tensor, out: torch.Tensor | None, accumulate: bool, alpha: float,
           beta: float | None) -> torch.Tensor:
    result = result * alpha if alpha != 1.0 else result
    if out is None:
        return result
    if accumulate:
        scale = 1.0 if beta is None else beta
        if scale != 1.0:
            out.mul_(scale)
        out.add_(result.reshape(out.shape).to(out.dtype))
    else:
        out.copy_(result.reshape(out.shape))
    return out


def _unsupported(name: str, **features: Any) -> None:
    used = [k for k, v in features.items() if v is not None and v is not False]
    if used:
        raise RuntimeError(f"float32 GEMM ({name}): {', '.join(used)} not supported on the float32 path; "
                           "the megatron engine's model uses none of them")


def wrap_general_gemm(original):
    """TE's ``general_gemm``, with float32 inputs computed by :func:`torch_gemm`."""

    def general_gemm(A, B, out_dtype=None, quantization_params=None, gelu=False, gelu_in=None, alpha=1.0,
                     beta=None, accumulate=False, layout="TN", out=None, bias=None, use_split_accumulator=False,
                     grad=False, ub=None, ub_type=None, extra_output=None, bulk_overlap=False):
        if not (_plain_fp32(A) and _plain_fp32(B)):
            return original(A, B, out_dtype=out_dtype, quantization_params=quantization_params, gelu=gelu,
                            gelu_in=gelu_in, alpha=alpha, beta=beta, accumulate=accumulate, layout=layout, out=out,
                            bias=bias, use_split_accumulator=use_split_accumulator, grad=grad, ub=ub,
                            ub_type=ub_type, extra_output=extra_output, bulk_overlap=bulk_overlap)
        _unsupported("general_gemm", quantization_params=quantization_params, gelu=gelu, bias=bias, ub=ub,
                     extra_output=extra_output, bulk_overlap=bulk_overlap)
        result = torch_gemm(A, B, layout)
        if out is None and out_dtype is not None:
            result = result.to(out_dtype)
        return _store(result, out, accumulate, alpha, beta), None, None, None

    general_gemm.__wrapped__ = original
    return general_gemm


def wrap_general_grouped_gemm(original):
    """TE's ``general_grouped_gemm``, with float32 inputs computed group by group by :func:`torch_gemm`."""

    def general_grouped_gemm(A, B, out, quantization_params, out_dtype, layout="TN", m_splits=None, gelu=False,
                             grad=False, accumulate=False, bias=None, use_bias=False, use_split_accumulator=False,
                             D_dtype=None, single_output=False):
        if not (all(_plain_fp32(a) for a in A) and all(_plain_fp32(b) for b in B)):
            return original(A, B, out, quantization_params, out_dtype, layout=layout, m_splits=m_splits, gelu=gelu,
                            grad=grad, accumulate=accumulate, bias=bias, use_bias=use_bias,
                            use_split_accumulator=use_split_accumulator, D_dtype=D_dtype, single_output=single_output)
        _unsupported("general_grouped_gemm", gelu=gelu, use_bias=use_bias, D_dtype=D_dtype,
                     quantization_params=any(q is not None for q in quantization_params or []) or None)
        if single_output:
            splits = list(m_splits)
            views, start = [], 0
            for size in splits:
                views.append(out[0][start:start + size])
                start += size
        else:
            views = list(out)
        for a, b, view in zip(A, B, views):
            if view.numel() == 0:
                continue
            _store(torch_gemm(a, b, layout), view, accumulate, 1.0, None)
        empty = [torch.Tensor() for _ in A]
        return (out[0] if single_output else out), empty, empty

    general_grouped_gemm.__wrapped__ = original
    return general_grouped_gemm


def install() -> list[str]:
    """Reroute TE's float32 GEMMs (idempotent); returns the names rerouted, for the fingerprint."""
    import importlib

    torch.backends.cuda.matmul.allow_tf32 = False  # torch's own float32 GEMMs: no TF32 either
    done = []
    for names, wrap, attr in ((GEMM_MODULES, wrap_general_gemm, "general_gemm"),
                              (GROUPED_MODULES, wrap_general_grouped_gemm, "general_grouped_gemm")):
        for name in names:
            module = importlib.import_module(f"transformer_engine.pytorch.module.{name}")
            current = getattr(module, attr, None)
            if current is None:
                continue
            if not hasattr(current, "__wrapped__"):
                setattr(module, attr, wrap(current))
            done.append(f"transformer_engine.pytorch.module.{name}.{attr}")
    return done
