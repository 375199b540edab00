"""Gated DeltaNet's decode step: the delta-rule step with its gating fused in
(``gated_delta_rule_decode_gated``: one launch where the layer ran eight, ``sigmoid(b)``, the float32
``g`` chain of casts, exp, softplus and products, and the step), and the whole per-token chain of
the layer between its two GEMMs (``gated_deltanet_decode``: conv update, SiLU, gating, delta-rule
step, gated output norm) as one launch, where a decode step ran three per GDN layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.conv1d import causal_conv1d_decode_reference
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


def gated_deltanet_decode_reference(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_slots: torch.Tensor,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """One token per request through the layer's chain between ``in_proj`` and ``out_proj``:
    ``gated_rms_norm(gated_delta_rule_decode_gated(split(causal_conv1d_decode(mixed_qkv))), z)``.

    ``mixed_qkv [B, 2·Hk·Dk + Hv·Dv]`` (q | k | v channels), ``z [B, Hv, Dv]``, ``a, b [B, Hv]``;
    ``conv_weight [C, K]``, ``norm_weight [Dv]``; ``conv_state [S, C, K-1]`` and
    ``recurrent_state [S, Hv, Dk, Dv]`` (float32) updated in the requests' slots. The head counts
    and sizes come from ``recurrent_state``. Returns ``[B, Hv, Dv]`` in the activations' dtype.
    """
    num_v_heads, head_k_dim, head_v_dim = recurrent_state.shape[1:]
    key_dim = (mixed_qkv.shape[-1] - num_v_heads * head_v_dim) // 2
    batch = mixed_qkv.shape[0]
    conv = causal_conv1d_decode_reference(mixed_qkv, conv_weight, conv_state, state_slots)
    q, k, v = conv.split([key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    core = gated_delta_rule_decode_gated_reference(
        q.reshape(batch, -1, head_k_dim),
        k.reshape(batch, -1, head_k_dim),
        v.reshape(batch, num_v_heads, head_v_dim),
        a, b, A_log, dt_bias, recurrent_state, state_slots,
    )
    return gated_rms_norm_reference(core, z, norm_weight, eps, gate_activation)


gated_delta_rule_decode_gated = op("gdn_decode")(gated_delta_rule_decode_gated_reference)
gated_deltanet_decode = op("gdn_decode")(gated_deltanet_decode_reference)
