"""LoRA and DoRA adapters on the reference model, with the base frozen.

:func:`apply_peft` attaches one adapter to each targeted projection of every decoder layer
(checkpoint names, see :mod:`muse_stack.models.muse_spark.peft_config`) and freezes every base parameter. The
base tensors keep their names, so a base checkpoint loads before or after; the adapter tensors
sit under ``<module>.adapter.`` (projections) and ``mlp.experts.adapters.<target>.`` (stacked
experts)::

    LoRA   y = W x + s B A drop(x)                                   s = alpha / r
    DoRA   y = W x + (m / n - 1) W drop(x) + (m / n) s B A drop(x)   n = ||W + s B A|| per output row

With no dropout (or in eval mode) DoRA is ``(m / n) (W + s B A) x``: the magnitude m times the
unit-norm direction of the adapted weight, as in Liu et al. (2024) and Hugging Face ``peft``.
The row norm n is differentiated through (``peft`` and the paper detach it to save memory; the
gradients here are the exact ones). A is Xavier-normal (seeded per tensor name), B is zero and
m is the base weight's row norms, so before any step the adapted model computes exactly the
base model's outputs.

Stacked experts get one adapter per expert (``per_expert``: A [E, r, in], B [E, out, r]) or one
shared by all ([1, r, in], [1, out, r]); DoRA is refused on them by the recipe check.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from muse_stack.models.muse_spark.init import _generator
from muse_stack.models.muse_spark.linear import Projection, linear
from muse_stack.models.muse_spark.peft_config import EXPERT_TARGETS, PeftSettings

def is_adapter_key(name: str) -> bool:
    return ".adapter." in name or ".experts.adapters." in name


def _xavier_normal_(tensor: torch.Tensor, name: str, seed: int, fan_in: int, fan_out: int) -> None:
    std = math.sqrt(2.0 / (fan_in + fan_out))
    # drawn on the CPU whatever the tensor's device: the same values on every machine and engine
    values = torch.empty(tensor.shape, dtype=torch.float32)
    values.normal_(0.0, std, generator=_generator(seed, name, torch.device("cpu")))
    with torch.no_grad():
        tensor.copy_(values)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 when the tensor already is (tests run the adapters in float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class LoRA(nn.Module):
    """``s B A drop(x)`` added to a projection's output (held as the projection's ``adapter``)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        self.dropout = _dropout(dropout)

    def update(self, x: torch.Tensor) -> torch.Tensor:
        return linear(linear(x, self.lora_A), self.lora_B) * self.scaling

    def forward(self, x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return out + self.update(self.dropout(x)).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``s B A`` [out, in] in fp32."""
        return self.scaling * (_wide(self.lora_B) @ _wide(self.lora_A))

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """The plain weight that computes what base + adapter compute (fp32)."""
        return _wide(weight) + self.delta_weight()

    def extra_repr(self) -> str:
        r, fan_in = self.lora_A.shape
        return f"lora, in={fan_in}, out={self.lora_B.shape[0]}, rank={r}, alpha={self.alpha:g}"


class DoRA(LoRA):
    """LoRA plus the magnitude vector ``lora_magnitude`` [out] (fp32) of the adapted weight's rows."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(in_features, out_features, rank, alpha, dropout, dtype=dtype, device=device)
        self.lora_magnitude = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device))

    def weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """``||W + s B A||`` per output row (fp32)."""
        return (_wide(weight) + self.delta_weight()).norm(p=2, dim=1)

    def forward(self, x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scale = self.lora_magnitude / self.weight_norm(weight)
        dropped = self.dropout(x)
        base = out if dropped is x else linear(dropped, weight)
        return (out + (scale - 1) * base + scale * self.update(dropped)).to(out.dtype)

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        adapted = _wide(weight) + self.delta_weight()
        return adapted * (self.lora_magnitude / adapted.norm(p=2, dim=1))[:, None]

    def extra_repr(self) -> str:
        return "dora, " + super().extra_repr().removeprefix("lora, ")


class ExpertLoRA(nn.Module):
    """LoRA on a stacked expert tensor ``[E, out, in]``: A [n, r, in], B [n, out, r] with n = E
    (one adapter per expert) or 1 (one shared)."""

    def __init__(self, experts: int, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 per_expert: bool, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        n = experts if per_expert else 1
        self.per_expert, self.rank, self.alpha, self.scaling = per_expert, rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(n, rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(n, out_features, rank, dtype=dtype, device=device))
        self.dropout = _dropout(dropout)

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        i = index if self.per_expert else 0
        return linear(linear(self.dropout(x), self.lora_A[i]), self.lora_B[i]) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``s B_e A_e`` for every expert [E or 1, out, in] (fp32)."""
        return self.scaling * torch.bmm(_wide(self.lora_B), _wide(self.lora_A))

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        return _wide(weight) + self.delta_weight()  # a shared adapter broadcasts over the experts

    def extra_repr(self) -> str:
        n, r, fan_in = self.lora_A.shape
        return (f"lora, {'per expert' if self.per_expert else 'shared'} x {n}, in={fan_in}, "
                f"out={self.lora_B.shape[1]}, rank={r}, alpha={self.alpha:g}")


def _layers(model: nn.Module):
    return model.model.language_model.layers


def _module(layer: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


def apply_peft(model: nn.Module, settings: PeftSettings, seed: int = 0) -> list[str]:
    """Freeze ``model`` (a MuseSparkForCausalLM) and attach the adapters ``settings`` name to
    every decoder layer; returns the adapter parameter names. Call it after the base weights
    are loaded (DoRA's magnitude starts from them) and before wrapping in DDP."""
    for p in model.parameters():
        p.requires_grad_(False)
    prefix = "model.language_model.layers"
    for index, layer in enumerate(_layers(model)):
        for target in settings.targets:
            name = f"{prefix}.{index}.{target}"
            if target in EXPERT_TARGETS:
                experts = layer.mlp.experts
                attr = target.rsplit(".", 1)[1]
                weight = getattr(experts, attr)
                count, fan_out, fan_in = weight.shape
                adapter = ExpertLoRA(count, fan_in, fan_out, settings.rank, settings.alpha, settings.dropout,
                                     settings.per_expert, dtype=weight.dtype, device=weight.device)
                key = f"{prefix}.{index}.mlp.experts.adapters.{attr}.lora_A"
                _xavier_normal_(adapter.lora_A, key, seed, fan_in, settings.rank)
                if experts.adapters is None:
                    experts.adapters = nn.ModuleDict()
                experts.adapters[attr] = adapter
                continue
            proj = _module(layer, target)
            if not isinstance(proj, Projection):
                raise TypeError(f"{name} is not a projection")
            cls = DoRA if settings.scheme == "dora" else LoRA
            adapter = cls(proj.in_features, proj.out_features, settings.rank, settings.alpha, settings.dropout,
                          dtype=proj.weight.dtype, device=proj.weight.device)
            _xavier_normal_(adapter.lora_A, f"{name}.adapter.lora_A", seed, proj.in_features, settings.rank)
            if isinstance(adapter, DoRA):
                with torch.no_grad():
                    adapter.lora_magnitude.copy_(adapter.weight_norm(proj.weight))
            proj.adapter = adapter
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, by their names in the model."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the base model's tensors (the checkpoint names)."""
    return {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}


@torch.no_grad()
def merge_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain state dict of the base with every adapter folded into its weight (in the base
    weight's dtype): a :class:`MuseSparkForCausalLM` without adapters computes with it what the
    adapted model computes. The model itself is not changed."""
    out = base_state_dict(model)
    for name, module in model.named_modules():
        if isinstance(module, Projection) and module.adapter is not None:
            key = f"{name}.weight"
            out[key] = module.adapter.merged(module.weight).to(module.weight.dtype)
        elif getattr(module, "adapters", None) is not None and hasattr(module, "gate_up_proj"):
            for attr, adapter in module.adapters.items():
                weight = getattr(module, attr)
                out[f"{name}.{attr}"] = adapter.merged(weight).to(weight.dtype)
    return {k: v.detach().clone() for k, v in out.items()}


def adapter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> adapter, projections and experts alike (``...experts.adapters.gate_up_proj``)."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, (LoRA, ExpertLoRA)):
            found[name] = module
    return found
