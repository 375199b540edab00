"""Gated DeltaNet's decode step with its gating fused in: one launch where the layer ran eight
(``sigmoid(b)``, the float32 ``g`` chain of casts, exp, softplus and products, and the step); and
the same step with the layer's gated output RMS norm in its epilogue (one launch fewer again)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.gated_delta_rule import gated_delta_rule_decode_reference
from freetoken.kernels.norm import gated_rms_norm_reference


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


def gated_delta_rule_decode_gated_norm_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    activation: str = "silu",
) -> torch.Tensor:
    """``gated_rms_norm(gated_delta_rule_decode_gated(...), z, norm_weight, eps, activation)``: the
    step's output rounded to the activations' dtype, then the output norm of each head's row with
    the gate ``z [B, Hv, Dv]``, rounded where the two launches round."""
    core = gated_delta_rule_decode_gated_reference(q, k, v, a, b, A_log, dt_bias, state, state_slots)
    return gated_rms_norm_reference(core, z, norm_weight, eps, activation)


gated_delta_rule_decode_gated = op("gdn_decode")(gated_delta_rule_decode_gated_reference)
gated_delta_rule_decode_gated_norm = op("gdn_decode")(gated_delta_rule_decode_gated_norm_reference)
