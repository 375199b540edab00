"""Gated DeltaNet's decode step with its gating fused in: one launch where the layer ran eight
(``sigmoid(b)``, the float32 ``g`` chain of casts, exp, softplus and products, and the step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.gated_delta_rule import gated_delta_rule_decode_reference


def gated_delta_rule_decode_gated_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """``gated_delta_rule_decode`` with ``β = sigmoid(b)`` (activations' dtype) and
    ``g = -exp(A_log) · softplus(a + dt_bias)`` (float32) computed as the layer computes them.

    ``a, b [B, Hv]`` (the in_proj columns), ``A_log, dt_bias [Hv]``; the rest as the decode step.
    """
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return gated_delta_rule_decode_reference(q, k, v, g, beta, state, state_slots)


gated_delta_rule_decode_gated = op("gdn_decode")(gated_delta_rule_decode_gated_reference)
