"""The grouped MoE path's output before its sum (``layers.moe``), summed by the norm after it in one
launch (``layers.normed_linear``): its own module, so that both import it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from freetoken import kernels
from freetoken.layers.norm import RMSNorm


class MoEPartial(NamedTuple):
    """The grouped path's output before its sum: ``moe = Σ_j pairs[:, j] + g · shared``, with
    ``g = sigmoid(gate_logit)``, or 1 when ``gate_logit`` is ``None`` (``shared`` already gated)."""

    pairs: torch.Tensor  # [T, k, H]: each (token, choice) pair's weighted expert output
    shared: torch.Tensor  # [T, H]
    gate_logit: torch.Tensor | None  # [T, 1]

    def add_rms_norm(
        self, norm: RMSNorm, residual: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(moe + residual), moe + residual)``, of ``rows`` only when given."""
        return kernels.moe_combine_add_rms_norm(
            self.pairs, self.shared, self.gate_logit, residual, norm.weight, norm.eps, norm.zero_centered, rows
        )
