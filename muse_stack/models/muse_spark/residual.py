"""The gated residual of Muse Spark: ``s = alpha * s + beta * branch`` per channel.

From the stored gate vector ``g``: ``u = g / temperature``, ``beta = sigmoid(u)``,
``alpha = sqrt(max(sigmoid(-u) * (1 + beta), 1e-3))``. Since ``sigmoid(-u) = 1 - beta``,
``alpha^2 + beta^2 = 1`` wherever the clamp is inactive: the update keeps a unit-RMS residual
stream at unit RMS when the (rms-normalised) branch is uncorrelated with it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from muse_stack.models.muse_spark.norms import upcast

#: floor under alpha^2
ALPHA_SQUARED_FLOOR = 1e-3


def residual_gate_coefficients(gate: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, beta) in fp32 from a stored gate vector."""
    u = upcast(gate) / temperature
    beta = torch.sigmoid(u)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-u) * (1.0 + beta), min=ALPHA_SQUARED_FLOOR))
    return alpha, beta


def initial_gate_value(num_layers: int, temperature: float) -> float:
    """Gate value the model is initialised with.

    Each layer has two gated residual updates, 2L in the whole decoder. The gate starts where
    ``beta = 1 / sqrt(2L)``: each update then adds a branch with 1/(2L) of the stream's
    variance and keeps ``alpha^2 = 1 - 1/(2L)``, so after all 2L updates the embedding still
    carries ``(1 - 1/(2L))^(2L) ~ e^-1`` of the variance whatever the depth, and the stream
    stays at unit RMS. (A zero gate would give beta = 1/2 in every layer and wash the
    embedding out as 0.75^L.)
    """
    beta0 = 1.0 / math.sqrt(2 * num_layers)
    return temperature * math.log(beta0 / (1.0 - beta0))


class GatedResidual(nn.Module):
    """Holds the stored ``gate`` vector (checkpoint name ``...residual_gate.gate``)."""

    def __init__(self, dim: int, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature
        self.gate = nn.Parameter(torch.zeros(dim))

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        return residual_gate_coefficients(self.gate, self.temperature)

    def forward(self, stream: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """The new residual stream (fp32)."""
        alpha, beta = self.coefficients()
        return alpha * upcast(stream) + beta * upcast(branch)

    def extra_repr(self) -> str:
        return f"{self.gate.shape[0]}, temperature={self.temperature}"
