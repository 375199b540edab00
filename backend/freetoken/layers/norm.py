from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.layers.weights import WeightTarget, new_param


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``zero_centered`` keeps the checkpoint's ``w`` and multiplies by
    ``1 + w`` in float32 at run time (see ``kernels.norm``)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool) -> None:
        super().__init__()
        self.weight = new_param(dim)
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {f"{prefix}weight": WeightTarget(self.weight)}
